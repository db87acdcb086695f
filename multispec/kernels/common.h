// Scalar helpers shared by the CPU kernels, written as plain integer and float arithmetic so that
// -O3 -march=native vectorises the loops that call them (c10::BFloat16's own conversions stay
// scalar).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
// normal range ends (-inf included), as the exact exponential rounds there.
inline float exp_nonpositive(float x) {
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

}  // namespace multispec_kernels
