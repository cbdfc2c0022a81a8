// (ours) Large-neighbourhood search after the local search: ruin and recreate.
// Mirrors skrull_ext/scheduler/lns.py step for step (same splitmix64 draws, same move order,
// same float operations, same work count), so both return identical plans; see its docstring.
#include <algorithm>
#include <cstdint>
#include <cstddef>
#include <limits>
#include <optional>
#include <utility>

#include "scheduler.h"

namespace skrull {
namespace {

constexpr uint64_t kSeed = 0x5D6E7A1B2C3D4E5FULL;  // lns.SEED
constexpr int64_t kQmax = 40;                      // lns.QMAX
constexpr double kTau0 = 2e-3;                     // lns.TAU0
constexpr double kTargetNoise = 0.01;              // lns.TARGET_NOISE
constexpr double kOrderNoise = 0.3;                // lns.ORDER_NOISE
constexpr int64_t kRefillEvery = 30;               // lns.REFILL_EVERY
constexpr int64_t kPinRankWork = 2;                // lns.PIN_RANK_WORK
constexpr int64_t kAloneDiv = 4;                   // lns.ALONE_DIV

class Rng {  // lns._Rng: splitmix64
 public:
  uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t m) { return static_cast<int64_t>(next() % static_cast<uint64_t>(m)); }
  double unit() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }

 private:
  uint64_t state_ = kSeed;
};

// lns._Mb: one micro-batch's lists and their sums (summed in list order).
struct Mb {
  Placement p;
  double comm = 0.0, share = 0.0, t = 0.0;
  double x = 0.0;       // the largest local load
  int64_t tok_max = 0;  // the most tokens on a CP rank
  bool has_dist = false;
  int64_t size = 0;
  std::vector<double> load;
  std::vector<int64_t> tok;
  std::vector<double> times;  // with pinned rings: each CP rank's time (they add to it)
  bool kept() const { return size || p.pin >= 0; }  // lns._Mb.kept
};

struct Pick {
  size_t d, j;
  Index i;
  int where;  // -1 distributed, else the CP rank
};

class Lns {
 public:
  Lns(const GdsContext& ctx, const std::vector<RankSplit>& splits, double overhead,
      int64_t budget, const Pins* pins)
      : ctx_(ctx), b_(ctx.batch), n_(ctx.cp_size), ovh_(overhead), budget_(budget),
        pins_(pins), picked_(static_cast<size_t>(ctx.batch.size), 0) {
    for (const auto& split : splits) {
      std::vector<Mb> rank;
      for (const auto& p : split) {
        if (!p.empty() || p.pin >= 0) rank.push_back(summed(p));
      }
      rank.push_back(summed(empty()));
      ranks_.push_back(std::move(rank));
    }
    for (size_t d = 0; d < ranks_.size(); ++d) rt_.push_back(rank_time(d));
    lens_.assign(ranks_.size(), -1);
    dirty_.assign(ranks_.size(), 1);
    work_ = 0;
  }

  // lns._Lns.refill: the ranks changed since their last refill, within half the budget left,
  // then resplit() of their pairs within half of what is left; true if one got faster.
  bool refill_dirty() {
    std::vector<size_t> ds;
    std::vector<RankSplit> splits;
    for (size_t d = 0; d < ranks_.size(); ++d) {
      if (!dirty_[d]) continue;
      dirty_[d] = 0;
      ds.push_back(d);
      for (const auto& mb : ranks_[d]) work_ += mb.size + 1;
      RankSplit split;
      for (const auto& mb : ranks_[d]) {
        if (mb.size && mb.p.pin < 0) split.push_back(mb.p);
      }
      splits.push_back(std::move(split));
    }
    std::vector<char> changed;
    int64_t work = 0;
    auto out = refill(ctx_, splits, ovh_, (budget_ - work_) / 2, &work, &changed);
    work_ += work;
    // then the pairs of the same ranks re-split (the refill's repacking, if kept)
    std::vector<char> again;
    work = 0;
    out = resplit(ctx_, out, ovh_, (budget_ - work_) / 2, &work, &again);
    work_ += work;
    bool any = false;
    for (size_t x = 0; x < ds.size(); ++x) {
      if (!changed[x] && !again[x]) continue;
      any = true;
      const size_t d = ds[x];
      std::vector<Mb> rank;  // the pinned micro-batches stay, first
      for (const auto& mb : ranks_[d]) {
        if (mb.p.pin >= 0) rank.push_back(mb);
      }
      for (const auto& p : out[x]) rank.push_back(summed(p));
      rank.push_back(summed(empty()));
      ranks_[d] = std::move(rank);
      rt_[d] = rank_time(d);
    }
    return any;
  }

  int64_t work() const { return work_; }
  // lns._Lns.stuck: the slowest DP rank had no sample to ruin, so no step can lower the
  // makespan.
  bool stuck() const { return stuck_; }
  void reset_work() { work_ = 0; }
  double makespan() const { return *std::max_element(rt_.begin(), rt_.end()); }
  double score() {
    work_ += static_cast<int64_t>(rt_.size());
    double sum = 0.0;
    for (double t : rt_) sum += t;
    return makespan() + 1e-3 * (sum / static_cast<double>(rt_.size()));
  }
  std::optional<double> step(double best_ms, double cur_score);
  std::vector<RankSplit> snapshot() {
    std::vector<RankSplit> out;
    for (const auto& rank : ranks_) {
      RankSplit split;
      work_ += static_cast<int64_t>(rank.size());
      for (const auto& mb : rank) {
        work_ += mb.size;
        if (mb.kept()) split.push_back(mb.p);
      }
      out.push_back(std::move(split));
    }
    return out;
  }

 private:
  Placement empty() const {
    Placement p;
    p.local.resize(static_cast<size_t>(n_));
    return p;
  }

  double time(double comm, double share, double x, bool has_dist) const {
    return std::max(0.0, timer(comm, share, has_dist).at(x));
  }
  // time()'s terms that do not depend on x, for pricing several CP ranks' loads at once.
  RankTimeOf timer(double comm, double share, bool has_dist) const {
    if (has_dist) comm += ctx_.latency;
    return RankTimeOf(comm, share, n_, b_.objective);
  }

  // lns._Lns._sum: sums mb's lists in order (work: samples + N) and prices it.
  void sum(Mb& mb) {
    mb.comm = mb.share = 0.0;
    int64_t dtok = 0;
    for (Index i : mb.p.distributed) {
      mb.comm += b_.comm[i];
      mb.share += b_.share(i, n_);
      dtok += shard_tokens(b_.lengths[i], n_);
    }
    mb.has_dist = !mb.p.distributed.empty();
    mb.size = static_cast<int64_t>(mb.p.distributed.size());
    mb.load.assign(static_cast<size_t>(n_), 0.0);
    mb.tok.assign(static_cast<size_t>(n_), dtok);
    for (int r = 0; r < n_; ++r) {
      for (Index i : mb.p.local[static_cast<size_t>(r)]) {
        mb.load[r] += b_.costs[i];
        mb.tok[r] += b_.lengths[i];
      }
      mb.size += static_cast<int64_t>(mb.p.local[static_cast<size_t>(r)].size());
    }
    work_ += mb.size + n_;
    mb.x = *std::max_element(mb.load.begin(), mb.load.end());
    if (mb.p.pin < 0) {
      mb.tok_max = *std::max_element(mb.tok.begin(), mb.tok.end());
      mb.t = mb.size ? time(mb.comm, mb.share, mb.x, mb.has_dist) + ovh_ : 0.0;
      return;
    }
    // pinned rings: each CP rank's own time plus its rings', its tokens plus their shards
    work_ += kPinRankWork / 2 * n_;
    const auto& seconds = pins_->seconds[static_cast<size_t>(mb.p.pin)];
    const auto& tokens = pins_->tokens[static_cast<size_t>(mb.p.pin)];
    mb.times.resize(static_cast<size_t>(n_));
    const RankTimeOf at = timer(mb.comm, mb.share, mb.has_dist);
    for (int r = 0; r < n_; ++r) {
      mb.tok[r] += tokens[r];
      mb.times[r] = std::max(0.0, at.at(mb.load[r])) + seconds[r];
    }
    mb.tok_max = *std::max_element(mb.tok.begin(), mb.tok.end());
    mb.t = *std::max_element(mb.times.begin(), mb.times.end()) + ovh_;
  }
  Mb summed(const Placement& p) {
    Mb mb;
    mb.p = p;
    sum(mb);
    return mb;
  }

  double rank_time(size_t d) {
    work_ += static_cast<int64_t>(ranks_[d].size());
    double t = 0.0;
    for (const auto& mb : ranks_[d]) {
      if (mb.kept()) t += mb.t;
    }
    return t;
  }

  // lns._Lns.insert_cost: (time with overhead, where) of mb plus sample i.
  std::optional<std::pair<double, int>> insert_cost(const Mb& mb, Index i) {
    if (mb.p.pin >= 0) return insert_pinned(mb, i);
    work_ += n_ + 1;
    const int64_t s = b_.lengths[i], cap = ctx_.bucket_size;
    const double x = mb.x;
    std::optional<std::pair<double, int>> best;
    if (n_ > 1 && mb.tok_max + shard_tokens(s, n_) <= cap) {
      best = std::make_pair(time(mb.comm + b_.comm[i], mb.share + b_.share(i, n_), x, true), -1);
    }
    int r = -1;
    for (int j = 0; j < n_; ++j) {
      if (mb.tok[j] + s <= cap && (r < 0 || mb.load[j] < mb.load[r])) r = j;
    }
    if (r >= 0) {
      const double t = time(mb.comm, mb.share, std::max(x, mb.load[r] + b_.costs[i]), mb.has_dist);
      if (!best || t < best->first) best = std::make_pair(t, r);
    }
    if (best) best->first += ovh_;
    return best;
  }

  // lns._Lns._insert_pinned: whole on the CP rank (with room) whose new time against the
  // others' is least, or distributed.
  std::optional<std::pair<double, int>> insert_pinned(const Mb& mb, Index i) {
    work_ += kPinRankWork * n_ + 1;
    const int64_t s = b_.lengths[i], cap = ctx_.bucket_size;
    const auto& seconds = pins_->seconds[static_cast<size_t>(mb.p.pin)];
    std::optional<std::pair<double, int>> best;
    if (n_ > 1 && mb.tok_max + shard_tokens(s, n_) <= cap) {
      const RankTimeOf at = timer(mb.comm + b_.comm[i], mb.share + b_.share(i, n_), true);
      double t = std::max(0.0, at.at(mb.load[0])) + seconds[0];
      for (int r = 1; r < n_; ++r) t = std::max(t, std::max(0.0, at.at(mb.load[r])) + seconds[r]);
      best = std::make_pair(t, -1);
    }
    auto& pre = pre_;  // prefix and suffix maxima of the CP ranks' times (all >= 0)
    auto& suf = suf_;
    pre.assign(static_cast<size_t>(n_) + 1, 0.0);
    suf.assign(static_cast<size_t>(n_) + 1, 0.0);
    for (int r = 0; r < n_; ++r) {
      pre[r + 1] = std::max(pre[r], mb.times[r]);
      suf[n_ - 1 - r] = std::max(suf[n_ - r], mb.times[n_ - 1 - r]);
    }
    const RankTimeOf at = timer(mb.comm, mb.share, mb.has_dist);
    for (int r = 0; r < n_; ++r) {
      if (mb.tok[r] + s > cap) continue;
      double t = std::max(0.0, at.at(mb.load[r] + b_.costs[i])) + seconds[r];
      t = std::max(t, std::max(pre[r], suf[r + 1]));
      if (!best || t < best->first) best = std::make_pair(t, r);
    }
    if (best) best->first += ovh_;
    return best;
  }

  void touch(size_t d, size_t j) {
    if (lens_[d] < 0) {
      lens_[d] = static_cast<int64_t>(ranks_[d].size());
      touched_.push_back(d);
    }
    if (static_cast<int64_t>(j) >= lens_[d]) return;
    for (size_t e = 0; e < used_; ++e) {
      if (journal_[e].first.first == d && journal_[e].first.second == j) return;
    }
    const Mb& mb = ranks_[d][j];
    work_ += mb.size + n_;
    if (used_ < journal_.size()) {  // reuse the entry's buffers
      journal_[used_].first = {d, j};
      journal_[used_].second = mb;
    } else {
      journal_.push_back({{d, j}, mb});
    }
    ++used_;
  }

  // lns._Lns._locate: the idx-th sample of DP rank d as (j, sample, where).
  Pick locate(size_t d, int64_t idx) {
    for (size_t j = 0; j < ranks_[d].size(); ++j) {
      ++work_;
      const Placement& p = ranks_[d][j].p;
      const int64_t nd = static_cast<int64_t>(p.distributed.size());
      if (idx < nd) return {d, j, p.distributed[idx], -1};
      idx -= nd;
      for (size_t r = 0; r < p.local.size(); ++r) {
        const int64_t nl = static_cast<int64_t>(p.local[r].size());
        if (idx < nl) return {d, j, p.local[r][idx], static_cast<int>(r)};
        idx -= nl;
      }
    }
    return {d, 0, -1, -1};  // unreachable: idx < the rank's sample count
  }

  void add(const Pick& pick) {
    ++work_;
    if (picked_[pick.i]) return;
    picked_[pick.i] = 1;
    picks_.push_back(pick);
  }

  void ruin(size_t d0);
  void remove();
  bool place(Index i, double target);
  void undo(const std::vector<double>& saved);
  void compact();

  const GdsContext& ctx_;
  const Batch& b_;
  const int n_;
  const double ovh_;
  const int64_t budget_;
  const Pins* pins_;  // null: none
  int64_t work_ = 0;
  bool stuck_ = false;
  Rng rng_;
  std::vector<std::vector<Mb>> ranks_;
  std::vector<double> rt_;
  std::vector<std::pair<std::pair<size_t, size_t>, Mb>> journal_;  // [used_] entries live
  size_t used_ = 0;
  std::vector<int64_t> lens_;   // [D] a rank's length before this move (-1: untouched)
  std::vector<size_t> touched_;  // the ranks with lens_ set, in first-touch order
  std::vector<Pick> picks_;
  std::vector<char> picked_;  // [K]
  std::vector<char> dirty_;   // [D] changed since its last refill
  std::vector<double> pre_, suf_;  // insert_pinned's scratch, [N + 1]
};

void Lns::ruin(size_t d0) {
  const auto& rank = ranks_[d0];
  const double u = rng_.unit();
  const int64_t q = 2 + static_cast<int64_t>(static_cast<double>(kQmax - 2) * (u * u));
  const int64_t kind = rng_.below(4);
  int64_t count = 0;
  std::vector<size_t> busy;
  for (size_t j = 0; j < rank.size(); ++j) {
    count += rank[j].size;
    if (rank[j].size) busy.push_back(j);
  }
  if (!count) return;
  int64_t take = q;
  if (kind == 3) {  // the most loaded CP rank of d0's slowest micro-batch and a random one
    size_t j = busy[0];
    for (size_t x : busy) {
      if (rank[x].t > rank[j].t) j = x;
    }
    const Mb& mb = rank[j];
    int r = 0;
    for (int x = 1; x < n_; ++x) {
      if (mb.load[x] > mb.load[r]) r = x;
    }
    const int other = static_cast<int>(rng_.below(n_));
    for (int w : {r, other}) {
      for (Index i : mb.p.local[static_cast<size_t>(w)]) add({d0, j, i, w});
    }
    take = q / 2;
  } else if (kind != 1) {
    const size_t j = busy[static_cast<size_t>(rng_.below(static_cast<int64_t>(busy.size())))];
    const Placement& p = ranks_[d0][j].p;
    if (kind == 0) {
      const size_t nd = std::min(p.distributed.size(), static_cast<size_t>(q));
      for (size_t x = 0; x < nd; ++x) add({d0, j, p.distributed[x], -1});
      take = q / 2;
    } else {
      take = 0;
      std::vector<std::pair<Index, int>> order;
      for (Index i : p.distributed) order.emplace_back(i, -1);
      for (size_t r = 0; r < p.local.size(); ++r) {
        for (Index i : p.local[r]) order.emplace_back(i, static_cast<int>(r));
      }
      if (static_cast<int64_t>(order.size()) <= 3 * q) {
        for (const auto& [i, r] : order) add({d0, j, i, r});
      } else {
        for (int64_t x = 0; x < 3 * q; ++x) {
          const int64_t at = rng_.below(static_cast<int64_t>(order.size()));
          const auto& [i, r] = order[static_cast<size_t>(at)];
          add({d0, j, i, r});
        }
      }
    }
  }
  for (int64_t x = 0; x < take; ++x) add(locate(d0, rng_.below(count)));
  const int64_t dp = static_cast<int64_t>(ranks_.size());
  const int64_t others = dp > 1 ? rng_.below(q / 2 + 1) : 0;
  for (int64_t x = 0; x < others; ++x) {
    size_t d = static_cast<size_t>(rng_.below(dp - 1));
    d += d >= d0 ? 1 : 0;
    int64_t total = 0;
    for (const auto& mb : ranks_[d]) total += mb.size;
    if (total) add(locate(d, rng_.below(total)));
  }
}

void Lns::remove() {
  std::vector<std::pair<size_t, size_t>> mbs;
  for (const auto& pk : picks_) {
    touch(pk.d, pk.j);
    Placement& p = ranks_[pk.d][pk.j].p;
    auto& v = pk.where < 0 ? p.distributed : p.local[static_cast<size_t>(pk.where)];
    v.erase(std::find(v.begin(), v.end(), pk.i));
    mbs.emplace_back(pk.d, pk.j);
  }
  std::sort(mbs.begin(), mbs.end());
  mbs.erase(std::unique(mbs.begin(), mbs.end()), mbs.end());
  for (const auto& [d, j] : mbs) sum(ranks_[d][j]);
  std::vector<size_t> ds;
  for (const auto& [d, j] : mbs) ds.push_back(d);
  ds.erase(std::unique(ds.begin(), ds.end()), ds.end());
  for (size_t d : ds) rt_[d] = rank_time(d);
}

bool Lns::place(Index i, double target) {
  bool found = false;
  double best_key = 0.0;
  size_t bd = 0, bj = 0;
  int where = -1;
  for (size_t d = 0; d < ranks_.size(); ++d) {
    for (size_t j = 0; j < ranks_[d].size(); ++j) {
      const Mb& mb = ranks_[d][j];
      const auto got = insert_cost(mb, i);
      if (!got) continue;
      const double delta = got->first - mb.t;
      const double key = std::max(rt_[d] + delta, target) + 1e-3 * delta;
      if (!found || key < best_key) {
        found = true;
        best_key = key;
        bd = d;
        bj = j;
        where = got->second;
      }
    }
  }
  if (!found) return false;
  touch(bd, bj);
  Mb& mb = ranks_[bd][bj];
  (where < 0 ? mb.p.distributed : mb.p.local[static_cast<size_t>(where)]).push_back(i);
  sum(mb);
  if (bj == ranks_[bd].size() - 1) ranks_[bd].push_back(summed(empty()));
  rt_[bd] = rank_time(bd);
  return true;
}

void Lns::undo(const std::vector<double>& saved) {
  for (size_t e = 0; e < used_; ++e) {
    const auto& at = journal_[e].first;
    std::swap(ranks_[at.first][at.second], journal_[e].second);
  }
  for (size_t d : touched_) ranks_[d].resize(static_cast<size_t>(lens_[d]));
  rt_ = saved;
}

void Lns::compact() {
  std::vector<size_t> ds(touched_);
  std::sort(ds.begin(), ds.end());
  for (size_t d : ds) {
    work_ += static_cast<int64_t>(ranks_[d].size());
    std::vector<Mb> rank;
    for (auto& mb : ranks_[d]) {
      if (mb.kept()) rank.push_back(std::move(mb));
    }
    rank.push_back(summed(empty()));
    ranks_[d] = std::move(rank);
    dirty_[d] = 1;
  }
}

std::optional<double> Lns::step(double best_ms, double cur_score) {
  size_t d0 = 0;
  for (size_t x = 1; x < rt_.size(); ++x) {
    if (rt_[x] > rt_[d0]) d0 = x;
  }
  used_ = 0;
  for (size_t d : touched_) lens_[d] = -1;
  touched_.clear();
  for (const auto& pk : picks_) picked_[pk.i] = 0;
  picks_.clear();
  const std::vector<double> saved(rt_);
  ruin(d0);
  if (picks_.empty()) {  // d0 holds only pinned rings: every step from here is this no-op
    stuck_ = true;
    return std::nullopt;
  }
  remove();
  const bool noisy = rng_.below(2) == 0;
  std::vector<std::pair<double, Index>> keys;
  for (const auto& pk : picks_) {
    const double c = b_.costs[pk.i];
    keys.emplace_back(-(noisy ? c * (1.0 + kOrderNoise * rng_.unit()) : c), pk.i);
  }
  const double target = best_ms * (1.0 - kTargetNoise * rng_.unit());
  std::sort(keys.begin(), keys.end());
  for (const auto& [key, i] : keys) {
    if (!place(i, target)) {
      undo(saved);
      return std::nullopt;
    }
  }
  const double now = score();
  const double tau =
      kTau0 * (1.0 - static_cast<double>(work_) / static_cast<double>(budget_));
  if (now < cur_score * (1.0 + tau)) {
    compact();
    return now;
  }
  undo(saved);
  return std::nullopt;
}

// Every DP rank's micro-batches padded with empty ones to the longest list (at least 1).
std::vector<RankSplit> padded(std::vector<RankSplit> splits, int cp_size) {
  size_t m = 1;
  for (const auto& s : splits) m = std::max(m, s.size());
  Placement empty;
  empty.local.resize(static_cast<size_t>(cp_size));
  for (auto& s : splits) s.resize(m, empty);
  return splits;
}

}  // namespace

std::vector<RankSplit> lns(const GdsContext& ctx, std::vector<RankSplit> splits,
                           double overhead, int64_t budget, double floor_t, int64_t* spent,
                           const Pins* pins) {
  if (spent) *spent = 0;
  if (budget <= 0 || splits.empty()) return splits;
  if (pins && pins->seconds.empty()) pins = nullptr;
  const int64_t polish = balance_share(budget, ctx.batch.size);  // kept for balance()
  const int64_t alone_budget =  // on top of the budget
      pins && splits.size() > 1 ? (budget - polish) / kAloneDiv : 0;
  int64_t dealt_work = 0;
  double start = 0.0;
  if (!pins) {
    for (const auto& split : splits) start = std::max(start, ctx.split_time(split, overhead));
  }
  if (!pins && start > floor_t * (1.0 + 1e-9)) {
    auto dealt = deal_best(ctx, splits, overhead, (budget - polish) / 2, &dealt_work);
    if (dealt) splits = padded(std::move(*dealt), ctx.cp_size);  // faster: start there
  } else if (pins) {  // the DP ranks without pinned rings re-dealt among themselves
    std::vector<size_t> free;
    std::vector<RankSplit> sub;
    for (size_t d = 0; d < splits.size(); ++d) {
      if (!has_pin(splits[d])) {
        free.push_back(d);
        sub.push_back(splits[d]);
      }
    }
    if (!free.empty()) {
      auto dealt = deal_best(ctx, sub, overhead, (budget - polish) / 2, &dealt_work);
      if (dealt) {
        for (size_t x = 0; x < free.size(); ++x) splits[free[x]] = std::move((*dealt)[x]);
      }
    }
    // then every local sample re-dealt around the rings and distributed samples
    auto dealt = pin_deal_best(ctx, splits, overhead, *pins,
                               (budget - polish - dealt_work) / 2, &dealt_work);
    if (dealt) splits = std::move(*dealt);
  }
  budget -= dealt_work + polish;
  Lns search(ctx, splits, overhead, budget, pins);
  double best_ms = search.makespan();
  double best_score = search.score();
  search.reset_work();
  double cur = best_score;
  std::optional<std::vector<RankSplit>> best;
  int64_t steps = 0;
  while (search.work() < budget && best_ms > floor_t * (1.0 + 1e-9) && !search.stuck()) {
    std::optional<double> got;
    if (steps % kRefillEvery == 0) {  // the first step, then every kRefillEvery-th
      if (search.refill_dirty()) got = search.score();
    } else {
      got = search.step(best_ms, cur);
    }
    ++steps;
    if (!got) continue;
    cur = *got;
    const double ms = search.makespan();
    if (ms < best_ms || (ms == best_ms && cur < best_score)) {
      best_ms = ms;
      best_score = cur;
      best = search.snapshot();
    }
  }
  int64_t polished_work = 0, after_work = 0;  // unless at the floor
  if (best_ms > floor_t * (1.0 + 1e-9)) {
    best = polished(ctx, best ? *best : splits, overhead, polish, &polished_work, pins);
    if (pins) {  // then the cross-DP-rank stages within what the search and polish left
      const int64_t left = budget - search.work() + polish - polished_work;
      best = after_search(ctx, *best, overhead, left, search.stuck() ? 0 : alone_budget,
                          *pins, &after_work);
    }
  }
  if (spent) *spent = dealt_work + search.work() + polished_work + after_work;
  return best ? padded(std::move(*best), ctx.cp_size) : splits;
}

}  // namespace skrull
