// Megatron-LM's DefaultDynamicCPScheduler on blocks of the D x N world, mirroring
// skrull_ext/scheduler/megatron_packing.py (_Round, _place, _fill_block, _fill_whole,
// _next_micro_batch, dynamic_cp_world, dynamic_cp) decision for decision and float for
// float, so that Skrull's dynamic-CP candidate (scheduler.dyncp) gets the same plan from
// the core as from the reference (tests/test_dyncp_candidate.py).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_set>
#include <utility>

#include "scheduler.h"

namespace skrull {
namespace {

struct Entry {
  Index id;
  int64_t s;  // padded length
};

// A group in creation order (the reference's members/packed dicts keep insertion order).
struct Group {
  int64_t gid;
  int first;
  int size;
  double packed;
};

int64_t padded(int64_t length, int64_t multiple) {
  return (length + multiple - 1) / multiple * multiple;
}

// dcp_gpus_needed: the next power of two of length / bucket (at least 1), at most limit.
int cp_needed(int64_t length, int64_t bucket, int limit) {
  const double e = std::ceil(std::log2(static_cast<double>(length) / static_cast<double>(bucket)));
  const int64_t need = e <= 0.0 ? 1 : (int64_t{1} << static_cast<int>(e));
  return static_cast<int>(std::min<int64_t>(need, limit));
}

double square_over(int64_t s, int64_t g) {  // Python's s * s / g on ints
  return static_cast<double>(s * s) / static_cast<double>(g);
}

struct Round {
  int total, block;
  std::vector<int> first_free;
  std::vector<std::vector<int64_t>> lens;
  std::vector<double> work;
  std::vector<std::vector<Index>> ids;
  std::vector<Group> members;
  std::vector<double> before, after;  // [r]: max of work[0, r), max of work[r, total)

  Round(int total_, int block_)
      : total(total_), block(block_), lens(total_), work(total_, 0.0), ids(total_) {
    for (int lo = 0; lo < total; lo += block) first_free.push_back(lo);
  }

  Group* find(int64_t gid) {
    for (auto& g : members)
      if (g.gid == gid) return &g;
    return nullptr;
  }

  void add(int64_t gid, int first, int size, Index sid, int64_t s) {
    Group* g = find(gid);
    if (g == nullptr) {
      members.push_back({gid, first, size, 0.0});
      g = &members.back();
      int& ff = first_free[static_cast<size_t>(first / block)];
      ff = std::max(ff, first + size);
    }
    g->packed += static_cast<double>(s) / static_cast<double>(size);
    const double w = square_over(s, size);
    for (int r = first; r < first + size; ++r) {
      lens[r].push_back(s);
      work[r] += w;
      ids[r].push_back(sid);
    }
    refresh();
  }

  // The reference's max over ranks of work (+ w inside the group), from prefix and suffix
  // maxima refreshed after each add (rounding is monotone: max(a + w, b + w) = max(a, b) + w).
  double projected(int first, int size, double w) const {
    double best = work[first];
    for (int r = first + 1; r < first + size; ++r) best = std::max(best, work[r]);
    best += w;
    if (first > 0) best = std::max(best, before[first]);
    if (first + size < total) best = std::max(best, after[first + size]);
    return best;
  }

  void refresh() {
    before.resize(total + 1);
    after.resize(total + 1);
    for (int r = 1; r <= total; ++r) {
      before[r] = r == 1 ? work[0] : std::max(before[r - 1], work[r - 1]);
    }
    for (int r = total - 1; r >= 0; --r) {
      after[r] = r == total - 1 ? work[r] : std::max(after[r + 1], work[r]);
    }
  }

  bool empty_in(int lo, int hi) const {
    for (int r = lo; r < hi; ++r)
      if (lens[r].empty()) return true;
    return false;
  }
};

struct Choice {
  double t;
  int64_t gid;  // -1: a new group
  int first, size;
};

// _place: Megatron's choice for one sample; false when it fits nowhere.
bool place(const Round& rnd, int64_t s, int64_t bucket, int block, double cap, Choice& best) {
  bool found = false;
  auto consider = [&](double t, int64_t gid, int first, int size) {
    if (t <= cap && (!found || t < best.t)) {
      best = {t, gid, first, size};
      found = true;
    }
  };
  for (int g = cp_needed(s, bucket, block); g <= block; g *= 2) {
    const double w = square_over(s, g);
    for (const Group& grp : rnd.members) {
      const double fill = grp.packed + static_cast<double>(s) / static_cast<double>(g);
      if (grp.size != g || fill > static_cast<double>(bucket)) continue;
      consider(rnd.projected(grp.first, g, w), grp.gid, grp.first, g);
    }
    for (size_t b = 0; b < rnd.first_free.size(); ++b) {
      const int lo = rnd.first_free[b];
      if (static_cast<int>(b + 1) * block - lo >= g) {
        consider(rnd.projected(lo, g, w), -1, lo, g);
        break;
      }
    }
  }
  return found;
}

// _fill_block: doubles the first group of the smallest size with room, shifting the
// groups behind it; false when none can (or nothing is empty).
bool fill_block(Round& rnd, int lo, int hi) {
  int empty0 = -1;
  for (int r = lo; r < hi && empty0 < 0; ++r)
    if (rnd.lens[r].empty()) empty0 = r;
  std::vector<size_t> groups;
  for (size_t q = 0; q < rnd.members.size(); ++q)
    if (lo <= rnd.members[q].first && rnd.members[q].first < hi) groups.push_back(q);
  if (empty0 < 0 || groups.empty()) return false;
  int smallest = rnd.members[groups[0]].size;
  for (size_t q : groups) smallest = std::min(smallest, rnd.members[q].size);
  const int dbl = std::min(smallest * 2, hi - lo);
  for (size_t q : groups) {
    Group& grp = rnd.members[q];
    if (grp.size != smallest) continue;
    const int first = grp.first, last = first + grp.size - 1, extra = dbl - smallest;
    if (last + 1 > empty0 || last + extra >= hi || empty0 + extra > hi) continue;
    const auto lens = rnd.lens[last];
    const auto ids = rnd.ids[last];
    std::vector<std::vector<int64_t>> moved_lens;
    std::vector<double> moved_work;
    std::vector<std::vector<Index>> moved_ids;
    for (int r = last + 1; r < empty0; ++r) {
      moved_lens.push_back(rnd.lens[r]);
      moved_work.push_back(rnd.work[r]);
      moved_ids.push_back(rnd.ids[r]);
    }
    double w = 0.0;
    for (int64_t x : lens) w += square_over(x, dbl);
    for (int r = first; r <= last + extra; ++r) {
      rnd.lens[r] = lens;
      rnd.ids[r] = ids;
      rnd.work[r] = w;
    }
    for (size_t k = 0; k < moved_lens.size(); ++k) {
      const int r = last + extra + 1 + static_cast<int>(k);
      rnd.lens[r] = std::move(moved_lens[k]);
      rnd.work[r] = moved_work[k];
      rnd.ids[r] = std::move(moved_ids[k]);
    }
    for (size_t o : groups)
      if (o != q && rnd.members[o].first > last) rnd.members[o].first += extra;
    grp.size = dbl;
    return true;
  }
  return false;
}

// _fill_whole: one group over [lo, hi), greedily re-selected from `pool` in order;
// returns the rest.
std::vector<Entry> fill_whole(Round& rnd, int lo, int hi, const std::vector<Entry>& pool,
                              int64_t bucket) {
  const int size = hi - lo;
  double packed = 0.0;
  std::vector<Entry> chosen, rest;
  for (const Entry& e : pool) {
    const double add = static_cast<double>(e.s) / static_cast<double>(size);
    if (packed + add <= static_cast<double>(bucket)) {
      chosen.push_back(e);
      packed += add;
    } else {
      rest.push_back(e);
    }
  }
  double w = 0.0;
  std::vector<int64_t> lens;
  std::vector<Index> ids;
  for (const Entry& e : chosen) {
    lens.push_back(e.s);
    ids.push_back(e.id);
    w += square_over(e.s, size);
  }
  for (int r = lo; r < hi; ++r) {
    rnd.lens[r] = lens;
    rnd.ids[r] = ids;
    rnd.work[r] = w;
  }
  rnd.members.erase(std::remove_if(rnd.members.begin(), rnd.members.end(),
                                   [&](const Group& g) { return lo <= g.first && g.first < hi; }),
                    rnd.members.end());
  rnd.members.push_back({-1 - lo, lo, size, 0.0});
  return rest;
}

// _next_micro_batch: one round; `pool` becomes the samples left for the next.
Round next_micro_batch(std::vector<Entry>& pool, int total, int block, int64_t bucket) {
  const auto longer = [](const Entry& a, const Entry& b) { return a.s > b.s; };
  // (ours, same order) The rest of a round stays sorted unless a block was re-selected.
  if (!std::is_sorted(pool.begin(), pool.end(), longer)) {
    std::stable_sort(pool.begin(), pool.end(), longer);
  }
  Round rnd(total, block);
  rnd.add(0, 0, cp_needed(pool[0].s, bucket, block), pool[0].id, pool[0].s);
  const double cap = static_cast<double>(pool[0].s) * static_cast<double>(bucket) * (1.0 + 0.05);
  std::vector<Entry> rest;
  int64_t next_gid = 1;
  Choice best{};
  // (ours, the reference's plan in O(log K) tries per placed sample) Between two adds a
  // sample fits iff it is no longer than some threshold (reference _next_micro_batch says
  // why), and the pool runs longest first: the next sample placed is the first that fits,
  // found by a galloping search; the ones before it fail in the reference's scan too.
  const auto fits = [&](size_t p) { return place(rnd, pool[p].s, bucket, block, cap, best); };
  size_t q = 1;
  while (q < pool.size() && fits(pool.size() - 1)) {
    size_t lo = q, hi = pool.size() - 1, step = 1;  // hi fits, [q, lo) fail
    while (lo + step - 1 < hi) {
      if (fits(lo + step - 1)) {
        hi = lo + step - 1;
        break;
      }
      lo += step;  // [lo, lo + step) all fail
      step *= 2;
    }
    while (lo < hi) {
      const size_t mid = lo + (hi - lo) / 2;
      if (fits(mid)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    rest.insert(rest.end(), pool.begin() + static_cast<std::ptrdiff_t>(q),
                pool.begin() + static_cast<std::ptrdiff_t>(lo));
    fits(lo);  // `best` for the sample placed
    const int64_t gid = best.gid >= 0 ? best.gid : next_gid++;
    rnd.add(gid, best.first, best.size, pool[lo].id, pool[lo].s);
    q = lo + 1;
  }
  rest.insert(rest.end(), pool.begin() + static_cast<std::ptrdiff_t>(std::min(q, pool.size())),
              pool.end());
  for (int lo = 0; lo < total; lo += block) {
    while (rnd.empty_in(lo, lo + block)) {
      if (fill_block(rnd, lo, lo + block)) continue;
      if (block == total) {  // Megatron: re-selected from the whole call's samples
        pool = fill_whole(rnd, 0, total, pool, bucket);
        return rnd;
      }
      std::unordered_set<Index> in_block;  // the reference's `mine`
      for (int r = lo; r < lo + block; ++r) in_block.insert(rnd.ids[r].begin(), rnd.ids[r].end());
      std::vector<Entry> mine;
      for (const Entry& e : pool) {
        if (in_block.count(e.id)) mine.push_back(e);
      }
      for (const Entry& e : fill_whole(rnd, lo, lo + block, mine, bucket)) rest.push_back(e);
      break;
    }
  }
  pool = std::move(rest);
  return rnd;
}

}  // namespace

std::vector<std::vector<WorldGroup>> dynamic_cp_world(const int64_t* lengths, int64_t k,
                                                      int dp_size, int cp_size,
                                                      int64_t bucket_size, int block) {
  const int total = dp_size * cp_size;
  int64_t mult = 1;
  if (block > 1) {
    int top = 1;
    while (top * 2 <= block) top *= 2;  // 1 << (block.bit_length() - 1)
    mult = std::lcm(int64_t{2} * block, int64_t{2} * top);
  }
  std::vector<Entry> pool;
  pool.reserve(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) pool.push_back({i, padded(lengths[i], mult)});
  std::vector<std::vector<WorldGroup>> out;
  while (!pool.empty()) {
    Round rnd = next_micro_batch(pool, total, block, bucket_size);
    std::vector<WorldGroup> groups;
    for (int r = 0; r < total;) {
      int size = 1;
      while (r + size < total && rnd.ids[r + size] == rnd.ids[r]) ++size;
      if (!rnd.ids[r].empty()) groups.push_back({r, size, rnd.ids[r]});
      r += size;
    }
    out.push_back(std::move(groups));
  }
  return out;
}

HybridPlan dynamic_cp_plan(const int64_t* lengths, int64_t k, int dp_size, int cp_size,
                           int64_t bucket_size) {
  const auto rounds = dynamic_cp_world(lengths, k, dp_size, cp_size, bucket_size, cp_size);
  HybridPlan plan;
  plan.sizes.assign(static_cast<size_t>(k), 0);
  plan.per_rank = static_cast<int64_t>(std::max<size_t>(1, rounds.size()));
  const size_t count = static_cast<size_t>(dp_size * plan.per_rank);
  plan.items.assign(count, {});
  plan.firsts.assign(count, {});
  for (size_t m = 0; m < rounds.size(); ++m) {
    for (const WorldGroup& g : rounds[m]) {  // ascending first rank: world_micro_batch's order
      const int d = g.first / cp_size;
      const size_t slot = static_cast<size_t>(d * plan.per_rank) + m;
      for (Index i : g.ids) {
        plan.items[slot].push_back(i);
        plan.firsts[slot].push_back(g.first - d * cp_size);
        plan.sizes[static_cast<size_t>(i)] = g.size;
      }
    }
  }
  return plan;
}

}  // namespace skrull
