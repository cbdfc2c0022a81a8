// (ours) Re-splitting pairs of one DP rank's micro-batches: their local samples re-dealt
// over both micro-batches' CP ranks.  Mirrors skrull_ext/scheduler/resplit.py step for
// step (same order of float operations, same work count), so both return identical plans;
// see that module's docstring.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

#include "scheduler.h"

namespace skrull {
namespace {

constexpr int64_t kDealWork = 2;  // resplit.DEAL_WORK

int64_t size_of(const Placement& p) {
  int64_t s = static_cast<int64_t>(p.distributed.size());
  for (const auto& r : p.local) s += static_cast<int64_t>(r.size());
  return s;
}

int64_t locals_of(const Placement& p) {
  int64_t s = 0;
  for (const auto& r : p.local) s += static_cast<int64_t>(r.size());
  return s;
}

// resplit._timed: the placement's time with the overhead; 0 when empty.
double timed(const GdsContext& ctx, const Placement& p, double overhead) {
  return size_of(p) ? micro_batch_time(p, ctx.batch, ctx.latency, ctx.cp_size) + overhead : 0.0;
}

// resplit._deal: the local samples of pa and pb dealt costliest first, each to the least
// loaded CP rank with room of the micro-batch whose time it raises least (ties: the lower
// time, then pa); nullopt if one fits no CP rank.
std::optional<std::pair<Placement, Placement>> deal(const GdsContext& ctx, const Placement& pa,
                                                    const Placement& pb) {
  const Batch& b = ctx.batch;
  const int n = ctx.cp_size;
  const int64_t cap = ctx.bucket_size;
  std::vector<Index> pool;
  for (const Placement* p : {&pa, &pb}) {
    for (const auto& r : p->local) pool.insert(pool.end(), r.begin(), r.end());
  }
  std::sort(pool.begin(), pool.end(), [&](Index x, Index y) {
    return b.costs[x] != b.costs[y] ? b.costs[x] > b.costs[y] : x < y;
  });
  Placement out[2];
  double comm[2], share[2], top[2];
  std::vector<double> load[2];
  std::vector<int64_t> tok[2];
  const Placement* src[2] = {&pa, &pb};
  for (int k = 0; k < 2; ++k) {
    double t_comm = 0.0, t_dist = 0.0;
    int64_t dtok = 0;
    for (Index i : src[k]->distributed) {
      t_comm += b.comm[i];
      t_dist += b.share(i, n);
      dtok += shard_tokens(b.lengths[i], n);
    }
    const bool has_dist = !src[k]->distributed.empty();
    if (has_dist) t_comm += ctx.latency;
    out[k].distributed = src[k]->distributed;
    out[k].local.assign(static_cast<size_t>(n), {});
    comm[k] = t_comm;
    share[k] = t_dist;
    load[k].assign(static_cast<size_t>(n), 0.0);
    tok[k].assign(static_cast<size_t>(n), dtok);
    // each micro-batch's time so far (its most loaded CP rank's)
    top[k] = has_dist ? rank_time(0.0, t_comm, t_dist, n, b.objective) : 0.0;
  }
  for (Index i : pool) {
    const int64_t s = b.lengths[i];
    const double c = b.costs[i];
    bool found = false;
    double best_added = 0.0, best_t = 0.0;
    int bk = 0, br = 0;
    for (int k = 0; k < 2; ++k) {
      int r = -1;
      for (int j = 0; j < n; ++j) {
        if (tok[k][j] + s <= cap && (r < 0 || load[k][j] < load[k][r])) r = j;
      }
      if (r < 0) continue;
      const double t = rank_time(load[k][r] + c, comm[k], share[k], n, b.objective);
      const double added = std::max(t, top[k]) - top[k];
      if (!found || added < best_added || (added == best_added && t < best_t)) {
        found = true;
        best_added = added;
        best_t = t;
        bk = k;
        br = r;
      }
    }
    if (!found) return std::nullopt;
    out[bk].local[static_cast<size_t>(br)].push_back(i);
    load[bk][br] += c;
    tok[bk][br] += s;
    top[bk] = std::max(top[bk], best_t);
  }
  return std::make_pair(std::move(out[0]), std::move(out[1]));
}

// resplit._rank: one DP rank's non-empty micro-batches re-split pair by pair within
// `limit` work units; *stopped when the limit ended it.
bool resplit_rank(const GdsContext& ctx, RankSplit& split, double overhead, int64_t limit,
                  int64_t* work, bool* stopped) {
  const int64_t n = ctx.cp_size;
  bool changed = false;
  std::vector<double> times;
  for (const auto& p : split) {
    *work += size_of(p) + n;
    times.push_back(timed(ctx, p, overhead));
  }
  while (true) {
    bool found = false;
    double best_saved = 0.0, best_ta = 0.0, best_tb = 0.0;
    size_t ba = 0, bb = 0;
    std::pair<Placement, Placement> best;
    for (size_t a = 0; a < split.size(); ++a) {
      for (size_t c = a + 1; c < split.size(); ++c) {
        const int64_t pool = locals_of(split[a]) + locals_of(split[c]);
        const int64_t size = size_of(split[a]) + size_of(split[c]);
        // sorting, dealing (2 N + 2 per sample), pricing both
        const int64_t estimate = 2 * pool + kDealWork * (2 * n + 2) * pool + size + 2 * n;
        if (*work + estimate >= limit) {
          *stopped = true;
          return changed;
        }
        *work += estimate;
        auto got = deal(ctx, split[a], split[c]);
        if (!got) continue;
        const double ta = timed(ctx, got->first, overhead);
        const double tb = timed(ctx, got->second, overhead);
        const double saved = (times[a] + times[c]) - (ta + tb);
        if (saved > 0.0 && (!found || saved > best_saved)) {
          found = true;
          best_saved = saved;
          best_ta = ta;
          best_tb = tb;
          ba = a;
          bb = c;
          best = std::move(*got);
        }
      }
    }
    if (!found) return changed;
    split[ba] = std::move(best.first);
    split[bb] = std::move(best.second);
    times[ba] = best_ta;
    times[bb] = best_tb;
    size_t w = 0;
    for (size_t j = 0; j < split.size(); ++j) {
      if (split[j].empty()) continue;
      if (w != j) {
        split[w] = std::move(split[j]);
        times[w] = times[j];
      }
      ++w;
    }
    split.resize(w);
    times.resize(w);
    changed = true;
  }
}

}  // namespace

std::vector<RankSplit> resplit(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                               double overhead, int64_t limit, int64_t* work,
                               std::vector<char>* changed) {
  std::vector<RankSplit> out;
  int64_t spent = 0;
  bool stopped = false;
  for (const auto& split : splits) {
    bool better = false;
    if (!stopped) {
      RankSplit full;
      for (const auto& p : split) {
        if (!p.empty()) full.push_back(p);
      }
      int64_t used = 0;
      better = resplit_rank(ctx, full, overhead, limit - spent, &used, &stopped);
      spent += used;
      if (better) {
        out.push_back(std::move(full));
        changed->push_back(1);
        continue;
      }
    }
    out.push_back(split);
    changed->push_back(0);
  }
  *work += spent;
  return out;
}

}  // namespace skrull
