// The lower bound on any plan's predicted time (mirrors skrull_ext/scheduler/bound.py,
// local and fully distributed placements only: subgroups=False), and the flat plan's
// validation, both for schedule()'s C++ path so that it does no per-sample Python work.
#include <algorithm>
#include <functional>
#include <limits>

#include "scheduler.h"

namespace skrull {

double plan_lower_bound(const Batch& batch, double latency, int dp_size, int cp_size,
                        int64_t bucket_size, double overhead) {
  const int64_t k = batch.size;
  const int n = cp_size;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> work(static_cast<size_t>(k));
  double alone_max = -inf, work_sum = 0.0;
  int64_t tokens = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t s = batch.lengths[i];
    tokens += s;
    double w = inf, a = inf;
    if (s <= bucket_size) {  // g = 1: whole on one rank
      w = a = batch.costs[i];
    }
    if (n > 1 && shard_tokens(s, n) <= bucket_size) {  // g = N: distributed
      const double sh = batch.share(i, n);
      w = std::min(w, n * sh);
      a = std::min(a, rank_time(0.0, batch.comm[i] + latency, sh, n, batch.objective));
    }
    work[static_cast<size_t>(i)] = w;
    work_sum += w;
    alone_max = std::max(alone_max, a);
  }
  if (k == 0) return 0.0;
  const int64_t per = bucket_size * n;
  const int64_t min_mbs = std::max((tokens + per - 1) / per, std::min<int64_t>(k, dp_size));
  const double average = work_sum / (static_cast<double>(dp_size) * n) +
                         overhead * static_cast<double>(min_mbs) / dp_size;
  const double single = alone_max + overhead;
  // Of the j D + 1 samples with the most work one DP rank holds j + 1: the smallest j + 1.
  std::sort(work.begin(), work.end(), std::greater<double>());
  std::vector<double> prefix(static_cast<size_t>(k) + 1, 0.0);
  for (int64_t p = 0; p < k; ++p) prefix[p + 1] = prefix[p] + work[p] / n;
  double best_group = 0.0;
  for (int64_t j = 1; j <= (k - 1) / dp_size; ++j) {
    const int64_t top = j * dp_size + 1;
    best_group = std::max(best_group, prefix[top] - prefix[top - j - 1]);
  }
  return std::max({average, single, best_group + overhead});
}

bool plan_valid(const std::vector<RankSplit>& splits, const Batch& batch, int cp_size,
                int64_t bucket_size) {
  std::vector<char> seen(static_cast<size_t>(batch.size), 0);
  auto mark = [&](Index i) {
    if (i < 0 || i >= batch.size || seen[i]) return false;
    seen[i] = 1;
    return true;
  };
  for (const auto& split : splits) {
    for (const auto& p : split) {
      if (static_cast<int>(p.local.size()) != cp_size) return false;
      int64_t dist = 0;
      for (Index i : p.distributed) {
        if (!mark(i)) return false;
        dist += shard_tokens(batch.lengths[i], cp_size);
      }
      for (const auto& rank : p.local) {
        int64_t t = dist;
        for (Index i : rank) {
          if (!mark(i)) return false;
          t += batch.lengths[i];
        }
        if (t > bucket_size) return false;
      }
    }
  }
  return std::all_of(seen.begin(), seen.end(), [](char c) { return c != 0; });
}

}  // namespace skrull
