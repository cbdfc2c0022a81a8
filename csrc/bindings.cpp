// pybind11 bindings of the scheduler core as skrull_ext._C.
//
// Arrays come in as any array-like (converted to contiguous int64 / float64); the C++
// work runs with the GIL released; results go out as the plain Python structures the
// reference returns (lists of ints, tuples of (distributed, local)).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cmath>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "gc_pause.h"
#include "objective_arg.h"
#include "scheduler.h"

namespace py = pybind11;
using skrull::Index;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

int64_t size_1d(const py::array& a, const char* name) {
  if (a.ndim() != 1) {
    throw py::value_error(std::string(name) + " must be a 1-D array, got " +
                          std::to_string(a.ndim()) + " dimensions");
  }
  return static_cast<int64_t>(a.shape(0));
}

void check_same_size(int64_t k, int64_t other, const char* name) {
  if (other != k) {
    throw py::value_error(std::string(name) + " has " + std::to_string(other) +
                          " entries but lengths has " + std::to_string(k));
  }
}

void check_positive(int64_t value, const char* name) {
  if (value < 1) throw py::value_error(std::string(name) + " must be >= 1, got " +
                                       std::to_string(value));
}

void check_lengths(const int64_t* lengths, int64_t k) {
  for (int64_t i = 0; i < k; ++i) {
    if (lengths[i] < 1 || lengths[i] > (int64_t{1} << 40)) {
      throw py::value_error("sample " + std::to_string(i) + " has length " +
                            std::to_string(lengths[i]) + ": lengths must be in [1, 2^40]");
    }
  }
}

void check_finite(const double* values, int64_t k, const char* name) {
  for (int64_t i = 0; i < k; ++i) {
    if (!std::isfinite(values[i])) {
      throw py::value_error(std::string(name) + "[" + std::to_string(i) +
                            "] is not finite: fix the cost model");
    }
  }
}

std::vector<Index> to_indices(const I64Array& idx, int64_t k) {
  const int64_t n = size_1d(idx, "idx");
  const int64_t* p = idx.data();
  std::vector<Index> out(p, p + n);
  for (Index i : out) {
    if (i < 0 || i >= k) {
      throw py::index_error("sample index " + std::to_string(i) + " out of range [0, " +
                            std::to_string(k) + ")");
    }
  }
  return out;
}

skrull::Rollback to_rollback(int code, bool allow_auto) {
  if (code < 0 || code > (allow_auto ? 2 : 1)) {
    throw py::value_error("rollback code " + std::to_string(code) + " is not one of " +
                          (allow_auto ? "0 (shortest), 1 (best-fit), 2 (auto)"
                                      : "0 (shortest), 1 (best-fit); use dacp_best for auto"));
  }
  return static_cast<skrull::Rollback>(code);
}

skrull::Variant to_variant(int code) {
  if (code < 0 || code > 3) {
    throw py::value_error("variant code " + std::to_string(code) +
                          " is not one of 0 (paper), 1 (balanced), 2 (lpt), 3 (auto)");
  }
  return static_cast<skrull::Variant>(code);
}

// A new Python list (kTuple: tuple) of the ids.
template <bool kTuple>
PyObject* int_seq(const std::vector<Index>& v) {
  const auto n = static_cast<Py_ssize_t>(v.size());
  PyObject* seq = kTuple ? PyTuple_New(n) : PyList_New(n);
  if (!seq) throw py::error_already_set();
  for (Py_ssize_t j = 0; j < n; ++j) {
    PyObject* item = PyLong_FromLongLong(v[static_cast<size_t>(j)]);
    if (!item) {
      Py_DECREF(seq);
      throw py::error_already_set();
    }
    if constexpr (kTuple) {
      PyTuple_SET_ITEM(seq, j, item);
    } else {
      PyList_SET_ITEM(seq, j, item);
    }
  }
  return kTuple ? skrull_py::untracked(seq) : seq;
}

py::list int_list(const std::vector<Index>& v) {
  return py::reinterpret_steal<py::list>(int_seq<false>(v));
}

py::tuple int_tuple(const std::vector<Index>& v) {
  return py::reinterpret_steal<py::tuple>(int_seq<true>(v));
}

using skrull_py::GcPause;  // gc_pause.h

// (distributed, local) as tuples of ints: MicroBatch's own field types.
py::tuple placement_tuple(const skrull::Placement& p) {
  py::tuple local(p.local.size());
  for (size_t r = 0; r < p.local.size(); ++r) local[r] = int_tuple(p.local[r]);
  skrull_py::untracked(local.ptr());
  py::tuple out = py::make_tuple(int_tuple(p.distributed), local);
  skrull_py::untracked(out.ptr());
  return out;
}

py::list nested_list(const std::vector<std::vector<Index>>& v) {
  py::list out(v.size());
  for (size_t j = 0; j < v.size(); ++j) out[j] = int_list(v[j]);
  return out;
}

py::object placement_obj(const std::optional<skrull::Placement>& p) {
  if (!p) return py::none();
  if (p->pin >= 0) return py::make_tuple(int_list(p->distributed), nested_list(p->local), p->pin);
  return py::make_tuple(int_list(p->distributed), nested_list(p->local));
}

// A plan as list[DP] of list[micro-batch] of (distributed, local): lists of ints, or with
// `tuples` tuples (placement_tuple).
py::list splits_list(const std::vector<skrull::RankSplit>& splits, bool tuples = false) {
  py::list out(splits.size());
  for (size_t d = 0; d < splits.size(); ++d) {
    py::list rank(splits[d].size());
    for (size_t m = 0; m < splits[d].size(); ++m) {
      rank[m] = tuples ? placement_tuple(splits[d][m]) : placement_obj(splits[d][m]);
    }
    out[d] = rank;
  }
  return out;
}

// Owns the converted arrays of a global batch and checks their shapes and values.
struct BatchArgs {
  I64Array lengths;
  F64Array costs;
  F64Array comm;
  F64Array shares;
  skrull::Batch view;

  BatchArgs(I64Array l, F64Array c, py::object m, py::object sh = py::none())
      : lengths(std::move(l)), costs(std::move(c)) {
    if (!sh.is_none()) {
      shares = sh.cast<F64Array>();
      check_same_size(size_1d(lengths, "lengths"), size_1d(shares, "shares"), "shares");
      check_finite(shares.data(), size_1d(shares, "shares"), "shares");
      view.shares = shares.data();
    }
    view.size = size_1d(lengths, "lengths");
    check_same_size(view.size, size_1d(costs, "costs"), "costs");
    view.lengths = lengths.data();
    view.costs = costs.data();
    check_lengths(view.lengths, view.size);
    check_finite(view.costs, view.size, "costs");
    if (!m.is_none()) {
      comm = m.cast<F64Array>();
      check_same_size(view.size, size_1d(comm, "comm"), "comm");
      view.comm = comm.data();
      check_finite(view.comm, view.size, "comm");
    }
  }
};

using Scheduler = std::vector<skrull::RankSplit> (*)(const skrull::Batch&, double, int, int,
                                                      int64_t, skrull::Rollback, double,
                                                      skrull::Variant, int64_t);

// gds_schedule with the portfolio's signature (it has no refinement budget).
std::vector<skrull::RankSplit> gds_only(const skrull::Batch& batch, double latency, int dp,
                                        int cp, int64_t bucket, skrull::Rollback policy,
                                        double overhead, skrull::Variant variant, int64_t) {
  return skrull::gds_schedule(batch, latency, dp, cp, bucket, policy, overhead, variant);
}

py::array_t<int64_t> int_array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// The plan as flat [P] / [Q] int64 arrays (scheduler.plan.FlatPlan's dist_ids, dist_mb,
// local_ids, local_slot): micro-batch g counts over DP ranks, then micro-batches; CP rank r
// of it is slot g * cp_size + r; ids in placement order), then [G] predicted seconds of
// each micro-batch (overhead included, 0 when empty), the plan's lower bound
// (skrull::plan_lower_bound) and whether it passes skrull::plan_valid.  Saves schedule()
// a Python walk over every sample.
py::tuple flat_arrays(const std::vector<skrull::RankSplit>& splits, int dp_size, int cp_size,
                      int64_t bucket_size, const skrull::Batch& batch, double latency,
                      double overhead) {
  std::vector<int64_t> dist_ids, dist_mb, local_ids, local_slot;
  py::array_t<double> times(static_cast<py::ssize_t>(
      std::accumulate(splits.begin(), splits.end(), size_t{0},
                      [](size_t a, const skrull::RankSplit& s) { return a + s.size(); })));
  double* t = times.mutable_data();
  int64_t g = 0;
  for (const auto& split : splits) {
    for (const auto& p : split) {
      // The same float operations as scheduler.pricing.micro_batch_times (bit-identical).
      t[g] = p.empty() ? 0.0 : skrull::micro_batch_time(p, batch, latency, cp_size) + overhead;
      for (Index i : p.distributed) {
        dist_ids.push_back(i);
        dist_mb.push_back(g);
      }
      for (size_t r = 0; r < p.local.size(); ++r) {
        for (Index i : p.local[r]) {
          local_ids.push_back(i);
          local_slot.push_back(g * cp_size + static_cast<int64_t>(r));
        }
      }
      ++g;
    }
  }
  return py::make_tuple(g, int_array(dist_ids), int_array(dist_mb), int_array(local_ids),
                        int_array(local_slot), times,
                        skrull::plan_lower_bound(batch, latency, dp_size, cp_size, bucket_size,
                                                 overhead),
                        skrull::plan_valid(splits, batch, cp_size, bucket_size));
}

// Checks the arguments, runs `fn` (gds_schedule or portfolio_schedule) without the GIL and
// converts the plan to lists; with `flat` returns (lists of tuple placements, flat_arrays).
py::object run_scheduler(Scheduler fn, I64Array lengths, F64Array costs, F64Array comm,
                       double latency, int dp_size, int cp_size, int64_t bucket_size,
                       int rollback, double overhead, int variant, py::object shares,
                       py::object objective, int64_t budget = 0, bool flat = false) {
  BatchArgs args(std::move(lengths), std::move(costs), comm, shares);
  args.view.objective = skrull_py::to_objective(objective);
  check_positive(dp_size, "dp_size");
  check_positive(cp_size, "cp_size");
  check_positive(bucket_size, "bucket_size");
  // Keeps every token count (C * N, sums of lengths) far inside int64.
  if (bucket_size > (int64_t{1} << 40)) throw py::value_error("bucket_size must be <= 2^40");
  if (cp_size > (1 << 16)) throw py::value_error("cp_size must be <= 65536");
  const auto policy = to_rollback(rollback, true);
  const auto var = to_variant(variant);
  if (budget < 0) throw py::value_error("budget must be >= 0 work units");
  std::vector<skrull::RankSplit> splits;
  {
    py::gil_scoped_release release;
    splits = fn(args.view, latency, dp_size, cp_size, bucket_size, policy, overhead, var, budget);
  }
  GcPause pause;
  py::list out = splits_list(splits, /*tuples=*/flat);
  if (flat) {
    return py::make_tuple(out, flat_arrays(splits, dp_size, cp_size, bucket_size, args.view,
                                           latency, overhead));
  }
  return std::move(out);
}

py::object gds_schedule(I64Array lengths, F64Array costs, F64Array comm, double latency,
                        int dp_size, int cp_size, int64_t bucket_size, int rollback,
                        double overhead, int variant, py::object shares, py::object objective,
                        bool flat) {
  return run_scheduler(&gds_only, std::move(lengths), std::move(costs),
                       std::move(comm), latency, dp_size, cp_size, bucket_size, rollback,
                       overhead, variant, std::move(shares), objective, 0, flat);
}

py::object portfolio_schedule(I64Array lengths, F64Array costs, F64Array comm,
                              double latency, int dp_size, int cp_size, int64_t bucket_size,
                              int rollback, double overhead, int variant, py::object shares,
                              py::object objective, int64_t budget, bool flat) {
  return run_scheduler(&skrull::portfolio_schedule, std::move(lengths), std::move(costs),
                       std::move(comm), latency, dp_size, cp_size, bucket_size, rollback,
                       overhead, variant, std::move(shares), objective, budget, flat);
}

// (ours) Calibration of --skrull-plan-budget-ms (benchmarks/bench_scheduler.py
// --calibrate): the portfolio's unrefined plan, then refine() (stage "refine") or lns()
// (stage "lns", never stopped by a floor; "deal": its first pass, resplit.deal_best)
// alone with `budget` work units, timed here (no
// conversion); (work units counted, wall seconds of that stage).
py::tuple refine_timing(I64Array lengths, F64Array costs, F64Array comm, double latency,
                        int dp_size, int cp_size, int64_t bucket_size, double overhead,
                        py::object shares, py::object objective, int64_t budget,
                        const std::string& stage) {
  if (stage != "refine" && stage != "lns" && stage != "deal") {
    throw py::value_error("stage: refine, lns or deal");
  }
  BatchArgs args(std::move(lengths), std::move(costs), comm, shares);
  args.view.objective = skrull_py::to_objective(objective);
  check_positive(dp_size, "dp_size");
  check_positive(cp_size, "cp_size");
  check_positive(bucket_size, "bucket_size");
  int64_t spent = 0;
  double seconds = 0.0;
  {
    py::gil_scoped_release release;
    const skrull::GdsContext ctx{args.view, latency, cp_size, bucket_size,
                                 skrull::Rollback::kAuto, skrull::Variant::kAuto};
    auto splits = skrull::portfolio_schedule(args.view, latency, dp_size, cp_size, bucket_size,
                                             ctx.rollback, overhead, ctx.variant, 0);
    const auto start = std::chrono::steady_clock::now();
    if (stage == "deal") {  // resplit.deal_best alone, `budget` its limit
      auto dealt = skrull::deal_best(ctx, splits, overhead, budget, &spent);
      if (dealt) splits = std::move(*dealt);
    } else {
      splits = stage == "lns"
                   ? skrull::lns(ctx, std::move(splits), overhead, budget, -1.0, &spent)
                   : skrull::refine(ctx, std::move(splits), overhead, budget, &spent);
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return py::make_tuple(spent, seconds);
}

// (ours) balance.balance on a given plan, for tests: (splits, work units counted).
// list[DP] of list[micro-batch] of (distributed, local) or, with pinned rings (lns),
// (distributed, local, pin): pin in [0, pins).
std::vector<skrull::RankSplit> parse_splits(py::object splits, int64_t k, int64_t pins) {
  std::vector<skrull::RankSplit> in;
  for (auto split : splits) {
    skrull::RankSplit rank;
    for (auto item : split) {
      auto t = item.cast<py::tuple>();
      skrull::Placement p;
      p.distributed = to_indices(t[0].cast<I64Array>(), k);
      for (auto r : t[1]) p.local.push_back(to_indices(r.cast<I64Array>(), k));
      if (t.size() > 2) {
        p.pin = t[2].cast<int64_t>();
        if (p.pin < 0 || p.pin >= pins) throw py::value_error("pin id out of range");
      }
      rank.push_back(std::move(p));
    }
    in.push_back(std::move(rank));
  }
  return in;
}

// (ours) Ruin and recreate with pinned sub-group rings (reference lns.lns with `pins`):
// (splits, work); pin_seconds / pin_tokens [P, N].
py::tuple lns_pinned(py::object splits, F64Array pin_seconds, I64Array pin_tokens,
                     I64Array lengths, F64Array costs, F64Array comm, double latency,
                     int cp_size, int64_t bucket_size, int rollback, int variant,
                     double overhead, py::object shares, py::object objective,
                     int64_t budget, double floor_t) {
  BatchArgs args(std::move(lengths), std::move(costs), comm, shares);
  args.view.objective = skrull_py::to_objective(objective);
  check_positive(cp_size, "cp_size");
  check_positive(bucket_size, "bucket_size");
  if (pin_seconds.ndim() != 2 || pin_tokens.ndim() != 2 ||
      pin_seconds.shape(0) != pin_tokens.shape(0) || pin_seconds.shape(1) != cp_size ||
      pin_tokens.shape(1) != cp_size) {
    throw py::value_error("pin_seconds and pin_tokens: [P, cp_size] each");
  }
  skrull::Pins pins;
  const auto ps = pin_seconds.unchecked<2>();
  const auto pt = pin_tokens.unchecked<2>();
  for (py::ssize_t x = 0; x < pin_seconds.shape(0); ++x) {
    pins.seconds.emplace_back();
    pins.tokens.emplace_back();
    for (int r = 0; r < cp_size; ++r) {
      pins.seconds.back().push_back(ps(x, r));
      pins.tokens.back().push_back(pt(x, r));
    }
  }
  auto in = parse_splits(splits, args.view.size, pin_seconds.shape(0));
  const auto policy = to_rollback(rollback, true);
  const auto dacp = to_variant(variant);
  int64_t work = 0;
  std::vector<skrull::RankSplit> out;
  {
    py::gil_scoped_release release;
    const skrull::GdsContext ctx{args.view, latency, cp_size, bucket_size, policy, dacp};
    out = skrull::lns(ctx, std::move(in), overhead, budget, floor_t, &work, &pins);
  }
  return py::make_tuple(splits_list(out), work);
}

py::tuple balance(py::object splits, I64Array lengths, F64Array costs, F64Array comm,
                  double latency, int cp_size, int64_t bucket_size, double overhead,
                  py::object shares, py::object objective, int64_t limit) {
  BatchArgs args(std::move(lengths), std::move(costs), comm, shares);
  args.view.objective = skrull_py::to_objective(objective);
  check_positive(cp_size, "cp_size");
  std::vector<skrull::RankSplit> in = parse_splits(splits, args.view.size, -1);
  int64_t work = 0;
  std::vector<skrull::RankSplit> out;
  {
    py::gil_scoped_release release;
    const skrull::GdsContext ctx{args.view, latency, cp_size, bucket_size,
                                 skrull::Rollback::kAuto, skrull::Variant::kAuto};
    out = skrull::balance(ctx, in, overhead, limit, &work);
  }
  return py::make_tuple(splits_list(out), work);
}

// (ours) The portfolio's pack candidate alone (reference pack.pack_schedule), for tests.
py::list pack_schedule(I64Array lengths, F64Array costs, py::object shares, int dp_size,
                       int cp_size, int64_t bucket_size, int64_t threshold, bool spread) {
  BatchArgs args(std::move(lengths), std::move(costs), py::none(), std::move(shares));
  check_positive(dp_size, "dp_size");
  check_positive(cp_size, "cp_size");
  check_positive(bucket_size, "bucket_size");
  std::vector<skrull::RankSplit> splits;
  {
    py::gil_scoped_release release;
    splits = skrull::pack_schedule(args.view, dp_size, cp_size, bucket_size, threshold, spread);
  }
  return splits_list(splits);
}

py::list baseline_groups(I64Array lengths, F64Array costs, int dp_size, int cp_size,
                   int64_t bucket_size, const std::string& name) {
  BatchArgs args(std::move(lengths), std::move(costs), py::none());
  check_positive(dp_size, "dp_size");
  check_positive(cp_size, "cp_size");
  check_positive(bucket_size, "bucket_size");
  using Grouping = skrull::Groups (*)(const skrull::Batch&, int, int, int64_t);
  Grouping fn = name == "kk"           ? &skrull::kk_groups
                : name == "sorted"     ? &skrull::sorted_groups
                : name == "all-cp"     ? &skrull::all_cp_groups
                : name == "per-seq-cp" ? &skrull::per_seq_cp_groups
                : name == "hybrid-cp"  ? &skrull::hybrid_cp_groups
                : name == "hybrid-cp-placed" ? &skrull::hybrid_cp_placed
                                       : nullptr;
  if (!fn) throw py::value_error("unknown grouping " + name);
  skrull::Groups groups;
  {
    py::gil_scoped_release release;
    groups = fn(args.view, dp_size, cp_size, bucket_size);
  }
  py::list out(groups.size());
  for (size_t d = 0; d < groups.size(); ++d) out[d] = nested_list(groups[d]);
  return out;
}

py::object dacp_place(I64Array lengths, F64Array costs, I64Array idx, int cp_size,
                      int64_t bucket_size, int rollback, py::object shares) {
  BatchArgs args(std::move(lengths), std::move(costs), py::none(), shares);
  check_positive(cp_size, "cp_size");
  auto ids = to_indices(idx, args.view.size);
  const auto policy = to_rollback(rollback, false);
  std::optional<skrull::Placement> placed;
  {
    py::gil_scoped_release release;
    placed = skrull::dacp_place(args.view, std::move(ids), cp_size, bucket_size, policy);
  }
  return placement_obj(placed);
}

py::object dacp_best(I64Array lengths, F64Array costs, F64Array comm, double latency,
                     I64Array idx, int cp_size, int64_t bucket_size, int rollback,
                     int variant, py::object shares, py::object objective) {
  BatchArgs args(std::move(lengths), std::move(costs), comm, shares);
  args.view.objective = skrull_py::to_objective(objective);
  check_positive(cp_size, "cp_size");
  auto ids = to_indices(idx, args.view.size);
  const auto policy = to_rollback(rollback, true);
  const auto var = to_variant(variant);
  std::optional<skrull::Placement> placed;
  {
    py::gil_scoped_release release;
    placed = skrull::dacp_best(args.view, ids, latency, cp_size, bucket_size, policy, var);
  }
  return placement_obj(placed);
}

double micro_batch_time(py::object placement, F64Array costs, F64Array comm, double latency,
                        int cp_size, py::object shares, py::object objective) {
  check_positive(cp_size, "cp_size");
  const int64_t k = size_1d(costs, "costs");
  check_same_size(k, size_1d(comm, "comm"), "comm");
  auto pair = placement.cast<py::tuple>();
  if (pair.size() != 2) throw py::value_error("placement must be (distributed, local)");
  skrull::Placement p;
  p.distributed = to_indices(pair[0].cast<I64Array>(), k);
  for (auto rank : pair[1]) p.local.push_back(to_indices(rank.cast<I64Array>(), k));
  skrull::Batch view{nullptr, costs.data(), comm.data(), k};
  view.objective = skrull_py::to_objective(objective);
  F64Array share_arr;
  if (!shares.is_none()) {
    share_arr = shares.cast<F64Array>();
    check_same_size(k, size_1d(share_arr, "shares"), "shares");
    view.shares = share_arr.data();
  }
  return skrull::micro_batch_time(p, view, latency, cp_size);
}

py::list lpt_partition(F64Array costs, I64Array idx, int bins) {
  const int64_t k = size_1d(costs, "costs");
  check_finite(costs.data(), k, "costs");
  check_positive(bins, "bins");
  auto ids = to_indices(idx, k);
  std::vector<std::vector<Index>> out;
  {
    py::gil_scoped_release release;
    out = skrull::lpt_partition(costs.data(), ids, bins);
  }
  return nested_list(out);
}

py::list interleave(I64Array sorted_idx, int64_t m) {
  check_positive(m, "m");
  const int64_t n = size_1d(sorted_idx, "sorted_idx");
  std::vector<Index> ids(sorted_idx.data(), sorted_idx.data() + n);
  return nested_list(skrull::interleave(ids, m));
}

}  // namespace

void bind_hybrid(py::module_& mod);  // hybrid_bindings.cpp
void bind_costs(py::module_& mod);   // costs.cpp

PYBIND11_MODULE(_C, mod) {
  mod.doc() = "C++ core of the Skrull scheduler (DACP + GDS); mirrors scheduler/reference.py";
  mod.def("gds_schedule", &gds_schedule, py::arg("lengths"), py::arg("costs"), py::arg("comm"),
          py::arg("latency"), py::arg("dp_size"), py::arg("cp_size"), py::arg("bucket_size"),
          py::arg("rollback"), py::arg("overhead") = 0.0, py::arg("variant") = 3,
          py::arg("shares") = py::none(), py::arg("objective") = 0, py::arg("flat") = false,
          "GDS over a global batch: list[DP] of list[micro-batch] of (distributed, local); "
          "flat=True: (that with (distributed, local) as tuples, (count, dist_ids, dist_mb, "
          "local_ids, local_slot, micro_batch_seconds, lower_bound, valid)).");
  mod.def("portfolio_schedule", &portfolio_schedule, py::arg("lengths"), py::arg("costs"),
          py::arg("comm"), py::arg("latency"), py::arg("dp_size"), py::arg("cp_size"),
          py::arg("bucket_size"), py::arg("rollback"), py::arg("overhead") = 0.0,
          py::arg("variant") = 3, py::arg("shares") = py::none(), py::arg("objective") = 0,
          py::arg("budget") = 0, py::arg("flat") = false,
          "GDS and the baselines' groupings under DACP; the fastest predicted plan, refined "
          "by local search within `budget` work units (0: none); flat as gds_schedule.");
  mod.def("refine_timing", &refine_timing, py::arg("lengths"), py::arg("costs"),
          py::arg("comm"), py::arg("latency"), py::arg("dp_size"), py::arg("cp_size"),
          py::arg("bucket_size"), py::arg("overhead"), py::arg("shares"), py::arg("objective"),
          py::arg("budget"), py::arg("stage") = "refine",
          "(work units counted, seconds) of refining the unrefined portfolio plan by one "
          "stage: the local search (`refine`) or ruin and recreate (`lns`).");
  mod.def("balance", &balance, py::arg("splits"), py::arg("lengths"), py::arg("costs"),
          py::arg("comm"), py::arg("latency"), py::arg("cp_size"), py::arg("bucket_size"),
          py::arg("overhead"), py::arg("shares"), py::arg("objective"), py::arg("limit"),
          "(splits, work): each DP rank's CP balance polish (scheduler.balance).");
  mod.def("lns_pinned", &lns_pinned, py::arg("splits"), py::arg("pin_seconds"),
          py::arg("pin_tokens"), py::arg("lengths"), py::arg("costs"), py::arg("comm"),
          py::arg("latency"), py::arg("cp_size"), py::arg("bucket_size"), py::arg("rollback"),
          py::arg("variant"), py::arg("overhead"), py::arg("shares"), py::arg("objective"),
          py::arg("budget"), py::arg("floor"),
          "(splits, work): ruin and recreate with pinned sub-group rings (scheduler.lns).");
  mod.def("baseline_groups", &baseline_groups, py::arg("lengths"), py::arg("costs"),
          py::arg("dp_size"), py::arg("cp_size"), py::arg("bucket_size"), py::arg("name"),
          "A baseline's samples per DP rank and micro-batch (scheduler.baselines.GROUPINGS).");
  mod.def("pack_schedule", &pack_schedule, py::arg("lengths"), py::arg("costs"),
          py::arg("shares"), py::arg("dp_size"), py::arg("cp_size"), py::arg("bucket_size"),
          py::arg("threshold"), py::arg("spread") = false,
          "(ours) The portfolio's pack candidate (scheduler.pack).");
  mod.def("dacp_place", &dacp_place, py::arg("lengths"), py::arg("costs"), py::arg("idx"),
          py::arg("cp_size"), py::arg("bucket_size"), py::arg("rollback") = 0,
          py::arg("shares") = py::none(),
          "DACP of one micro-batch: (distributed, local) or None if infeasible.");
  mod.def("dacp_best", &dacp_best, py::arg("lengths"), py::arg("costs"), py::arg("comm"),
          py::arg("latency"), py::arg("idx"), py::arg("cp_size"), py::arg("bucket_size"),
          py::arg("rollback"), py::arg("variant") = 0, py::arg("shares") = py::none(),
          py::arg("objective") = 0,
          "DACP with a roll-back policy and variant (paper/balanced/lpt); auto keeps the fastest.");
  mod.def("micro_batch_time", &micro_batch_time, py::arg("placement"), py::arg("costs"),
          py::arg("comm"), py::arg("latency"), py::arg("cp_size"),
          py::arg("shares") = py::none(), py::arg("objective") = 0,
          "Predicted seconds of one placed micro-batch (no overhead).");
  mod.def("lpt_partition", &lpt_partition, py::arg("costs"), py::arg("idx"), py::arg("bins"),
          "Longest-processing-time bin packing: `bins` lists of sample ids.");
  mod.def("interleave", &interleave, py::arg("sorted_idx"), py::arg("m"),
          "Micro-batch j takes sorted_idx[j], sorted_idx[j + m], ...");
  mod.def("can_pair", &skrull::can_pair, py::arg("sx"), py::arg("sy"), py::arg("cp_size"),
          py::arg("bucket_size"), "Whether two sequences fit one micro-batch together.");
  mod.def("shard_tokens", &skrull::shard_tokens, py::arg("length"), py::arg("n"),
          "Tokens per rank of a sample zigzag-sharded over n ranks.");
  bind_hybrid(mod);
  bind_costs(mod);
}
