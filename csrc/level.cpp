// (ours) The portfolio's `level` candidate: one micro-batch per DP rank, the k longest
// samples on r rings (DP ranks 0 .. r-1), the others whole on the slot where their rank's
// time is the least.  Mirrors _least / _rings / _level / level_schedule of
// skrull_ext/scheduler/level.py (the specification); see scheduler.h.
#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

#include "scheduler.h"
#include "slots.h"

namespace skrull {
namespace {

constexpr int64_t kLevelMaxK = 16;     // reference level.LEVEL_MAX_K
constexpr int64_t kLevelMaxRings = 4;  // reference level.LEVEL_MAX_RINGS

// Reference _rings: the k longest samples over r rings, each to the ring whose time alone
// is least among those with room (ties: the lowest); nullopt when one fits none.
std::optional<std::vector<std::vector<Index>>> rings_of(const GdsContext& ctx,
                                                        const std::vector<Index>& order,
                                                        int64_t k, int64_t r) {
  const Batch& b = ctx.batch;
  const int n = ctx.cp_size;
  std::vector<std::vector<Index>> rings(static_cast<size_t>(r));
  std::vector<int64_t> used(static_cast<size_t>(r), 0);
  std::vector<double> comm(static_cast<size_t>(r), ctx.latency), share(static_cast<size_t>(r), 0.0);
  for (int64_t j = 0; j < k; ++j) {
    const Index i = order[j];
    const int64_t sh = shard_tokens(b.lengths[i], n);
    int64_t best = -1;
    double best_t = std::numeric_limits<double>::infinity();
    for (int64_t d = 0; d < r; ++d) {
      const double t = rank_time(0.0, comm[d], share[d], n, b.objective);
      if (used[d] + sh <= ctx.bucket_size && t < best_t) {
        best = d;
        best_t = t;
      }
    }
    if (best < 0) return std::nullopt;
    rings[best].push_back(i);
    used[best] += sh;
    comm[best] += b.comm[i];
    share[best] += b.share(i, n);
  }
  return rings;
}

// Reference _level: slot d * n + r is CP rank r of DP rank d, ring d on DP rank d; nullopt
// when a sample finds no slot or a slot's time reaches best_t.
std::optional<std::vector<RankSplit>> level(const GdsContext& ctx,
                                            const std::vector<Index>& order, int64_t k,
                                            const std::vector<std::vector<Index>>& rings,
                                            int dp_size, double best_t, double overhead) {
  const Batch& b = ctx.batch;
  const int n = ctx.cp_size;
  const int64_t cap = ctx.bucket_size;
  const int64_t r = k ? static_cast<int64_t>(rings.size()) : 0;
  const int64_t slots = static_cast<int64_t>(dp_size) * n;
  std::vector<int64_t> rem(static_cast<size_t>(slots), cap);
  std::vector<double> t_comm(static_cast<size_t>(r), ctx.latency), t_dist(static_cast<size_t>(r), 0.0);
  for (int64_t d = 0; d < r; ++d) {
    int64_t used = 0;
    for (Index i : rings[d]) used += shard_tokens(b.lengths[i], n);
    for (int64_t q = 0; q < n; ++q) rem[d * n + q] = cap - used;
    for (Index i : rings[d]) {
      t_comm[d] += b.comm[i];
      t_dist[d] += b.share(i, n);
    }
  }
  std::vector<double> load(static_cast<size_t>(slots), 0.0);
  std::vector<std::vector<Index>> local(static_cast<size_t>(slots));
  SlotHeap plain;
  std::vector<SlotHeap> on_ring(static_cast<size_t>(r));
  for (int64_t slot = 0; slot < slots; ++slot) {
    if (slot < r * n) {
      on_ring[slot / n].add(slot);
    } else {
      plain.add(slot);
    }
  }
  for (size_t j = static_cast<size_t>(k); j < order.size(); ++j) {
    const Index i = order[j];
    const int64_t s = b.lengths[i];
    const double c = b.costs[i];
    int64_t slot = plain.least(s, rem, load);
    double t = slot < 0 ? std::numeric_limits<double>::infinity() : load[slot] + c;
    SlotHeap* from = &plain;
    int64_t ring_slot = -1, ring_d = -1;
    double t_ring = std::numeric_limits<double>::infinity();
    for (int64_t d = 0; d < r; ++d) {  // the ring ranks' least-loaded slots, lowest rank on ties
      const int64_t q = on_ring[d].least(s, rem, load);
      if (q < 0) continue;
      const double td = rank_time(load[q] + c, t_comm[d], t_dist[d], n, b.objective);
      if (td < t_ring) {
        ring_slot = q;
        ring_d = d;
        t_ring = td;
      }
    }
    if (ring_slot >= 0 && t_ring <= t) {  // ring ranks' slots come first on ties
      slot = ring_slot;
      t = t_ring;
      from = &on_ring[ring_d];
    }
    if (slot < 0 || t + overhead >= best_t) return std::nullopt;
    local[slot].push_back(i);
    rem[slot] -= s;
    load[slot] += c;
    from->update(slot, load[slot]);
  }
  std::vector<RankSplit> out(static_cast<size_t>(dp_size));
  for (int d = 0; d < dp_size; ++d) {
    Placement p;
    if (d < r) p.distributed = rings[d];
    p.local.assign(local.begin() + static_cast<int64_t>(d) * n,
                   local.begin() + static_cast<int64_t>(d + 1) * n);
    out[d].push_back(std::move(p));
  }
  return out;
}

}  // namespace

std::optional<std::vector<RankSplit>> level_schedule(const GdsContext& ctx, int dp_size,
                                                     double overhead, double best_t) {
  const Batch& b = ctx.batch;
  const int n = ctx.cp_size;
  const int64_t cap = ctx.bucket_size;
  if (n < 2) return std::nullopt;
  int64_t total = 0, k0 = 0;
  for (Index i = 0; i < b.size; ++i) {
    total += b.lengths[i];
    k0 += b.lengths[i] > cap;
  }
  if (total > static_cast<int64_t>(dp_size) * n * cap) return std::nullopt;
  std::vector<Index> order(static_cast<size_t>(b.size));
  std::iota(order.begin(), order.end(), Index{0});
  const int64_t* len = b.lengths;
  std::sort(order.begin(), order.end(),
            [len](Index x, Index y) { return len[x] > len[y] || (len[x] == len[y] && x < y); });
  std::optional<std::vector<RankSplit>> best;
  const int64_t last = std::min<int64_t>(b.size, std::max(k0, kLevelMaxK));
  const int64_t max_rings = std::min<int64_t>(dp_size, kLevelMaxRings);
  for (int64_t r = 1; r <= max_rings; ++r) {
    for (int64_t k = std::max(k0, r > 1 ? r : 0); k <= last; ++k) {
      const auto rings = rings_of(ctx, order, k, r);
      if (!rings) break;
      if (k) {  // the rings alone already reach the best time: more samples only add
        double alone = 0.0;
        for (const auto& ring : *rings) {
          RankSplit split(1);
          split[0].distributed = ring;
          split[0].local.resize(static_cast<size_t>(n));
          alone = std::max(alone, ctx.split_time(split, overhead));
        }
        if (alone >= best_t) break;
      }
      auto placed = level(ctx, order, k, *rings, dp_size, best_t, overhead);
      if (!placed) continue;
      double t = 0.0;
      for (const auto& split : *placed) t = std::max(t, ctx.split_time(split, overhead));
      if (t < best_t) {
        best = std::move(placed);
        best_t = t;
      }
    }
  }
  return best;
}

}  // namespace skrull
