// C++17 core of the Skrull scheduler: DACP placement (docs/design.md section 3) and the GDS
// split of a global batch (section 4).
//
// This is a step-for-step port of skrull_ext/scheduler/reference.py (the specification):
// same iteration orders, same tie-breaking (lowest rank / sample index), same float
// accumulation order (built with -ffp-contract=off), so both return identical plans.
// No Python headers here; csrc/bindings.cpp exposes it as skrull_ext._C.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace skrull {

using Index = int64_t;

// DACP roll-back victim choice; the codes match _ROLLBACK_CODES in scheduler/__init__.py.
enum class Rollback : int { kShortest = 0, kBestFit = 1, kAuto = 2 };

// DACP step a: the paper's local-first rule, ours (distribute when that lowers the
// micro-batch objective), ours (distribute the k longest, LPT the rest, best k), or all
// keeping the fastest; codes match _VARIANT_CODES (reference.DACP_VARIANTS order).
enum class Variant : int { kPaper = 0, kBalanced = 1, kLpt = 2, kAuto = 3 };

// How a micro-batch's time is composed (objective.rank_time): the paper's objective or
// ours, the ring step by step; codes match objective.objective_arg.
enum class ObjectiveCode : int { kPaper = 0, kRing = 1 };

// The objective's code and, when `physical`, the cost model's ring terms
// (objective.Objective.terms): linear seconds per token, ring transfer seconds per shard
// token and step, latency per step, ring-step overhead, forward share of attention work.
struct Objective {
  ObjectiveCode code = ObjectiveCode::kPaper;
  bool physical = false;
  double lam = 0.0, beta = 0.0, ell = 0.0, step = 0.0, fwd = 1.0;
  bool paper() const { return code == ObjectiveCode::kPaper; }
};

// Non-owning view of one global batch: [size] token lengths, compute seconds of each
// whole sequence and ring bandwidth seconds of each distributed sequence.  `comm` may be
// null for functions that never read it (dacp_place, lpt_partition).
struct Batch {
  const int64_t* lengths = nullptr;
  const double* costs = nullptr;
  const double* comm = nullptr;
  int64_t size = 0;
  // Optional [size] seconds each CP rank spends on a distributed sequence; null means
  // costs[i] / cp_size (the reference's `shares=None`).
  const double* shares = nullptr;
  // The cost model's objective; every time estimate of the core goes through rank_time.
  Objective objective = Objective{};

  double share(Index i, int cp_size) const {
    return shares ? shares[i] : costs[i] / cp_size;
  }
};

// One micro-batch on one CP group: `distributed` sample ids in placement order and
// `local[r]` the ids held whole by CP rank r, in placement order.
struct Placement {
  std::vector<Index> distributed;
  std::vector<std::vector<Index>> local;
  // (ours) lns with pinned rings: the id of the sub-group rings pinned in this micro-batch
  // (Pins), -1: none.  Only lns() and the balance() it calls with pins read it.
  int64_t pin = -1;

  bool empty() const;
  int64_t size() const;  // samples held, distributed and local
};

using RankSplit = std::vector<Placement>;  // the micro-batches of one DP rank

// Tokens each of n ranks holds of a sample zigzag-sharded over them: pad(S, 2n) / n.
// Inline: the placement loops call it once per sample.
inline int64_t shard_tokens(int64_t length, int64_t n) {
  if (n <= 1) return length;
  const int64_t m = 2 * n;
  return (length + m - 1) / m * m / n;  // lengths are >= 0, so this is the ceiling
}

// DACP for one micro-batch with one victim policy (kShortest or kBestFit; kAuto acts as
// kBestFit, like the reference's dacp_place).  nullopt when the micro-batch is infeasible.
std::optional<Placement> dacp_place(const Batch& batch, std::vector<Index> idx, int cp_size,
                                    int64_t bucket_size, Rollback policy);

// (ours) Distribute the k longest sequences, pack the rest local by LPT, keep the best k
// (reference dacp_place_lpt); needs batch.comm.  With `limit` only a time below *limit
// counts (nullopt when none is).
std::optional<Placement> dacp_place_lpt(const Batch& batch, const std::vector<Index>& idx,
                                        double latency, int cp_size, int64_t bucket_size,
                                        const double* limit = nullptr);

// DACP with the chosen policy and variant; kAuto tries each and keeps the fastest
// (candidates paper/shortest, paper/best-fit, balanced/shortest, balanced/best-fit, lpt).
std::optional<Placement> dacp_best(const Batch& batch, const std::vector<Index>& idx,
                                   double latency, int cp_size, int64_t bucket_size,
                                   Rollback policy, Variant variant = Variant::kPaper);

// Whether dacp_best places idx (reference dacp_feasible): some candidate does, the
// cheapest tried first.
bool dacp_feasible(const Batch& batch, const std::vector<Index>& idx, double latency,
                   int cp_size, int64_t bucket_size, Rollback policy, Variant variant);

// Seconds of one CP rank: local compute x, ring t_comm, per-rank distributed compute
// t_dist, n CP ranks (objective.rank_time, the same float operations; see its module doc
// for how a physical objective splits t_comm and t_dist).  RankTimeOf precomputes the
// terms that do not depend on x; rank_time is its value at x.
struct RankTimeOf {
  RankTimeOf(double t_comm, double t_dist, int n, const Objective& obj) {
    const double kFwdBytes = 1.0 / 3.0;
    if (n < 2 || (!obj.physical && obj.paper())) {
      kind_ = 0;
      c_[0] = t_comm;
      b_[0] = t_dist;
      return;
    }
    if (!obj.physical) {
      kind_ = 1;
      b_[0] = t_dist / n;
      c_[0] = t_comm / (n - 1);
      tail_[0] = static_cast<double>(n - 2) * std::max(b_[0], c_[0]);
      return;
    }
    if (!(t_comm > 0.0)) {  // nothing distributed: local work plus t_dist
      kind_ = 4;
      b_[0] = t_dist;
      return;
    }
    const double mu = 3.0 * static_cast<double>(n - 1) * obj.beta;
    const double tot = mu + obj.lam + obj.beta;
    const double w = std::max(
        t_comm - ((2.0 * n - 1.0) * obj.ell + static_cast<double>(n) * obj.step), 0.0);
    const double outside = tot > 0.0 ? w * ((obj.lam + obj.beta) / tot) : 0.0;
    const double ring = w - outside;
    const double blocks = t_dist - outside + static_cast<double>(n) * obj.step;
    const double ell = obj.ell;
    out_ = outside + ell;
    if (obj.paper()) {
      kind_ = 2;
      c_[0] = ring + 2.0 * static_cast<double>(n - 1) * ell;
      b_[0] = blocks;
      return;
    }
    kind_ = 3;
    const double share[2] = {obj.fwd, 1.0 - obj.fwd};
    const double part[2] = {kFwdBytes, 1.0 - kFwdBytes};
    for (int p = 0; p < 2; ++p) {
      a_[p] = share[p];
      b_[p] = share[p] * blocks / n;
      c_[p] = part[p] * ring / (n - 1) + ell;
      tail_[p] = static_cast<double>(n - 2) * std::max(b_[p], c_[p]);
    }
  }

  double at(double x) const {
    switch (kind_) {
      case 0:
        return std::max(c_[0], x) + b_[0];
      case 1:
        return std::max(x + b_[0], c_[0]) + b_[0] + tail_[0];
      case 2:
        return out_ + std::max(c_[0], x) + b_[0];
      case 4:
        return x + b_[0];
      default: {
        double t = out_;
        t = t + (std::max(a_[0] * x + b_[0], c_[0]) + b_[0] + tail_[0]);
        t = t + (std::max(a_[1] * x + b_[1], c_[1]) + b_[1] + tail_[1]);
        return t;
      }
    }
  }

 private:
  int kind_ = 0;
  double out_ = 0.0;
  double a_[2] = {1.0, 0.0}, b_[2] = {0.0, 0.0}, c_[2] = {0.0, 0.0}, tail_[2] = {0.0, 0.0};
};

// Inline: the placement loops call it once per sample.
inline double rank_time(double x, double t_comm, double t_dist, int n, const Objective& objective) {
  return RankTimeOf(t_comm, t_dist, n, objective).at(x);
}

// Predicted seconds of one placed micro-batch (no fixed overhead).
double micro_batch_time(const Placement& placement, const Batch& batch, double latency,
                        int cp_size);

// Longest-processing-time bin packing of `idx` by cost onto `bins` bins.
// (key, index) pairs sorted by key, ties in their order before the sort (radix for
// large inputs; gds.cpp).
using Keyed = std::pair<uint64_t, Index>;
void stable_sort_by_key(std::vector<Keyed>& a);

std::vector<std::vector<Index>> lpt_partition(const double* costs,
                                              const std::vector<Index>& idx, int bins);

// Whether sequences of sx and sy tokens fit one micro-batch together.
bool can_pair(int64_t sx, int64_t sy, int cp_size, int64_t bucket_size);

// Micro-batch j takes sorted_idx[j], sorted_idx[j + m], ...  (m >= 1).
std::vector<std::vector<Index>> interleave(const std::vector<Index>& sorted_idx, int64_t m);

// What the GDS helpers share (reference GdsContext): the batch and the settings.
struct GdsContext {
  const Batch& batch;
  double latency;
  int cp_size;
  int64_t bucket_size;
  Rollback rollback;
  Variant variant;

  // dacp_best of one micro-batch's samples.
  std::optional<Placement> place(const std::vector<Index>& idx) const;
  // Predicted seconds of one DP rank's micro-batches (empty ones cost nothing).
  double split_time(const RankSplit& split, double overhead) const;
};

// GDS: dp_size lists of equally many placements (empty placements pad).  Every sample
// must fit alone (shard_tokens(S, N) <= bucket_size); throws std::invalid_argument if not.
std::vector<RankSplit> gds_schedule(const Batch& batch, double latency, int dp_size,
                                    int cp_size, int64_t bucket_size, Rollback policy,
                                    double overhead, Variant variant = Variant::kAuto);

// (C++ only) Lets the portfolio stop GDS once it cannot win: a DP rank's time is at least
// its samples' least work over N plus one overhead per micro-batch, so when that bound,
// with one more micro-batch than a count found infeasible, reaches `limit` (the best
// candidate's time; GDS must be strictly faster) GDS cannot be picked.
struct GdsCutoff {
  double limit;
  double overhead;
};

// gds_schedule with an optional cutoff: nullopt when it gave up (never without `cut`).
std::optional<std::vector<RankSplit>> gds_schedule_cut(const Batch& batch, double latency,
                                                       int dp_size, int cp_size,
                                                       int64_t bucket_size, Rollback policy,
                                                       double overhead, Variant variant,
                                                       const GdsCutoff* cut);

// ---- portfolio.cpp: the baselines' groupings and the portfolio (reference portfolio.py,
// scheduler/baselines.py).
using Groups = std::vector<std::vector<std::vector<Index>>>;  // [DP][micro-batch] ids

std::vector<std::vector<Index>> karmarkar_karp(const double* weights,
                                               const std::vector<Index>& idx, int parts);
int64_t hybrid_cp_size(int64_t length, int cp_size, int64_t bucket_size);
Groups kk_groups(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size);
Groups sorted_groups(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size);
Groups all_cp_groups(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size);
Groups per_seq_cp_groups(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size);
Groups hybrid_cp_groups(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size);
// hybrid_cp_groups with each item followed by its block's first CP rank (one grouping
// run for both: [i0, first0, i1, first1, ...] per micro-batch).
Groups hybrid_cp_placed(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size);

// ---- hybrid.cpp: (ours) hybrid CP's plan priced with its CP sub-group rings, Skrull's
// last candidate (reference scheduler.hybrid.candidate).
// Seconds of each sample on its hybrid-CP sub-group (read where 1 < size < cp_size).
struct SubgroupPrices {
  const double* share = nullptr;  // [size] per-rank compute seconds (share_seconds(S, g))
  const double* comm = nullptr;   // [size] ring bandwidth seconds (comm_seconds(S, g))
  std::vector<double> latency;    // [cp_size + 1] ring latency of a g-rank sub-group at [g]
};

// Hybrid CP's plan, padded to equal micro-batch counts, micro-batch g = d * per_rank + j.
struct HybridPlan {
  int64_t per_rank = 0;
  std::vector<int64_t> sizes;                     // [K] each sample's CP group size
  std::vector<std::vector<Index>> items, firsts;  // [G] samples, their block's first rank
  std::vector<double> times;                      // [G] seconds (overhead in; 0 when empty)
  std::vector<double> rank_times;                 // [D] sums of times, in order
  bool valid = false;                             // hybrid_valid
};

HybridPlan hybrid_candidate(const Batch& batch, const SubgroupPrices& sub, double latency,
                            int dp_size, int cp_size, int64_t bucket_size, double overhead);
// Every sample exactly once, blocks inside the CP group, no CP rank over the bucket.
bool hybrid_valid(const HybridPlan& plan, const Batch& batch, int cp_size, int64_t bucket_size);
// A priced plan's micro-batches re-dealt to the DP ranks when the slowest gets faster (true
// then; times and rank_times follow).
bool deal_micro_batches(HybridPlan& plan, int dp_size);
// Fills plan.times and plan.rank_times from its items, firsts and sizes (per sample; where
// 1 < size < cp_size, `sub` holds the sample's seconds on that size).
void price_subgroup_plan(HybridPlan& plan, const Batch& batch, const SubgroupPrices& sub,
                         double latency, int dp_size, int cp_size, double overhead);

// ---- dyncp.cpp: (ours) Megatron-LM's dynamic-CP plan (reference
// scheduler.megatron_packing.dynamic_cp), as Skrull's candidate (scheduler.dyncp).
// Per round the world groups (first world rank, size, sample ids); block = cp_size keeps
// groups inside DP replicas (the baseline policy).
struct WorldGroup {
  int first;
  int size;
  std::vector<Index> ids;
};
std::vector<std::vector<WorldGroup>> dynamic_cp_world(const int64_t* lengths, int64_t k,
                                                      int dp_size, int cp_size,
                                                      int64_t bucket_size, int block);
// The dynamic_cp policy's plan (block = cp_size), sizes from its groups, unpriced.
HybridPlan dynamic_cp_plan(const int64_t* lengths, int64_t k, int dp_size, int cp_size,
                           int64_t bucket_size);

// DACP of one micro-batch, or all-distributed in `group` order when strictly faster
// (reference refine.place_group).
std::optional<Placement> place_group(const GdsContext& ctx, const std::vector<Index>& group);

// The sorted grouping, GDS, then the other baseline groupings, each placed by DACP (or
// all-distributed when faster); the lowest predicted iteration time wins (ties: the
// earlier candidate; reference portfolio.PORTFOLIO); then refine() within `budget` work
// units (0: none).
std::vector<RankSplit> portfolio_schedule(const Batch& batch, double latency, int dp_size,
                                          int cp_size, int64_t bucket_size, Rollback policy,
                                          double overhead, Variant variant = Variant::kAuto,
                                          int64_t budget = 0);

// ---- pack.cpp: (ours) the portfolio's `pack` candidates (reference scheduler/pack.py).
// Samples longer than bucket - bucket / divisor (divisor 0: the bucket) are distributed.
int64_t pack_threshold(int divisor, int64_t bucket_size);
// LPT over DP ranks on each sample's least work, then per rank the long samples
// distributed first-fit decreasing (`spread`: on the micro-batch with room and the least
// distributed work), the others whole on the least-loaded slot with room; non-empty
// micro-batches only (not padded to equal counts).
std::vector<RankSplit> pack_schedule(const Batch& batch, int dp_size, int cp_size,
                                     int64_t bucket_size, int64_t threshold,
                                     bool spread = false);

// ---- level.cpp: (ours) the portfolio's `level` candidate (reference scheduler/level.py):
// one micro-batch per DP rank, the k longest samples distributed over r rings (DP ranks
// 0 .. r-1), the others whole on the slot where their rank's time is the least; the
// fastest (r, k) strictly below best_t (nullopt when none is).
std::optional<std::vector<RankSplit>> level_schedule(const GdsContext& ctx, int dp_size,
                                                     double overhead, double best_t);

// ---- refine.cpp: (ours) local search under the iteration time (reference refine.refine):
// relocate / swap / merge moves from the slowest DP rank, at most `budget` work units.
// `spent` (optional): the work units the search counted (benchmarks' calibration).
std::vector<RankSplit> refine(const GdsContext& ctx, std::vector<RankSplit> splits,
                              double overhead, int64_t budget, int64_t* spent = nullptr);

// ---- lns.cpp: (ours) ruin and recreate after the local search (reference lns.lns): at
// most `budget` work units, stopping once the slowest DP rank's time reaches floor_t
// (plan_lower_bound); the best plan seen, never slower than `splits`.
// `pins` (reference lns.lns's): per id, the seconds [N] and tokens [N] its pinned rings add
// to a micro-batch's CP ranks (Placement::pin).
struct Pins {
  std::vector<std::vector<double>> seconds;
  std::vector<std::vector<int64_t>> tokens;
};
std::vector<RankSplit> lns(const GdsContext& ctx, std::vector<RankSplit> splits,
                           double overhead, int64_t budget, double floor_t,
                           int64_t* spent = nullptr, const Pins* pins = nullptr);

// ---- refill.cpp: refill.refill, each DP rank repacked first-fit decreasing into micro-batches
// of at most int(frac x N x bucket) tokens, each placed by place_group; kept where its
// split_time falls strictly (changed[d]); its work added to *work.
std::vector<RankSplit> refill(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                              double overhead, int64_t limit, int64_t* work,
                              std::vector<char>* changed);

// ---- balance.cpp: (ours) each DP rank's local samples moved and swapped between its
// (micro-batch, CP rank) slots, the slowest rank first (reference balance.balance), within
// `limit` work units (*work: the units counted); a rank changed only where it got faster.
// With `pins`, the micro-batches holding pinned rings (Placement::pin) take part, their
// rings' seconds and tokens counted per CP rank (reference balance(..., pins)).
std::vector<RankSplit> balance(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                               double overhead, int64_t limit, int64_t* work = nullptr,
                               const Pins* pins = nullptr);
// One DP rank's seconds: ctx.split_time, or with `pins` their rings' seconds counted
// (reference balance._split_time).
double split_seconds(const GdsContext& ctx, const RankSplit& split, double overhead,
                     const Pins* pins);
// ---- regroup.cpp: (ours) the slowest DP rank's binding local samples moved or swapped into
// other DP ranks' slots (reference regroup.regroup), within `limit` work units (*work: the
// units counted); kept only where the slowest DP rank got strictly faster.
std::vector<RankSplit> regroup(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                               double overhead, int64_t limit, int64_t* work = nullptr,
                               const Pins* pins = nullptr);
// regroup.after_search: lns's stages after the pinned search and its polish: regroup()
// within `left` units, the pinned deal with what it leaves, then (alone > 0) every DP rank
// but the slowest searched alone by lns() and regroup() again within `alone`, kept when the
// slowest DP rank gets strictly faster; *work: the units counted.
std::vector<RankSplit> after_search(const GdsContext& ctx, std::vector<RankSplit> best,
                                    double overhead, int64_t left, int64_t alone,
                                    const Pins& pins, int64_t* work);
// The part of ruin and recreate's `budget` kept for balance() on k samples
// (balance.balance_share).
int64_t balance_share(int64_t budget, int64_t k);
// Whether a DP rank's micro-batches hold pinned rings (lns with pins).
bool has_pin(const RankSplit& split);
// balance.polished: balance() of the micro-batches without pinned rings, then, with pins,
// of all of them within what that left of `polish` (*work: the units of both passes).
std::vector<RankSplit> polished(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                                double overhead, int64_t polish, int64_t* work,
                                const Pins* pins);

// resplit.ring_time: (t_comm, t_dist) of distributed samples `dist` (latency included if
// any), summed in list order.
std::pair<double, double> ring_sums(const GdsContext& ctx, const std::vector<Index>& dist);

// ---- resplit.cpp: (ours) pairs of each DP rank's micro-batches with their local samples
// re-dealt over both (reference resplit.resplit), within `limit` work units (added to
// *work); changed[d] whether rank d got faster (then its non-empty micro-batches only).
std::vector<RankSplit> resplit(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                               double overhead, int64_t limit, int64_t* work,
                               std::vector<char>* changed);

// resplit.deal: the batch's samples re-dealt costliest first over a skeleton of micro-batches
// (mode 0 keep, 1 rings, 2 long: resplit.DEAL_MODES); nullopt when a sample fits nowhere or
// the work would reach `limit` (work added to *work).  deal_best: the fastest of the three
// when strictly faster than `splits` (reference resplit.deal_best).
std::optional<std::vector<RankSplit>> deal(const GdsContext& ctx,
                                           const std::vector<RankSplit>& splits,
                                           double overhead, int mode, int64_t limit,
                                           int64_t* work);
std::optional<std::vector<RankSplit>> deal_best(const GdsContext& ctx,
                                                const std::vector<RankSplit>& splits,
                                                double overhead, int64_t limit,
                                                int64_t* work);

// Where the deals (resplit.cpp's deal, pindeal.cpp) put a sample: the slot whose key
// (DP rank time + added) + 1e-3 x added is least, added = max(t, top) - top for a slot
// whose time goes from `top` to `t` (ties: the first offered).  Inline: per candidate.
struct DealChoice {
  bool found = false;
  double key = 0.0, added = 0.0, t = 0.0;
  size_t slot = 0;
  int where = -1;

  void offer(double rank_time, double top, double time, size_t k, int x) {
    const double a = std::max(time, top) - top;
    const double kk = (rank_time + a) + 1e-3 * a;
    if (!found || kk < key) {
      found = true;
      key = kk;
      added = a;
      t = time;
      slot = k;
      where = x;
    }
  }
  // Whether a slot of a DP rank at `rank_time` cannot win (its key is at least that).
  bool beats(double rank_time) const { return found && rank_time >= key; }
};

// ---- pindeal.cpp: (ours) every local sample re-dealt around the micro-batches' distributed
// samples and pinned rings, whole or (dist) on a full ring (reference pindeal.pin_deal);
// nullopt when a sample fits nowhere or the work would reach `limit` (work added to
// *work).  pin_deal_best: the faster of both modes when strictly faster than `splits`.
std::optional<std::vector<RankSplit>> pin_deal(const GdsContext& ctx,
                                               const std::vector<RankSplit>& splits,
                                               double overhead, const Pins& pins, bool dist,
                                               int64_t limit, int64_t* work);
std::optional<std::vector<RankSplit>> pin_deal_best(const GdsContext& ctx,
                                                    const std::vector<RankSplit>& splits,
                                                    double overhead, const Pins& pins,
                                                    int64_t limit, int64_t* work);

// ---- bound.cpp: (C++ only) what schedule() checks and reports, without per-sample Python.
// reference bound.lower_bound with subgroups=False, before the iteration overhead and
// its 1e-12 slack (sums in another order than numpy's: equal up to rounding).
double plan_lower_bound(const Batch& batch, double latency, int dp_size, int cp_size,
                        int64_t bucket_size, double overhead);
// Every sample exactly once, N local lists per micro-batch, no CP rank over the bucket
// (what plan._placements_valid checks).
bool plan_valid(const std::vector<RankSplit>& splits, const Batch& batch, int cp_size,
                int64_t bucket_size);

}  // namespace skrull
