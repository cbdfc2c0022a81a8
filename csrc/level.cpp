// (ours) The portfolio's `level` candidate: one micro-batch per DP rank, the k longest
// samples on one ring in DP rank 0, the others whole on the slot where their rank's time
// is the least.  Mirrors _least / _level / level_schedule of skrull_ext/scheduler/level.py
// (the specification); see scheduler.h.
#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

#include "scheduler.h"
#include "slots.h"

namespace skrull {
namespace {

constexpr int64_t kLevelMaxK = 16;  // reference level.LEVEL_MAX_K

// Reference _level: slot d * n + r is CP rank r of DP rank d; nullopt when a sample finds
// no slot or a slot's time reaches best_t.
std::optional<std::vector<RankSplit>> level(const GdsContext& ctx,
                                            const std::vector<Index>& order, int64_t k,
                                            int dp_size, double best_t, double overhead) {
  const Batch& b = ctx.batch;
  const int n = ctx.cp_size;
  const int64_t cap = ctx.bucket_size;
  int64_t used = 0;
  double t_comm = k ? ctx.latency : 0.0, t_dist = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    used += shard_tokens(b.lengths[order[j]], n);
    t_comm += b.comm[order[j]];
    t_dist += b.share(order[j], n);
  }
  const int64_t slots = static_cast<int64_t>(dp_size) * n;
  std::vector<int64_t> rem(static_cast<size_t>(slots), cap);
  std::vector<double> load(static_cast<size_t>(slots), 0.0);
  std::vector<std::vector<Index>> local(static_cast<size_t>(slots));
  const bool ring = k > 0;
  SlotHeap plain, on_ring;
  for (int64_t slot = 0; slot < slots; ++slot) {
    if (ring && slot < n) {
      rem[slot] = cap - used;
      on_ring.add(slot);
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
    if (ring) {
      const int64_t r = on_ring.least(s, rem, load);
      if (r >= 0) {
        const double t_ring = rank_time(load[r] + c, t_comm, t_dist, n, b.objective);
        if (t_ring <= t) {
          slot = r;
          t = t_ring;
          from = &on_ring;
        }
      }
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
    if (d == 0) p.distributed.assign(order.begin(), order.begin() + k);
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
  int64_t used = 0;
  for (int64_t j = 0; j < k0; ++j) used += shard_tokens(len[order[j]], n);
  const int64_t last = std::min<int64_t>(b.size, std::max(k0, kLevelMaxK));
  for (int64_t k = k0; k <= last; ++k) {
    if (k > k0) used += shard_tokens(len[order[k - 1]], n);
    if (used > cap) break;
    if (k) {
      RankSplit ring(1);
      ring[0].distributed.assign(order.begin(), order.begin() + k);
      ring[0].local.resize(static_cast<size_t>(n));
      if (ctx.split_time(ring, overhead) >= best_t) break;
    }
    auto placed = level(ctx, order, k, dp_size, best_t, overhead);
    if (!placed) continue;
    double t = 0.0;
    for (const auto& split : *placed) t = std::max(t, ctx.split_time(split, overhead));
    if (t < best_t) {
      best = std::move(placed);
      best_t = t;
    }
  }
  return best;
}

}  // namespace skrull
