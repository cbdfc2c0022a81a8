// Shared by the pybind11 bindings (bindings.cpp, hybrid_bindings.cpp, costs.cpp): the
// objective argument every entry point takes.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "scheduler.h"

namespace skrull_py {

// A code (0 paper, 1 ring: the legacy composition of plain objective names) or
// objective.Objective.code()'s tuple (code, lam, beta, ell, step, fwd) with the cost
// model's ring terms (skrull_ext/scheduler/objective.py).
inline skrull::Objective to_objective(const pybind11::object& arg) {
  skrull::Objective obj;
  int code = 0;
  if (pybind11::isinstance<pybind11::tuple>(arg)) {
    const auto t = arg.cast<pybind11::tuple>();
    if (t.size() != 6) {
      throw pybind11::value_error("objective tuple must be (code, lam, beta, ell, step, fwd)");
    }
    code = t[0].cast<int>();
    obj.physical = true;
    obj.lam = t[1].cast<double>();
    obj.beta = t[2].cast<double>();
    obj.ell = t[3].cast<double>();
    obj.step = t[4].cast<double>();
    obj.fwd = t[5].cast<double>();
  } else {
    code = arg.cast<int>();
  }
  if (code < 0 || code > 1) {
    throw pybind11::value_error("objective code " + std::to_string(code) +
                                " is not one of 0 (paper), 1 (ring)");
  }
  obj.code = static_cast<skrull::ObjectiveCode>(code);
  return obj;
}

}  // namespace skrull_py
