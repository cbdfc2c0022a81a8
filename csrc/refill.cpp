// (ours) refill.refill: each DP rank of ruin and recreate repacked into full micro-batches.
// Split from lns.cpp (the search that calls it); mirrors skrull_ext/scheduler/refill.py
// step for step (same order, same float operations, same work count).
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "scheduler.h"

namespace skrull {
namespace {

constexpr double kRefillFracs[] = {0.97};  // refill.REFILL_FRACS
constexpr int64_t kRefillPlaceWork = 64;   // refill.REFILL_PLACE_WORK

}  // namespace

// refill.refill: each DP rank repacked first-fit decreasing (by cost, ties index) into
// micro-batches of at most int(frac x N x bucket) tokens, each placed by place_group; kept
// where its split_time falls strictly.  Adds its work to *work.
std::vector<RankSplit> refill(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                              double overhead, int64_t limit, int64_t* work,
                              std::vector<char>* changed) {
  const Batch& b = ctx.batch;
  const int64_t n = ctx.cp_size, cap = ctx.bucket_size;
  std::vector<RankSplit> out;
  for (const auto& split : splits) {
    int64_t full = 0, size = 0;
    for (const auto& p : split) {
      if (p.empty()) continue;
      ++full;
      size += static_cast<int64_t>(p.distributed.size());
      for (const auto& r : p.local) size += static_cast<int64_t>(r.size());
    }
    *work += static_cast<int64_t>(split.size());
    const int64_t estimate = size * (full + 1) + kRefillPlaceWork * (size + n * full);
    RankSplit best = split;
    bool better = false, priced = false;
    double best_t = 0.0;
    std::vector<Index> pool;
    for (double frac : kRefillFracs) {
      if (*work + estimate >= limit) break;
      if (!priced) {  // the rank's samples, costliest first, and its time
        priced = true;
        for (const auto& p : split) {
          pool.insert(pool.end(), p.distributed.begin(), p.distributed.end());
          for (const auto& r : p.local) pool.insert(pool.end(), r.begin(), r.end());
        }
        std::sort(pool.begin(), pool.end(), [&](Index x, Index y) {
          return b.costs[x] != b.costs[y] ? b.costs[x] > b.costs[y] : x < y;
        });
        *work += 2 * (size + n * full);
        best_t = ctx.split_time(split, overhead);
      }
      const int64_t room = static_cast<int64_t>(frac * static_cast<double>(cap) *
                                                static_cast<double>(n));
      std::vector<std::vector<Index>> groups;
      std::vector<int64_t> tokens;
      for (Index i : pool) {
        const int64_t s = b.lengths[i];
        bool put = false;
        for (size_t g = 0; g < groups.size(); ++g) {
          ++*work;
          if (tokens[g] + s <= room) {
            groups[g].push_back(i);
            tokens[g] += s;
            put = true;
            break;
          }
        }
        if (!put) {
          groups.push_back({i});
          tokens.push_back(s);
        }
      }
      RankSplit placed;
      for (const auto& g : groups) {
        *work += kRefillPlaceWork * (static_cast<int64_t>(g.size()) + n);
        auto p = place_group(ctx, g);
        if (!p) break;
        placed.push_back(std::move(*p));
      }
      if (placed.size() < groups.size()) continue;
      const double t = ctx.split_time(placed, overhead);
      if (t < best_t) {
        best = std::move(placed);
        best_t = t;
        better = true;
      }
    }
    out.push_back(std::move(best));
    changed->push_back(better ? 1 : 0);
  }
  return out;
}

}  // namespace skrull
