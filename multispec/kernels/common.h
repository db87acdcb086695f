// Scalar helpers shared by the CPU kernels, written as plain integer and float arithmetic so that
// -O3 -march=native vectorises the loops that call them (c10::BFloat16's own conversions stay
// scalar).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

namespace multispec_kernels {

// bf16 -> float: the bits shifted into the upper half.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint16_t raw;
  std::memcpy(&raw, &x, sizeof(raw));
  const uint32_t bits = static_cast<uint32_t>(raw) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// float -> bf16 bits, rounding to nearest even as torch does (NaN stays NaN).
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

template <typename scalar_t>
inline scalar_t narrow_to(float x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else {
    const uint16_t raw = bf16_bits(x);
    scalar_t out;
    std::memcpy(&out, &raw, sizeof(out));
    return out;
  }
}

// The value a float takes once stored in scalar_t.
template <typename scalar_t>
inline float rounded(float x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else {
    const uint32_t bits = static_cast<uint32_t>(bf16_bits(x)) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
}

// exp(x) for x <= 0: 2^(x log2 e) split into an integer power, set in the exponent bits, and a
// degree-6 polynomial on [-0.5, 0.5] (relative error below 2e-7); 0 below -87, where float32's
// normal range ends (-inf included), as the exact exponential rounds there. Always inlined: a call
// left in a loop stops the loop from being vectorised (a sum over a row then runs one float at a
// time, in another order).
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const bool vanishes = x < -87.0f;
  x = std::max(x, -87.0f);
  const float y = x * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = (y - n) * 0.693147180559945309f;
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return vanishes ? 0.0f : p * scale;
}

// round(silu(gate)) * up, not yet rounded itself: silu(x) = x * sigmoid(x), the sigmoid from
// exp(-|x|) so that the exponent is never positive. The layer stack's activation and the fused
// gate/up product's (stream_gemm.cpp) both call this, so the two agree bit for bit.
template <typename scalar_t>
inline float silu_times(float gate, float up) {
  const float e = exp_nonpositive(-std::fabs(gate));
  const float sigmoid = (gate >= 0.0f ? 1.0f : e) / (1.0f + e);
  return rounded<scalar_t>(gate * sigmoid) * up;
}

// Items 0 .. n-1 shared among the intra-op threads so that none waits long for another: each
// thread starts on its own contiguous share, in order, and one that runs out takes the last item of
// the share with the most left, one at a time, until nothing is left. With fixed halves, one of the
// two cores of a Zen 4 waited for the other at the end of every product (14-17 us a call at 16
// samples in flight, 68 at 128) and of every attention layer (12-17 us, 181 at 128): the cores do not
// run at the same speed. Here those waits are 4-5 us at 16 and 10-20 at 128; a step of 128 samples
// ran 1.07-1.12x faster between processes, 1.015x switching within one (a core left alone reads
// memory faster, so a wait costs less than its length). What an item computes does not depend on
// which thread takes it.
class Shares {
 public:
  Shares(int64_t n, int64_t parts) : parts_(std::max<int64_t>(1, std::min(parts, n))), slots_(new Slot[parts_]) {
    for (int64_t p = 0; p < parts_; ++p)
      slots_[p].range.store(pack(n * p / parts_, n * (p + 1) / parts_), std::memory_order_relaxed);
  }
  int64_t parts() const { return parts_; }
  // The next item for ``part``: from the front of its own share, else from the back of the fullest
  // other share; -1 when every item is taken.
  int64_t next(int64_t part) {
    std::atomic<uint64_t>& own = slots_[part].range;
    uint64_t r = own.load(std::memory_order_relaxed);
    while (low(r) < high(r))
      if (own.compare_exchange_weak(r, pack(low(r) + 1, high(r)), std::memory_order_relaxed)) return low(r);
    while (true) {
      int64_t victim = -1, most = 0;
      for (int64_t p = 0; p < parts_; ++p) {
        const uint64_t v = slots_[p].range.load(std::memory_order_relaxed);
        if (high(v) - low(v) > most) most = high(v) - low(v), victim = p;
      }
      if (victim < 0) return -1;
      std::atomic<uint64_t>& other = slots_[victim].range;
      uint64_t v = other.load(std::memory_order_relaxed);
      while (low(v) < high(v))
        if (other.compare_exchange_weak(v, pack(low(v), high(v) - 1), std::memory_order_relaxed)) return high(v) - 1;
    }
  }

 private:
  struct alignas(64) Slot {
    std::atomic<uint64_t> range{0};
  };
  static uint64_t pack(int64_t lo, int64_t hi) { return static_cast<uint64_t>(lo) | static_cast<uint64_t>(hi) << 32; }
  static int64_t low(uint64_t r) { return static_cast<int64_t>(r & 0xFFFFFFFFu); }
  static int64_t high(uint64_t r) { return static_cast<int64_t>(r >> 32); }
  int64_t parts_;
  std::unique_ptr<Slot[]> slots_;
};

// body(part, shares) on every thread, each draining ``shares.next(part)``; items 0 .. n-1 (n < 2^31).
template <typename Body>
void balanced_for(int64_t n, const Body& body) {
  if (n <= 0) return;
  TORCH_CHECK(n < (int64_t{1} << 31), "balanced_for takes fewer than 2^31 items");
  Shares shares(n, at::get_num_threads());
  at::parallel_for(0, shares.parts(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) body(part, shares);
  });
}

}  // namespace multispec_kernels
