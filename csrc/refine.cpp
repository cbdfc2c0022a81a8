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

int64_t placement_size(const Placement& p) {
  int64_t s = static_cast<int64_t>(p.distributed.size());
  for (const auto& r : p.local) s += static_cast<int64_t>(r.size());
  return s;
}

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

// At most two micro-batches of a DP rank replaced while pricing it (the reference's dict).
struct Repl {
  size_t j[2] = {SIZE_MAX, SIZE_MAX};
  const Priced* p[2] = {nullptr, nullptr};
  Repl() = default;
  Repl(size_t j0, const Priced* p0) : j{j0, SIZE_MAX}, p{p0, nullptr} {}
  Repl(size_t j0, const Priced* p0, size_t j1, const Priced* p1) : j{j0, j1}, p{p0, p1} {}
  const Priced* find(size_t at) const {
    return at == j[0] ? p[0] : at == j[1] ? p[1] : nullptr;
  }
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

  bool step();
  std::vector<RankSplit> result() const;

 private:
  double price(const Placement& p) {
    work_ += placement_size(p) + n_;
    return micro_batch_time(p, ctx_.batch, ctx_.latency, n_);
  }

  double rank_time(size_t d, const Repl& repl = Repl()) {
    double t = 0.0;
    work_ += static_cast<int64_t>(splits_[d].size());
    for (size_t j = 0; j < splits_[d].size(); ++j) {
      const Placement* p = &splits_[d][j];
      double mt = mbt_[d][j];
      if (const Priced* r = repl.find(j)) {
        p = &r->p;
        mt = r->t;
      }
      if (!p->empty()) t += mt + overhead_;
    }
    return t;
  }

  std::vector<int64_t> tokens(const Placement& p) const {
    int64_t dist = 0;
    for (Index i : p.distributed) dist += shard_tokens(ctx_.batch.lengths[i], n_);
    std::vector<int64_t> out;
    for (const auto& rank : p.local) {
      int64_t t = dist;
      for (Index i : rank) t += ctx_.batch.lengths[i];
      out.push_back(t);
    }
    return out;
  }

  std::optional<Priced> best_insert(const Placement& p, Index i);
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
};

std::optional<Priced> Search::best_insert(const Placement& p, Index i) {
  const int64_t s = ctx_.batch.lengths[i], cap = ctx_.bucket_size;
  const auto tok = tokens(p);
  std::optional<Priced> best;
  if (n_ > 1 && *std::max_element(tok.begin(), tok.end()) + shard_tokens(s, n_) <= cap) {
    Placement cand = p;
    cand.distributed.push_back(i);
    const double t = price(cand);
    best = Priced{std::move(cand), t};
  }
  int r = -1;
  std::vector<double> loads;
  for (const auto& rank : p.local) {
    double x = 0.0;
    for (Index v : rank) x += ctx_.batch.costs[v];
    loads.push_back(x);
  }
  for (int j = 0; j < n_; ++j) {
    if (tok[j] + s <= cap && (r < 0 || loads[j] < loads[r])) r = j;
  }
  if (r >= 0) {
    Placement cand = p;
    cand.local[static_cast<size_t>(r)].push_back(i);
    const double t = price(cand);
    if (!best || t < best->t) best = Priced{std::move(cand), t};
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
  const Priced src{without(splits_[d][j], i, where), 0.0};
  std::vector<std::pair<size_t, size_t>> targets{{d, j}};
  for (size_t k : fast_d2_) targets.emplace_back(d2, k);
  size_t own = 0;
  for (size_t k : fast_d_) {
    if (k != j && own < kTargets) {
      targets.emplace_back(d, k);
      ++own;
    }
  }
  std::optional<Priced> src_priced;
  std::optional<double> src_rt;
  for (const auto& [e, k] : targets) {
    if (spent()) return false;
    if (e == d && k == j) {
      auto ins = best_insert(src.p, i);
      if (ins && rank_time(d, Repl(j, &*ins)) < rt_[d]) {
        apply({{{d, j}, *ins}});
        return true;
      }
      continue;
    }
    if (!src_priced) {
      const double t = price(src.p);
      src_priced = Priced{src.p, t};
    }
    auto ins = best_insert(splits_[e][k], i);
    if (!ins) continue;
    double now;
    if (e == d) {
      now = rank_time(d, Repl(j, &*src_priced, k, &*ins));
    } else {
      if (!src_rt) src_rt = rank_time(d, Repl(j, &*src_priced));
      now = std::max(*src_rt, rank_time(e, Repl(k, &*ins)));
    }
    if (now < rt_[d]) {
      apply({{{d, j}, *src_priced}, {{e, k}, *ins}});
      return true;
    }
  }
  return false;
}

bool Search::swap(size_t d, size_t j, Index i, int where, size_t d2) {
  const double* costs = ctx_.batch.costs;
  const Placement src = without(splits_[d][j], i, where);
  for (size_t k : full_d2_) {
    const Placement tgt = splits_[d2][k];
    for (const auto& [b, wb] : samples_of(tgt)) {
      if (!(costs[b] < costs[i])) continue;
      if (spent()) return false;
      auto new_src = best_insert(src, b);
      if (!new_src) continue;
      auto new_tgt = best_insert(without(tgt, b, wb), i);
      if (!new_tgt) continue;
      const double a = rank_time(d, Repl(j, &*new_src));
      const double now = std::max(a, rank_time(d2, Repl(k, &*new_tgt)));
      if (now < rt_[d]) {
        apply({{{d, j}, *new_src}, {{d2, k}, *new_tgt}});
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
      const Priced merged{std::move(*placed), t}, none{empty_placement(n_), 0.0};
      if (rank_time(d, Repl(a, &merged, b, &none)) < rt_[d]) {
        apply({{{d, a}, merged}, {{d, b}, none}});
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
                              double overhead, int64_t budget) {
  if (budget <= 0) return splits;
  Search search(ctx, splits, overhead, budget);
  while (!search.spent() && search.step()) {
  }
  return search.result();
}

}  // namespace skrull
