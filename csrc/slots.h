// (ours) The least-loaded slot with room, for the portfolio's candidates that place samples
// whole on (micro-batch, CP rank) slots, longest first (pack.cpp, level.cpp): the same
// choice as the references' scans (least load, then lowest slot).
#pragma once

#include <cstdint>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

namespace skrull {

// Slots with room for the current sample wait in `open` keyed (load, slot), the others in
// `aside` (largest room first) until the samples, which only shrink, fit them again.
class SlotHeap {
 public:
  void add(int64_t slot, double load = 0.0) { open_.emplace(load, slot); }
  // The least-loaded slot with room for s tokens, -1 when none.
  int64_t least(int64_t s, const std::vector<int64_t>& rem, const std::vector<double>& load) {
    while (!aside_.empty() && aside_.top().first >= s) {
      open_.emplace(load[aside_.top().second], aside_.top().second);
      aside_.pop();
    }
    while (!open_.empty() && rem[open_.top().second] < s) {
      aside_.emplace(rem[open_.top().second], open_.top().second);
      open_.pop();
    }
    return open_.empty() ? -1 : open_.top().second;
  }
  // After a sample joined least()'s slot: re-key it with its new load.
  void update(int64_t slot, double load) {
    open_.pop();
    open_.emplace(load, slot);
  }

 private:
  using Open = std::pair<double, int64_t>;
  std::priority_queue<Open, std::vector<Open>, std::greater<Open>> open_;
  std::priority_queue<std::pair<int64_t, int64_t>> aside_;
};

}  // namespace skrull
