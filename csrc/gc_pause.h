// Shared by the pybind11 bindings (bindings.cpp, hybrid_bindings.cpp); needs Python.h.
#pragma once

#include <Python.h>

namespace skrull_py {

// Pauses Python's cyclic GC while building a large result: the many fresh lists would
// otherwise trigger repeated full collections (half the conversion time for big plans).
class GcPause {
 public:
  GcPause() : was_enabled_(PyGC_Disable() == 1) {}
  ~GcPause() {
    if (was_enabled_) PyGC_Enable();
  }
  GcPause(const GcPause&) = delete;
  GcPause& operator=(const GcPause&) = delete;

 private:
  bool was_enabled_;
};

// Takes a freshly filled tuple of ints or of such tuples out of the cyclic GC: it can
// never be part of a cycle, and CPython untracks such tuples itself, but only when a
// collection first visits them.  Untracked at birth, a plan's tens of thousands of
// tuples cost no collection anything (~4 ms per plan at K = 65,536, bucket 2K; a
// MicroBatch's __dict__ then stays untracked too).  Returns `tuple`.
inline PyObject* untracked(PyObject* tuple) {
  PyObject_GC_UnTrack(tuple);  // a no-op on the untracked empty tuple
  return tuple;
}

}  // namespace skrull_py
