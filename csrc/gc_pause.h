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

}  // namespace skrull_py
