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

int64_t locals_of(const Placement& p) {
  int64_t s = 0;
  for (const auto& r : p.local) s += static_cast<int64_t>(r.size());
  return s;
}

// resplit._timed: the placement's time with the overhead; 0 when empty.
double timed(const GdsContext& ctx, const Placement& p, double overhead) {
  return p.size() ? micro_batch_time(p, ctx.batch, ctx.latency, ctx.cp_size) + overhead : 0.0;
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
    *work += p.size() + n;
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
        const int64_t size = split[a].size() + split[c].size();
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

// resplit._rings: ids first-fit decreasing by cost (ties: the lower index) into groups
// whose shard tokens fit the bucket; *checks counts the first-fit checks.
std::vector<std::vector<Index>> rings(const GdsContext& ctx, std::vector<Index> ids,
                                      int64_t* checks) {
  const Batch& b = ctx.batch;
  std::sort(ids.begin(), ids.end(), [&](Index x, Index y) {
    return b.costs[x] != b.costs[y] ? b.costs[x] > b.costs[y] : x < y;
  });
  std::vector<std::vector<Index>> groups;
  std::vector<int64_t> tokens;
  for (Index i : ids) {
    const int64_t s = shard_tokens(b.lengths[i], ctx.cp_size);
    bool placed = false;
    for (size_t g = 0; g < groups.size() && !placed; ++g) {
      ++*checks;
      if (tokens[g] + s <= ctx.bucket_size) {
        groups[g].push_back(i);
        tokens[g] += s;
        placed = true;
      }
    }
    if (!placed) {
      groups.push_back({i});
      tokens.push_back(s);
    }
  }
  return groups;
}

}  // namespace

std::pair<double, double> ring_sums(const GdsContext& ctx, const std::vector<Index>& dist) {
  double t_comm = 0.0, t_dist = 0.0;
  for (Index i : dist) {
    t_comm += ctx.batch.comm[i];
    t_dist += ctx.batch.share(i, ctx.cp_size);
  }
  return {dist.empty() ? t_comm : t_comm + ctx.latency, t_dist};
}

namespace {

using Skeleton = std::vector<std::pair<size_t, std::vector<Index>>>;

// resplit._skeleton: the micro-batches deal() fills, (DP rank, distributed samples) each.
Skeleton skeleton(const GdsContext& ctx, const std::vector<RankSplit>& splits, int mode,
                  int64_t* work) {
  const size_t d = splits.size();
  Skeleton out;
  std::vector<Index> ids;
  int64_t full = 0;
  for (size_t r = 0; r < d; ++r) {
    for (const auto& p : splits[r]) {
      if (p.empty()) continue;
      ++full;
      *work += 1 + p.size();
      if (mode == 0) out.emplace_back(r, p.distributed);
      for (Index i : p.distributed) {
        if (mode == 1 || ctx.batch.lengths[i] > ctx.bucket_size) ids.push_back(i);
      }
    }
  }
  if (mode == 0) {  // and one empty micro-batch per DP rank, for what fits nowhere else
    for (size_t r = 0; r < d; ++r) out.emplace_back(r, std::vector<Index>{});
    return out;
  }
  int64_t checks = 0;
  auto groups = rings(ctx, ids, &checks);
  const size_t ng = groups.size();
  std::vector<double> ring(ng);
  for (size_t g = 0; g < ng; ++g) {
    const auto sums = ring_sums(ctx, groups[g]);
    ring[g] = rank_time(0.0, sums.first, sums.second, ctx.cp_size, ctx.batch.objective);
  }
  *work += checks + 2 * static_cast<int64_t>(ids.size()) + static_cast<int64_t>(d * ng);
  std::vector<size_t> order(ng);
  for (size_t g = 0; g < ng; ++g) order[g] = g;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return ring[x] > ring[y]; });
  std::vector<double> load(d, 0.0);
  std::vector<int64_t> count(d, 0);
  for (size_t g : order) {  // longest ring first, to the least loaded DP rank
    size_t r = 0;
    for (size_t x = 1; x < d; ++x) {
      if (load[x] < load[r]) r = x;
    }
    load[r] += ring[g];
    ++count[r];
    out.emplace_back(r, std::move(groups[g]));
  }
  // the plan's micro-batches spread evenly, and one more
  const int64_t per = (full + static_cast<int64_t>(d) - 1) / static_cast<int64_t>(d);
  for (size_t r = 0; r < d; ++r) {
    for (int64_t j = std::min(count[r], per); j <= per; ++j) {
      out.emplace_back(r, std::vector<Index>{});
    }
  }
  return out;
}

// resplit.deal's micro-batches being filled: per skeleton entry its placement, ring sums,
// per CP rank loads and tokens, its time so far and its least loaded CP rank (ties: the
// lower), and each DP rank's time so far.
struct Dealer {
  const GdsContext& ctx;
  const Skeleton& skel;
  double overhead;
  std::vector<Placement> out;
  std::vector<double> comm, share, top, rt;
  std::vector<std::vector<double>> load;
  std::vector<std::vector<int64_t>> tok;
  std::vector<int> least;

  Dealer(const GdsContext& c, const Skeleton& sk, size_t dp, double ovh)
      : ctx(c), skel(sk), overhead(ovh), out(sk.size()), comm(sk.size()), share(sk.size()),
        top(sk.size()), rt(dp, 0.0), load(sk.size()), tok(sk.size()), least(sk.size(), 0) {
    const int n = ctx.cp_size;
    for (size_t k = 0; k < skel.size(); ++k) {
      const auto& dist = skel[k].second;
      const auto sums = ring_sums(ctx, dist);
      int64_t dtok = 0;
      for (Index i : dist) dtok += shard_tokens(ctx.batch.lengths[i], n);
      comm[k] = sums.first;
      share[k] = sums.second;
      top[k] = dist.empty() ? 0.0
                            : rank_time(0.0, comm[k], share[k], n, ctx.batch.objective) + overhead;
      rt[skel[k].first] += top[k];
      out[k].distributed = dist;
      out[k].local.assign(static_cast<size_t>(n), {});
      load[k].assign(static_cast<size_t>(n), 0.0);
      tok[k].assign(static_cast<size_t>(n), dtok);
    }
  }

  // Sample i where (DP rank time + added) + 1e-3 added is least (ties: the first); false
  // if it fits no CP rank.
  bool add(Index i) {
    const Batch& b = ctx.batch;
    const int n = ctx.cp_size;
    const int64_t s = b.lengths[i];
    const double c = b.costs[i];
    DealChoice best;
    for (size_t k = 0; k < skel.size(); ++k) {
      // Exact pruning: the key is at least the DP rank's time (added >= 0, monotone
      // rounding), and only a strictly lower key wins.
      if (best.beats(rt[skel[k].first])) continue;
      int j = least[k];  // the least loaded CP rank if it has room, else a scan
      if (tok[k][j] + s > ctx.bucket_size) {
        j = -1;
        for (int x = 0; x < n; ++x) {
          if (tok[k][x] + s <= ctx.bucket_size && (j < 0 || load[k][x] < load[k][j])) j = x;
        }
        if (j < 0) continue;
      }
      const double t = rank_time(load[k][j] + c, comm[k], share[k], n, b.objective) + overhead;
      best.offer(rt[skel[k].first], top[k], t, k, j);
    }
    if (!best.found) return false;
    const size_t bk = best.slot;
    const auto br = static_cast<size_t>(best.where);
    out[bk].local[br].push_back(i);
    load[bk][br] += c;
    tok[bk][br] += s;
    top[bk] = std::max(top[bk], best.t);
    rt[skel[bk].first] += best.added;
    int lo = 0;
    for (int x = 1; x < n; ++x) {
      if (load[bk][x] < load[bk][lo]) lo = x;
    }
    least[bk] = lo;
    return true;
  }
};

}  // namespace

std::optional<std::vector<RankSplit>> deal(const GdsContext& ctx,
                                           const std::vector<RankSplit>& splits,
                                           double overhead, int mode, int64_t limit,
                                           int64_t* work) {
  const Batch& b = ctx.batch;
  const Skeleton skel = skeleton(ctx, splits, mode, work);
  std::vector<char> held(static_cast<size_t>(b.size), 0);
  for (const auto& m : skel) {
    for (Index i : m.second) held[static_cast<size_t>(i)] = 1;
  }
  std::vector<Index> pool;
  for (const auto& split : splits) {
    for (const auto& p : split) {
      for (Index i : p.distributed) {
        if (!held[static_cast<size_t>(i)]) pool.push_back(i);
      }
      for (const auto& r : p.local) {
        for (Index i : r) {
          if (!held[static_cast<size_t>(i)]) pool.push_back(i);
        }
      }
    }
  }
  const int64_t per = 2 + static_cast<int64_t>(skel.size()) * (ctx.cp_size + 1) / 3;
  const int64_t np = static_cast<int64_t>(pool.size());
  if (*work + np * per >= limit) return std::nullopt;
  *work += np * per;
  std::sort(pool.begin(), pool.end(), [&](Index x, Index y) {
    return b.costs[x] != b.costs[y] ? b.costs[x] > b.costs[y] : x < y;
  });
  Dealer dealer(ctx, skel, splits.size(), overhead);
  for (Index i : pool) {
    if (!dealer.add(i)) return std::nullopt;
  }
  std::vector<RankSplit> result(splits.size());
  for (size_t k = 0; k < skel.size(); ++k) {
    if (!dealer.out[k].empty()) result[skel[k].first].push_back(std::move(dealer.out[k]));
  }
  return result;
}

std::optional<std::vector<RankSplit>> deal_best(const GdsContext& ctx,
                                                const std::vector<RankSplit>& splits,
                                                double overhead, int64_t limit,
                                                int64_t* work) {
  const int64_t n = ctx.cp_size;
  int64_t spent = 0;
  double cur = 0.0;
  for (const auto& split : splits) {
    for (const auto& p : split) spent += p.size() + n;
    cur = std::max(cur, ctx.split_time(split, overhead));
  }
  std::optional<std::vector<RankSplit>> best;
  for (int mode = 0; mode < 3; ++mode) {  // resplit.DEAL_MODES: keep, rings, long
    int64_t used = 0;
    auto got = deal(ctx, splits, overhead, mode, limit - spent, &used);
    spent += used;
    if (!got) continue;
    double t = 0.0;
    for (const auto& split : *got) {
      for (const auto& p : split) spent += p.size() + n;
      t = std::max(t, ctx.split_time(split, overhead));
    }
    if (t < cur) {
      cur = t;
      best = std::move(got);
    }
  }
  *work += spent;
  return best;
}

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
