// Megatron-Core hybrid CP's plan (skrull_ext/scheduler/baselines.py: hybrid_cp_size,
// _hybrid_place, _hybrid_micro_batches, hybrid_cp) and, as Skrull's last candidate, its
// prediction with CP sub-group rings (scheduler.pricing.micro_batch_times / _grouped_times, the
// same float operations: bit-identical); see scheduler.h.
#include <algorithm>
#include <numeric>
#include <cstring>
#include <utility>

#include "scheduler.h"

namespace skrull {
namespace {

// Puts sample i on the least-loaded aligned block of n ranks with room (_hybrid_place).
struct HybridMicroBatch {
  std::vector<int64_t> rem;
  std::vector<double> load;
  std::vector<Index> items;
  std::vector<Index> firsts;  // first CP rank of each item's block
};

// Sample i's CP group size n, tokens per rank of its block and compute per rank (costs[i]
// / n, the reference's load increment), computed once per sample.
struct HybridItem {
  Index i;
  int n;
  int64_t shard;
  double load;
};

bool hybrid_place(HybridMicroBatch& mb, const HybridItem& it, int cp_size) {
  const int n = it.n;
  const int64_t sh = it.shard;
  int best_first = -1;
  double best_load = 0.0;
  for (int first = 0; first + n <= cp_size; first += n) {
    bool room = true;
    double load = mb.load[first];
    for (int r = first; r < first + n; ++r) {
      room = room && mb.rem[r] >= sh;
      load = std::max(load, mb.load[r]);
    }
    if (room && (best_first < 0 || load < best_load)) {
      best_first = first;
      best_load = load;
    }
  }
  if (best_first < 0) return false;
  for (int r = best_first; r < best_first + n; ++r) {
    mb.rem[r] -= sh;
    mb.load[r] += it.load;
  }
  mb.items.push_back(it.i);
  mb.firsts.push_back(best_first);
  return true;
}

}  // namespace

int64_t hybrid_cp_size(int64_t length, int cp_size, int64_t bucket_size) {
  int64_t n = 1;
  while (n < cp_size && shard_tokens(length, n) > bucket_size) n *= 2;
  return std::min<int64_t>(n, cp_size);
}

namespace {

// First fit over a DP rank's hybrid-CP micro-batches without scanning them all: for every
// block size g (1, 2, 4, ... and cp_size), cap[m][g] = the most tokens an aligned g-block of
// micro-batch m can still take on each of its ranks (max over blocks of their min room),
// and each run of kRun micro-batches keeps the max of its members' caps.  hybrid_place
// succeeds on m exactly when cap[m][g] >= the shard, so the first micro-batch found here is
// the one the reference's linear scan finds (same plans), in O(M / kRun + kRun) per sample
// instead of O(M cp_size): K = 65,536 with ~1,000 micro-batches per DP rank took ~1 s.
class HybridFirstFit {
 public:
  HybridFirstFit(int cp_size) : cp_(cp_size) {
    for (int g = 1; g < cp_size; g *= 2) sizes_.push_back(g);
    sizes_.push_back(cp_size);
  }
  int slot(int n) const {
    return static_cast<int>(std::find(sizes_.begin(), sizes_.end(), n) - sizes_.begin());
  }
  // Index of the first micro-batch with an aligned n-block of room >= need, or -1.
  int64_t find(int n, int64_t need) const {
    const size_t s = static_cast<size_t>(slot(n)), k = sizes_.size();
    for (size_t run = 0; run < run_max_.size() / k; ++run) {
      if (run_max_[run * k + s] < need) continue;
      const size_t end = std::min(cap_.size() / k, (run + 1) * kRun);
      for (size_t m = run * kRun; m < end; ++m)
        if (cap_[m * k + s] >= need) return static_cast<int64_t>(m);
    }
    return -1;
  }
  // Recomputes micro-batch m's caps (appending it if new) and its run's maxima.  Caps
  // only shrink, so a run's maximum needs a rescan only where m held it.
  void update(size_t m, const std::vector<int64_t>& rem) {
    const size_t k = sizes_.size();
    const bool fresh = cap_.size() < (m + 1) * k;
    if (fresh) cap_.resize((m + 1) * k, 0);
    const size_t run = m / kRun;
    if (run_max_.size() < (run + 1) * k) run_max_.resize((run + 1) * k, -1);
    const size_t end = std::min(cap_.size() / k, (run + 1) * kRun);
    for (size_t s = 0; s < k; ++s) {
      const int g = sizes_[s];
      int64_t best = -1;
      for (int first = 0; first + g <= cp_; first += g)
        best = std::max(best, *std::min_element(rem.begin() + first, rem.begin() + first + g));
      const int64_t old = cap_[m * k + s];
      cap_[m * k + s] = best;
      int64_t& top = run_max_[run * k + s];
      if (fresh || best >= top) {
        top = std::max(top, best);
      } else if (old == top) {
        top = -1;
        for (size_t j = run * kRun; j < end; ++j) top = std::max(top, cap_[j * k + s]);
      }
    }
  }

 private:
  static constexpr size_t kRun = 32;
  int cp_;
  std::vector<int> sizes_;
  std::vector<int64_t> cap_, run_max_;  // [micro-batch][size], [run][size]
};

// An integer whose ascending order is x's descending order (-0.0 as 0.0; x not NaN).
uint64_t descending_key(double x) {
  x += 0.0;
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return ~(bits >> 63 ? ~bits : bits | (uint64_t{1} << 63));
}

// Stable LSD radix sort of (key, index) pairs by key, 11 bits per pass, skipping the passes
// where every key has the same digit (the high bits of similar costs): ~4x faster than
// std::sort on a DP rank's 16K samples.
void radix_sort(std::vector<std::pair<uint64_t, Index>>& v,
                std::vector<std::pair<uint64_t, Index>>& spare) {
  constexpr int kBits = 11;
  constexpr size_t kBuckets = size_t{1} << kBits;
  spare.resize(v.size());
  std::vector<size_t> count(kBuckets);
  for (int shift = 0; shift < 64; shift += kBits) {
    std::fill(count.begin(), count.end(), 0);
    for (const auto& x : v) ++count[(x.first >> shift) & (kBuckets - 1)];
    if (v.empty() || count[(v[0].first >> shift) & (kBuckets - 1)] == v.size()) continue;
    size_t sum = 0;
    for (auto& c : count) sum += std::exchange(c, sum);
    for (const auto& x : v) spare[count[(x.first >> shift) & (kBuckets - 1)]++] = x;
    v.swap(spare);
  }
}

// Each DP rank's hybrid-CP micro-batches (reference baselines._hybrid_micro_batches).
std::vector<std::vector<HybridMicroBatch>> hybrid_micro_batches(const Batch& batch, int dp_size,
                                                                int cp_size, int64_t bucket_size) {
  std::vector<std::vector<HybridMicroBatch>> out;
  const double* costs = batch.costs;
  const int64_t base = batch.size / dp_size, extra = batch.size % dp_size;
  Index next = 0;
  std::vector<std::pair<uint64_t, Index>> keyed, spare;
  for (int d = 0; d < dp_size; ++d) {  // numpy.array_split's contiguous slices
    keyed.resize(static_cast<size_t>(base + (d < extra ? 1 : 0)));
    for (auto& [key, i] : keyed) key = descending_key(costs[i = next++]);
    radix_sort(keyed, spare);  // cost descending, ties by index (a stable sort by cost)
    std::vector<HybridMicroBatch> mbs;
    HybridFirstFit fit(cp_size);
    for (const auto& [key, i] : keyed) {
      const int n = static_cast<int>(hybrid_cp_size(batch.lengths[i], cp_size, bucket_size));
      const HybridItem it{i, n, shard_tokens(batch.lengths[i], n), costs[i] / n};
      int64_t m = fit.find(n, it.shard);
      if (m < 0) {
        m = static_cast<int64_t>(mbs.size());
        mbs.push_back({std::vector<int64_t>(cp_size, bucket_size),
                       std::vector<double>(cp_size, 0.0), {}, {}});
      }
      hybrid_place(mbs[static_cast<size_t>(m)], it, cp_size);
      fit.update(static_cast<size_t>(m), mbs[static_cast<size_t>(m)].rem);
    }
    out.push_back(std::move(mbs));
  }
  return out;
}

Groups hybrid_field(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size,
                    std::vector<Index> HybridMicroBatch::*field) {
  Groups out;
  for (auto& mbs : hybrid_micro_batches(batch, dp_size, cp_size, bucket_size)) {
    std::vector<std::vector<Index>> groups;
    for (auto& mb : mbs) groups.push_back(std::move(mb.*field));
    out.push_back(std::move(groups));
  }
  return out;
}

}  // namespace

Groups hybrid_cp_groups(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size) {
  return hybrid_field(batch, dp_size, cp_size, bucket_size, &HybridMicroBatch::items);
}

Groups hybrid_cp_placed(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size) {
  Groups out;
  for (auto& mbs : hybrid_micro_batches(batch, dp_size, cp_size, bucket_size)) {
    std::vector<std::vector<Index>> groups;
    for (const auto& mb : mbs) {
      std::vector<Index> pairs;
      pairs.reserve(2 * mb.items.size());
      for (size_t j = 0; j < mb.items.size(); ++j) {
        pairs.push_back(mb.items[j]);
        pairs.push_back(mb.firsts[j]);
      }
      groups.push_back(std::move(pairs));
    }
    out.push_back(std::move(groups));
  }
  return out;
}


namespace {

// One sub-group ring of a micro-batch: its block and its samples' summed seconds.
struct Ring {
  Index first;
  int64_t size;
  double share;
  double comm;
};

// scheduler.pricing.micro_batch_times of one hybrid-CP micro-batch (overhead included, 0 when
// empty), in its float order: per CP rank rank_time(local, ring, share) over the full
// ring, plus 0.0 + each sub-group ring's time in (first, size) order, unoverlapped.
double priced(const std::vector<Index>& items, const std::vector<Index>& firsts,
              const std::vector<int64_t>& sizes, const Batch& b, const SubgroupPrices& sub,
              double latency, int n, double overhead, std::vector<double>& local,
              std::vector<double>& extra, std::vector<Ring>& rings) {
  if (items.empty()) return 0.0;
  std::fill(local.begin(), local.end(), 0.0);
  rings.clear();
  double share = 0.0, comm = 0.0;
  bool dist = false;
  for (size_t j = 0; j < items.size(); ++j) {
    const Index i = items[j], first = firsts[j];
    const int64_t g = sizes[static_cast<size_t>(i)];
    if (g == n) {
      share += b.share(i, n);
      comm += b.comm[i];
      dist = true;
    } else if (g == 1) {
      local[static_cast<size_t>(first)] += b.costs[i];
    } else {
      auto ring = std::find_if(rings.begin(), rings.end(), [&](const Ring& r) {
        return r.first == first && r.size == g;
      });
      if (ring == rings.end()) ring = rings.insert(rings.end(), Ring{first, g, 0.0, 0.0});
      ring->share += sub.share[i];
      ring->comm += sub.comm[i];
    }
  }
  if (dist) comm += latency;
  std::fill(extra.begin(), extra.end(), 0.0);
  std::sort(rings.begin(), rings.end(), [](const Ring& x, const Ring& y) {
    return x.first != y.first ? x.first < y.first : x.size < y.size;
  });
  for (const Ring& r : rings) {
    const double t = rank_time(0.0, r.comm + sub.latency[static_cast<size_t>(r.size)], r.share,
                               static_cast<int>(r.size), b.objective);
    for (Index q = r.first; q < r.first + r.size; ++q) extra[static_cast<size_t>(q)] += t;
  }
  double worst = 0.0;
  for (int q = 0; q < n; ++q) {
    double t = rank_time(local[static_cast<size_t>(q)], comm, share, n, b.objective);
    if (!rings.empty()) t += extra[static_cast<size_t>(q)];
    worst = q == 0 ? t : std::max(worst, t);
  }
  return worst + overhead;
}

}  // namespace

void price_subgroup_plan(HybridPlan& plan, const Batch& batch, const SubgroupPrices& sub,
                         double latency, int dp_size, int cp_size, double overhead) {
  std::vector<double> local(static_cast<size_t>(cp_size)), extra(local);
  std::vector<Ring> rings;
  plan.times.clear();
  plan.rank_times.clear();
  for (int d = 0; d < dp_size; ++d) {
    double total = 0.0;  // Python's sum() over the DP rank's micro-batch times, in order
    for (int64_t j = 0; j < plan.per_rank; ++j) {
      const size_t g = static_cast<size_t>(d * plan.per_rank + j);
      const double t = priced(plan.items[g], plan.firsts[g], plan.sizes, batch, sub, latency,
                              cp_size, overhead, local, extra, rings);
      total += t;
      plan.times.push_back(t);
    }
    plan.rank_times.push_back(total);
  }
}

// (ours) Whole micro-batches re-dealt to the DP ranks (reference hybrid.dealt): the
// slowest first (ties: lower index) to the least-loaded rank with fewer than per_rank
// (ties: lower rank); kept only when the slowest rank gets strictly faster.
bool deal_micro_batches(HybridPlan& plan, int dp_size) {
  const size_t count = plan.times.size(), m = static_cast<size_t>(plan.per_rank);
  const std::vector<double>& t = plan.times;
  std::vector<size_t> order(count);
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&t](size_t a, size_t b) { return t[a] > t[b] || (t[a] == t[b] && a < b); });
  std::vector<double> load(static_cast<size_t>(dp_size), 0.0);
  std::vector<std::vector<size_t>> deal(static_cast<size_t>(dp_size));
  for (size_t g : order) {
    size_t best = deal.size();
    for (size_t r = 0; r < deal.size(); ++r) {
      if (deal[r].size() < m && (best == deal.size() || load[r] < load[best])) best = r;
    }
    deal[best].push_back(g);
    load[best] += t[g];  // the rank's left-to-right sum, as the reference's
  }
  const double before = *std::max_element(plan.rank_times.begin(), plan.rank_times.end());
  if (!(*std::max_element(load.begin(), load.end()) < before)) return false;
  HybridPlan out;
  out.per_rank = plan.per_rank;
  out.sizes = std::move(plan.sizes);
  out.valid = plan.valid;
  out.rank_times = load;
  for (const auto& rank : deal) {
    for (size_t g : rank) {
      out.items.push_back(std::move(plan.items[g]));
      out.firsts.push_back(std::move(plan.firsts[g]));
      out.times.push_back(t[g]);
    }
  }
  plan = std::move(out);
  return true;
}

HybridPlan hybrid_candidate(const Batch& batch, const SubgroupPrices& sub, double latency,
                            int dp_size, int cp_size, int64_t bucket_size, double overhead) {
  HybridPlan plan;
  plan.sizes.resize(static_cast<size_t>(batch.size));
  for (Index i = 0; i < batch.size; ++i)
    plan.sizes[static_cast<size_t>(i)] = hybrid_cp_size(batch.lengths[i], cp_size, bucket_size);
  auto ranks = hybrid_micro_batches(batch, dp_size, cp_size, bucket_size);
  size_t m = 1;
  for (const auto& mbs : ranks) m = std::max(m, mbs.size());
  plan.per_rank = static_cast<int64_t>(m);
  for (auto& mbs : ranks) {
    for (size_t j = 0; j < m; ++j) {
      plan.items.push_back(j < mbs.size() ? std::move(mbs[j].items) : std::vector<Index>{});
      plan.firsts.push_back(j < mbs.size() ? std::move(mbs[j].firsts) : std::vector<Index>{});
    }
  }
  price_subgroup_plan(plan, batch, sub, latency, dp_size, cp_size, overhead);
  plan.valid = hybrid_valid(plan, batch, cp_size, bucket_size);
  deal_micro_batches(plan, dp_size);
  return plan;
}

bool hybrid_valid(const HybridPlan& plan, const Batch& batch, int cp_size, int64_t bucket_size) {
  std::vector<int> seen(static_cast<size_t>(batch.size), 0);
  std::vector<int64_t> tokens(static_cast<size_t>(cp_size));
  for (size_t g = 0; g < plan.items.size(); ++g) {
    std::fill(tokens.begin(), tokens.end(), 0);
    for (size_t j = 0; j < plan.items[g].size(); ++j) {
      const Index i = plan.items[g][j], first = plan.firsts[g][j];
      if (i < 0 || i >= batch.size || ++seen[static_cast<size_t>(i)] > 1) return false;
      const int64_t size = plan.sizes[static_cast<size_t>(i)];
      if (first < 0 || first + size > cp_size) return false;
      const int64_t sh = shard_tokens(batch.lengths[i], size);
      for (Index r = first; r < first + size; ++r) {
        tokens[static_cast<size_t>(r)] += sh;
        if (tokens[static_cast<size_t>(r)] > bucket_size) return false;
      }
    }
  }
  return std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; });
}

}  // namespace skrull
