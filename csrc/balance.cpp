// (ours) CP-balance polish of a plan: one DP rank's local samples moved and swapped between
// the (micro-batch, CP rank) slots of that rank.  Mirrors skrull_ext/scheduler/balance.py
// step for step (same candidate order, same float operations, same work count), so both
// return identical plans; see that module's docstring.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "scheduler.h"

namespace skrull {
namespace {

constexpr int64_t kDests = 16;    // balance.DESTS
constexpr int64_t kWindow = 1;    // balance.WINDOW
constexpr int64_t kEvalWork = 4;  // balance.EVAL_WORK
constexpr int64_t kPairWork = 2;  // balance.PAIR_WORK
constexpr int64_t kApplyWork = 8; // balance.APPLY_WORK
constexpr int64_t kBalanceDiv = 8; // balance.BALANCE_DIV
constexpr int64_t kBalanceMinSamples = 256;  // balance.BALANCE_MIN_SAMPLES

using Keyed = std::pair<double, Index>;  // (cost, sample): a slot's cost order

struct Step {
  size_t m, m2;
  int r, r2;
  Index i, j;  // j -1: a move
  double xs, xd, ts, td;
};

// balance._Rank: one DP rank's non-empty micro-batches (with `pins`: those holding pinned
// rings too, their rings' seconds and tokens added to each CP rank).
class Rank {
 public:
  Rank(const GdsContext& ctx, const RankSplit& split, const Pins* pins)
      : ctx_(ctx), n_(ctx.cp_size) {
    const Batch& b = ctx.batch;
    for (size_t j = 0; j < split.size(); ++j) {
      const Placement& p = split[j];
      const bool pinned = pins != nullptr && p.pin >= 0;
      if (p.empty() && !pinned) continue;
      js.push_back(j);
      pin_.push_back(pinned ? &pins->seconds[static_cast<size_t>(p.pin)] : nullptr);
      const auto [comm, share] = ring_sums(ctx, p.distributed);
      int64_t dtok = 0;
      for (Index i : p.distributed) dtok += shard_tokens(b.lengths[i], n_);
      comm_.push_back(comm);
      share_.push_back(share);
      loc_.push_back(p.local);
      std::vector<std::vector<Keyed>> srt;
      std::vector<double> loads, ts;
      std::vector<int64_t> toks;
      for (const auto& r : p.local) {
        std::vector<Keyed> keyed;
        double x = 0.0;
        int64_t tk = dtok;
        for (Index i : r) {
          keyed.emplace_back(b.costs[i], i);
          x += b.costs[i];
          tk += b.lengths[i];
        }
        std::sort(keyed.begin(), keyed.end());
        srt.push_back(std::move(keyed));
        loads.push_back(x);
        toks.push_back(tk);
        work += static_cast<int64_t>(r.size());
      }
      srt_.push_back(std::move(srt));
      if (pinned) {
        const auto& extra = pins->tokens[static_cast<size_t>(p.pin)];
        for (size_t r = 0; r < toks.size(); ++r) toks[r] += extra[r];
      }
      const size_t m = load_.size();
      load_.push_back(std::move(loads));
      tok_.push_back(std::move(toks));
      for (size_t r = 0; r < load_[m].size(); ++r) ts.push_back(rt(m, r, load_[m][r]));
      t_.push_back(std::move(ts));
      order_.emplace_back();
      reorder(m);
      work += static_cast<int64_t>(p.distributed.size()) + 2 * n_;
    }
    est = estimate();
  }

  std::vector<size_t> js;
  int64_t work = 0;
  bool changed = false;
  double est = 0.0;

  double rt(size_t m, size_t r, double x) const {
    const double t = rank_time(x, comm_[m], share_[m], n_, ctx_.batch.objective);
    return pin_[m] == nullptr ? t : std::max(0.0, t) + (*pin_[m])[r];
  }
  double top(size_t m) const { return t_[m][static_cast<size_t>(order_[m][0])]; }
  double other(size_t m, int a, int b) const {
    for (size_t q = 0; q < 3 && q < order_[m].size(); ++q) {
      const int r = order_[m][q];
      if (r != a && r != b) return t_[m][static_cast<size_t>(r)];
    }
    return -std::numeric_limits<double>::infinity();
  }
  double estimate() const {
    double s = 0.0;
    for (size_t m = 0; m < js.size(); ++m) s += top(m);
    return s;
  }
  // balance._Rank.spread: load, or time where pinned rings make the CP ranks' differ.
  double spread(size_t m) const {
    const auto hi = static_cast<size_t>(order_[m][0]);
    const auto lo = static_cast<size_t>(order_[m][static_cast<size_t>(n_ - 1)]);
    if (pin_[m] == nullptr) return load_[m][hi] - load_[m][lo];
    return t_[m][hi] - t_[m][lo];
  }
  // balance._Rank.time: the rank's seconds, its micro-batches' tops in order.
  double time(double overhead) const {
    double t = 0.0;
    for (size_t m = 0; m < js.size(); ++m) t += top(m) + overhead;
    return t;
  }
  std::vector<size_t> sources() const {
    std::vector<size_t> out(js.size());
    for (size_t m = 0; m < out.size(); ++m) out[m] = m;
    std::sort(out.begin(), out.end(), [this](size_t a, size_t b) {
      const double sa = spread(a), sb = spread(b);
      return sa > sb || (sa == sb && a < b);
    });
    return out;
  }
  int64_t source_work(size_t m) const {
    const auto s = static_cast<int64_t>(loc_[m][static_cast<size_t>(order_[m][0])].size());
    return 1 + static_cast<int64_t>(js.size()) * std::min<int64_t>(kDests, n_) *
                   (kPairWork + s + kEvalWork * 2 * kWindow * (1 + s));
  }
  std::optional<Step> best_from(size_t m) const;
  void apply(const Step& st);
  RankSplit result(const RankSplit& split) const {
    RankSplit out = split;
    for (size_t m = 0; m < js.size(); ++m) out[js[m]].local = loc_[m];
    return out;
  }

 private:
  void reorder(size_t m) {
    auto& o = order_[m];
    o.resize(static_cast<size_t>(n_));
    for (int r = 0; r < n_; ++r) o[static_cast<size_t>(r)] = r;
    const auto& t = t_[m];
    const auto& x = load_[m];
    std::sort(o.begin(), o.end(), [&](int a, int b) {
      const auto ua = static_cast<size_t>(a), ub = static_cast<size_t>(b);
      if (t[ua] != t[ub]) return t[ua] > t[ub];
      if (x[ua] != x[ub]) return x[ua] > x[ub];
      return a < b;
    });
  }
  // (d primary, d secondary) and the two new times (balance._Rank._price).
  void price(Step* st, double* dp, double* ds) const {
    st->ts = rt(st->m, static_cast<size_t>(st->r), st->xs);
    st->td = rt(st->m2, static_cast<size_t>(st->r2), st->xd);
    if (st->m == st->m2) {
      *dp = std::max(std::max(st->ts, st->td), other(st->m, st->r, st->r2)) - top(st->m);
    } else {
      *dp = (std::max(st->ts, other(st->m, st->r, -1)) - top(st->m)) +
            (std::max(st->td, other(st->m2, st->r2, -1)) - top(st->m2));
    }
    const double os = t_[st->m][static_cast<size_t>(st->r)];
    const double od = t_[st->m2][static_cast<size_t>(st->r2)];
    *ds = (st->ts * st->ts - os * os) + (st->td * st->td - od * od);
  }

  const GdsContext& ctx_;
  int n_;
  std::vector<double> comm_, share_;
  std::vector<const std::vector<double>*> pin_;  // the rings' seconds [N] or null
  std::vector<std::vector<std::vector<Index>>> loc_;
  std::vector<std::vector<std::vector<Keyed>>> srt_;
  std::vector<std::vector<double>> load_, t_;
  std::vector<std::vector<int64_t>> tok_;
  std::vector<std::vector<int>> order_;
};

// First index of `v` whose cost is >= x (bisect_left on (x, -1)).
size_t lower(const std::vector<Keyed>& v, double x) {
  return static_cast<size_t>(
      std::lower_bound(v.begin(), v.end(), x,
                       [](const Keyed& a, double y) { return a.first < y; }) -
      v.begin());
}

std::optional<Step> Rank::best_from(size_t m) const {
  const int64_t cap = ctx_.bucket_size;
  const int64_t* lengths = ctx_.batch.lengths;
  std::optional<Step> best;
  double kp = 0.0, ks = 0.0;
  const int r = order_[m][0];
  const auto& src = srt_[m][static_cast<size_t>(r)];
  if (src.empty()) return best;
  const double ls = load_[m][static_cast<size_t>(r)];
  const int64_t toks = tok_[m][static_cast<size_t>(r)];
  const double second = other(m, r, -1);
  const auto consider = [&](Step st) {
    double dp = 0.0, ds = 0.0;
    price(&st, &dp, &ds);
    if (dp < kp || (dp == kp && ds < ks)) {
      kp = dp;
      ks = ds;
      best = st;
    }
  };
  const int64_t dests = std::min<int64_t>(kDests, n_);
  for (size_t m2 = 0; m2 < js.size(); ++m2) {
    for (int64_t q = 1; q <= dests; ++q) {
      const int r2 = order_[m2][static_cast<size_t>(n_ - q)];
      if (m2 == m && r2 == r) continue;
      const double ld = load_[m2][static_cast<size_t>(r2)];
      const int64_t tokd = tok_[m2][static_cast<size_t>(r2)];
      double delta = (ls - ld) / 2.0;
      if (pin_[m] != nullptr || pin_[m2] != nullptr) {
        delta = (t_[m][static_cast<size_t>(r)] - t_[m2][static_cast<size_t>(r2)]) / 2.0;
      }
      if (m2 != m) {
        const double room = std::min(t_[m][static_cast<size_t>(r)] - second,
                                     top(m2) - t_[m2][static_cast<size_t>(r2)]);
        if (room > 0.0) delta = room;
      }
      if (!(delta > 0.0)) continue;
      const auto& dst = srt_[m2][static_cast<size_t>(r2)];
      const size_t lo = lower(src, delta);
      const size_t k0 = lo > static_cast<size_t>(kWindow) ? lo - kWindow : 0;
      for (size_t k = k0; k < std::min(src.size(), lo + kWindow); ++k) {
        const auto [ci, i] = src[k];
        if (tokd + lengths[i] > cap) continue;
        consider(Step{m, m2, r, r2, i, -1, ls - ci, ld + ci, 0.0, 0.0});
      }
      for (const auto& [ci, i] : src) {
        const int64_t si = lengths[i];
        const size_t lo2 = lower(dst, ci - delta);
        const size_t k1 = lo2 > static_cast<size_t>(kWindow) ? lo2 - kWindow : 0;
        for (size_t k = k1; k < std::min(dst.size(), lo2 + kWindow); ++k) {
          const auto [cj, j] = dst[k];
          const int64_t sj = lengths[j];
          if (!(cj < ci) || toks - si + sj > cap || tokd + si - sj > cap) continue;
          consider(Step{m, m2, r, r2, i, j, ls - ci + cj, ld + ci - cj, 0.0, 0.0});
        }
      }
    }
  }
  return best;
}

void Rank::apply(const Step& st) {
  const Batch& b = ctx_.batch;
  const auto r = static_cast<size_t>(st.r), r2 = static_cast<size_t>(st.r2);
  const auto take = [&](size_t m, size_t slot, Index x) {
    auto& l = loc_[m][slot];
    l.erase(std::find(l.begin(), l.end(), x));
    auto& s = srt_[m][slot];
    s.erase(std::find(s.begin(), s.end(), Keyed{b.costs[x], x}));
  };
  const auto put = [&](size_t m, size_t slot, Index x) {
    loc_[m][slot].push_back(x);
    auto& s = srt_[m][slot];
    const Keyed key{b.costs[x], x};
    s.insert(std::upper_bound(s.begin(), s.end(), key), key);
  };
  take(st.m, r, st.i);
  if (st.j >= 0) take(st.m2, r2, st.j);
  put(st.m2, r2, st.i);
  tok_[st.m][r] -= b.lengths[st.i];
  tok_[st.m2][r2] += b.lengths[st.i];
  if (st.j >= 0) {
    put(st.m, r, st.j);
    tok_[st.m][r] += b.lengths[st.j];
    tok_[st.m2][r2] -= b.lengths[st.j];
  }
  load_[st.m][r] = st.xs;
  load_[st.m2][r2] = st.xd;
  t_[st.m][r] = st.ts;
  t_[st.m2][r2] = st.td;
  reorder(st.m);
  if (st.m2 != st.m) reorder(st.m2);
  work += kApplyWork + 2 * n_;
  changed = true;
  est = estimate();
}

}  // namespace

// balance._split_time: ctx.split_time, or with pinned rings their seconds counted.
double split_seconds(const GdsContext& ctx, const RankSplit& split, double overhead,
                     const Pins* pins) {
  if (pins == nullptr) return ctx.split_time(split, overhead);
  return Rank(ctx, split, pins).time(overhead);
}

bool has_pin(const RankSplit& split) {
  for (const auto& p : split) {
    if (p.pin >= 0) return true;
  }
  return false;
}

// balance.polished: balance() of each DP rank's micro-batches without pinned rings (those
// first, as they are); with pinned rings, then a second pass within what the first left,
// those micro-batches included (their rings' seconds and tokens counted).
std::vector<RankSplit> polished(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                                double overhead, int64_t polish, int64_t* work,
                                const Pins* pins) {
  bool any = false;
  for (const auto& s : splits) any = any || has_pin(s);
  if (!any) return balance(ctx, splits, overhead, polish, work);
  std::vector<RankSplit> pinned(splits.size()), free(splits.size());
  for (size_t d = 0; d < splits.size(); ++d) {
    for (const auto& p : splits[d]) {
      if (p.pin >= 0) {
        pinned[d].push_back(p);
      } else if (!p.empty()) {
        free[d].push_back(p);
      }
    }
  }
  int64_t first = 0, second = 0;
  auto done = balance(ctx, free, overhead, polish, &first);
  for (size_t d = 0; d < splits.size(); ++d) {
    pinned[d].insert(pinned[d].end(), done[d].begin(), done[d].end());
  }
  auto out = balance(ctx, pinned, overhead, polish - first, &second, pins);
  if (work) *work = first + second;
  return out;
}

int64_t balance_share(int64_t budget, int64_t k) {
  return k >= kBalanceMinSamples ? budget / kBalanceDiv : 0;
}

std::vector<RankSplit> balance(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                               double overhead, int64_t limit, int64_t* work_out,
                               const Pins* pins) {
  if (work_out) *work_out = 0;
  if (limit <= 0 || ctx.cp_size < 2 || splits.empty()) return splits;
  int64_t work = 0, check = 0;
  for (const auto& split : splits) {
    for (const auto& p : split) {
      int64_t size = static_cast<int64_t>(p.distributed.size());
      for (const auto& r : p.local) size += static_cast<int64_t>(r.size());
      check += 2 * (size + ctx.cp_size);
    }
  }
  if (2 * check >= limit) return splits;  // building the ranks costs at most `check`
  limit -= check;                          // the final split_time checks
  std::vector<Rank> ranks;
  ranks.reserve(splits.size());
  for (const auto& split : splits) {
    ranks.emplace_back(ctx, split, pins);
    work += ranks.back().work;
    ranks.back().work = 0;
  }
  const auto rank_key = [&](const Rank& rk) {
    return rk.est + overhead * static_cast<double>(rk.js.size());
  };
  while (work < limit) {
    size_t d = 0;
    for (size_t x = 1; x < ranks.size(); ++x) {
      if (rank_key(ranks[x]) > rank_key(ranks[d])) d = x;
    }
    Rank& rk = ranks[d];
    work += static_cast<int64_t>(ranks.size() + rk.js.size());
    std::optional<Step> step;
    for (size_t m : rk.sources()) {
      const int64_t cost = rk.source_work(m);
      if (work + cost + kApplyWork + 2 * ctx.cp_size >= limit) break;
      work += cost;
      step = rk.best_from(m);
      if (step) break;
    }
    if (!step) break;
    rk.apply(*step);
    work += rk.work;
    rk.work = 0;
  }
  std::vector<RankSplit> out;
  out.reserve(splits.size());
  for (size_t d = 0; d < splits.size(); ++d) {
    if (ranks[d].changed) {
      RankSplit cand = ranks[d].result(splits[d]);
      if (split_seconds(ctx, cand, overhead, pins) <
          split_seconds(ctx, splits[d], overhead, pins)) {
        out.push_back(std::move(cand));
        continue;
      }
    }
    out.push_back(splits[d]);
  }
  if (work_out) *work_out = work + check;
  return out;
}

}  // namespace skrull
