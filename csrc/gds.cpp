// GDS (docs/design.md section 4): LPT over DP ranks, then per DP rank the fewest interleaved
// micro-batches that DACP can place, then the (ours) re-split to the common count.
// Mirrors lpt_partition / interleave / _split_rank / _fewest_split / _isolate / _plan_rank /
// GdsContext / gds_schedule of
// skrull_ext/scheduler/reference.py; see scheduler.h.
#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

#include "scheduler.h"

namespace skrull {
namespace {


// Bits of a finite double whose unsigned order is the value's order (-0.0 maps to 0.0).
uint64_t order_bits(double x) {
  if (x == 0.0) x = 0.0;
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u >> 63) ? ~u : (u | (uint64_t{1} << 63));
}

// One DP rank's samples in ascending (length, index) order, with their lengths.
struct RankSeqs {
  std::vector<Index> ids;
  std::vector<int64_t> lengths;
};

// Interleaves `seqs` into m micro-batches and places each; nullopt if any is infeasible.
// The reference checks group by group and stops at the first failure; the answer (all
// placements, or none) does not depend on the order, so the cheap token-sum check runs
// over every group first and DACP then visits the fullest groups first (the likeliest to
// fail), which makes the m += 1 search cheap for large batches.
// `check_only` (reference too): only decide feasibility (dacp_feasible); an empty split
// when feasible.
std::optional<RankSplit> split_rank(const Batch& batch, const RankSeqs& seqs, int64_t m,
                                    double latency, int cp_size, int64_t bucket_size,
                                    Rollback policy, Variant variant, bool check_only = false) {
  const int64_t cap = bucket_size * cp_size;
  const int64_t size = static_cast<int64_t>(seqs.ids.size());
  // With ascending lengths (>= 1) the group holding the last sample has the largest sum:
  // it dominates every other group element by element.  Checking it first costs
  // O(size / m), which keeps the m += 1 search near-linear when many m fail.
  int64_t last = 0;
  for (int64_t p = size - 1; p >= 0; p -= m) last += seqs.lengths[p];
  if (last > cap) return std::nullopt;
  std::vector<int64_t> sums(static_cast<size_t>(m), 0);
  int64_t g = 0;
  for (int64_t s : seqs.lengths) {
    sums[g] += s;
    if (++g == m) g = 0;
  }
  for (int64_t s : sums) {
    if (s > cap) return std::nullopt;
  }
  std::vector<int64_t> visit(static_cast<size_t>(m));
  std::iota(visit.begin(), visit.end(), 0);
  std::stable_sort(visit.begin(), visit.end(),
                   [&sums](int64_t a, int64_t b) { return sums[a] > sums[b]; });
  RankSplit out(check_only ? 0 : static_cast<size_t>(m));
  const bool lpt_allowed = variant == Variant::kAuto || variant == Variant::kLpt;
  std::vector<Index> group;
  group.reserve(static_cast<size_t>(size / m + 1));
  for (int64_t j : visit) {
    group.clear();
    for (int64_t p = j; p < size; p += m) group.push_back(seqs.ids[p]);
    if (check_only) {
      if (lpt_allowed) {  // (C++ only, exact) all distributed fits: LPT's k = all places it
        int64_t shards = 0;
        for (Index i : group) shards += shard_tokens(batch.lengths[i], cp_size);
        if (shards <= bucket_size) continue;
      }
      if (!dacp_feasible(batch, group, latency, cp_size, bucket_size, policy, variant)) {
        return std::nullopt;
      }
      continue;
    }
    auto placed = dacp_best(batch, group, latency, cp_size, bucket_size, policy, variant);
    if (!placed) return std::nullopt;
    out[j] = std::move(*placed);
  }
  return out;
}

// Every bin's samples in ascending (length, index) order: one stable sort of all
// samples by length, then each sample appended to its bin in that order.
std::vector<RankSeqs> sort_bins(const std::vector<std::vector<Index>>& bins,
                                const Batch& batch) {
  std::vector<int> bin_of(static_cast<size_t>(batch.size), -1);
  std::vector<RankSeqs> out(bins.size());
  for (size_t b = 0; b < bins.size(); ++b) {
    for (Index i : bins[b]) bin_of[i] = static_cast<int>(b);
    out[b].ids.reserve(bins[b].size());
    out[b].lengths.reserve(bins[b].size());
  }
  std::vector<Keyed> keyed(static_cast<size_t>(batch.size));
  for (int64_t i = 0; i < batch.size; ++i) {
    keyed[i] = {static_cast<uint64_t>(batch.lengths[i]), i};
  }
  stable_sort_by_key(keyed);
  for (const auto& [len, i] : keyed) {
    auto& bin = out[bin_of[i]];
    bin.ids.push_back(i);
    bin.lengths.push_back(static_cast<int64_t>(len));
  }
  return out;
}

// reference LINEAR_COUNTS: counts tried one by one before galloping.
constexpr int64_t kLinearCounts = 16;

// The interleaved split with a locally fewest micro-batch count (reference
// _fewest_split): kLinearCounts counts one by one from m, then galloping to the first
// feasible count and a binary search down to the last infeasible one.
// With `cut` (C++ only, see GdsCutoff) gives up (nullopt) once the rank's bound with one
// more micro-batch than the last infeasible count exceeds the cutoff.
std::optional<RankSplit> fewest_split(const Batch& batch, const RankSeqs& rest, int64_t m,
                                      double latency, int cp_size, int64_t bucket_size,
                                      Rollback policy, Variant variant,
                                      const GdsCutoff* cut, double rank_base) {
  const int64_t count = static_cast<int64_t>(rest.ids.size());
  int64_t lo = m - 1, step = 1, tries = 0;
  auto fits = [&](int64_t count_m) {
    return split_rank(batch, rest, count_m, latency, cp_size, bucket_size, policy, variant,
                      /*check_only=*/true)
        .has_value();
  };
  for (;;) {
    if (m - lo == 1) {
      // (C++ only, same plans) Counts tried one at a time (and the first) are final once
      // they fit: place them at once instead of deciding feasibility and then placing the
      // same count again (split_rank fails exactly when a group has no feasible variant,
      // dacp_feasible's test; an infeasible count usually fails at its fullest group, which
      // is tried first, at about a feasibility check's cost).
      if (auto split = split_rank(batch, rest, m, latency, cp_size, bucket_size, policy,
                                  variant)) {
        return split;
      }
    } else if (fits(m)) {
      break;
    }
    if (m >= count) throw std::logic_error("one sample per micro-batch must be feasible");
    if (cut && (rank_base + static_cast<double>(m + 1) * cut->overhead) * (1.0 - 1e-9) >=
                   cut->limit) {
      return std::nullopt;
    }
    if (++tries > kLinearCounts) step *= 2;
    lo = m;
    m = std::min(m + step, count);
  }
  while (m - lo > 1) {
    const int64_t mid = (lo + m) / 2;
    if (fits(mid)) {
      m = mid;
    } else {
      lo = mid;
    }
  }
  // The search decided feasibility only; place every micro-batch of the chosen count.
  return split_rank(batch, rest, m, latency, cp_size, bucket_size, policy, variant);
}

// (ours) Splits off the samples that fit no micro-batch with any other sample of the
// rank (reference _isolate): whether one pairs with the rank's shortest other sample
// decides it.  Both outputs keep the ascending order.
void isolate(const RankSeqs& seqs, int cp_size, int64_t bucket_size, RankSeqs* rest,
             std::vector<Index>* alone) {
  const size_t count = seqs.ids.size();
  if (count < 2) {
    *rest = seqs;
    return;
  }
  for (size_t p = 0; p < count; ++p) {
    const int64_t other = seqs.lengths[p == 0 ? 1 : 0];
    if (can_pair(seqs.lengths[p], other, cp_size, bucket_size)) {
      rest->ids.push_back(seqs.ids[p]);
      rest->lengths.push_back(seqs.lengths[p]);
    } else {
      alone->push_back(seqs.ids[p]);
    }
  }
}

// One DP rank's micro-batches (reference _plan_rank): the fewest feasible (m == 0) or
// exactly m; GDS steps 2-4 on the samples that can share, then one per isolated sample.
// `cut` (C++ only): nullopt when the fewest-count search can no longer beat cut->limit.
std::optional<RankSplit> plan_rank(const Batch& batch, const RankSeqs& seqs, int64_t m,
                                   double latency, int cp_size, int64_t bucket_size,
                                   Rollback policy, Variant variant,
                                   const GdsCutoff* cut = nullptr) {
  RankSeqs rest;
  std::vector<Index> alone;
  isolate(seqs, cp_size, bucket_size, &rest, &alone);
  RankSplit singles;
  for (Index i : alone) {
    singles.push_back(*dacp_best(batch, {i}, latency, cp_size, bucket_size, policy, variant));
  }
  const auto n_alone = static_cast<int64_t>(alone.size());
  auto with_singles = [&singles](RankSplit split) {
    for (auto& p : singles) split.push_back(std::move(p));
    return split;
  };
  if (rest.ids.empty()) {
    if (m == 0 || m == n_alone) return singles;
    return std::nullopt;
  }
  if (m != 0) {
    if (m <= n_alone) return std::nullopt;
    auto split = split_rank(batch, rest, m - n_alone, latency, cp_size, bucket_size, policy,
                            variant);
    if (!split) return std::nullopt;
    return with_singles(std::move(*split));
  }
  const int64_t cap = bucket_size * cp_size;
  int64_t total = 0;
  for (int64_t s : rest.lengths) total += s;
  m = std::max<int64_t>(1, (total + cap - 1) / cap);
  double base = 0.0;  // the rank's least work over N, plus its isolated micro-batches
  if (cut) {
    for (Index i : seqs.ids) {
      const double sh = batch.share(i, cp_size);
      double w = cp_size * sh;
      if (batch.lengths[i] <= bucket_size) w = std::min(w, batch.costs[i]);
      base += w;
    }
    base = base / cp_size + static_cast<double>(n_alone) * cut->overhead;
  }
  auto split = fewest_split(batch, rest, m, latency, cp_size, bucket_size, policy, variant,
                            cut, base);
  if (!split) return std::nullopt;
  return with_singles(std::move(*split));
}

void check_fits(const Batch& batch, int cp_size, int64_t bucket_size) {
  for (int64_t i = 0; i < batch.size; ++i) {
    const int64_t s = batch.lengths[i];
    if (s < 1 || shard_tokens(s, cp_size) > bucket_size) {
      throw std::invalid_argument(
          "sample " + std::to_string(i) + " of length " + std::to_string(s) +
          (s < 1 ? " is empty: remove zero-length samples"
                 : " cannot fit even when distributed: raise the bucket size or cp_size"));
    }
  }
}

}  // namespace

// Sorts by (key, position before the sort): a stable sort by key.  LSD radix on bytes
// (all eight histograms in one pass; bytes shared by every key skipped) for large
// inputs, where it is about 3x faster than std::sort; a comparison sort for small ones.
void stable_sort_by_key(std::vector<Keyed>& a) {
  if (a.size() < 2048) {
    std::stable_sort(a.begin(), a.end(),
                     [](const Keyed& x, const Keyed& y) { return x.first < y.first; });
    return;
  }
  std::vector<size_t> count(8 * 256, 0);
  for (const auto& e : a) {
    for (int d = 0; d < 8; ++d) ++count[d * 256 + ((e.first >> (8 * d)) & 255)];
  }
  std::vector<Keyed> tmp(a.size());
  for (int d = 0; d < 8; ++d) {
    size_t* c = &count[d * 256];
    const int shift = 8 * d;
    if (c[(a[0].first >> shift) & 255] == a.size()) continue;
    size_t start = 0;
    for (int b = 0; b < 256; ++b) {
      const size_t n = c[b];
      c[b] = start;
      start += n;
    }
    for (const auto& e : a) tmp[c[(e.first >> shift) & 255]++] = e;
    a.swap(tmp);
  }
}

std::optional<Placement> GdsContext::place(const std::vector<Index>& idx) const {
  return dacp_best(batch, idx, latency, cp_size, bucket_size, rollback, variant);
}

double GdsContext::split_time(const RankSplit& split, double overhead) const {
  double t = 0.0;
  for (const auto& placement : split) {
    if (!placement.empty()) t += micro_batch_time(placement, batch, latency, cp_size) + overhead;
  }
  return t;
}

bool can_pair(int64_t sx, int64_t sy, int cp_size, int64_t bucket_size) {
  const int64_t n = cp_size, c = bucket_size;
  if (sx + sy <= c || (n > 1 && sx <= c && sy <= c)) return true;  // both local
  if (n == 1) return false;
  const int64_t hx = shard_tokens(sx, n), hy = shard_tokens(sy, n);
  return (sx <= c && hy <= c - sx) || (sy <= c && hx <= c - sy) || hx + hy <= c;
}

std::vector<std::vector<Index>> lpt_partition(const double* costs,
                                              const std::vector<Index>& idx, int bins) {
  // Sort key (-cost, index): a stable sort by descending cost of the ids in ascending
  // order.  Costs are finite (checked by the bindings).
  std::vector<Keyed> order(idx.size());
  for (size_t p = 0; p < idx.size(); ++p) order[p] = {0, idx[p]};
  if (!std::is_sorted(idx.begin(), idx.end())) {
    std::sort(order.begin(), order.end(),
              [](const Keyed& a, const Keyed& b) { return a.second < b.second; });
  }
  for (auto& e : order) e.first = ~order_bits(costs[e.second]);
  stable_sort_by_key(order);
  std::vector<std::vector<Index>> out(static_cast<size_t>(bins));
  for (auto& bin : out) bin.reserve(order.size() / static_cast<size_t>(bins) + 1);
  // The reference pops the smallest (load, bin) tuple of a heap: the least load, lowest
  // bin on ties.  A linear scan finds the same bin; a heap is kept for many bins.
  if (bins <= 16) {
    std::vector<double> load(static_cast<size_t>(bins), 0.0);
    for (const auto& e : order) {
      const Index i = e.second;
      int b = 0;
      for (int j = 1; j < bins; ++j) {
        if (load[j] < load[b]) b = j;
      }
      out[b].push_back(i);
      load[b] = load[b] + costs[i];
    }
    return out;
  }
  using Entry = std::pair<double, int>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int b = 0; b < bins; ++b) heap.emplace(0.0, b);
  for (const auto& e : order) {
    const Entry top = heap.top();
    heap.pop();
    out[top.second].push_back(e.second);
    heap.emplace(top.first + costs[e.second], top.second);
  }
  return out;
}

std::vector<std::vector<Index>> interleave(const std::vector<Index>& sorted_idx, int64_t m) {
  std::vector<std::vector<Index>> out(static_cast<size_t>(m));
  const int64_t size = static_cast<int64_t>(sorted_idx.size());
  for (int64_t j = 0; j < m; ++j) {
    out[j].reserve(static_cast<size_t>(size / m + 1));
    for (int64_t p = j; p < size; p += m) out[j].push_back(sorted_idx[p]);
  }
  return out;
}

std::vector<RankSplit> gds_schedule(const Batch& batch, double latency, int dp_size,
                                    int cp_size, int64_t bucket_size, Rollback policy,
                                    double overhead, Variant variant) {
  return *gds_schedule_cut(batch, latency, dp_size, cp_size, bucket_size, policy, overhead,
                           variant, nullptr);
}

std::optional<std::vector<RankSplit>> gds_schedule_cut(const Batch& batch, double latency,
                                                       int dp_size, int cp_size,
                                                       int64_t bucket_size, Rollback policy,
                                                       double overhead, Variant variant,
                                                       const GdsCutoff* cut) {
  check_fits(batch, cp_size, bucket_size);
  std::vector<Index> all(static_cast<size_t>(batch.size));
  std::iota(all.begin(), all.end(), 0);
  const auto sorted_bins = sort_bins(lpt_partition(batch.costs, all, dp_size), batch);
  std::vector<RankSplit> splits;
  splits.reserve(sorted_bins.size());
  for (const auto& seqs : sorted_bins) {
    if (seqs.ids.empty()) {
      splits.emplace_back();
      continue;
    }
    auto split = plan_rank(batch, seqs, 0, latency, cp_size, bucket_size, policy, variant, cut);
    if (!split) return std::nullopt;
    splits.push_back(std::move(*split));
  }
  size_t m_max = 0;
  for (const auto& s : splits) m_max = std::max(m_max, s.size());
  for (size_t d = 0; d < splits.size(); ++d) {
    const auto& seqs = sorted_bins[d];
    if (!seqs.ids.empty() && splits[d].size() < m_max) {
      // (ours) Re-split into m_max micro-batches when that lowers this rank's time.
      auto alt = plan_rank(batch, seqs, static_cast<int64_t>(m_max), latency, cp_size,
                           bucket_size, policy, variant);
      const GdsContext ctx{batch, latency, cp_size, bucket_size, policy, variant};
      if (alt && ctx.split_time(*alt, overhead) < ctx.split_time(splits[d], overhead)) {
        splits[d] = std::move(*alt);
      }
    }
    while (splits[d].size() < m_max) {
      Placement empty;
      empty.local.resize(static_cast<size_t>(cp_size));
      splits[d].push_back(std::move(empty));
    }
  }
  return splits;
}

}  // namespace skrull
