// (ours) Cross-DP-rank polish of a plan with pinned rings: the slowest DP rank's binding
// local samples moved or swapped into other DP ranks' slots.  Mirrors
// skrull_ext/scheduler/regroup.py step for step (same candidate order, same float
// operations, same work count), so both return identical plans; see that module's docstring.
// Also lns's stages after the pinned search (after_search, search_alone).
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <vector>

#include "scheduler.h"

namespace skrull {
namespace {

constexpr double kEps = 1e-12;     // regroup.EPS
constexpr size_t kDests = 4;       // regroup.DESTS
constexpr int64_t kAloneSplit = 2;  // regroup.ALONE_SPLIT

// regroup._Mb: one micro-batch's lists, ring sums, per-CP-rank loads, tokens and times.
struct Mb {
  std::vector<Index> dist;
  std::vector<std::vector<Index>> local;
  int64_t pin = -1;
  std::vector<double> sec, load, t;
  std::vector<int64_t> tok;
  double comm = 0.0, share = 0.0;
  int64_t size = 0;
  RankTimeOf of{0.0, 0.0, 1, Objective{}};  // rank_time's terms for comm and share

  int64_t sum(const GdsContext& ctx, const Pins* pins) {
    const int n = ctx.cp_size;
    const Batch& b = ctx.batch;
    std::tie(comm, share) = ring_sums(ctx, dist);
    of = RankTimeOf(comm, share, n, b.objective);
    int64_t dtok = 0;
    for (Index i : dist) dtok += shard_tokens(b.lengths[i], n);
    load.assign(n, 0.0);
    tok.assign(n, 0);
    t.assign(n, 0.0);
    size = static_cast<int64_t>(dist.size());
    for (int r = 0; r < n; ++r) {
      double x = 0.0;
      int64_t tk = dtok;
      for (Index i : local[r]) {
        x += b.costs[i];
        tk += b.lengths[i];
      }
      load[r] = x;
      tok[r] = tk + (pin < 0 ? 0 : pins->tokens[static_cast<size_t>(pin)][r]);
      size += static_cast<int64_t>(local[r].size());
    }
    for (int r = 0; r < n; ++r) t[r] = time(r, load[r]);
    return size + n;
  }
  double time(int r, double x) const {
    return std::max(0.0, of.at(x)) + sec[r];
  }
  bool kept() const { return size > 0 || pin >= 0; }
  double top() const { return *std::max_element(t.begin(), t.end()); }
  double seconds(double overhead) const { return kept() ? top() + overhead : 0.0; }
};

double rank_seconds(const std::vector<Mb>& rank, double overhead) {
  double t = 0.0;
  for (const auto& mb : rank) t += mb.seconds(overhead);
  return t;
}

struct Cand {
  double k0 = 0.0, k1 = 0.0;
  size_t j = 0, d = 0, j2 = 0;
  int r = 0, r2 = 0;
  Index i = 0, i2 = -1;
  bool found = false;
};

// regroup._best: the best step from DP rank d0; adds the work counted.
Cand best_step(const GdsContext& ctx, const std::vector<std::vector<Mb>>& ranks,
               const std::vector<double>& rt, size_t d0, double overhead, int64_t& work) {
  const int n = ctx.cp_size;
  const Batch& b = ctx.batch;
  const int64_t cap = ctx.bucket_size;
  const double t0 = rt[d0], bar = t0 * (1.0 - kEps);
  Cand best;
  // each other micro-batch's destination CP ranks (least time first), top and seconds:
  // the same for every source sample, so computed once per step
  struct Dest {
    std::vector<int> order;
    double top, old;
  };
  std::vector<std::vector<Dest>> dests(ranks.size());
  for (size_t d = 0; d < ranks.size(); ++d) {
    if (d == d0) continue;
    for (const Mb& mb2 : ranks[d]) {
      Dest x{std::vector<int>(n), mb2.top(), mb2.seconds(overhead)};
      std::iota(x.order.begin(), x.order.end(), 0);
      std::sort(x.order.begin(), x.order.end(), [&mb2](int a, int c) {
        return mb2.t[a] < mb2.t[c] || (mb2.t[a] == mb2.t[c] && a < c);
      });
      x.order.resize(std::min(kDests, x.order.size()));
      dests[d].push_back(std::move(x));
    }
  }
  for (size_t j = 0; j < ranks[d0].size(); ++j) {
    const Mb& mb = ranks[d0][j];
    const double top = mb.top(), old = mb.seconds(overhead);
    const bool empties = mb.size == 1 && mb.pin < 0;  // a move of its one sample empties it
    for (int r = 0; r < n; ++r) {
      if (mb.t[r] != top) continue;
      double others = 0.0;
      for (int x = 0; x < n; ++x) {
        if (x != r) others = std::max(others, mb.t[x]);
      }
      for (Index i : mb.local[r]) {
        const double ci = b.costs[i];
        const int64_t si = b.lengths[i];
        for (size_t d = 0; d < ranks.size(); ++d) {
          if (d == d0) continue;
          for (size_t j2 = 0; j2 < ranks[d].size(); ++j2) {
            const Mb& mb2 = ranks[d][j2];
            const Dest& dst2 = dests[d][j2];
            work += n;
            const double top2 = dst2.top, old2 = dst2.old;
            for (int r2 : dst2.order) {
              const auto& slot = mb2.local[r2];
              for (size_t k = 0; k <= slot.size(); ++k) {
                const Index i2 = k == 0 ? -1 : slot[k - 1];
                if (i2 >= 0) ++work;
                const double c2 = i2 >= 0 ? b.costs[i2] : 0.0;
                const int64_t s2 = i2 >= 0 ? b.lengths[i2] : 0;
                if ((i2 >= 0 && !(c2 < ci)) || mb2.tok[r2] + si - s2 > cap) continue;
                if (i2 >= 0 && mb.tok[r] - si + s2 > cap) continue;
                const double src = (empties && i2 < 0)
                                       ? 0.0
                                       : std::max(others, mb.time(r, mb.load[r] - ci + c2)) +
                                             overhead;
                const double nt0 = t0 - old + src;
                const double dst = std::max(top2, mb2.time(r2, mb2.load[r2] + ci - c2));
                const double nt = rt[d] - old2 + (dst + overhead);
                if (!(nt0 < bar && nt < bar)) continue;
                const double k0 = std::max(nt0, nt);
                if (!best.found || k0 < best.k0 || (k0 == best.k0 && nt0 < best.k1)) {
                  best = Cand{k0, nt0, j, d, j2, r, r2, i, i2, true};
                }
              }
            }
          }
        }
      }
    }
  }
  return best;
}

void erase_one(std::vector<Index>& v, Index x) { v.erase(std::find(v.begin(), v.end(), x)); }

// regroup.search_alone: every DP rank but the slowest searched alone (lns on that rank),
// kept where it got strictly faster; *work: the units given, not those spent.
std::vector<RankSplit> search_alone(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                                    double overhead, int64_t limit, const Pins& pins,
                                    int64_t* work) {
  *work = 0;
  const size_t dp = splits.size();
  std::vector<double> times(dp);
  size_t d0 = 0;
  for (size_t d = 0; d < dp; ++d) {
    times[d] = split_seconds(ctx, splits[d], overhead, &pins);
    if (times[d] > times[d0]) d0 = d;
  }
  const int64_t others = static_cast<int64_t>(dp) - 1;
  const int64_t each = limit / (kAloneSplit * std::max<int64_t>(1, others));
  if (each <= 0 || others <= 0) return splits;
  std::vector<RankSplit> out(splits);
  for (size_t d = 0; d < dp; ++d) {
    if (d == d0) continue;
    auto searched = lns(ctx, {splits[d]}, overhead, each, 0.0, nullptr, &pins);
    RankSplit got;
    for (auto& p : searched[0]) {
      if (!p.empty() || p.pin >= 0) got.push_back(std::move(p));
    }
    if (split_seconds(ctx, got, overhead, &pins) < times[d]) out[d] = std::move(got);
  }
  *work = each * others;
  return out;
}

// The slowest DP rank's seconds (with the rings').
double makespan(const GdsContext& ctx, const std::vector<RankSplit>& splits, double overhead,
                const Pins& pins) {
  double t = 0.0;
  for (const auto& s : splits) t = std::max(t, split_seconds(ctx, s, overhead, &pins));
  return t;
}

}  // namespace

std::vector<RankSplit> regroup(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                               double overhead, int64_t limit, int64_t* work_out,
                               const Pins* pins) {
  if (work_out) *work_out = 0;
  const int n = ctx.cp_size;
  if (limit <= 0 || n < 2 || splits.size() < 2) return splits;
  int64_t check = 0;
  for (const auto& split : splits) {
    for (const auto& p : split) {
      int64_t size = static_cast<int64_t>(p.distributed.size());
      for (const auto& r : p.local) size += static_cast<int64_t>(r.size());
      check += 2 * (size + n);
    }
  }
  if (2 * check >= limit) return splits;
  limit -= check;
  int64_t work = 0;
  std::vector<std::vector<Mb>> ranks(splits.size());
  for (size_t d = 0; d < splits.size(); ++d) {
    for (const auto& p : splits[d]) {
      const bool pinned = pins != nullptr && p.pin >= 0;
      if (p.empty() && !pinned) continue;
      Mb mb;
      mb.dist = p.distributed;
      mb.local = p.local;
      mb.pin = pinned ? p.pin : -1;
      mb.sec = pinned ? pins->seconds[static_cast<size_t>(p.pin)] : std::vector<double>(n, 0.0);
      work += mb.sum(ctx, pins);
      ranks[d].push_back(std::move(mb));
    }
  }
  std::vector<double> rt(ranks.size());
  for (size_t d = 0; d < ranks.size(); ++d) rt[d] = rank_seconds(ranks[d], overhead);
  bool changed = false;
  while (work < limit) {
    size_t d0 = 0;
    for (size_t d = 1; d < ranks.size(); ++d) {
      if (rt[d] > rt[d0]) d0 = d;
    }
    work += static_cast<int64_t>(ranks.size());
    const Cand c = best_step(ctx, ranks, rt, d0, overhead, work);
    if (!c.found) break;
    Mb& mb = ranks[d0][c.j];
    Mb& mb2 = ranks[c.d][c.j2];
    erase_one(mb.local[c.r], c.i);
    mb2.local[c.r2].push_back(c.i);
    if (c.i2 >= 0) {
      erase_one(mb2.local[c.r2], c.i2);
      mb.local[c.r].push_back(c.i2);
    }
    work += mb.sum(ctx, pins);
    work += mb2.sum(ctx, pins);
    if (!mb.kept()) ranks[d0].erase(ranks[d0].begin() + static_cast<std::ptrdiff_t>(c.j));
    rt[d0] = rank_seconds(ranks[d0], overhead);
    rt[c.d] = rank_seconds(ranks[c.d], overhead);
    changed = true;
  }
  work += check;
  if (work_out) *work_out = work;
  if (!changed) return splits;
  std::vector<RankSplit> out(ranks.size());
  double before = 0.0, after = 0.0;
  for (size_t d = 0; d < ranks.size(); ++d) {
    for (const auto& mb : ranks[d]) {
      Placement p;
      p.distributed = mb.dist;
      p.local = mb.local;
      p.pin = mb.pin;
      out[d].push_back(std::move(p));
    }
    after = std::max(after, split_seconds(ctx, out[d], overhead, pins));
    before = std::max(before, split_seconds(ctx, splits[d], overhead, pins));
  }
  return after < before ? out : splits;
}

std::vector<RankSplit> after_search(const GdsContext& ctx, std::vector<RankSplit> best,
                                    double overhead, int64_t left, int64_t alone,
                                    const Pins& pins, int64_t* work) {
  int64_t used = 0;
  best = regroup(ctx, best, overhead, left, &used, &pins);
  *work = used;
  if (left - used > 0) {  // the pinned deal once more with the rest
    int64_t more = 0;
    auto dealt = pin_deal_best(ctx, best, overhead, pins, left - used, &more);
    *work += more;
    if (dealt) best = std::move(*dealt);
  }
  if (alone > 0) {  // then the other DP ranks searched alone, and regroup() again
    int64_t given = 0, again = 0;
    auto out = search_alone(ctx, best, overhead, alone, pins, &given);
    out = regroup(ctx, out, overhead, alone - given, &again, &pins);
    *work += given + again;
    if (makespan(ctx, out, overhead, pins) < makespan(ctx, best, overhead, pins)) {
      best = std::move(out);
    }
  }
  return best;
}

}  // namespace skrull
