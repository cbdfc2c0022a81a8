// (ours) The per-call arrays schedule() needs before the core runs, in C++:
// skrull_ext._C.cost_arrays (CostModel.schedule_arrays) and skrull_ext._C.hybrid_floor
// (scheduler.hybrid.hybrid_floor); registered by bindings.cpp's module (bind_costs).
//
// Why C++: at K = 256 the C++ core plans in ~0.12 ms, and the ~15 numpy calls of these two
// (~1-2 us each, whatever K) were a third of schedule()'s time around it.  The formulas
// and their parameters stay in Python (skrull_ext/costmodel/model.py passes the folded
// scalars); this file only repeats the float operations in the same order, so with
// -ffp-contract=off (setup.py) the arrays are bit-identical to numpy's
// (tests/test_cost_arrays_cpp.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

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
  double kv_coef;           // kv_hidden_size (float)
  double bytes;             // bytes_per_element (float)
};

CostScalars scalars_of(const py::tuple& t) {
  if (t.size() != 9) throw py::value_error("scalars must be CostModel.cost_scalars (9 floats)");
  double v[9];
  for (size_t i = 0; i < 9; ++i) v[i] = t[i].cast<double>();
  return CostScalars{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]};
}

const int64_t* lengths_1d(const I64Array& lengths) {
  if (lengths.ndim() != 1) throw py::value_error("lengths must be a 1-D array");
  return lengths.data();
}

// (costs, comm, shares), each [K] float64: CostModel.schedule_arrays's float operations.
// `ring`: ring steps x seconds per byte at this cp_size (CostModel computes it per call).
py::tuple cost_arrays(const I64Array& lengths, int64_t cp_size, const py::tuple& scalars,
                      double ring) {
  const CostScalars p = scalars_of(scalars);
  const int64_t* len = lengths_1d(lengths);
  const int64_t k = lengths.shape(0);
  F64Array costs(k), comm(k), shares(k);
  double* c = costs.mutable_data();
  double* m = comm.mutable_data();
  double* sh = shares.mutable_data();
  const double n = static_cast<double>(cp_size);
  {
    py::gil_scoped_release release;
    for (int64_t i = 0; i < k; ++i) {
      const double s = static_cast<double>(len[i]);
      const double linear_s = p.c_linear * (p.linear_per_token * s);
      const double attention = p.attention_coef * s * s * p.layers;
      double att = attention;
      if (p.half != 0.0) att = attention * (1.0 + p.half / std::max(s, 1.0));
      double cost = linear_s + p.c_attention * att;
      if (p.calls != 0.0) cost = cost + p.calls;
      c[i] = cost;
      if (cp_size <= 1) {
        m[i] = 0.0;
        sh[i] = cost;
        continue;
      }
      const double shard = static_cast<double>(skrull::shard_tokens(len[i], cp_size));
      double att_n = attention / n;
      if (p.half != 0.0) att_n = att_n * (1.0 + p.half / shard);
      double share = linear_s / n + p.c_attention * att_n;
      if (p.calls != 0.0) share = share + p.calls * n;
      sh[i] = share;
      m[i] = ring * (2.0 * shard * p.kv_coef * p.bytes);
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

}  // namespace

void bind_costs(py::module_& mod) {
  mod.def("cost_arrays", &cost_arrays, py::arg("lengths"), py::arg("cp_size"),
          py::arg("scalars"), py::arg("ring"),
          "(costs, comm, shares) [K] float64 of int64 lengths given CostModel.cost_scalars: "
          "CostModel.schedule_arrays, bit for bit.");
  mod.def("hybrid_floor", &hybrid_floor, py::arg("lengths"), py::arg("costs"),
          py::arg("dp_size"), py::arg("cp_size"), py::arg("bucket_size"), py::arg("overhead"),
          py::arg("fixed"), "scheduler.hybrid.hybrid_floor (sums in sample order).");
}
