// (ours) The baselines' groupings and Skrull's portfolio over them.
// Mirrors per_seq_cp_groups / all_cp_groups / sorted_groups / karmarkar_karp / kk_groups
// of skrull_ext/scheduler/baselines.py (hybrid CP's grouping: hybrid.cpp) and
// grouping_work / all_distributed / place_group / place_groups / dacp_each / iteration_time /
// portfolio_schedule of skrull_ext/scheduler/portfolio.py; see scheduler.h.
#include <algorithm>
#include <iterator>
#include <limits>
#include <queue>
#include <utility>

#include "scheduler.h"

namespace skrull {
namespace {

// reference portfolio.MAX_GROUPING_WORK: kk and hybrid-cp are skipped above it.
constexpr int64_t kMaxGroupingWork = int64_t{1} << 20;
// reference portfolio.MAX_PACK_SAMPLES: the pack candidates are skipped above it.
constexpr int64_t kMaxPackSamples = int64_t{1} << 14;
constexpr int64_t kMaxLnsSamples = int64_t{1} << 14;  // lns.MAX_LNS_SAMPLES
constexpr int64_t kRefineUnitsPerMs = 225000;         // refine.WORK_UNITS_PER_MS
constexpr int64_t kLnsUnitsPerMs = 300000;            // lns.WORK_UNITS_PER_MS

// Packs `order` into consecutive groups whose shard tokens fit the bucket (_next_fit).
std::vector<std::vector<Index>> next_fit(const Batch& batch, const std::vector<Index>& order,
                                         int cp_size, int64_t bucket_size) {
  std::vector<std::vector<Index>> groups;
  int64_t used = bucket_size + 1;
  for (Index i : order) {
    const int64_t sh = shard_tokens(batch.lengths[i], cp_size);
    if (used + sh > bucket_size) {
      groups.emplace_back();
      used = 0;
    }
    groups.back().push_back(i);
    used += sh;
  }
  return groups;
}

// One part of a Karmarkar-Karp state: its weight and samples (order irrelevant: sorted
// at the end).
struct KkPart {
  double sum;
  std::vector<Index> items;
};

// numpy.array_split(arange(size), parts): the first size % parts slices get one more.
std::vector<std::vector<Index>> array_split(int64_t size, int parts) {
  std::vector<std::vector<Index>> out(static_cast<size_t>(parts));
  const int64_t base = size / parts, extra = size % parts;
  Index next = 0;
  for (int d = 0; d < parts; ++d) {
    const int64_t count = base + (d < extra ? 1 : 0);
    for (int64_t p = 0; p < count; ++p) out[d].push_back(next++);
  }
  return out;
}

int64_t grouping_work(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size) {
  int64_t total = 0;
  for (int64_t i = 0; i < batch.size; ++i) total += batch.lengths[i];
  const int64_t per = bucket_size * cp_size * dp_size;
  return batch.size * std::max<int64_t>(1, (total + per - 1) / per);
}

// Gives up (nullopt) when a group cannot be placed or a DP rank's running time reaches
// best_t (reference place_groups); with `ties` (C++ only: a candidate that runs after one
// it precedes in the reference's order, so it wins ties) only once it exceeds best_t.
std::optional<std::vector<RankSplit>> place_groups(const GdsContext& ctx, const Groups& groups,
                                                   double overhead, double best_t,
                                                   bool ties = false) {
  std::vector<RankSplit> out;
  out.reserve(groups.size());
  for (const auto& rank : groups) {
    RankSplit placed;
    placed.reserve(rank.size());
    double t = 0.0;
    for (const auto& group : rank) {
      auto p = place_group(ctx, group);
      if (!p) return std::nullopt;
      t += micro_batch_time(*p, ctx.batch, ctx.latency, ctx.cp_size) + overhead;
      placed.push_back(std::move(*p));
      if (t > best_t || (t == best_t && !ties)) return std::nullopt;
    }
    out.push_back(std::move(placed));
  }
  return out;
}

// Each micro-batch with a local sample re-placed by place_group (samples: distributed,
// then CP rank by rank) when strictly faster (reference dacp_each).  (C++ only, same
// plans) Gives up (false) as soon as a DP rank's running split_time reaches best_t: it
// only grows, and the candidate must be strictly faster to win.
bool dacp_each(const GdsContext& ctx, std::vector<RankSplit>& splits, double overhead,
               double best_t) {
  const Batch& b = ctx.batch;
  for (auto& split : splits) {
    double t = 0.0;  // split_time's sum, in its order
    for (auto& p : split) {
      if (p.empty()) continue;
      double own = micro_batch_time(p, b, ctx.latency, ctx.cp_size);
      bool has_local = false;
      for (const auto& r : p.local) has_local = has_local || !r.empty();
      if (has_local) {  // else every sample had to be distributed
        std::vector<Index> group(p.distributed);
        for (const auto& r : p.local) group.insert(group.end(), r.begin(), r.end());
        auto alt = place_group(ctx, group);
        if (alt) {
          const double alt_t = micro_batch_time(*alt, b, ctx.latency, ctx.cp_size);
          if (alt_t < own) {
            p = std::move(*alt);
            own = alt_t;
          }
        }
      }
      t += own + overhead;
      if (t >= best_t) return false;
    }
  }
  return true;
}

double iteration_time(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                      double overhead) {
  double worst = 0.0;
  for (const auto& split : splits) worst = std::max(worst, ctx.split_time(split, overhead));
  return worst;
}

// (C++ only: exact pruning, same plans) A lower bound on the iteration time of any
// placement of `groups`: per micro-batch at least its samples' least work over the N
// ranks, and at least each sample's cheapest placement alone (rank_time is >= local work
// plus the distributed share and monotone), plus the overhead.
double grouping_bound(const GdsContext& ctx, const Groups& groups, double overhead) {
  const Batch& b = ctx.batch;
  const int n = ctx.cp_size;
  double worst = 0.0;
  for (const auto& rank : groups) {
    double t = 0.0;
    for (const auto& group : rank) {
      double work = 0.0, alone = 0.0;
      for (Index i : group) {
        const double sh = b.share(i, n);
        double w = n * sh;
        double a = rank_time(0.0, b.comm[i] + ctx.latency, sh, n, b.objective);
        if (b.lengths[i] <= ctx.bucket_size) {
          w = std::min(w, b.costs[i]);
          a = std::min(a, b.costs[i]);
        }
        work += w;
        alone = std::max(alone, a);
      }
      t += std::max(work / n, alone) + overhead;
    }
    worst = std::max(worst, t);
  }
  return worst;
}

// (C++ only: which of two equivalent orders runs, same plans) GDS before the sorted
// grouping when every sample fits half a micro-batch: GDS then needs about the token
// bound's micro-batch count and usually wins, so the sorted grouping's placement gives up
// early.  With longer samples GDS may need thousands of micro-batches; the sorted grouping
// runs first then, and its time stops GDS's count search early (GdsCutoff).
// (C++ only, exact pruning) fl(alone_i + overhead) per sample, alone_i its least time in a
// micro-batch (whole on one rank if it fits, rank_time(0, comm_i + latency, share_i)
// distributed), or {} when some input is negative.  With non-negative inputs every float
// operation of a prediction is monotone (sums of non-negative terms, max, rank_time), so
// any plan's time, and the time of any DP rank holding sample i, is >= this value,
// bit for bit: once the best candidate's time is at most its maximum, no later candidate
// can be strictly faster.
std::vector<double> alone_times(const GdsContext& ctx, double overhead) {
  const Batch& b = ctx.batch;
  const int n = ctx.cp_size;
  if (ctx.latency < 0.0 || overhead < 0.0) return {};
  std::vector<double> out(static_cast<size_t>(b.size));
  for (int64_t i = 0; i < b.size; ++i) {
    const double sh = b.share(i, n);
    if (b.costs[i] < 0.0 || b.comm[i] < 0.0 || sh < 0.0) return {};
    double a = std::numeric_limits<double>::infinity();
    if (b.lengths[i] <= ctx.bucket_size) a = b.costs[i];
    if (n > 1) a = std::min(a, rank_time(0.0, b.comm[i] + ctx.latency, sh, n, b.objective));
    out[static_cast<size_t>(i)] = a + overhead;
  }
  return out;
}

// Pads every DP rank with empty micro-batches to the longest rank's count (at least m).
void pad_equal(std::vector<RankSplit>& splits, int cp_size, size_t m = 0) {
  for (const auto& split : splits) m = std::max(m, split.size());
  for (auto& split : splits) {
    while (split.size() < m) {
      Placement empty;
      empty.local.resize(static_cast<size_t>(cp_size));
      split.push_back(std::move(empty));
    }
  }
}

// Search::result() of a refinement that accepts no move: each DP rank's non-empty
// micro-batches in order, padded with empty ones to equal counts (at least one).
std::vector<RankSplit> unrefined(std::vector<RankSplit> splits, int cp_size) {
  for (auto& split : splits) {
    split.erase(std::remove_if(split.begin(), split.end(),
                               [](const Placement& p) { return p.empty(); }),
                split.end());
  }
  pad_equal(splits, cp_size, 1);
  return splits;
}

// Whether refine() would accept no move: its first step works on the slowest DP rank
// (ties: the lowest), and when that rank holds a sample whose alone time (alone_times)
// reaches the rank's time, every move keeps that sample on a rank it touches, so no
// touched rank can fall strictly below (see alone_times).
bool refine_is_futile(const GdsContext& ctx, const std::vector<RankSplit>& splits,
                      double overhead, const std::vector<double>& alone) {
  if (alone.empty() || splits.empty()) return false;
  size_t d = 0;
  double worst = ctx.split_time(splits[0], overhead);
  for (size_t x = 1; x < splits.size(); ++x) {
    const double t = ctx.split_time(splits[x], overhead);
    if (t > worst) {
      worst = t;
      d = x;
    }
  }
  for (const auto& p : splits[d]) {
    for (Index i : p.distributed) {
      if (alone[i] >= worst) return true;
    }
    for (const auto& rank : p.local) {
      for (Index i : rank) {
        if (alone[i] >= worst) return true;
      }
    }
  }
  return false;
}

bool gds_first(const Batch& batch, int cp_size, int64_t bucket_size) {
  int64_t longest = 0;
  for (int64_t i = 0; i < batch.size; ++i) longest = std::max(longest, batch.lengths[i]);
  return 2 * longest <= bucket_size * cp_size;
}

}  // namespace

namespace {

std::optional<Placement> all_distributed(const GdsContext& ctx, const std::vector<Index>& group) {
  int64_t tokens = 0;
  for (Index i : group) tokens += shard_tokens(ctx.batch.lengths[i], ctx.cp_size);
  if (tokens > ctx.bucket_size) return std::nullopt;
  Placement out;
  out.distributed = group;
  out.local.resize(static_cast<size_t>(ctx.cp_size));
  return out;
}

}  // namespace

std::optional<Placement> place_group(const GdsContext& ctx, const std::vector<Index>& group) {
  auto placed = ctx.place(group);
  auto alt = all_distributed(ctx, group);
  if (!alt) return placed;
  if (!placed || micro_batch_time(*alt, ctx.batch, ctx.latency, ctx.cp_size) <
                     micro_batch_time(*placed, ctx.batch, ctx.latency, ctx.cp_size)) {
    return alt;
  }
  return placed;
}

Groups per_seq_cp_groups(const Batch& batch, int dp_size, int, int64_t) {
  Groups out(static_cast<size_t>(dp_size));
  for (int d = 0; d < dp_size; ++d) {
    for (Index i = d; i < batch.size; i += dp_size) out[d].push_back({i});
  }
  return out;
}

Groups all_cp_groups(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size) {
  Groups out;
  for (const auto& slice : array_split(batch.size, dp_size)) {
    out.push_back(next_fit(batch, slice, cp_size, bucket_size));
  }
  return out;
}

Groups sorted_groups(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size) {
  // A stable sort by length (radix when large); the sign-bit flip keeps int64 order.
  std::vector<Keyed> keyed(static_cast<size_t>(batch.size));
  for (Index i = 0; i < batch.size; ++i) {
    keyed[i] = {static_cast<uint64_t>(batch.lengths[i]) ^ (uint64_t{1} << 63), i};
  }
  stable_sort_by_key(keyed);
  std::vector<Index> order(keyed.size());
  for (size_t p = 0; p < keyed.size(); ++p) order[p] = keyed[p].second;
  Groups out;
  for (int d = 0; d < dp_size; ++d) {
    std::vector<Index> mine;
    for (size_t p = static_cast<size_t>(d); p < order.size(); p += dp_size) mine.push_back(order[p]);
    out.push_back(next_fit(batch, mine, cp_size, bucket_size));
  }
  return out;
}

namespace {

// The reference's algorithm as written: every state holds all `parts` parts.
std::vector<std::vector<Index>> karmarkar_karp_dense(const double* weights,
                                                     const std::vector<Index>& order,
                                                     int parts) {
  std::vector<std::vector<KkPart>> states;
  states.reserve(order.size() * 2);
  // Min-heap on (-difference, counter), as the reference's heapq of tuples.
  using Entry = std::pair<double, int64_t>;  // (key, counter == index into states)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (Index i : order) {
    std::vector<KkPart> state(static_cast<size_t>(parts), KkPart{0.0, {}});
    state[0] = KkPart{weights[i], {i}};
    heap.emplace(-weights[i], static_cast<int64_t>(states.size()));
    states.push_back(std::move(state));
  }
  while (heap.size() > 1) {
    auto a = std::move(states[heap.top().second]);
    heap.pop();
    auto b = std::move(states[heap.top().second]);
    heap.pop();
    std::stable_sort(b.begin(), b.end(),
                     [](const KkPart& x, const KkPart& y) { return x.sum < y.sum; });
    for (size_t j = 0; j < a.size(); ++j) {  // smallest of b pairs with largest of a
      a[j].sum = a[j].sum + b[j].sum;
      a[j].items.insert(a[j].items.end(), b[j].items.begin(), b[j].items.end());
    }
    std::stable_sort(a.begin(), a.end(),
                     [](const KkPart& x, const KkPart& y) { return x.sum > y.sum; });
    heap.emplace(-(a.front().sum - a.back().sum), static_cast<int64_t>(states.size()));
    states.push_back(std::move(a));
  }
  std::vector<std::vector<Index>> out(static_cast<size_t>(parts));
  if (heap.empty()) return out;
  auto& last = states[heap.top().second];
  for (int j = 0; j < parts; ++j) {
    out[j] = std::move(last[j].items);
    std::sort(out[j].begin(), out[j].end());
  }
  return out;
}

// A stable sort without std::stable_sort's buffer allocation: Karmarkar-Karp sorts
// thousands of states of at most `parts` parts (usually a handful); large ones take
// std::stable_sort (same order: both are stable).
template <typename T, typename Less>
void insertion_sort(std::vector<T>& v, Less less) {
  if (v.size() > 32) {
    std::stable_sort(v.begin(), v.end(), less);
    return;
  }
  for (size_t p = 1; p < v.size(); ++p) {
    T x = v[p];
    size_t q = p;
    for (; q > 0 && less(x, v[q - 1]); --q) v[q] = v[q - 1];
    v[q] = x;
  }
}

// Same answer as karmarkar_karp_dense when every weight is > 0, in time that does not
// grow with parts x items: a state keeps only its non-empty parts (the dense state's
// zero-sum parts are all alike and sort last), and a part's samples are a linked list
// (concatenation in O(1); the final lists are sorted anyway).  Pairing the dense a[j]
// with b ascending[j] touches a's non-empty parts (j < p) and b's (j >= parts - q).
std::vector<std::vector<Index>> karmarkar_karp_sparse(const double* weights,
                                                      const std::vector<Index>& order,
                                                      int parts) {
  struct Part {
    double sum;
    Index head, tail;
  };
  Index max_id = 0;
  for (Index i : order) max_id = std::max(max_id, i);
  std::vector<Index> next(static_cast<size_t>(max_id + 1), -1);
  std::vector<std::vector<Part>> states;
  states.reserve(order.size() * 2);
  using Entry = std::pair<double, int64_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (Index i : order) {
    heap.emplace(-weights[i], static_cast<int64_t>(states.size()));
    states.push_back({Part{weights[i], i, i}});
  }
  const int64_t m = parts;
  std::vector<Part> merged;
  while (heap.size() > 1) {
    auto a = std::move(states[heap.top().second]);
    heap.pop();
    auto b = std::move(states[heap.top().second]);
    heap.pop();
    insertion_sort(b, [](const Part& x, const Part& y) { return x.sum < y.sum; });
    const int64_t p = static_cast<int64_t>(a.size()), q = static_cast<int64_t>(b.size());
    const int64_t off = m - q;  // dense index of b's first non-empty part
    merged.clear();
    for (int64_t j = 0; j < p; ++j) {
      Part part = a[j];
      if (j >= off) {
        const Part& o = b[j - off];
        part.sum = part.sum + o.sum;
        next[part.tail] = o.head;
        part.tail = o.tail;
      }
      merged.push_back(part);
    }
    for (int64_t j = std::max(p, off); j < m; ++j) merged.push_back(b[j - off]);
    insertion_sort(merged, [](const Part& x, const Part& y) { return x.sum > y.sum; });
    const double low = static_cast<int64_t>(merged.size()) < m ? 0.0 : merged.back().sum;
    heap.emplace(-(merged.front().sum - low), static_cast<int64_t>(states.size()));
    states.push_back(merged);
  }
  std::vector<std::vector<Index>> out(static_cast<size_t>(parts));
  if (heap.empty()) return out;
  const auto& last = states[heap.top().second];
  for (size_t j = 0; j < last.size(); ++j) {
    for (Index i = last[j].head; i >= 0; i = next[i]) out[j].push_back(i);
    std::sort(out[j].begin(), out[j].end());
  }
  return out;
}

}  // namespace

std::vector<std::vector<Index>> karmarkar_karp(const double* weights,
                                               const std::vector<Index>& idx, int parts) {
  std::vector<Index> order(idx);
  std::sort(order.begin(), order.end(), [weights](Index a, Index b) {
    return weights[a] > weights[b] || (weights[a] == weights[b] && a < b);
  });
  for (Index i : order) {
    if (!(weights[i] > 0.0)) return karmarkar_karp_dense(weights, order, parts);
  }
  return karmarkar_karp_sparse(weights, order, parts);
}

Groups kk_groups(const Batch& batch, int dp_size, int cp_size, int64_t bucket_size) {
  std::vector<Index> all(static_cast<size_t>(batch.size));
  for (Index i = 0; i < batch.size; ++i) all[i] = i;
  Groups out;
  for (const auto& seqs : karmarkar_karp(batch.costs, all, dp_size)) {
    std::vector<std::vector<Index>> parts;
    if (!seqs.empty()) {
      int64_t total = 0;
      for (Index i : seqs) total += shard_tokens(batch.lengths[i], cp_size);
      for (int64_t m = std::max<int64_t>(1, (total + bucket_size - 1) / bucket_size);; ++m) {
        parts.clear();
        bool fits = true;
        for (auto& p : karmarkar_karp(batch.costs, seqs, static_cast<int>(m))) {
          if (p.empty()) continue;
          int64_t tokens = 0;
          for (Index i : p) tokens += shard_tokens(batch.lengths[i], cp_size);
          fits = fits && tokens <= bucket_size;
          parts.push_back(std::move(p));
        }
        if (fits) break;
      }
    }
    out.push_back(std::move(parts));
  }
  return out;
}

std::vector<RankSplit> portfolio_schedule(const Batch& batch, double latency, int dp_size,
                                          int cp_size, int64_t bucket_size, Rollback policy,
                                          double overhead, Variant variant, int64_t budget) {
  const GdsContext ctx{batch, latency, cp_size, bucket_size, policy, variant};
  const bool costly = grouping_work(batch, dp_size, cp_size, bucket_size) > kMaxGroupingWork;
  using Grouping = Groups (*)(const Batch&, int, int, int64_t);
  // reference PORTFOLIO order; nullptr stands for GDS, `true` marks the costly groupings.
  const std::pair<Grouping, bool> candidates[] = {
      {sorted_groups, false}, {nullptr, false},           {kk_groups, true},
      {all_cp_groups, false}, {per_seq_cp_groups, false}, {hybrid_cp_groups, true}};
  // Then reference pack.PACK_THRESHOLDS in order: `pack`, `pack-95`, `pack-spread` (their
  // divisors; pack.PACK_SPREAD).
  const std::pair<int, bool> packs[] = {{0, false}, {20, false}, {0, true}};
  std::vector<RankSplit> best;
  double best_t = std::numeric_limits<double>::infinity();
  size_t first = 0;
  if (gds_first(batch, cp_size, bucket_size)) {
    // (C++ only, same plans) GDS without a cutoff, then the sorted grouping, which
    // precedes GDS in the reference's order and so wins ties: its placement gives up
    // only once a DP rank exceeds GDS's time.
    best = *gds_schedule_cut(batch, latency, dp_size, cp_size, bucket_size, policy, overhead,
                             variant, nullptr);
    best_t = iteration_time(ctx, best, overhead);
    const Groups groups = sorted_groups(batch, dp_size, cp_size, bucket_size);
    if (grouping_bound(ctx, groups, overhead) * (1.0 - 1e-9) < best_t) {
      auto placed = place_groups(ctx, groups, overhead, best_t, /*ties=*/true);
      const double t = placed ? iteration_time(ctx, *placed, overhead) : best_t;
      if (placed && t <= best_t) {
        best = std::move(*placed);
        best_t = t;
      }
    }
    first = 2;
  }
  const std::vector<double> alone = alone_times(ctx, overhead);
  const double floor_t =
      alone.empty() ? -1.0 : *std::max_element(alone.begin(), alone.end());
  for (size_t c = first; c < std::size(candidates); ++c) {
    const auto& [grouping, is_costly] = candidates[c];
    // Only a strictly faster candidate wins, and none is below floor_t (alone_times).
    // (The sorted grouping, first in the reference's order, never needs to be faster.)
    if (c > 0 && best_t <= floor_t) break;
    std::optional<std::vector<RankSplit>> placed;
    if (!grouping) {
      // (C++ only, same plans) GDS stops once its bound shows it cannot beat best_t.
      const GdsCutoff cut{best_t, overhead};
      placed = gds_schedule_cut(batch, latency, dp_size, cp_size, bucket_size, policy,
                                overhead, variant, &cut);
    } else {
      if (costly && is_costly) continue;
      const Groups groups = grouping(batch, dp_size, cp_size, bucket_size);
      // Cannot beat the best (ties keep the earlier); the margin covers float reordering.
      if (grouping_bound(ctx, groups, overhead) * (1.0 - 1e-9) >= best_t) continue;
      placed = place_groups(ctx, groups, overhead, best_t);
    }
    if (!placed) continue;
    const double t = iteration_time(ctx, *placed, overhead);
    if (t < best_t) {
      best = std::move(*placed);
      best_t = t;
    }
  }
  for (const auto& [divisor, spread] : packs) {
    if (batch.size > kMaxPackSamples || best_t <= floor_t) break;
    auto placed = pack_schedule(batch, dp_size, cp_size, bucket_size,
                                pack_threshold(divisor, bucket_size), spread);
    if (!dacp_each(ctx, placed, overhead, best_t)) continue;
    const double t = iteration_time(ctx, placed, overhead);
    if (t < best_t) {
      best = std::move(placed);
      best_t = t;
    }
  }
  if (best_t > floor_t) {  // reference pack.PORTFOLIO's last: `level`
    auto placed = level_schedule(ctx, dp_size, overhead, best_t);
    if (placed) {
      best = std::move(*placed);
      best_t = iteration_time(ctx, best, overhead);
    }
  }
  if (budget > 0 && best_t <= floor_t && refine_is_futile(ctx, best, overhead, alone)) {
    best = unrefined(std::move(best), cp_size);  // and lns() stops at once (its floor)
  } else {
    // reference refine_and_lns: the local search with at most half the budget, ruin and
    // recreate with the rest in its own units (up to kMaxLnsSamples samples).
    int64_t spent = 0;
    best = refine(ctx, std::move(best), overhead, budget / 2, &spent);
    if (batch.size <= kMaxLnsSamples) {
      best = lns(ctx, std::move(best), overhead,
                 (budget - spent) * kLnsUnitsPerMs / kRefineUnitsPerMs,
                 plan_lower_bound(batch, latency, dp_size, cp_size, bucket_size, overhead));
    }
  }
  pad_equal(best, cp_size);
  return best;
}

}  // namespace skrull
