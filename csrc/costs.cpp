// (ours) The per-call arrays schedule() needs around the core, in C++:
// skrull_ext._C.cost_arrays (CostModel.schedule_arrays), skrull_ext._C.hybrid_floor
// (scheduler.hybrid.hybrid_floor) and skrull_ext._C.sample_bounds
// (scheduler.bound.sample_bounds); registered by bindings.cpp's module (bind_costs).
//
// Why C++: at K = 256 the C++ core plans in ~0.12 ms, and the ~15 numpy calls of the first two
// (~1-2 us each, whatever K) were a third of schedule()'s time around it; at K = 65,536
// the bound over hybrid CP's sub-groups took ~4.6 ms of numpy per plan.  The formulas
// and their parameters stay in Python (skrull_ext/costmodel/model.py passes the folded
// scalars); this file only repeats the float operations in the same order, so with
// -ffp-contract=off (setup.py) the arrays are bit-identical to numpy's
// (tests/test_cost_arrays_cpp.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "objective_arg.h"
#include "scheduler.h"

namespace py = pybind11;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

// CostModel.cost_scalars: its coefficients folded in Python as numpy would have applied
// them (a plain tuple, so a CostModel stays picklable).
struct CostScalars {
  double linear_per_token;  // LINEAR_TRAIN_FACTOR * per-token matmul FLOPs
  double attention_coef;    // ATTENTION_TRAIN_FACTOR * 2.0 * hidden
  double layers;            // num_layers (float)
  double c_linear, c_attention;
  double half;              // attention_half_tokens (0: no short-block surcharge)
  double calls;             // attention_call_overhead * num_layers (0: none)
  double outside;           // lam + nu: a shard token's linear and dK/dV-return seconds
};

CostScalars scalars_of(const py::tuple& t) {
  if (t.size() != 8) throw py::value_error("scalars must be CostModel.cost_scalars (8 floats)");
  double v[8];
  for (size_t i = 0; i < 8; ++i) v[i] = t[i].cast<double>();
  return CostScalars{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]};
}

// One sample's (cost, share, comm) at cp_size: CostModel.schedule_arrays's float
// operations for one entry (cp_size <= 1: share = cost, comm = 0).  `ring`:
// CostModel.shard_token_seconds(cp_size).
struct SampleCost {
  double cost, share, comm;
};

inline SampleCost sample_cost(const CostScalars& p, int64_t length, int64_t cp_size,
                              double ring) {
  const double s = static_cast<double>(length);
  const double linear_s = p.c_linear * (p.linear_per_token * s);
  const double attention = p.attention_coef * s * s * p.layers;
  double att = attention;
  if (p.half != 0.0) att = attention * (1.0 + p.half / std::max(s, 1.0));
  double cost = linear_s + p.c_attention * att;
  if (p.calls != 0.0) cost = cost + p.calls;
  if (cp_size <= 1) return SampleCost{cost, cost, 0.0};
  const double n = static_cast<double>(cp_size);
  const double shard = static_cast<double>(skrull::shard_tokens(length, cp_size));
  const double pad = shard * n;  // the padded sequence: 1/N of its attention per rank
  double att_n = p.attention_coef * pad * pad * p.layers / n;
  if (p.half != 0.0) att_n = att_n * (1.0 + p.half / shard);
  double share = p.outside * shard + p.c_attention * att_n;
  if (p.calls != 0.0) share = share + p.calls * n;
  return SampleCost{cost, share, ring * shard};
}

const int64_t* lengths_1d(const I64Array& lengths) {
  if (lengths.ndim() != 1) throw py::value_error("lengths must be a 1-D array");
  return lengths.data();
}

// (costs, comm, shares), each [K] float64: CostModel.schedule_arrays's float operations.
// `ring`: CostModel.shard_token_seconds(cp_size) (computed per call in Python).
py::tuple cost_arrays(const I64Array& lengths, int64_t cp_size, const py::tuple& scalars,
                      double ring) {
  const CostScalars p = scalars_of(scalars);
  const int64_t* len = lengths_1d(lengths);
  const int64_t k = lengths.shape(0);
  F64Array costs(k), comm(k), shares(k);
  double* c = costs.mutable_data();
  double* m = comm.mutable_data();
  double* sh = shares.mutable_data();
  {
    py::gil_scoped_release release;
    for (int64_t i = 0; i < k; ++i) {
      const SampleCost e = sample_cost(p, len[i], cp_size, ring);
      c[i] = e.cost;
      sh[i] = e.share;
      m[i] = e.comm;
    }
  }
  return py::make_tuple(costs, comm, shares);
}

// scheduler.hybrid.hybrid_floor: the slowest of hybrid CP's D contiguous slices (numpy's
// array_split) priced at unsharded work / N plus one overhead per micro-batch it needs at
// least, plus the iteration overhead, less a 1e-12 relative slack.  A gate, not a plan
// input: its sums run in sample order where numpy's are pairwise, a difference of a few
// ulps that the slack (and the gate's use, "cannot beat") absorbs.
double hybrid_floor(const I64Array& lengths, const F64Array& costs, int64_t dp_size,
                    int64_t cp_size, int64_t bucket_size, double overhead, double fixed) {
  const int64_t* len = lengths_1d(lengths);
  const int64_t k = lengths.shape(0);
  if (costs.ndim() != 1 || costs.shape(0) != k) {
    throw py::value_error("costs must be a 1-D array with one entry per sample");
  }
  if (dp_size < 1 || cp_size < 1 || bucket_size < 1) {
    throw py::value_error("dp_size, cp_size and bucket_size must be >= 1");
  }
  if (k < dp_size) return 0.0;
  const double* w = costs.data();
  const int64_t per = k / dp_size, extra = k % dp_size, cap = bucket_size * cp_size;
  double worst = 0.0;
  for (int64_t j = 0, lo = 0; j < dp_size; ++j) {
    const int64_t hi = lo + per + (j < extra ? 1 : 0);
    double work = 0.0;
    int64_t tokens = 0;
    for (int64_t i = lo; i < hi; ++i) {
      work += w[i];
      tokens += len[i];
    }
    const int64_t mbs = std::max<int64_t>(1, (tokens + cap - 1) / cap);
    worst = std::max(worst, work / static_cast<double>(cp_size) +
                                overhead * static_cast<double>(mbs));
    lo = hi;
  }
  return (worst + fixed) * (1.0 - 1e-12);
}

// An optional [K] float64 array argument (None: computed here).
const double* optional_array(const py::object& obj, int64_t k, F64Array& keep, const char* name) {
  if (obj.is_none()) return nullptr;
  keep = obj.cast<F64Array>();
  if (keep.ndim() != 1 || keep.shape(0) != k) {
    throw py::value_error(std::string(name) + " must be a 1-D array with one entry per sample");
  }
  return keep.data();
}

// bound.sample_bounds: per sample, over the group sizes g it fits (shard tokens <= the
// bucket), work = min g x share_g (g = 1: its cost) and alone = min rank_time(0, comm_g +
// latency_g, share_g, g), in numpy's float operations (bit-identical).  `rings[j]`,
// `latencies[j]`: CostModel.shard_token_seconds and comm_latency at sizes[j];
// `costs` / `shares` / `comm`: the batch's arrays at g = 1 / N when the caller has them.
py::tuple sample_bounds(const I64Array& lengths, int64_t cp_size, int64_t bucket_size,
                        const py::tuple& scalars, const std::vector<int64_t>& sizes,
                        const std::vector<double>& rings, const std::vector<double>& latencies,
                        const py::object& objective_obj, const py::object& costs_obj,
                        const py::object& shares_obj, const py::object& comm_obj) {
  const CostScalars p = scalars_of(scalars);
  const int64_t* len = lengths_1d(lengths);
  const int64_t k = lengths.shape(0);
  if (rings.size() != sizes.size() || latencies.size() != sizes.size()) {
    throw py::value_error("sizes, rings and latencies must have one entry per group size");
  }
  F64Array keep_costs, keep_shares, keep_comm;
  const double* costs = optional_array(costs_obj, k, keep_costs, "costs");
  const double* shares = optional_array(shares_obj, k, keep_shares, "shares");
  const double* comm = optional_array(comm_obj, k, keep_comm, "comm");
  const skrull::Objective objective = skrull_py::to_objective(objective_obj);
  const int n = static_cast<int>(cp_size);
  const double inf = std::numeric_limits<double>::infinity();
  F64Array work_out(k), alone_out(k);
  double* work = work_out.mutable_data();
  double* alone = alone_out.mutable_data();
  {
    py::gil_scoped_release release;
    for (int64_t i = 0; i < k; ++i) {
      double w = inf, a = inf;
      for (size_t j = 0; j < sizes.size(); ++j) {
        const int64_t g = sizes[j];
        if (skrull::shard_tokens(len[i], g) > bucket_size) continue;
        if (g == 1) {
          const double cost = costs ? costs[i] : sample_cost(p, len[i], 1, 0.0).cost;
          w = std::min(w, cost);
          a = std::min(a, cost);
          continue;
        }
        double share, bytes_s;
        if (g == cp_size && shares && comm) {
          share = shares[i];
          bytes_s = comm[i];
        } else {
          const SampleCost e = sample_cost(p, len[i], g, rings[j]);
          share = e.share;
          bytes_s = e.comm;
        }
        w = std::min(w, static_cast<double>(g) * share);
        a = std::min(a, skrull::rank_time(0.0, bytes_s + latencies[j], share, static_cast<int>(g),
                                          objective));
      }
      work[i] = w;
      alone[i] = a;
    }
  }
  return py::make_tuple(work_out, alone_out);
}

}  // namespace

void bind_costs(py::module_& mod) {
  mod.def("cost_arrays", &cost_arrays, py::arg("lengths"), py::arg("cp_size"),
          py::arg("scalars"), py::arg("ring"),
          "(costs, comm, shares) [K] float64 of int64 lengths given CostModel.cost_scalars: "
          "CostModel.schedule_arrays, bit for bit.");
  mod.def("hybrid_floor", &hybrid_floor, py::arg("lengths"), py::arg("costs"),
          py::arg("dp_size"), py::arg("cp_size"), py::arg("bucket_size"), py::arg("overhead"),
          py::arg("fixed"), "scheduler.hybrid.hybrid_floor (sums in sample order).");
  mod.def("sample_bounds", &sample_bounds, py::arg("lengths"), py::arg("cp_size"),
          py::arg("bucket_size"), py::arg("scalars"), py::arg("sizes"), py::arg("rings"),
          py::arg("latencies"), py::arg("objective"), py::arg("costs") = py::none(),
          py::arg("shares") = py::none(), py::arg("comm") = py::none(),
          "(work, alone) [K] float64: scheduler.bound.sample_bounds, bit for bit.");
}
