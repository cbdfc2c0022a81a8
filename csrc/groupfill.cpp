// (ours) The group-fill candidate's greedy (skrull_ext/scheduler/groupfill.py, `fill`, is
// the spec): costliest sample first, each on the option (whole, an aligned g-rank sub-group
// or all N ranks) and position (DP rank, micro-batch, first rank) that keeps its DP rank's
// estimated time under a target, least rank-seconds first, else where that estimate ends
// lowest (best fit: grows least).  The same loop order, tie-breaks and float operations as
// the reference, so both backends build the same plan (tests/test_groupfill.py).  Bound as
// skrull_ext._C.groupfill (bind_groupfill, registered by hybrid_bindings.cpp's bind_hybrid).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

// The key the reference compares as a tuple: (over the target, rank-seconds of the
// option, the estimate or its growth); strictly less wins, so the first such position in
// scan order is kept.
struct Key {
  bool over;
  double work;
  double fit;
  bool operator<(const Key& o) const {
    if (over != o.over) return !over;
    if (work != o.work) return work < o.work;
    return fit < o.fit;
  }
};

struct Fill {
  int64_t d, m, n, c;
  std::vector<double> load;    // [d][m][n] per-CP-rank seconds
  std::vector<int64_t> used;   // [d][m][n] tokens
  std::vector<double> peak;    // [d][m] the micro-batch's largest rank seconds
  std::vector<double> total;   // [d] the DP rank's estimate
  Fill(int64_t d_, int64_t m_, int64_t n_, int64_t c_)
      : d(d_), m(m_), n(n_), c(c_), load(d_ * m_ * n_, 0.0), used(d_ * m_ * n_, 0),
        peak(d_ * m_, 0.0), total(d_, 0.0) {}

  void place(int64_t r, int64_t j, int64_t g, int64_t first, double p, int64_t t) {
    double* row = &load[(r * m + j) * n];
    int64_t* toks = &used[(r * m + j) * n];
    for (int64_t k = first; k < first + g; ++k) {
      row[k] += p;
      toks[k] += t;
    }
    double top = row[0];
    for (int64_t k = 1; k < n; ++k) top = std::max(top, row[k]);
    peak[r * m + j] = top;
    double acc = 0.0;
    for (int64_t x = 0; x < m; ++x) acc += peak[r * m + x];  // left to right, as the spec
    total[r] = acc;
  }
};

py::object groupfill(I64Array order, F64Array share, I64Array tokens, I64Array sizes,
                     int64_t d, int64_t m, int64_t n, int64_t c, double target, bool best_fit) {
  const int64_t k = order.size(), groups = sizes.size();
  if (share.ndim() != 2 || tokens.ndim() != 2 || share.shape(0) != groups ||
      tokens.shape(0) != groups || share.shape(1) != tokens.shape(1) || d < 1 || m < 1 ||
      n < 1) {
    throw py::value_error("groupfill: share and tokens must be [G, K] with G = len(sizes)");
  }
  const int64_t width = share.shape(1);
  const int64_t* ord = order.data();
  const double* sh = share.data();
  const int64_t* tk = tokens.data();
  const int64_t* gs = sizes.data();
  for (int64_t s = 0; s < k; ++s) {
    if (ord[s] < 0 || ord[s] >= width) throw py::value_error("groupfill: order out of range");
  }
  for (int64_t o = 0; o < groups; ++o) {
    if (gs[o] < 1 || gs[o] > n) throw py::value_error("groupfill: group size out of range");
  }
  Fill f(d, m, n, c);
  std::vector<int64_t> where(k * 5);
  for (int64_t s = 0; s < k; ++s) {
    const int64_t i = ord[s];
    bool found = false;
    Key key{false, 0.0, 0.0};
    int64_t pr = 0, pj = 0, po = 0, pf = 0;
    for (int64_t r = 0; r < d; ++r) {
      for (int64_t j = 0; j < m; ++j) {
        const double* row = &f.load[(r * m + j) * n];
        const int64_t* toks = &f.used[(r * m + j) * n];
        const double top = f.peak[r * m + j], tot = f.total[r];
        for (int64_t o = 0; o < groups; ++o) {
          const int64_t g = gs[o], t = tk[o * width + i];
          const double p = sh[o * width + i], w = static_cast<double>(g) * p;
          // Exact pruning: under the target already, a costlier option cannot win.
          if (found && !key.over && w > key.work) continue;
          for (int64_t first = 0; first + g <= n; first += g) {  // aligned, inside
            bool fits = true;
            double hi = row[first];
            for (int64_t q = first; q < first + g; ++q) {
              if (toks[q] + t > c) {
                fits = false;
                break;
              }
              hi = std::max(hi, row[q]);
            }
            if (!fits) continue;
            const double nw = tot - top + std::max(top, hi + p);
            const Key cand{nw > target, w, best_fit ? nw - tot : nw};
            if (!found || cand < key) {
              found = true;
              key = cand;
              pr = r, pj = j, po = o, pf = first;
            }
          }
        }
      }
    }
    if (!found) return py::none();
    f.place(pr, pj, gs[po], pf, sh[po * width + i], tk[po * width + i]);
    const int64_t row[5] = {i, pr, pj, gs[po], pf};
    std::copy(row, row + 5, &where[s * 5]);
  }
  double est = f.total[0];
  for (int64_t r = 1; r < d; ++r) est = std::max(est, f.total[r]);
  I64Array out({k, int64_t{5}});
  std::copy(where.begin(), where.end(), out.mutable_data());
  return py::make_tuple(est, out);
}

}  // namespace

void bind_groupfill(py::module_& mod) {
  mod.def("groupfill", &groupfill, py::arg("order"), py::arg("share"), py::arg("tokens"),
          py::arg("sizes"), py::arg("d"), py::arg("m"), py::arg("n"), py::arg("c"),
          py::arg("target"), py::arg("best_fit"),
          "(ours) The group-fill greedy (scheduler.groupfill.fill): (estimate, where [K, 5]) "
          "or None when a sample fits nowhere.");
}
