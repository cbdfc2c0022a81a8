// (ours) Local search refinement of the portfolio's plan under the true iteration time.
// Mirrors skrull_ext/scheduler/refine.py step for step (same move order, same work count,
// same float operations), so both return identical plans; see that module's docstring.
#include <algorithm>
#include <cstdint>
#include <cstddef>
#include <utility>

#include "scheduler.h"

namespace skrull {
namespace {

constexpr size_t kTargets = 4;         // refine.TARGETS
constexpr int64_t kPlaceWorkFactor = 8;  // refine.PLACE_WORK_FACTOR

// (sample, where): where -1 distributed, else the CP rank (refine._samples).
std::vector<std::pair<Index, int>> samples_of(const Placement& p) {
  std::vector<std::pair<Index, int>> out;
  for (Index i : p.distributed) out.emplace_back(i, -1);
  for (size_t r = 0; r < p.local.size(); ++r) {
    for (Index i : p.local[r]) out.emplace_back(i, static_cast<int>(r));
  }
  return out;
}

Placement without(const Placement& p, Index i, int where) {
  Placement out = p;
  auto& v = where < 0 ? out.distributed : out.local[static_cast<size_t>(where)];
  v.erase(std::remove(v.begin(), v.end(), i), v.end());
  return out;
}

Placement empty_placement(int cp_size) {
  Placement p;
  p.local.resize(static_cast<size_t>(cp_size));
  return p;
}

struct Priced {
  Placement p;
  double t;
};

// At most two micro-batches of a DP rank replaced while pricing it (the reference's dict):
// their times and whether they are empty.
struct Repl {
  size_t j[2] = {SIZE_MAX, SIZE_MAX};
  double t[2] = {0.0, 0.0};
  bool empty[2] = {false, false};
  Repl() = default;
  Repl(size_t j0, double t0, bool e0 = false) : j{j0, SIZE_MAX}, t{t0, 0.0}, empty{e0, false} {}
  Repl(size_t j0, double t0, bool e0, size_t j1, double t1, bool e1)
      : j{j0, j1}, t{t0, t1}, empty{e0, e1} {}
  int find(size_t at) const { return at == j[0] ? 0 : at == j[1] ? 1 : -1; }
};

// (C++ only, same floats) What pricing a placement with one more sample needs, summed in
// placement order as micro_batch_time and the reference's tokens() sum it: appending a
// sample adds one term to these sums, so best_insert prices its candidates without
// building or walking them.
struct Sums {
  double comm = 0.0, dist = 0.0;  // distributed samples' ring and per-rank seconds
  bool has_dist = false;
  int64_t size = 0;               // samples
  std::vector<double> load;       // [N] local seconds
  std::vector<int64_t> tok;       // [N] tokens
};

// One best_insert outcome: its time and where the sample goes (-1: distributed).
struct Insert {
  double t;
  int where;
};

class Search {
 public:
  Search(const GdsContext& ctx, const std::vector<RankSplit>& splits, double overhead,
         int64_t budget)
      : ctx_(ctx), n_(ctx.cp_size), overhead_(overhead), budget_(budget), splits_(splits) {
    for (auto& s : splits_) s.push_back(empty_placement(n_));
    mbt_.resize(splits_.size());
    for (size_t d = 0; d < splits_.size(); ++d) {
      for (const auto& p : splits_[d]) mbt_[d].push_back(price(p));
    }
    for (size_t d = 0; d < splits_.size(); ++d) rt_.push_back(rank_time(d));
    work_ = 0;
  }

  bool spent() const { return work_ >= budget_; }
  int64_t work() const { return work_; }

  bool step();
  std::vector<RankSplit> result() const;

 private:
  double price(const Placement& p) {
    work_ += p.size() + n_;
    return micro_batch_time(p, ctx_.batch, ctx_.latency, n_);
  }

  double rank_time(size_t d, const Repl& repl = Repl()) {
    double t = 0.0;
    work_ += static_cast<int64_t>(splits_[d].size());
    for (size_t j = 0; j < splits_[d].size(); ++j) {
      const int r = repl.find(j);
      const bool empty = r < 0 ? splits_[d][j].empty() : repl.empty[r];
      const double mt = r < 0 ? mbt_[d][j] : repl.t[r];
      if (!empty) t += mt + overhead_;
    }
    return t;
  }

  // Sums of p without sample `skip` (where it sits: skip_where, -1 distributed), into *out.
  void sums(const Placement& p, Sums* out, Index skip = -1, int skip_where = -2) const {
    const Batch& b = ctx_.batch;
    out->comm = out->dist = 0.0;
    out->size = 0;
    int64_t dist_tok = 0;
    for (Index i : p.distributed) {
      if (skip_where == -1 && i == skip) continue;
      out->comm += b.comm[i];
      out->dist += b.share(i, n_);
      dist_tok += shard_tokens(b.lengths[i], n_);
      ++out->size;
    }
    out->has_dist = out->size > 0;
    out->load.assign(static_cast<size_t>(n_), 0.0);
    out->tok.assign(static_cast<size_t>(n_), dist_tok);
    for (int r = 0; r < n_; ++r) {
      for (Index i : p.local[static_cast<size_t>(r)]) {
        if (skip_where == r && i == skip) continue;
        out->load[r] += b.costs[i];
        out->tok[r] += b.lengths[i];
        ++out->size;
      }
    }
  }

  // sums() of p without sample `skip` at `where`, from full = sums(p): only the list that
  // held it is summed again (in order, so the floats match a fresh sums()).
  void sums_without(const Placement& p, const Sums& full, Index skip, int where,
                    Sums* out) const {
    const Batch& b = ctx_.batch;
    out->load.assign(full.load.begin(), full.load.end());
    out->tok.assign(full.tok.begin(), full.tok.end());
    out->size = full.size - 1;
    out->comm = full.comm;
    out->dist = full.dist;
    out->has_dist = full.has_dist;
    if (where < 0) {
      out->comm = out->dist = 0.0;
      for (Index i : p.distributed) {
        if (i == skip) continue;
        out->comm += b.comm[i];
        out->dist += b.share(i, n_);
      }
      out->has_dist = p.distributed.size() > 1;
      const int64_t sh = shard_tokens(b.lengths[skip], n_);
      for (auto& t : out->tok) t -= sh;
    } else {
      double load = 0.0;
      for (Index i : p.local[static_cast<size_t>(where)]) {
        if (i != skip) load += b.costs[i];
      }
      out->load[where] = load;
      out->tok[where] -= b.lengths[skip];
    }
  }

  // micro_batch_time of the summed placement plus sample i (where: -1 distributed, else
  // the CP rank), the same float operations; counts price()'s work.
  double price_with(const Sums& s, Index i, int where) {
    const Batch& b = ctx_.batch;
    work_ += s.size + 1 + n_;
    double t_comm = s.comm, t_dist = s.dist;
    if (where < 0) {
      t_comm += b.comm[i];
      t_dist += b.share(i, n_);
    }
    if (where < 0 || s.has_dist) t_comm += ctx_.latency;
    double x_max = 0.0;
    for (int r = 0; r < n_; ++r) {
      x_max = std::max(x_max, r == where ? s.load[r] + b.costs[i] : s.load[r]);
    }
    return std::max(0.0, skrull::rank_time(x_max, t_comm, t_dist, n_, b.objective));
  }

  // p without `skip` (if given) plus sample i at `where`.
  Placement with(const Placement& p, Index i, int where, Index skip = -1,
                 int skip_where = -2) const {
    Placement out = skip_where >= -1 ? without(p, skip, skip_where) : p;
    (where < 0 ? out.distributed : out.local[static_cast<size_t>(where)]).push_back(i);
    return out;
  }

  std::optional<Insert> best_insert(const Sums& s, Index i);
  std::vector<size_t> fastest(size_t d, size_t count, bool nonempty);
  void apply(const std::vector<std::pair<std::pair<size_t, size_t>, Priced>>& changes);
  bool relocate(size_t d, size_t j, Index i, int where, size_t d2);
  bool swap(size_t d, size_t j, Index i, int where, size_t d2);
  bool merge(size_t d);

  const GdsContext& ctx_;
  const int n_;
  const double overhead_;
  const int64_t budget_;
  int64_t work_ = 0;
  std::vector<RankSplit> splits_;
  std::vector<std::vector<double>> mbt_;
  std::vector<double> rt_;
  std::vector<size_t> fast_d_, fast_d2_, full_d2_;  // step(): refine.py's fast_d, ...
  Sums sums_a_, sums_b_, sums_c_;  // scratch
};

// Reference best_insert on the sums of its placement (same candidates, times and work).
std::optional<Insert> Search::best_insert(const Sums& sm, Index i) {
  const int64_t s = ctx_.batch.lengths[i], cap = ctx_.bucket_size;
  std::optional<Insert> best;
  if (n_ > 1 && *std::max_element(sm.tok.begin(), sm.tok.end()) + shard_tokens(s, n_) <= cap) {
    best = Insert{price_with(sm, i, -1), -1};
  }
  int r = -1;
  for (int j = 0; j < n_; ++j) {
    if (sm.tok[j] + s <= cap && (r < 0 || sm.load[j] < sm.load[r])) r = j;
  }
  if (r >= 0) {
    const double t = price_with(sm, i, r);
    if (!best || t < best->t) best = Insert{t, r};
  }
  return best;
}

std::vector<size_t> Search::fastest(size_t d, size_t count, bool nonempty) {
  work_ += static_cast<int64_t>(splits_[d].size());
  std::vector<size_t> order;
  for (size_t j = 0; j < splits_[d].size(); ++j) {
    if (!(nonempty && splits_[d][j].empty())) order.push_back(j);
  }
  const auto& mbt = mbt_[d];
  const size_t keep = std::min(order.size(), count);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                    [&mbt](size_t a, size_t b) {
                      return mbt[a] < mbt[b] || (mbt[a] == mbt[b] && a < b);
                    });
  order.resize(keep);
  return order;
}

void Search::apply(const std::vector<std::pair<std::pair<size_t, size_t>, Priced>>& changes) {
  std::vector<size_t> ranks;
  for (const auto& [at, priced] : changes) {
    splits_[at.first][at.second] = priced.p;
    mbt_[at.first][at.second] = priced.t;
    ranks.push_back(at.first);
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  for (size_t d : ranks) {
    bool has_empty = false;
    for (const auto& p : splits_[d]) has_empty = has_empty || p.empty();
    if (!has_empty) {
      splits_[d].push_back(empty_placement(n_));
      mbt_[d].push_back(0.0);
    }
    rt_[d] = rank_time(d);
  }
}

bool Search::relocate(size_t d, size_t j, Index i, int where, size_t d2) {
  const Placement src = without(splits_[d][j], i, where);
  std::vector<std::pair<size_t, size_t>> targets{{d, j}};
  for (size_t k : fast_d2_) targets.emplace_back(d2, k);
  size_t own = 0;
  for (size_t k : fast_d_) {
    if (k != j && own < kTargets) {
      targets.emplace_back(d, k);
      ++own;
    }
  }
  std::optional<double> src_t, src_rt;
  const bool src_empty = src.empty();
  for (const auto& [e, k] : targets) {
    if (spent()) return false;
    if (e == d && k == j) {
      sums(src, &sums_a_);
      auto ins = best_insert(sums_a_, i);
      if (ins && rank_time(d, Repl(j, ins->t)) < rt_[d]) {
        apply({{{d, j}, Priced{with(src, i, ins->where), ins->t}}});
        return true;
      }
      continue;
    }
    if (!src_t) src_t = price(src);
    sums(splits_[e][k], &sums_a_);
    auto ins = best_insert(sums_a_, i);
    if (!ins) continue;
    double now;
    if (e == d) {
      now = rank_time(d, Repl(j, *src_t, src_empty, k, ins->t, false));
    } else {
      if (!src_rt) src_rt = rank_time(d, Repl(j, *src_t, src_empty));
      now = std::max(*src_rt, rank_time(e, Repl(k, ins->t)));
    }
    if (now < rt_[d]) {
      apply({{{d, j}, Priced{src, *src_t}},
             {{e, k}, Priced{with(splits_[e][k], i, ins->where), ins->t}}});
      return true;
    }
  }
  return false;
}

bool Search::swap(size_t d, size_t j, Index i, int where, size_t d2) {
  const double* costs = ctx_.batch.costs;
  const Placement& here = splits_[d][j];
  bool src_summed = false;
  for (size_t k : full_d2_) {
    const Placement& tgt = splits_[d2][k];
    bool tgt_summed = false;
    for (const auto& [b, wb] : samples_of(tgt)) {
      if (!(costs[b] < costs[i])) continue;
      if (spent()) return false;
      if (!src_summed) {  // the reference's src = without(here, i, where), summed once
        sums(here, &sums_a_, i, where);
        src_summed = true;
      }
      auto new_src = best_insert(sums_a_, b);
      if (!new_src) continue;
      if (!tgt_summed) {
        sums(tgt, &sums_c_);
        tgt_summed = true;
      }
      sums_without(tgt, sums_c_, b, wb, &sums_b_);
      auto new_tgt = best_insert(sums_b_, i);
      if (!new_tgt) continue;
      const double a = rank_time(d, Repl(j, new_src->t));
      const double now = std::max(a, rank_time(d2, Repl(k, new_tgt->t)));
      if (now < rt_[d]) {
        Priced p_src{with(here, b, new_src->where, i, where), new_src->t};
        Priced p_tgt{with(tgt, i, new_tgt->where, b, wb), new_tgt->t};
        apply({{{d, j}, std::move(p_src)}, {{d2, k}, std::move(p_tgt)}});
        return true;
      }
    }
  }
  return false;
}

bool Search::merge(size_t d) {
  const auto cands = fastest(d, kTargets, true);
  for (size_t x = 0; x < cands.size(); ++x) {
    for (size_t y = x + 1; y < cands.size(); ++y) {
      if (spent()) return false;
      const size_t a = cands[x], b = cands[y];
      std::vector<Index> group;
      int64_t total = 0;
      for (size_t q : {a, b}) {
        for (const auto& [i, w] : samples_of(splits_[d][q])) {
          group.push_back(i);
          total += ctx_.batch.lengths[i];
        }
      }
      if (total > ctx_.bucket_size * n_) continue;
      work_ += kPlaceWorkFactor * (static_cast<int64_t>(group.size()) + n_);
      auto placed = place_group(ctx_, group);
      if (!placed) continue;
      const double t = price(*placed);
      if (rank_time(d, Repl(a, t, placed->empty(), b, 0.0, true)) < rt_[d]) {
        apply({{{d, a}, Priced{std::move(*placed), t}}, {{d, b}, Priced{empty_placement(n_), 0.0}}});
        return true;
      }
    }
  }
  return false;
}

bool Search::step() {
  size_t d = 0, d2 = 0;
  for (size_t x = 1; x < rt_.size(); ++x) {
    if (rt_[x] > rt_[d]) d = x;
    if (rt_[x] < rt_[d2]) d2 = x;
  }
  std::vector<size_t> order;
  for (size_t j = 0; j < splits_[d].size(); ++j) {
    if (!splits_[d][j].empty()) order.push_back(j);
  }
  const auto& mbt = mbt_[d];
  std::sort(order.begin(), order.end(), [&mbt](size_t a, size_t b) {
    return mbt[a] > mbt[b] || (mbt[a] == mbt[b] && a < b);
  });
  // The targets of every move of this step (none changes before one is accepted).
  fast_d_ = fastest(d, kTargets + 1, false);
  fast_d2_.clear();
  full_d2_.clear();
  if (d2 != d) {
    fast_d2_ = fastest(d2, kTargets, false);
    full_d2_ = fastest(d2, kTargets, true);
  }
  for (int move = 0; move < (d2 != d ? 2 : 1); ++move) {
    for (size_t j : order) {
      for (const auto& [i, where] : samples_of(splits_[d][j])) {
        if (move == 0 ? relocate(d, j, i, where, d2) : swap(d, j, i, where, d2)) return true;
        if (spent()) return false;
      }
    }
  }
  return merge(d);
}

std::vector<RankSplit> Search::result() const {
  std::vector<RankSplit> out(splits_.size());
  size_t m = 1;
  for (size_t d = 0; d < splits_.size(); ++d) {
    for (const auto& p : splits_[d]) {
      if (!p.empty()) out[d].push_back(p);
    }
    m = std::max(m, out[d].size());
  }
  for (auto& s : out) {
    while (s.size() < m) s.push_back(empty_placement(n_));
  }
  return out;
}

}  // namespace

std::vector<RankSplit> refine(const GdsContext& ctx, std::vector<RankSplit> splits,
                              double overhead, int64_t budget, int64_t* spent) {
  if (spent) *spent = 0;
  if (budget <= 0) return splits;
  Search search(ctx, splits, overhead, budget);
  while (!search.spent() && search.step()) {
  }
  if (spent) *spent = search.work();
  return search.result();
}

}  // namespace skrull
