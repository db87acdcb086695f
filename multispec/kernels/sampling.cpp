// The target distribution of a decode step's rows from their logits, for the CPU, in one pass
// over each row: p = softmax(logits / temperature) in float32, and the log-normaliser of the raw
// logits (logsumexp), from which the log-probability of any token is logits[token] - lse.
//
// The Python path runs four full passes over a [rows, vocabulary] matrix for this (conversion to
// float32, the division by the temperature, the softmax, and a log-softmax for the log-probabilities
// of the appended tokens); at 128 rows of a 49k vocabulary they cost about a fifth of a step. Here
// each row is read three times while it sits in the core's cache, in parallel over rows.
// Temperatures <= 0 (greedy rows) become one-hot at the row's first maximum (torch's argmax), whose
// index is returned too (-1 for the other rows): the Python path builds that from an argmax over the
// row, a one-hot int64 matrix and two copies, about 4 ms for the 32 rows of a verification of 8
// samples here, and the greedy walk then took the argmax of the one-hot rows again.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using multispec_kernels::exp_nonpositive;
using multispec_kernels::widen;

template <typename scalar_t>
void rows_softmax(const at::Tensor& logits, const float* temperature, at::Tensor& probs, at::Tensor& lse,
                  at::Tensor& top_index) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const scalar_t* lp = logits.data_ptr<scalar_t>();
  float* pp = probs.data_ptr<float>();
  float* ep = lse.data_ptr<float>();
  int64_t* tp = top_index.data_ptr<int64_t>();
  multispec_kernels::balanced_for(rows, [&](int64_t part, multispec_kernels::Shares& shares) {
    std::vector<float> row(vocab);
    float* x = row.data();
    for (int64_t r; (r = shares.next(part)) >= 0;) {
      const scalar_t* in = lp + r * vocab;
      // The maximum as a vector reduction: a scalar max chain waits on each compare (about 65 us
      // a row of 49k); max rounds nothing, so any order gives the same value.
      float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
      for (int64_t i = 0; i < vocab; ++i) {
        x[i] = widen(in[i]);
        top = x[i] > top ? x[i] : top;
      }
      float* out = pp + r * vocab;
      float raw = 0.0f, scaled = 0.0f;
      if (!(temperature[r] > 0.0f)) {
#pragma omp simd reduction(+ : raw)
        for (int64_t i = 0; i < vocab; ++i) raw += exp_nonpositive(x[i] - top);
        std::memset(out, 0, vocab * sizeof(float));
        int64_t first = 0;
        while (first < vocab - 1 && !(x[first] == top)) ++first;
        out[first] = 1.0f;
        ep[r] = top + std::log(raw);
        tp[r] = first;
        continue;
      }
      tp[r] = -1;
      const float t = temperature[r];
      if (t == 1.0f) {
#pragma omp simd reduction(+ : raw)
        for (int64_t i = 0; i < vocab; ++i) {
          const float e = exp_nonpositive(x[i] - top);
          out[i] = e;
          raw += e;
        }
        scaled = raw;
      } else {
        const float inv = 1.0f / t;
#pragma omp simd reduction(+ : raw, scaled)
        for (int64_t i = 0; i < vocab; ++i) {
          const float d = x[i] - top;
          raw += exp_nonpositive(d);
          const float e = exp_nonpositive(d * inv);
          out[i] = e;
          scaled += e;
        }
      }
      const float norm = 1.0f / scaled;
#pragma omp simd
      for (int64_t i = 0; i < vocab; ++i) out[i] *= norm;
      ep[r] = top + std::log(raw);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_rows(const at::Tensor& logits, const at::Tensor& temperature) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be a contiguous CPU [rows, vocabulary]");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.dim() == 1 &&
                  temperature.size(0) == logits.size(0) && temperature.is_contiguous(),
              "temperature must be a contiguous float32 vector with one entry per row");
  auto probs = at::empty({logits.size(0), logits.size(1)}, logits.options().dtype(at::kFloat));
  auto lse = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  auto top = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  const float* t = temperature.data_ptr<float>();
  switch (logits.scalar_type()) {
    case at::kFloat:
      rows_softmax<float>(logits, t, probs, lse, top);
      break;
    case at::kBFloat16:
      rows_softmax<c10::BFloat16>(logits, t, probs, lse, top);
      break;
    default:
      TORCH_CHECK(false, "softmax_rows takes float32 or bfloat16 logits");
  }
  return {probs, lse, top};
}

// One index per uniform from rows of non-negative weights, by the two-level inverse-CDF search of
// multispec.verify.sampling.sample_rows (which calls this on a CPU): float32 sums of blocks of
// BLOCK entries, their running total in float64 to find the block where u * total falls, then a
// float64 running sum inside that block. The Python path runs about fifteen small operators for it;
// here each row is one task. weights [R, V] with R = 1 (shared by every uniform) or R = N; u [N]
// float64 in [0, 1). Returns the indices [N] and whether each row's weights summed to zero [N]
// (its index is then meaningless: the caller draws that row from its fallback).
constexpr int64_t BLOCK = 64;

std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& weights, const at::Tensor& u) {
  TORCH_CHECK(weights.device().is_cpu() && weights.dim() == 2 && weights.is_contiguous() &&
                  weights.scalar_type() == at::kFloat && weights.size(1) > 0,
              "weights must be a contiguous float32 CPU [rows, vocabulary]");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.dim() == 1 && u.is_contiguous(),
              "u must be a contiguous float64 vector");
  const int64_t n = u.size(0), vocab = weights.size(1), shared = weights.size(0) == 1;
  TORCH_CHECK(shared || weights.size(0) == n, "weights has ", weights.size(0), " rows for ", n, " uniforms");
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  auto index = at::empty({n}, weights.options().dtype(at::kLong));
  auto empty = at::empty({n}, weights.options().dtype(at::kBool));
  const float* wp = weights.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* ip = index.data_ptr<int64_t>();
  bool* ep = empty.data_ptr<bool>();
  // A shared row's running totals are computed once.
  std::vector<double> shared_cumulative;
  auto cumulate = [&](const float* w, double* cumulative) {
    double running = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t size = std::min(BLOCK, vocab - b * BLOCK);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < size; ++i) sum += w[b * BLOCK + i];
      running += static_cast<double>(sum);
      cumulative[b] = running;
    }
  };
  if (shared) {
    shared_cumulative.resize(blocks);
    cumulate(wp, shared_cumulative.data());
  }
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    std::vector<double> own(shared ? 0 : blocks);
    for (int64_t r = begin; r < end; ++r) {
      const float* w = wp + (shared ? 0 : r * vocab);
      const double* cumulative = shared ? shared_cumulative.data() : own.data();
      if (!shared) cumulate(w, own.data());
      const double total = cumulative[blocks - 1];
      ep[r] = !(total > 0.0);
      if (ep[r]) {
        ip[r] = 0;
        continue;
      }
      const double target = up[r] * total;
      // The first block whose running total exceeds the target (an empty block never does).
      int64_t block = std::upper_bound(cumulative, cumulative + blocks, target) - cumulative;
      int64_t chosen = -1;
      if (block < blocks) {
        const double before = block > 0 ? cumulative[block - 1] : 0.0;
        const double want = target - before;
        const int64_t size = std::min(BLOCK, vocab - block * BLOCK);
        double running = 0.0;
        for (int64_t i = 0; i < size; ++i) {
          running += static_cast<double>(w[block * BLOCK + i]);
          if (running > want) {
            chosen = block * BLOCK + i;
            break;
          }
        }
      } else {
        block = blocks - 1;  // u * total rounded up to the total
      }
      // The block's own running sum fell short of its float32 sum by rounding, or the target was at
      // the total: the last entry of positive weight at or before the block.
      for (int64_t i = std::min(vocab, (block + 1) * BLOCK) - 1; chosen < 0 && i >= 0; --i)
        if (w[i] > 0.0f) chosen = i;
      ip[r] = chosen;
    }
  });
  return {index, empty};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multispec, m) {
  m.def("softmax_rows(Tensor logits, Tensor temperature) -> (Tensor probs, Tensor lse, Tensor top)");
  m.def("sample_rows(Tensor weights, Tensor u) -> (Tensor index, Tensor empty)");
}

TORCH_LIBRARY_IMPL(multispec, CPU, m) {
  m.impl("softmax_rows", &softmax_rows);
  m.impl("sample_rows", &sample_rows);
}
