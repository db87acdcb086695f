// The work split the kernels' parallel loops share (``multispec_kernels::balanced_for``, common.h),
// exposed for its tests: which thread's part took each item when one part runs slow.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <tuple>

namespace {

// Items 0 .. n-1 through balanced_for; every item part 0 takes first spins ``slow_us``
// microseconds (a slow core). Returns how often each item was taken [n] and the part that took it
// last [n].
std::tuple<at::Tensor, at::Tensor> balanced_parts(int64_t n, int64_t slow_us) {
  TORCH_CHECK(n >= 0 && n < (int64_t{1} << 31), "n must be in [0, 2^31)");
  auto taken = at::zeros({n}, at::kLong);
  auto part_of = at::full({n}, -1, at::kLong);
  std::unique_ptr<std::atomic<int64_t>[]> counts(new std::atomic<int64_t>[n]);
  for (int64_t i = 0; i < n; ++i) counts[i].store(0, std::memory_order_relaxed);
  int64_t* parts = part_of.data_ptr<int64_t>();
  multispec_kernels::balanced_for(n, [&](int64_t part, multispec_kernels::Shares& shares) {
    for (int64_t item; (item = shares.next(part)) >= 0;) {
      counts[item].fetch_add(1, std::memory_order_relaxed);
      parts[item] = part;
      if (part == 0 && slow_us > 0) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(slow_us);
        while (std::chrono::steady_clock::now() < until) {
        }
      }
    }
  });
  int64_t* tp = taken.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) tp[i] = counts[i].load(std::memory_order_relaxed);
  return {taken, part_of};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multispec, m) {
  m.def("balanced_parts(int n, int slow_us) -> (Tensor taken, Tensor part)", &balanced_parts);
}
