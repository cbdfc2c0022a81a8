// pybind11 binding of the hybrid-CP candidate (csrc/hybrid.cpp) as
// skrull_ext._C.hybrid_candidate; registered by bindings.cpp's module (bind_hybrid).
//
// Only a winning plan crosses into Python: a losing one costs no Python object per sample
// or micro-batch.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
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

const double* checked(const F64Array& a, int64_t k, const char* name) {
  if (a.ndim() != 1 || a.shape(0) != k) {
    throw py::value_error(std::string(name) + " must be a 1-D array of " + std::to_string(k) +
                          " entries (one per sample)");
  }
  for (int64_t i = 0; i < k; ++i) {
    if (!std::isfinite(a.data()[i])) {
      throw py::value_error(std::string(name) + "[" + std::to_string(i) +
                            "] is not finite: fix the cost model");
    }
  }
  return a.data();
}

py::tuple ints(const std::vector<Index>& v) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(v.size()));
  if (!out) throw py::error_already_set();
  for (size_t j = 0; j < v.size(); ++j) {
    PyObject* item = PyLong_FromLongLong(v[j]);
    if (!item) {
      Py_DECREF(out);
      throw py::error_already_set();
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(j), item);
  }
  return py::reinterpret_steal<py::tuple>(skrull_py::untracked(out));
}

// A tuple of ints from the C API (pybind11's make_tuple casts each item: ~5x slower, which
// counts for the thousands of grouped placements of a large plan).
py::tuple row(std::initializer_list<Index> v) {
  return ints(std::vector<Index>(v));
}

py::array_t<int64_t> int_array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// An instance of `cls` (scheduler.plan.MicroBatch) with these fields, as
// MicroBatch.trusted builds it (object.__new__, then its __dict__) without a Python call
// per micro-batch.
py::object micro_batch(const py::object& cls, py::tuple dist, py::tuple local, py::tuple grouped) {
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  py::object obj = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
  if (!obj) throw py::error_already_set();
  py::dict fields;
  fields["distributed"] = std::move(dist);
  fields["local"] = std::move(local);
  fields["grouped"] = std::move(grouped);
  if (PyObject_GenericSetDict(obj.ptr(), fields.ptr(), nullptr) != 0) throw py::error_already_set();
  return obj;
}

// The plan as MicroBatch fields and scheduler.plan.FlatPlan's arrays (flatten_placements'
// order: distributed, local rank by rank, grouped; each in placement order).
py::tuple plan_objects(const skrull::HybridPlan& plan, int dp_size, int cp_size,
                       const py::object& cls) {
  const size_t n = static_cast<size_t>(cp_size);
  std::vector<int64_t> dist_ids, dist_mb, local_ids, local_slot;
  py::list grouped_rows, ranks(static_cast<size_t>(dp_size));
  std::vector<std::vector<Index>> local(n);
  for (int d = 0; d < dp_size; ++d) {
    py::list mbs(static_cast<size_t>(plan.per_rank));
    for (int64_t j = 0; j < plan.per_rank; ++j) {
      const int64_t g = d * plan.per_rank + j;
      const auto& items = plan.items[static_cast<size_t>(g)];
      const auto& firsts = plan.firsts[static_cast<size_t>(g)];
      std::vector<Index> dist;
      std::vector<py::tuple> grouped;
      for (auto& r : local) r.clear();
      for (size_t q = 0; q < items.size(); ++q) {
        const Index i = items[q], first = firsts[q];
        const int64_t size = plan.sizes[static_cast<size_t>(i)];
        if (size == cp_size) {
          dist.push_back(i);
          dist_ids.push_back(i);
          dist_mb.push_back(g);
        } else if (size == 1) {
          local[static_cast<size_t>(first)].push_back(i);
        } else {
          grouped.push_back(row({i, first, size}));
          grouped_rows.append(row({g, i, first, size}));
        }
      }
      py::tuple local_t(n);
      for (size_t r = 0; r < n; ++r) {
        local_t[r] = ints(local[r]);
        for (Index i : local[r]) {
          local_ids.push_back(i);
          local_slot.push_back(g * cp_size + static_cast<int64_t>(r));
        }
      }
      py::tuple grouped_t(grouped.size());
      for (size_t q = 0; q < grouped.size(); ++q) grouped_t[q] = std::move(grouped[q]);
      skrull_py::untracked(local_t.ptr());  // tuples of int tuples (gc_pause.h)
      skrull_py::untracked(grouped_t.ptr());
      if (cls.is_none()) {
        py::tuple fields = py::make_tuple(ints(dist), local_t, grouped_t);
        mbs[static_cast<size_t>(j)] = py::reinterpret_borrow<py::object>(
            skrull_py::untracked(fields.ptr()));
      } else {
        mbs[static_cast<size_t>(j)] = micro_batch(cls, ints(dist), local_t, grouped_t);
      }
    }
    ranks[static_cast<size_t>(d)] = mbs;
  }
  py::array_t<double> times(static_cast<py::ssize_t>(plan.times.size()));
  std::copy(plan.times.begin(), plan.times.end(), times.mutable_data());
  const auto count = static_cast<int64_t>(plan.times.size());
  return py::make_tuple(ranks, py::make_tuple(count, int_array(dist_ids), int_array(dist_mb),
                                              int_array(local_ids), int_array(local_slot),
                                              grouped_rows, times, plan.valid));
}

// Every sample fits the bucket distributed (else one error naming the first that does not).
void check_fits(const I64Array& lengths, int cp_size, int64_t bucket_size) {
  for (int64_t i = 0; i < lengths.shape(0); ++i) {
    const int64_t s = lengths.data()[i];
    if (s < 1 || skrull::shard_tokens(s, cp_size) > bucket_size) {
      throw py::value_error("sample " + std::to_string(i) + " of length " + std::to_string(s) +
                            " does not fit the bucket distributed");
    }
  }
}

// The checks both candidates share (argument ranges, the class, every sample fitting the
// bucket distributed, finite per-sample seconds) and the batch they price.
skrull::Batch checked_batch(const I64Array& lengths, const F64Array& costs,
                            const F64Array& shares, const F64Array& comm, int dp_size,
                            int cp_size, int min_cp, int64_t bucket_size,
                            const py::object& objective, const py::object& micro_batch_cls) {
  if (lengths.ndim() != 1) throw py::value_error("lengths must be a 1-D array");
  const int64_t k = lengths.shape(0);
  if (dp_size < 1 || cp_size < min_cp || cp_size > (1 << 16) || bucket_size < 1 ||
      bucket_size > (int64_t{1} << 40)) {
    throw py::value_error("need dp_size >= 1, " + std::to_string(min_cp) +
                          " <= cp_size <= 65536, 1 <= bucket_size <= 2^40");
  }
  const skrull::Objective obj = skrull_py::to_objective(objective);
  if (!micro_batch_cls.is_none() && !PyType_Check(micro_batch_cls.ptr())) {
    throw py::type_error("micro_batch must be a class (scheduler.plan.MicroBatch) or None");
  }
  check_fits(lengths, cp_size, bucket_size);
  return skrull::Batch{lengths.data(), checked(costs, k, "costs"), checked(comm, k, "comm"), k,
                       checked(shares, k, "shares"), obj};
}

// (iteration seconds, None) unless the priced plan comes within `margin` of beating
// `limit`, else (iteration seconds, plan_objects).
py::tuple handed_over(const skrull::HybridPlan& plan, double fixed, double limit, double margin,
                      int dp_size, int cp_size, const py::object& micro_batch_cls) {
  double slowest = plan.rank_times.empty() ? 0.0 : plan.rank_times[0];
  for (double t : plan.rank_times) slowest = std::max(slowest, t);
  const double iteration = slowest + fixed;
  if (!(iteration < limit * (1.0 + margin))) return py::make_tuple(iteration, py::none());
  skrull_py::GcPause pause;  // a winning plan is many fresh tuples
  return py::make_tuple(iteration, plan_objects(plan, dp_size, cp_size, micro_batch_cls));
}

// (iteration seconds, None) when hybrid CP's plan is not within `margin` of beating
// `limit` (the caller then keeps its plan without building anything), else (iteration
// seconds, (micro-batch fields per DP rank, flat arrays)); Python re-checks exactly.
py::tuple hybrid_candidate(I64Array lengths, F64Array costs, F64Array shares, F64Array comm,
                           F64Array sub_share, F64Array sub_comm, F64Array sub_latency,
                           double latency, int dp_size, int cp_size, int64_t bucket_size,
                           double overhead, double fixed, py::object objective, double limit,
                           double margin, py::object micro_batch_cls) {
  const skrull::Batch batch = checked_batch(lengths, costs, shares, comm, dp_size, cp_size, 1,
                                            bucket_size, objective, micro_batch_cls);
  const int64_t k = batch.size;
  skrull::SubgroupPrices sub{checked(sub_share, k, "sub_share"), checked(sub_comm, k, "sub_comm"),
                             {}};
  sub.latency.assign(checked(sub_latency, cp_size + 1, "sub_latency"),
                     sub_latency.data() + cp_size + 1);
  skrull::HybridPlan plan;
  {
    py::gil_scoped_release release;
    plan = skrull::hybrid_candidate(batch, sub, latency, dp_size, cp_size, bucket_size,
                                    overhead);
  }
  return handed_over(plan, fixed, limit, margin, dp_size, cp_size, micro_batch_cls);
}

// (ours) Megatron's dynamic-CP plan (csrc/dyncp.cpp) priced like hybrid_candidate's; the
// seconds of every sample on every sub-group size g = 2, 4, .. < cp_size are the rows of
// sub_share / sub_comm ([sizes][K]), read at each sample's group size once it is known.
py::tuple dyncp_candidate(I64Array lengths, F64Array costs, F64Array shares, F64Array comm,
                          F64Array sub_share, F64Array sub_comm, F64Array sub_latency,
                          double latency, int dp_size, int cp_size, int64_t bucket_size,
                          double overhead, double fixed, py::object objective, double limit,
                          double margin, py::object micro_batch_cls) {
  const skrull::Batch batch = checked_batch(lengths, costs, shares, comm, dp_size, cp_size, 2,
                                            bucket_size, objective, micro_batch_cls);
  const int64_t k = batch.size;
  std::vector<int> sizes;
  for (int g = 2; g < cp_size; g *= 2) sizes.push_back(g);
  const int64_t rows = static_cast<int64_t>(sizes.size());
  if (sub_share.ndim() != 2 || sub_share.shape(0) != rows || sub_share.shape(1) != k ||
      sub_comm.ndim() != 2 || sub_comm.shape(0) != rows || sub_comm.shape(1) != k) {
    throw py::value_error("sub_share and sub_comm must be [" + std::to_string(rows) + ", " +
                          std::to_string(k) + "] (one row per sub-group size 2, 4, .. < cp_size)");
  }
  checked(sub_latency, cp_size + 1, "sub_latency");
  std::vector<double> share(static_cast<size_t>(k), 0.0), ring(share);
  skrull::HybridPlan plan;
  {
    py::gil_scoped_release release;
    plan = skrull::dynamic_cp_plan(lengths.data(), k, dp_size, cp_size, bucket_size);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t g = plan.sizes[static_cast<size_t>(i)];
      const auto row = std::find(sizes.begin(), sizes.end(), g) - sizes.begin();
      if (row < rows) {
        share[static_cast<size_t>(i)] = sub_share.data()[row * k + i];
        ring[static_cast<size_t>(i)] = sub_comm.data()[row * k + i];
      }
    }
    skrull::SubgroupPrices sub{share.data(), ring.data(), {}};
    sub.latency.assign(sub_latency.data(), sub_latency.data() + cp_size + 1);
    skrull::price_subgroup_plan(plan, batch, sub, latency, dp_size, cp_size, overhead);
    plan.valid = skrull::hybrid_valid(plan, batch, cp_size, bucket_size);
    skrull::deal_micro_batches(plan, dp_size);
  }
  return handed_over(plan, fixed, limit, margin, dp_size, cp_size, micro_batch_cls);
}

// dynamic_cp_world as Python lists of (first, size, ids) per round (for the parity tests).
py::list dyncp_world(I64Array lengths, int dp_size, int cp_size, int64_t bucket_size, int block) {
  if (lengths.ndim() != 1 || dp_size < 1 || cp_size < 1 || block < 1 ||
      (dp_size * cp_size) % block != 0 || bucket_size < 1) {
    throw py::value_error("need 1-D lengths, dp_size, cp_size, bucket_size >= 1 and a block "
                          "dividing dp_size * cp_size");
  }
  const auto rounds = skrull::dynamic_cp_world(lengths.data(), lengths.shape(0), dp_size,
                                               cp_size, bucket_size, block);
  py::list out;
  for (const auto& groups : rounds) {
    py::list mb;
    for (const auto& g : groups) mb.append(py::make_tuple(g.first, g.size, ints(g.ids)));
    out.append(mb);
  }
  return out;
}

}  // namespace

void bind_groupfill(py::module_& mod);  // groupfill.cpp

void bind_hybrid(py::module_& mod) {
  bind_groupfill(mod);
  mod.def("dyncp_world", &dyncp_world, py::arg("lengths"), py::arg("dp_size"),
          py::arg("cp_size"), py::arg("bucket_size"), py::arg("block"),
          "Megatron's dynamic-CP groups per round over D x N ranks in blocks of `block`: "
          "[[(first_rank, size, ids)]] (scheduler.megatron_packing.dynamic_cp_world).");
  mod.def("dyncp_candidate", &dyncp_candidate, py::arg("lengths"), py::arg("costs"),
          py::arg("shares"), py::arg("comm"), py::arg("sub_share"), py::arg("sub_comm"),
          py::arg("sub_latency"), py::arg("latency"), py::arg("dp_size"), py::arg("cp_size"),
          py::arg("bucket_size"), py::arg("overhead"), py::arg("fixed"), py::arg("objective"),
          py::arg("limit"), py::arg("margin") = 1e-9, py::arg("micro_batch") = py::none(),
          "(ours) Megatron's dynamic-CP plan (block = cp_size) priced with its CP sub-group "
          "rings; returns what hybrid_candidate returns.");
  mod.def("hybrid_candidate", &hybrid_candidate, py::arg("lengths"), py::arg("costs"),
          py::arg("shares"), py::arg("comm"), py::arg("sub_share"), py::arg("sub_comm"),
          py::arg("sub_latency"), py::arg("latency"), py::arg("dp_size"), py::arg("cp_size"),
          py::arg("bucket_size"), py::arg("overhead"), py::arg("fixed"), py::arg("objective"),
          py::arg("limit"), py::arg("margin") = 1e-9, py::arg("micro_batch") = py::none(),
          "(ours) Hybrid CP's plan priced with its CP sub-group rings: (iteration seconds, "
          "None) unless within `margin` of beating `limit`, else (iteration seconds, "
          "(per DP rank [(distributed, local, grouped)] or, given the class, [micro_batch], "
          "(count, dist_ids, dist_mb, "
          "local_ids, local_slot, grouped rows, micro_batch_seconds, valid))).");
}
