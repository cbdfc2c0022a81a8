// DACP (docs/design.md section 3): local-first placement of one micro-batch with roll-back,
// and our balanced and LPT variants.
// Mirrors dacp_place / _choose_victim / _roll_back / micro_batch_time /
// dacp_place_lpt / dacp_best of
// skrull_ext/scheduler/reference.py line for line; see scheduler.h.
#include <algorithm>
#include <cstddef>

#include "scheduler.h"

namespace skrull {
namespace {

// First index of the smallest / largest value (the reference's _argmin / _argmax).
template <typename T>
int argmin(const std::vector<T>& v) {
  int best = 0;
  for (int j = 1; j < static_cast<int>(v.size()); ++j) {
    if (v[j] < v[best]) best = j;
  }
  return best;
}

template <typename T>
int argmax(const std::vector<T>& v) {
  int best = 0;
  for (int j = 1; j < static_cast<int>(v.size()); ++j) {
    if (v[j] > v[best]) best = j;
  }
  return best;
}

// Ascending (length, index): the order DACP places a micro-batch in.
void sort_by_length(std::vector<Index>& idx, const int64_t* lengths) {
  auto less = [lengths](Index a, Index b) {
    return lengths[a] < lengths[b] || (lengths[a] == lengths[b] && a < b);
  };
  // GDS hands over interleaved slices of an already sorted list: skip the sort then.
  if (!std::is_sorted(idx.begin(), idx.end(), less)) std::sort(idx.begin(), idx.end(), less);
}

// Position in local_r of the local sequence to demote (reference _choose_victim).
// best-fit: the shortest one whose demotion lets a sequence of `need` tokens be placed by
// steps a-c (the shortest overall when none does).  Ties: earliest placed.
size_t choose_victim(const std::vector<Index>& local_r, const int64_t* lengths,
                     const std::vector<int64_t>& rem, int r, int64_t need, int n,
                     Rollback policy) {
  size_t shortest = 0;
  for (size_t p = 1; p < local_r.size(); ++p) {
    if (lengths[local_r[p]] < lengths[local_r[shortest]]) shortest = p;
  }
  if (policy == Rollback::kShortest) return shortest;
  // The trial budgets are rem - sv everywhere plus lv back on rank r: their min / max
  // follow from the min / max over the other ranks (exact integer arithmetic).
  int64_t min_other = INT64_MAX, max_other = INT64_MIN;
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    min_other = std::min(min_other, rem[j]);
    max_other = std::max(max_other, rem[j]);
  }
  const int64_t need_shard = shard_tokens(need, n);
  long best = -1;
  for (size_t p = 0; p < local_r.size(); ++p) {
    const int64_t lv = lengths[local_r[p]];
    const int64_t sv = shard_tokens(lv, n);
    const int64_t on_r = rem[r] - sv + lv;
    const int64_t lo = std::min(min_other - sv, on_r);
    const int64_t hi = std::max(max_other - sv, on_r);
    if (lo < 0 || !(hi >= need || lo >= need_shard)) continue;
    if (best < 0 || lv < lengths[local_r[best]]) best = static_cast<long>(p);
  }
  return best < 0 ? shortest : static_cast<size_t>(best);
}

}  // namespace

int64_t Placement::size() const {
  int64_t s = static_cast<int64_t>(distributed.size());
  for (const auto& r : local) s += static_cast<int64_t>(r.size());
  return s;
}

bool Placement::empty() const {
  if (!distributed.empty()) return false;
  for (const auto& r : local) {
    if (!r.empty()) return false;
  }
  return true;
}

namespace {

// Step d (reference _roll_back): demotes a local sequence of the fullest rank to
// distributed, freeing its tokens there and charging its shard to every rank.  Returns
// false (nothing changed) when nothing can be demoted; else sets *rank and *victim.
// Sets *chose_victim once a victim had to be chosen (where the policies can differ).
bool roll_back(std::vector<std::vector<Index>>& local, std::vector<int64_t>& rem,
               const int64_t* lengths, int64_t need, int n, Rollback policy, int* rank,
               Index* victim, bool* chose_victim) {
  const int r = argmin(rem);
  if (n == 1 || local[r].empty()) return false;  // with one rank a demotion frees nothing
  *chose_victim = true;
  const size_t p = choose_victim(local[r], lengths, rem, r, need, n, policy);
  const Index v = local[r][p];
  const int64_t lv = lengths[v];
  const int64_t sv = shard_tokens(lv, n);
  if (rem[r] + lv < sv) return false;
  for (int j = 0; j < n; ++j) {
    if (j != r && rem[j] < sv) return false;  // the demoted one would overflow
  }
  local[r].erase(local[r].begin() + static_cast<std::ptrdiff_t>(p));
  rem[r] += lv;
  for (int j = 0; j < n; ++j) rem[j] -= sv;
  *rank = r;
  *victim = v;
  return true;
}

// max_j rank_time(local_j, t_comm, t_dist), with `extra` added to rank r (reference
// _objective).  rank_time is non-decreasing in the load (float max and + are monotone),
// so this is rank_time of the largest load: one evaluation instead of n, same value.
double objective(const std::vector<double>& local_load, double t_comm, double t_dist,
                 const Objective& obj, int r = -1, double extra = 0.0) {
  const int n = static_cast<int>(local_load.size());
  double x_max = 0.0;
  for (int j = 0; j < n; ++j) {
    double x = local_load[j];
    if (j == r) x = x + extra;
    x_max = std::max(x_max, x);
  }
  return n ? std::max(0.0, rank_time(x_max, t_comm, t_dist, n, obj)) : 0.0;
}

// Reference dacp_place (balanced: the objective test of step a, which reads batch.comm).
std::optional<Placement> place(const Batch& batch, std::vector<Index> idx, int cp_size,
                               int64_t bucket_size, Rollback policy, bool balanced,
                               double latency, bool* chose_victim) {
  const int n = cp_size;
  const int64_t* lengths = batch.lengths;
  const double* costs = batch.costs;
  sort_by_length(idx, lengths);
  std::vector<int64_t> rem(n, bucket_size);
  std::vector<double> local_load(n, 0.0);  // compute of each rank's local sequences
  double dist_load = 0.0;  // per-rank compute of the distributed ones
  double comm_sum = 0.0;
  Placement out;
  out.local.resize(n);
  auto& local = out.local;
  auto& dist = out.distributed;
  for (Index i : idx) {
    const int64_t s = lengths[i];
    const int64_t sh = shard_tokens(s, n);
    while (true) {
      int r = argmin(local_load);
      if (rem[r] < s) r = argmax(rem);
      // Whether all ranks take its shard; only read below when it does not fit local or
      // for the balanced test (C++ only: the scan is skipped otherwise, same steps).
      const bool fits = rem[r] >= s;
      bool can_dist = (!fits || balanced) && n > 1 &&
                      *std::min_element(rem.begin(), rem.end()) >= sh;
      if (fits) {  // steps a and b: local on the least loaded / emptiest rank
        if (balanced && can_dist) {  // (ours) unless distributing lowers the objective
          const double t_comm = dist.empty() ? 0.0 : comm_sum + latency;
          // (C++ only, same values) One scan for both objectives: with costs[i] >= 0 the
          // largest load with it added to rank r is max(largest, load_r + cost) exactly.
          double keep;
          double x_max = 0.0;
          for (int j = 0; j < n; ++j) x_max = std::max(x_max, local_load[j]);
          if (costs[i] >= 0.0) {
            const double x = std::max(x_max, local_load[r] + costs[i]);
            keep = std::max(0.0, rank_time(x, t_comm, dist_load, n, batch.objective));
          } else {
            keep = objective(local_load, t_comm, dist_load, batch.objective, r, costs[i]);
          }
          const double move = std::max(
              0.0, rank_time(x_max, comm_sum + batch.comm[i] + latency,
                             dist_load + batch.share(i, n), n, batch.objective));
          can_dist = move < keep;
        } else {
          can_dist = false;
        }
        if (!can_dist) {
          local[r].push_back(i);
          rem[r] -= s;
          local_load[r] += costs[i];
          break;
        }
      }
      Index v = i;
      if (can_dist) {  // step c: distributed
        for (int j = 0; j < n; ++j) rem[j] -= sh;
      } else {  // step d: roll back, then retry the same sequence
        int demoted_rank = -1;
        if (!roll_back(local, rem, lengths, s, n, policy, &demoted_rank, &v, chose_victim)) {
          return std::nullopt;
        }
        local_load[demoted_rank] -= costs[v];
      }
      dist.push_back(v);
      if (batch.comm) comm_sum += batch.comm[v];
      dist_load += batch.share(v, n);
      if (v == i) break;
    }
  }
  return out;
}

}  // namespace

std::optional<Placement> dacp_place(const Batch& batch, std::vector<Index> idx, int cp_size,
                                    int64_t bucket_size, Rollback policy) {
  bool chose_victim = false;
  return place(batch, std::move(idx), cp_size, bucket_size, policy, /*balanced=*/false,
               /*latency=*/0.0, &chose_victim);
}

double micro_batch_time(const Placement& placement, const Batch& batch, double latency,
                        int cp_size) {
  double t_comm = 0.0;
  double t_dist = 0.0;
  for (Index i : placement.distributed) {
    t_comm += batch.comm[i];
    t_dist += batch.share(i, cp_size);
  }
  if (!placement.distributed.empty()) t_comm += latency;
  // The slowest rank is the one with the most local work (see objective()).
  double x_max = 0.0;
  for (const auto& rank : placement.local) {
    double t_local = 0.0;
    for (Index i : rank) t_local += batch.costs[i];
    x_max = std::max(x_max, t_local);
  }
  if (placement.local.empty()) return 0.0;
  return std::max(0.0, rank_time(x_max, t_comm, t_dist, cp_size, batch.objective));
}

namespace {

// Each of order[first..] to the least-loaded rank with room (reference _lpt_local), its
// rank written to (*rank_of)[p - first]; *time gets the micro-batch time from the loads
// summed here.  Gives up (false) when a rank has no room, or, with `best_t`, as soon as a
// rank's time reaches *best_t: loads only grow, so the candidate could not win.  `len` and
// `cost` are order's lengths and costs, gathered once per search (every count packs the
// same suffix of them; contiguous reads).  `rem` and `load` are scratch space.
bool lpt_local(const Batch& batch, const int64_t* len, const double* cost, size_t count,
               size_t first, int n, int64_t cap, double t_comm, double t_dist,
               const double* best_t, std::vector<int>* rank_of, std::vector<int64_t>* rem,
               std::vector<double>* load, double* time) {
  rem->assign(n, cap);
  load->assign(n, 0.0);
  int64_t* rm = rem->data();
  double* ld = load->data();
  rank_of->resize(count - first);
  int* out = rank_of->data() - first;
  // rank_time's terms that do not depend on the load, computed as rank_time does.
  const RankTimeOf time_of(t_comm, t_dist, n, batch.objective);
  const double limit = best_t ? *best_t : 0.0;
  int64_t least_room = cap;  // every rank's room is >= this
  for (size_t p = first; p < count; ++p) {
    const int64_t s = len[p];
    int r = 0;
    if (s <= least_room) {  // every rank has room: the first least-loaded one
      for (int j = 1; j < n; ++j) {
        if (ld[j] < ld[r]) r = j;
      }
    } else {
      r = -1;
      for (int j = 0; j < n; ++j) {
        if (rm[j] >= s && (r < 0 || ld[j] < ld[r])) r = j;
      }
      if (r < 0) return false;
    }
    out[p] = r;
    rm[r] -= s;
    least_room = std::min(least_room, rm[r]);
    const double x = ld[r] + cost[p];
    ld[r] = x;
    if (best_t && time_of.at(x) >= limit) return false;  // rank_time(x, ...) >= *best_t
  }
  double x_max = 0.0;  // the slowest rank has the most local work (see objective())
  for (int j = 0; j < n; ++j) x_max = std::max(x_max, ld[j]);
  *time = std::max(0.0, time_of.at(x_max));
  return true;
}

// One feasible count k of dacp_place_lpt with its lower bound (reference _lpt_bounds).
struct LptCount {
  double bound;
  size_t k;
  int64_t shard_sum;
  double t_comm, t_dist;
};

// Every feasible k with its bound, sorted by (bound, k) (reference _lpt_bounds).
std::vector<LptCount> lpt_bounds(const Batch& batch, const std::vector<Index>& order,
                                 double latency, int n, int64_t bucket_size) {
  const size_t count = order.size();
  std::vector<double> suffix(count + 1, 0.0), top(count + 1, 0.0);
  for (size_t p = count; p-- > 0;) {
    const double c = batch.costs[order[p]];
    suffix[p] = suffix[p + 1] + c;
    top[p] = std::max(top[p + 1], c);
  }
  std::vector<LptCount> rows;
  rows.reserve(count + 1);
  int64_t shard_sum = 0;
  double comm_sum = 0.0, dist_load = 0.0;
  for (size_t k = 0; k <= count; ++k) {
    if (k) {
      if (n == 1) break;
      const Index i = order[k - 1];
      shard_sum += shard_tokens(batch.lengths[i], n);
      if (shard_sum > bucket_size) break;
      comm_sum += batch.comm[i];
      dist_load += batch.share(i, n);
    }
    const double t_comm = k ? comm_sum + latency : 0.0;
    // Some rank holds q = ceil(rest / n) of the rest: at least the q smallest.
    const size_t q = (count - k + n - 1) / n;
    const double x = std::max(std::max(suffix[k] / n, top[k]), suffix[count - q]);
    rows.push_back({rank_time(x, t_comm, dist_load, n, batch.objective), k, shard_sum, t_comm,
                    dist_load});
  }
  std::sort(rows.begin(), rows.end(), [](const LptCount& a, const LptCount& b) {
    return a.bound < b.bound || (a.bound == b.bound && a.k < b.k);
  });
  return rows;
}

// dacp_place_lpt's search; `any`: stop at the first feasible count (dacp_feasible).
std::optional<Placement> lpt_search(const Batch& batch, const std::vector<Index>& idx,
                                    double latency, int n, int64_t bucket_size,
                                    const double* limit, bool any) {
  const int64_t* lengths = batch.lengths;
  std::vector<Index> order(idx);
  std::sort(order.begin(), order.end(), [lengths](Index a, Index b) {
    return lengths[a] > lengths[b] || (lengths[a] == lengths[b] && a < b);
  });
  std::vector<int64_t> len(order.size());
  std::vector<double> cost(order.size());
  for (size_t p = 0; p < order.size(); ++p) {
    len[p] = lengths[order[p]];
    cost[p] = batch.costs[order[p]];
  }
  bool found = false;
  double best_t = limit ? *limit : 0.0;
  size_t best_k = 0;
  std::vector<int> rank_of, best_rank_of;
  std::vector<int64_t> rem;
  std::vector<double> load;
  for (const LptCount& c : lpt_bounds(batch, order, latency, n, bucket_size)) {
    const bool bounded = found || limit;
    if (bounded && c.bound >= best_t) break;
    double t = 0.0;
    if (!lpt_local(batch, len.data(), cost.data(), order.size(), c.k, n,
                   bucket_size - c.shard_sum, c.t_comm, c.t_dist,
                   bounded ? &best_t : nullptr, &rank_of, &rem, &load, &t)) {
      continue;
    }
    found = true;
    best_t = t;
    best_k = c.k;
    best_rank_of.swap(rank_of);
    if (any) break;
  }
  if (!found) return std::nullopt;
  Placement out;
  out.distributed.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(best_k));
  out.local.resize(n);
  for (size_t p = best_k; p < order.size(); ++p) {
    out.local[best_rank_of[p - best_k]].push_back(order[p]);
  }
  return out;
}

}  // namespace

std::optional<Placement> dacp_place_lpt(const Batch& batch, const std::vector<Index>& idx,
                                        double latency, int cp_size, int64_t bucket_size,
                                        const double* limit) {
  return lpt_search(batch, idx, latency, cp_size, bucket_size, limit, false);
}

std::optional<Placement> dacp_best(const Batch& batch, const std::vector<Index>& idx,
                                   double latency, int cp_size, int64_t bucket_size,
                                   Rollback policy, Variant variant) {
  std::optional<Placement> best;
  double best_t = 0.0;
  auto consider = [&](std::optional<Placement> cand) {
    if (!cand) return;
    const double t = micro_batch_time(*cand, batch, latency, cp_size);
    if (!best || t < best_t) {
      best = std::move(cand);
      best_t = t;
    }
  };
  for (Variant var : {Variant::kPaper, Variant::kBalanced}) {
    if (variant != Variant::kAuto && variant != var) continue;
    auto run = [&](Rollback rb, bool* chose) {
      return place(batch, idx, cp_size, bucket_size, rb, var == Variant::kBalanced, latency,
                   chose);
    };
    bool chose_victim = false;
    if (policy == Rollback::kBestFit) {
      consider(run(Rollback::kBestFit, &chose_victim));
      continue;
    }
    consider(run(Rollback::kShortest, &chose_victim));
    // Without a victim choice best-fit walks the very same steps: same placement (or the
    // same failure) and an equal time, which the reference's strict "<" never keeps.
    if (policy == Rollback::kAuto && chose_victim) {
      consider(run(Rollback::kBestFit, &chose_victim));
    }
  }
  if (variant == Variant::kAuto || variant == Variant::kLpt) {
    // Only a time below the best so far can win (strict "<"): the search's limit.
    consider(dacp_place_lpt(batch, idx, latency, cp_size, bucket_size,
                            best ? &best_t : nullptr));
  }
  return best;
}

bool dacp_feasible(const Batch& batch, const std::vector<Index>& idx, double latency,
                   int cp_size, int64_t bucket_size, Rollback policy, Variant variant) {
  for (Variant var : {Variant::kPaper, Variant::kBalanced}) {
    if (variant != Variant::kAuto && variant != var) continue;
    bool chose_victim = false;
    const Rollback first = policy == Rollback::kBestFit ? Rollback::kBestFit : Rollback::kShortest;
    if (place(batch, idx, cp_size, bucket_size, first, var == Variant::kBalanced, latency,
              &chose_victim)) {
      return true;
    }
    // Without a victim choice best-fit fails the very same way.
    if (policy == Rollback::kAuto && chose_victim &&
        place(batch, idx, cp_size, bucket_size, Rollback::kBestFit, var == Variant::kBalanced,
              latency, &chose_victim)) {
      return true;
    }
  }
  if (variant != Variant::kAuto && variant != Variant::kLpt) return false;
  return lpt_search(batch, idx, latency, cp_size, bucket_size, nullptr, true).has_value();
}

}  // namespace skrull
