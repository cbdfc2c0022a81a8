// (ours) The portfolio's `pack` candidates: long samples packed distributed into few
// micro-batches, the rest whole on the least-loaded slot.  Mirrors _pack_rank /
// pack_schedule of skrull_ext/scheduler/pack.py (the specification); see scheduler.h.
#include <algorithm>
#include <functional>
#include <queue>
#include <utility>

#include "scheduler.h"
#include "slots.h"

namespace skrull {
namespace {

// Leftmost micro-batch whose free shard room is >= need, over a growing list (a max
// segment tree; same answer as the reference's scan from micro-batch 0).
class FirstFit {
 public:
  explicit FirstFit(size_t capacity) {
    while (size_ < capacity) size_ *= 2;
    tree_.assign(2 * size_, -1);
  }
  void set(size_t k, int64_t room) {
    size_t p = k + size_;
    tree_[p] = room;
    for (p /= 2; p >= 1; p /= 2) tree_[p] = std::max(tree_[2 * p], tree_[2 * p + 1]);
  }
  // -1 when none.
  int64_t find(int64_t need) const {
    if (tree_[1] < need) return -1;
    size_t p = 1;
    while (p < size_) p = tree_[2 * p] >= need ? 2 * p : 2 * p + 1;
    return static_cast<int64_t>(p - size_);
  }

 private:
  size_t size_ = 1;
  std::vector<int64_t> tree_;
};

std::vector<Index> sorted_by_length_desc(const Batch& b, std::vector<Index> ids) {
  const int64_t* len = b.lengths;
  std::sort(ids.begin(), ids.end(),
            [len](Index x, Index y) { return len[x] > len[y] || (len[x] == len[y] && x < y); });
  return ids;
}

// Step 2, `pack-spread`: each long sample on the micro-batch with room and the least
// distributed work (ties: the lowest), by a scan as the reference's; a new one when none.
// dist and used come with m0 empty micro-batches.
void spread_longs(const Batch& b, const std::vector<Index>& longs, int n, int64_t cap,
                  int64_t m0, std::vector<std::vector<Index>>& dist,
                  std::vector<int64_t>& used) {
  std::vector<double> work(static_cast<size_t>(m0), 0.0);
  for (Index i : longs) {
    const int64_t s = shard_tokens(b.lengths[i], n);
    size_t k = dist.size();
    for (size_t j = 0; j < dist.size(); ++j) {
      if (used[j] + s <= cap && (k == dist.size() || work[j] < work[k])) k = j;
    }
    if (k == dist.size()) {
      dist.emplace_back();
      used.push_back(0);
      work.push_back(0.0);
    }
    dist[k].push_back(i);
    used[k] += s;
    work[k] += b.share(i, n);
  }
}

// Step 2: the long samples first-fit decreasing; dist[k] and used[k] per micro-batch (m0
// empty ones given).
void pack_longs(const Batch& b, const std::vector<Index>& longs, int n, int64_t cap, int64_t m0,
                std::vector<std::vector<Index>>& dist, std::vector<int64_t>& used) {
  FirstFit fit(static_cast<size_t>(m0) + longs.size());
  for (int64_t k = 0; k < m0; ++k) fit.set(static_cast<size_t>(k), cap);
  for (Index i : longs) {
    const int64_t s = shard_tokens(b.lengths[i], n);
    int64_t k = fit.find(s);
    if (k < 0) {
      k = static_cast<int64_t>(dist.size());
      dist.emplace_back();
      used.push_back(0);
    }
    dist[k].push_back(i);
    used[k] += s;
    fit.set(static_cast<size_t>(k), cap - used[k]);
  }
}

// Steps 2-3 for one DP rank (reference _pack_rank).
RankSplit pack_rank(const Batch& b, const std::vector<Index>& seqs, int n, int64_t cap,
                    int64_t threshold, bool spread) {
  std::vector<Index> longs, shorts;
  int64_t need = 0;
  for (Index i : seqs) {
    if (b.lengths[i] > threshold) {
      longs.push_back(i);
      need += n * shard_tokens(b.lengths[i], n);
    } else {
      shorts.push_back(i);
      need += b.lengths[i];
    }
  }
  longs = sorted_by_length_desc(b, std::move(longs));
  shorts = sorted_by_length_desc(b, std::move(shorts));
  const int64_t m0 = std::max<int64_t>(1, (need + n * cap - 1) / (n * cap));
  // m0 empty micro-batches to start from; both steps may open more.
  std::vector<std::vector<Index>> dist(static_cast<size_t>(m0));
  std::vector<int64_t> used(static_cast<size_t>(m0), 0);
  if (spread) {
    spread_longs(b, longs, n, cap, m0, dist, used);
  } else {
    pack_longs(b, longs, n, cap, m0, dist, used);
  }
  // Slot k * n + r: CP rank r of micro-batch k (the reference's least load, then lowest
  // slot: SlotHeap).
  std::vector<int64_t> rem;
  std::vector<double> load;
  std::vector<std::vector<Index>> local;
  SlotHeap slots;
  auto add_micro_batch = [&](int64_t room) {
    for (int r = 0; r < n; ++r) {
      slots.add(static_cast<int64_t>(rem.size()));
      rem.push_back(room);
      load.push_back(0.0);
      local.emplace_back();
    }
  };
  for (int64_t u : used) add_micro_batch(cap - u);
  for (Index i : shorts) {
    const int64_t s = b.lengths[i];
    int64_t slot = slots.least(s, rem, load);
    if (slot < 0) {
      dist.emplace_back();
      add_micro_batch(cap);
      slot = slots.least(s, rem, load);
    }
    local[slot].push_back(i);
    rem[slot] -= s;
    load[slot] += b.costs[i];
    slots.update(slot, load[slot]);
  }
  RankSplit out;
  for (size_t k = 0; k < dist.size(); ++k) {
    Placement p;
    p.distributed = std::move(dist[k]);
    p.local.assign(local.begin() + k * n, local.begin() + (k + 1) * n);
    if (!p.empty()) out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

int64_t pack_threshold(int divisor, int64_t bucket_size) {
  return bucket_size - (divisor ? bucket_size / divisor : 0);
}

std::vector<RankSplit> pack_schedule(const Batch& batch, int dp_size, int cp_size,
                                     int64_t bucket_size, int64_t threshold, bool spread) {
  const int n = cp_size;
  threshold = n == 1 ? bucket_size : std::min(threshold, bucket_size);
  std::vector<double> work(static_cast<size_t>(batch.size));
  std::vector<Index> all(static_cast<size_t>(batch.size));
  for (Index i = 0; i < batch.size; ++i) {
    all[i] = i;
    work[i] = batch.lengths[i] <= threshold ? batch.costs[i] : n * batch.share(i, n);
  }
  std::vector<RankSplit> out;
  for (const auto& seqs : lpt_partition(work.data(), all, dp_size)) {
    out.push_back(pack_rank(batch, seqs, n, bucket_size, threshold, spread));
  }
  return out;
}

}  // namespace skrull
