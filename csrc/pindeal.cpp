// (ours) The whole batch re-dealt around pinned sub-group rings, before ruin and recreate
// with pins.  Mirrors skrull_ext/scheduler/pindeal.py step for step (same order of float
// operations, same work count), so both return identical plans; see that module's
// docstring.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "scheduler.h"

namespace skrull {
namespace {

constexpr int64_t kRingWork = 2;  // pindeal.RING_WORK

// pindeal._Slot: one skeleton micro-batch.
struct Slot {
  Slot(const GdsContext& ctx, const std::vector<Index>& dist, int64_t pid, const Pins& pins,
       double overhead)
      : ctx_(ctx), n_(ctx.cp_size) {
    const size_t n = static_cast<size_t>(n_);
    p.distributed = dist;
    p.local.resize(n);
    p.pin = pid;
    int64_t dtok = 0;
    for (Index i : dist) {
      raw_comm_ += ctx.batch.comm[i];
      raw_dist_ += ctx.batch.share(i, n_);
    }
    for (Index i : dist) dtok += shard_tokens(ctx.batch.lengths[i], n_);
    psec_.assign(n, 0.0);
    tok_.assign(n, dtok);
    if (pid >= 0) {
      psec_ = pins.seconds[static_cast<size_t>(pid)];
      for (size_t x = 0; x < n; ++x) tok_[x] = dtok + pins.tokens[static_cast<size_t>(pid)][x];
    }
    load_.assign(n, 0.0);
    if (!dist.empty() || pid >= 0) {
      double m = rank(0, 0.0);
      for (int x = 1; x < n_; ++x) m = std::max(m, rank(x, 0.0));
      top = m + overhead;
    }
  }

  double rank(int x, double add) const {
    const size_t u = static_cast<size_t>(x);
    if (p.distributed.empty()) return std::max(0.0, load_[u] + add) + psec_[u];  // no ring
    const double t = rank_time(load_[u] + add, raw_comm_ + ctx_.latency, raw_dist_, n_,
                               ctx_.batch.objective);
    return std::max(0.0, t) + psec_[u];
  }

  // (CP rank, its time after) of a whole sample, or rank -1 when none has room.
  std::pair<int, double> local(int64_t s, double c) const {
    int j = -1;
    double tj = 0.0;
    if (p.distributed.empty()) {  // no full ring: least load plus rings' seconds
      for (int x = 0; x < n_; ++x) {
        const size_t u = static_cast<size_t>(x);
        if (tok_[u] + s > ctx_.bucket_size) continue;
        const size_t v = static_cast<size_t>(j);
        if (j < 0 || load_[u] + psec_[u] < load_[v] + psec_[v]) j = x;
      }
      return {j, j < 0 ? 0.0 : rank(j, c)};
    }
    for (int x = 0; x < n_; ++x) {
      if (tok_[static_cast<size_t>(x)] + s > ctx_.bucket_size) continue;
      const double t = rank(x, c);
      if (j < 0 || t < tj) {
        j = x;
        tj = t;
      }
    }
    return {j, tj};
  }

  // The micro-batch's time with sample i on its full ring; nullopt when it does not fit.
  std::optional<double> ring(Index i) const {
    const int64_t sh = shard_tokens(ctx_.batch.lengths[i], n_);
    for (int64_t t : tok_) {
      if (t + sh > ctx_.bucket_size) return std::nullopt;
    }
    const double raw_comm = raw_comm_ + ctx_.batch.comm[i];
    const double raw_dist = raw_dist_ + ctx_.batch.share(i, n_);
    const double c = raw_comm + ctx_.latency;
    double m = 0.0;
    for (int x = 0; x < n_; ++x) {
      const size_t u = static_cast<size_t>(x);
      const double t =
          std::max(0.0, rank_time(load_[u], c, raw_dist, n_, ctx_.batch.objective)) + psec_[u];
      m = x == 0 ? t : std::max(m, t);
    }
    return m;
  }

  void put(Index i, int x, double t) {
    if (x < 0) {
      p.distributed.push_back(i);
      raw_comm_ += ctx_.batch.comm[i];
      raw_dist_ += ctx_.batch.share(i, n_);
      const int64_t sh = shard_tokens(ctx_.batch.lengths[i], n_);
      for (auto& v : tok_) v += sh;
    } else {
      const size_t u = static_cast<size_t>(x);
      p.local[u].push_back(i);
      load_[u] += ctx_.batch.costs[i];
      tok_[u] += ctx_.batch.lengths[i];
    }
    top = std::max(top, t);
  }

  Placement p;
  double top = 0.0;

 private:
  const GdsContext& ctx_;
  int n_;
  double raw_comm_ = 0.0, raw_dist_ = 0.0;
  std::vector<double> psec_, load_;
  std::vector<int64_t> tok_;
};

}  // namespace

std::optional<std::vector<RankSplit>> pin_deal(const GdsContext& ctx,
                                               const std::vector<RankSplit>& splits,
                                               double overhead, const Pins& pins, bool dist,
                                               int64_t limit, int64_t* work) {
  const Batch& b = ctx.batch;
  std::vector<size_t> rank_of;
  std::vector<Slot> skel;
  std::vector<Index> pool;
  for (size_t r = 0; r < splits.size(); ++r) {
    for (const auto& p : splits[r]) {
      const int64_t size = p.size();
      if (size == 0 && p.pin < 0) continue;
      *work += 1 + size;
      rank_of.push_back(r);
      skel.emplace_back(ctx, p.distributed, p.pin, pins, overhead);
      for (const auto& loc : p.local) pool.insert(pool.end(), loc.begin(), loc.end());
    }
  }
  for (size_t r = 0; r < splits.size(); ++r) {
    rank_of.push_back(r);
    skel.emplace_back(ctx, std::vector<Index>{}, -1, pins, overhead);
  }
  const int64_t per = 2 + static_cast<int64_t>(skel.size()) * (ctx.cp_size + 1) / 3;
  const int64_t np = static_cast<int64_t>(pool.size());
  if (*work + np * per >= limit) return std::nullopt;
  *work += np * per;
  std::sort(pool.begin(), pool.end(), [&](Index x, Index y) {
    return b.costs[x] != b.costs[y] ? b.costs[x] > b.costs[y] : x < y;
  });
  std::vector<double> rt(splits.size(), 0.0);
  for (size_t k = 0; k < skel.size(); ++k) rt[rank_of[k]] += skel[k].top;
  for (Index i : pool) {
    const int64_t s = b.lengths[i];
    const double c = b.costs[i];
    DealChoice best;
    auto offer = [&](size_t k, int x, double t) {
      best.offer(rt[rank_of[k]], skel[k].top, t, k, x);
    };
    for (size_t k = 0; k < skel.size(); ++k) {
      if (best.beats(rt[rank_of[k]])) continue;  // every key here is at least rt
      const auto got = skel[k].local(s, c);
      if (got.first >= 0) offer(k, got.first, got.second + overhead);
      if (dist && 2.0 * c >= skel[k].top - overhead) {
        *work += kRingWork * ctx.cp_size;
        if (*work >= limit) return std::nullopt;
        const auto ring = skel[k].ring(i);
        if (ring) offer(k, -1, *ring + overhead);
      }
    }
    if (!best.found) return std::nullopt;
    skel[best.slot].put(i, best.where, best.t);
    rt[rank_of[best.slot]] += best.added;
  }
  std::vector<RankSplit> out(splits.size());
  for (size_t k = 0; k < skel.size(); ++k) {
    if (skel[k].p.size() || skel[k].p.pin >= 0) {
      out[rank_of[k]].push_back(std::move(skel[k].p));
    }
  }
  return out;
}

std::optional<std::vector<RankSplit>> pin_deal_best(const GdsContext& ctx,
                                                    const std::vector<RankSplit>& splits,
                                                    double overhead, const Pins& pins,
                                                    int64_t limit, int64_t* work) {
  const int64_t n = ctx.cp_size;
  int64_t spent = 0;
  double cur = 0.0;
  for (size_t d = 0; d < splits.size(); ++d) {
    for (const auto& p : splits[d]) spent += p.size() + n;
    const double t = split_seconds(ctx, splits[d], overhead, &pins);
    cur = d == 0 ? t : std::max(cur, t);
  }
  std::optional<std::vector<RankSplit>> best;
  for (int mode = 0; mode < 2; ++mode) {  // pindeal.PIN_DEAL_MODES: keep, dist
    int64_t used = 0;
    auto got = pin_deal(ctx, splits, overhead, pins, mode == 1, limit - spent, &used);
    spent += used;
    if (!got) continue;
    double t = 0.0;
    for (size_t d = 0; d < got->size(); ++d) {
      for (const auto& p : (*got)[d]) spent += p.size() + n;
      const double x = split_seconds(ctx, (*got)[d], overhead, &pins);
      t = d == 0 ? x : std::max(t, x);
    }
    if (t < cur) {
      cur = t;
      best = std::move(got);
    }
  }
  *work += spent;
  return best;
}

}  // namespace skrull
