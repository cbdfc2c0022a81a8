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

#include "objective_arg.h"

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

// The greedy's inputs (groupfill.fill's arguments): [G, K] row-major tables.
struct Args {
  const int64_t* order;
  const double* share;
  const int64_t* tokens;
  const int64_t* sizes;
  int64_t k, groups, width, d, m, n, c;
  double target;
  bool best_fit;
};

// The additive estimate (groupfill._Additive): a rank's seconds in a micro-batch are the
// sum of its samples' seconds alone.
struct Additive {
  const Args& a;
  std::vector<double> load;  // [d][m][n] per-CP-rank seconds
  std::vector<double> peak;  // [d][m] the micro-batch's largest rank seconds
  std::vector<double> total; // [d] the DP rank's estimate
  explicit Additive(const Args& a_)
      : a(a_), load(a_.d * a_.m * a_.n, 0.0), peak(a_.d * a_.m, 0.0), total(a_.d, 0.0) {}

  const double* row(int64_t rj) const { return &load[rj * a.n]; }
  void begin(int64_t, int64_t) {}
  // The micro-batch's new peak with sample i at (option o, first rank), `hi` the largest
  // rank seconds it covers (row()).
  double peak_at(int64_t rj, int64_t o, int64_t, int64_t, int64_t i, double hi) {
    return std::max(peak[rj], hi + a.share[o * a.width + i]);
  }
  void place(int64_t rj, int64_t o, int64_t first, int64_t, int64_t i) {
    const int64_t g = a.sizes[o];
    double* r = &load[rj * a.n];
    for (int64_t k = first; k < first + g; ++k) r[k] += a.share[o * a.width + i];
    double top = r[0];
    for (int64_t k = 1; k < a.n; ++k) top = std::max(top, r[k]);
    peak[rj] = top;
  }
};

// The overlap estimate (groupfill._Overlap): per CP rank the full ring's rank_time at the
// rank's local seconds, plus each sub-group ring over it priced as one ring of all its
// samples (rank_time with no local work, the latency once).
struct Overlap {
  const Args& a;
  const double* comm;  // [G, K]
  const double* dist;  // [G, K]
  const double* lat;   // [G]
  skrull::Objective obj;
  int64_t positions;
  std::vector<double> x, sub, time;  // [d][m][n]
  std::vector<double> fc, fd, peak;  // [d][m]
  std::vector<char> has;             // [d][m]
  std::vector<double> rc, rs, rt;    // [d][m][P]
  std::vector<double> total;         // [d]
  std::vector<skrull::RankTimeOf> part;  // [d][m] the full ring's part as it stands
  double full_new = 0.0;             // the full ring's new peak at the scanned micro-batch
  Overlap(const Args& a_, const double* comm_, const double* dist_, const double* lat_,
          skrull::Objective obj_, int64_t positions_)
      : a(a_), comm(comm_), dist(dist_), lat(lat_), obj(obj_), positions(positions_),
        x(a_.d * a_.m * a_.n, 0.0), sub(x), time(x), fc(a_.d * a_.m, 0.0), fd(fc), peak(fc),
        has(a_.d * a_.m, 0), rc(a_.d * a_.m * positions_, 0.0), rs(rc), rt(rc),
        total(a_.d, 0.0),
        part(a_.d * a_.m, skrull::RankTimeOf(0.0, 0.0, static_cast<int>(a_.n), obj_)) {}

  double tc(int64_t rj) const { return has[rj] ? fc[rj] + lat[a.groups - 1] : 0.0; }
  const double* row(int64_t rj) const { return &time[rj * a.n]; }
  // Sample i's full ring at micro-batch rj: every rank changes, so its new peak is the
  // largest new rank time (the reference's max over the ranks).
  void begin(int64_t rj, int64_t i) {
    const int64_t o = a.groups - 1, w = o * a.width + i;
    const skrull::RankTimeOf full(fc[rj] + comm[w] + lat[o], fd[rj] + dist[w],
                                  static_cast<int>(a.n), obj);
    const double* xs = &x[rj * a.n];
    const double* ss = &sub[rj * a.n];
    double top = full.at(xs[0]) + ss[0];
    for (int64_t k = 1; k < a.n; ++k) top = std::max(top, full.at(xs[k]) + ss[k]);
    full_new = top;
  }
  double peak_at(int64_t rj, int64_t o, int64_t first, int64_t q, int64_t i, double hi) {
    const int64_t g = a.sizes[o], w = o * a.width + i;
    if (g == a.n) return full_new;
    if (g == 1) {
      const int64_t at = rj * a.n + first;
      return std::max(peak[rj], part[rj].at(x[at] + a.share[i]) + sub[at]);
    }
    const int64_t at = rj * positions + q;
    const double ring = skrull::rank_time(0.0, rc[at] + comm[w] + lat[o], rs[at] + dist[w],
                                          static_cast<int>(g), obj);
    return std::max(peak[rj], hi + (ring - rt[at]));
  }
  void place(int64_t rj, int64_t o, int64_t first, int64_t q, int64_t i) {
    const int64_t g = a.sizes[o], w = o * a.width + i;
    if (g == 1) {
      x[rj * a.n + first] += a.share[i];
    } else if (g == a.n) {
      fc[rj] += comm[w];
      fd[rj] += dist[w];
      has[rj] = 1;
    } else {
      const int64_t at = rj * positions + q;
      rc[at] += comm[w];
      rs[at] += dist[w];
      const double ring = skrull::rank_time(0.0, rc[at] + lat[o], rs[at], static_cast<int>(g), obj);
      for (int64_t k = first; k < first + g; ++k) sub[rj * a.n + k] += ring - rt[at];
      rt[at] = ring;
    }
    part[rj] = skrull::RankTimeOf(tc(rj), fd[rj], static_cast<int>(a.n), obj);
    double top = 0.0;
    for (int64_t k = 0; k < a.n; ++k) {
      time[rj * a.n + k] = part[rj].at(x[rj * a.n + k]) + sub[rj * a.n + k];
      top = k == 0 ? time[rj * a.n] : std::max(top, time[rj * a.n + k]);
    }
    peak[rj] = top;
  }
};

// The greedy over estimate S (Additive or Overlap): (estimate, where [K, 5]) or None.
template <class S>
py::object run(const Args& a, S& s, double overhead) {
  std::vector<int64_t> used(a.d * a.m * a.n, 0), where(a.k * 5);
  std::vector<int64_t> base(a.groups, 0);  // the first position index of each option
  for (int64_t o = 1; o < a.groups; ++o) base[o] = base[o - 1] + a.n / a.sizes[o - 1];
  for (int64_t step = 0; step < a.k; ++step) {
    const int64_t i = a.order[step];
    bool found = false;
    Key key{false, 0.0, 0.0};
    int64_t pr = 0, pj = 0, po = 0, pf = 0;
    for (int64_t r = 0; r < a.d; ++r) {
      for (int64_t j = 0; j < a.m; ++j) {
        const int64_t rj = r * a.m + j;
        const double* row = s.row(rj);
        const int64_t* toks = &used[rj * a.n];
        const double top = s.peak[rj], tot = s.total[r];
        bool began = false;
        for (int64_t o = 0; o < a.groups; ++o) {
          const int64_t g = a.sizes[o], t = a.tokens[o * a.width + i];
          const double w = static_cast<double>(g) * a.share[o * a.width + i];
          // Exact pruning: under the target already, a costlier option cannot win.
          if (found && !key.over && w > key.work) continue;
          for (int64_t first = 0; first + g <= a.n; first += g) {  // aligned, inside
            bool fits = true;
            double hi = row[first];
            for (int64_t q = first; q < first + g; ++q) {
              if (toks[q] + t > a.c) {
                fits = false;
                break;
              }
              hi = std::max(hi, row[q]);
            }
            if (!fits) continue;
            if (g == a.n && !began) {
              s.begin(rj, i);
              began = true;
            }
            const double nw = tot - top + s.peak_at(rj, o, first, base[o] + first / g, i, hi);
            const Key cand{nw > a.target, w, a.best_fit ? nw - tot : nw};
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
    const int64_t g = a.sizes[po];
    int64_t* toks = &used[(pr * a.m + pj) * a.n];
    for (int64_t q = pf; q < pf + g; ++q) toks[q] += a.tokens[po * a.width + i];
    s.place(pr * a.m + pj, po, pf, base[po] + pf / g, i);
    double acc = 0.0;
    for (int64_t x = 0; x < a.m; ++x) acc += s.peak[pr * a.m + x];  // left to right, as the spec
    s.total[pr] = acc;
    const int64_t out[5] = {i, pr, pj, g, pf};
    std::copy(out, out + 5, &where[step * 5]);
  }
  // Each non-empty micro-batch adds `overhead` to its DP rank's returned estimate.
  std::vector<char> busy(a.d * a.m, 0);
  for (int64_t step = 0; step < a.k; ++step) {
    busy[where[step * 5 + 1] * a.m + where[step * 5 + 2]] = 1;
  }
  double est = 0.0;
  for (int64_t r = 0; r < a.d; ++r) {
    double count = 0.0;
    for (int64_t j = 0; j < a.m; ++j) count += busy[r * a.m + j] ? 1.0 : 0.0;
    const double t = s.total[r] + overhead * count;
    est = r == 0 ? t : std::max(est, t);
  }
  I64Array out({a.k, int64_t{5}});
  std::copy(where.begin(), where.end(), out.mutable_data());
  return py::make_tuple(est, out);
}

py::object groupfill(I64Array order, F64Array share, I64Array tokens, I64Array sizes,
                     int64_t d, int64_t m, int64_t n, int64_t c, double target, bool best_fit,
                     py::object overlap, double overhead) {
  const int64_t k = order.size(), groups = sizes.size();
  if (share.ndim() != 2 || tokens.ndim() != 2 || share.shape(0) != groups ||
      tokens.shape(0) != groups || share.shape(1) != tokens.shape(1) || d < 1 || m < 1 ||
      n < 1 || groups < 1) {
    throw py::value_error("groupfill: share and tokens must be [G, K] with G = len(sizes)");
  }
  const Args a{order.data(), share.data(), tokens.data(), sizes.data(), k, groups,
               share.shape(1), d, m, n, c, target, best_fit};
  for (int64_t s = 0; s < k; ++s) {
    if (a.order[s] < 0 || a.order[s] >= a.width) {
      throw py::value_error("groupfill: order out of range");
    }
  }
  for (int64_t o = 0; o < groups; ++o) {
    if (a.sizes[o] < 1 || a.sizes[o] > n || (o > 0 && a.sizes[o] <= a.sizes[o - 1])) {
      throw py::value_error("groupfill: group sizes must ascend within 1..n");
    }
  }
  if (overlap.is_none()) {
    Additive s(a);
    return run(a, s, overhead);
  }
  if (a.sizes[groups - 1] != n) throw py::value_error("groupfill: overlap needs the last size n");
  const auto t = overlap.cast<py::tuple>();
  if (t.size() != 4) throw py::value_error("groupfill: overlap is (comm, dist, lat, objective)");
  const F64Array comm = t[0].cast<F64Array>(), dist = t[1].cast<F64Array>(),
                 lat = t[2].cast<F64Array>();
  if (comm.ndim() != 2 || dist.ndim() != 2 || comm.shape(0) != groups ||
      dist.shape(0) != groups || comm.shape(1) != a.width || dist.shape(1) != a.width ||
      lat.size() != groups) {
    throw py::value_error("groupfill: overlap's comm and dist must be [G, K], lat [G]");
  }
  int64_t positions = 0;
  for (int64_t o = 0; o < groups; ++o) positions += n / a.sizes[o];
  Overlap s(a, comm.data(), dist.data(), lat.data(), skrull_py::to_objective(t[3]), positions);
  return run(a, s, overhead);
}

}  // namespace

void bind_groupfill(py::module_& mod) {
  mod.def("groupfill", &groupfill, py::arg("order"), py::arg("share"), py::arg("tokens"),
          py::arg("sizes"), py::arg("d"), py::arg("m"), py::arg("n"), py::arg("c"),
          py::arg("target"), py::arg("best_fit"), py::arg("overlap") = py::none(),
          py::arg("overhead") = 0.0,
          "(ours) The group-fill greedy (scheduler.groupfill.fill): (estimate, where [K, 5]) "
          "or None when a sample fits nowhere; overlap = (comm, dist, lat, objective) composes "
          "each rank's time as the cost model does.");
}
