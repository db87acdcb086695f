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
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using multispec_kernels::exp_nonpositive;
using multispec_kernels::widen;

// One row's softmax: p = softmax(in / t) into out (one-hot at the first maximum where t <= 0), the
// log-normaliser of the raw logits into lse and the one-hot index (-1 for t > 0) into top; x is
// the row widened to float32 (vocab floats of scratch). Not inlined: softmax_rows and softmax_draw
// run this same code, so their probabilities agree bit for bit.
template <typename scalar_t>
__attribute__((noinline)) void softmax_row(const scalar_t* in, int64_t vocab, float t, float* x, float* out,
                                           float& lse, int64_t& top_index) {
  // The maximum as a vector reduction: a scalar max chain waits on each compare (about 65 us
  // a row of 49k); max rounds nothing, so any order gives the same value.
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < vocab; ++i) {
    x[i] = widen(in[i]);
    top = x[i] > top ? x[i] : top;
  }
  float raw = 0.0f, scaled = 0.0f;
  if (!(t > 0.0f)) {
#pragma omp simd reduction(+ : raw)
    for (int64_t i = 0; i < vocab; ++i) raw += exp_nonpositive(x[i] - top);
    std::memset(out, 0, vocab * sizeof(float));
    int64_t first = 0;
    while (first < vocab - 1 && !(x[first] == top)) ++first;
    out[first] = 1.0f;
    lse = top + std::log(raw);
    top_index = first;
    return;
  }
  top_index = -1;
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
  lse = top + std::log(raw);
}

// Truncated laws (top-k, top-p, min-p), each row in a few passes over its vocabulary: torch's
// path sorts every such row (about 2 ms a row of 49k here, 138 ms for a step of 64 rows with top-p).
// Here top-k's threshold comes from a running list of the k largest (``top_row``, below) for the
// usual small k, else from a histogram of the values' leading bits and a selection inside the bin
// where it lies; top-p's from the few tokens within 2^-8 (then 2^-16, 2^-24) of the likeliest,
// sorted, where they hold the mass, else from the same histogram over all tokens.
void top_row(const float* w, int64_t vocab, int64_t k, float* values, int64_t* tokens);
constexpr int64_t LISTED_K = 256;  // top-k up to this many through top_row
constexpr int KEY_BITS = 12;
constexpr uint32_t BINS = 1u << KEY_BITS;
constexpr int KEY_SHIFT = 32 - KEY_BITS;

// An unsigned key that orders floats as their values (-inf first; no NaN expected).
inline uint32_t order_key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct TruncationScratch {
  std::vector<uint32_t> counts = std::vector<uint32_t>(BINS);
  std::vector<double> mass = std::vector<double>(BINS);
  std::vector<float> pool;
  std::vector<float> values = std::vector<float>(LISTED_K);
  std::vector<int64_t> tokens = std::vector<int64_t>(LISTED_K);
};

// The k-th largest of x[0 .. n) (1 <= k <= n): the bin of the keys' leading bits where the count
// from the top reaches k, then a selection among that bin's values.
float kth_largest(const float* x, int64_t n, int64_t k, TruncationScratch& s) {
  if (k <= LISTED_K) {
    top_row(x, n, k, s.values.data(), s.tokens.data());
    return s.values[k - 1];
  }
  std::fill(s.counts.begin(), s.counts.end(), 0u);
  for (int64_t i = 0; i < n; ++i) ++s.counts[order_key(x[i]) >> KEY_SHIFT];
  int64_t above = 0;
  int64_t bin = BINS - 1;
  for (; bin > 0 && above + s.counts[bin] < k; --bin) above += s.counts[bin];
  s.pool.clear();
  for (int64_t i = 0; i < n; ++i)
    if ((order_key(x[i]) >> KEY_SHIFT) == static_cast<uint32_t>(bin)) s.pool.push_back(x[i]);
  const int64_t j = k - above - 1;
  std::nth_element(s.pool.begin(), s.pool.begin() + j, s.pool.end(), std::greater<float>());
  return s.pool[j];
}

// top_p_floor's last part: ``pool`` (the candidates, below weights that total ``above_mass``)
// sorted, then walked down group of equal weights by group while the mass above stays below the
// target; the last group entered gives tau.
float walk_floor(std::vector<float>& pool, double above_mass, double target) {
  std::sort(pool.begin(), pool.end(), std::greater<float>());
  float tau = pool.front();
  double running = above_mass;
  for (size_t a = 0; a < pool.size() && running < target;) {
    size_t b = a;
    double group = 0.0;
    while (b < pool.size() && pool[b] == pool[a]) group += static_cast<double>(pool[b++]);
    tau = pool[a];
    running += group;
    a = b;
  }
  return tau;
}

// Top-p over non-negative weights e[0 .. n) (not normalised): the smallest weight tau such that
// every token with e >= tau is kept, where a token is kept when the weights strictly above its own
// sum to less than ``target`` (top_p times the row's total). Tokens of equal weight are kept or
// dropped together. Where the tokens near the likeliest do not hold the target, the bins' sums run
// in float64 over the positive weights' leading bits (their bits order them), and only the
// threshold's bin is sorted.
float top_p_floor(const float* e, int64_t n, double target, TruncationScratch& s) {
  // The likeliest weight is 1 (exp(0)); most rows hold top_p within a few octaves of it.
  for (const float cut : {0x1p-8f, 0x1p-16f, 0x1p-24f}) {
    s.pool.clear();
    double mass = 0.0;
    for (int64_t i = 0; i < n; ++i)
      if (e[i] >= cut) {
        s.pool.push_back(e[i]);
        mass += static_cast<double>(e[i]);
      }
    if (mass >= target) return walk_floor(s.pool, 0.0, target);
    if (s.pool.size() > static_cast<size_t>(n) / 8) break;  // a flat row: the histogram below
  }
  std::fill(s.mass.begin(), s.mass.end(), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &e[i], sizeof(bits));
    s.mass[bits >> KEY_SHIFT] += static_cast<double>(e[i]);
  }
  double above = 0.0;
  int64_t bin = BINS - 1;
  for (; bin >= 0 && !(above + s.mass[bin] >= target); --bin) above += s.mass[bin];
  if (bin <= 0) return 0.0f;  // the target is the whole row (or rounding put it past): keep every token
  s.pool.clear();
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &e[i], sizeof(bits));
    if ((bits >> KEY_SHIFT) == static_cast<uint32_t>(bin)) s.pool.push_back(e[i]);
  }
  return walk_floor(s.pool, above, target);
}

// softmax_row for a truncated law (temperature > 0): min-p (the scaled logit at least
// ``log_min_p`` below the row's largest), top-k (the raw logit at least the k-th largest; k <= 0
// off) and top-p (top_p < 1), in vLLM's order; lse stays the raw logits' log-normaliser. The
// reference is multispec.engine.sampler.target_probs.
template <typename scalar_t>
__attribute__((noinline)) void truncated_row(const scalar_t* in, int64_t vocab, float t, int64_t k, float top_p,
                                             float log_min_p, float* x, float* out, float& lse, int64_t& top_index,
                                             TruncationScratch& s) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < vocab; ++i) {
    x[i] = widen(in[i]);
    top = x[i] > top ? x[i] : top;
  }
  float raw = 0.0f;
#pragma omp simd reduction(+ : raw)
  for (int64_t i = 0; i < vocab; ++i) raw += exp_nonpositive(x[i] - top);
  lse = top + std::log(raw);
  top_index = -1;
  const float least = k > 0 && k < vocab ? kth_largest(x, vocab, k, s) : -std::numeric_limits<float>::infinity();
  const float inv = 1.0f / t;
  float scaled = 0.0f;
#pragma omp simd reduction(+ : scaled)
  for (int64_t i = 0; i < vocab; ++i) {
    const float d = (x[i] - top) * inv;
    const float e = x[i] >= least && d >= log_min_p ? exp_nonpositive(d) : 0.0f;
    out[i] = e;
    scaled += e;
  }
  if (top_p < 1.0f) {
    const float tau = top_p_floor(out, vocab, static_cast<double>(top_p) * static_cast<double>(scaled), s);
    scaled = 0.0f;
#pragma omp simd reduction(+ : scaled)
    for (int64_t i = 0; i < vocab; ++i) {
      const float e = out[i] >= tau ? out[i] : 0.0f;
      out[i] = e;
      scaled += e;
    }
  }
  const float norm = 1.0f / scaled;
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) out[i] *= norm;
}

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
    for (int64_t r; (r = shares.next(part)) >= 0;)
      softmax_row(lp + r * vocab, vocab, temperature[r], row.data(), pp + r * vocab, ep[r], tp[r]);
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

// softmax_rows with each row's truncation: top_k [R] int64 (<= 0 off), top_p [R] float32 (1 off),
// log_min_p [R] float32 (log of min_p; -inf off). Greedy rows and rows without truncation take
// softmax_row itself, so they match softmax_rows bit for bit.
std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_truncated(const at::Tensor& logits, const at::Tensor& temperature,
                                                                 const at::Tensor& top_k, const at::Tensor& top_p,
                                                                 const at::Tensor& log_min_p) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be a contiguous CPU [rows, vocabulary]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto vector = [&](const at::Tensor& v, at::ScalarType type, const char* name) {
    TORCH_CHECK(v.scalar_type() == type && v.dim() == 1 && v.size(0) == rows && v.is_contiguous(), name,
                " must be a contiguous vector of ", c10::toString(type), " with one entry per row");
  };
  vector(temperature, at::kFloat, "temperature");
  vector(top_k, at::kLong, "top_k");
  vector(top_p, at::kFloat, "top_p");
  vector(log_min_p, at::kFloat, "log_min_p");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "softmax_truncated takes float32 or bfloat16 logits");
  auto probs = at::empty({rows, vocab}, logits.options().dtype(at::kFloat));
  auto lse = at::empty({rows}, logits.options().dtype(at::kFloat));
  auto top = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* tp = temperature.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float* pp = top_p.data_ptr<float>();
  const float* mp = log_min_p.data_ptr<float>();
  float* out = probs.data_ptr<float>();
  float* ep = lse.data_ptr<float>();
  int64_t* ip = top.data_ptr<int64_t>();
  auto run = [&](auto element) {
    using scalar_t = decltype(element);
    const scalar_t* in = logits.data_ptr<scalar_t>();
    multispec_kernels::balanced_for(rows, [&](int64_t part, multispec_kernels::Shares& shares) {
      std::vector<float> x(vocab);
      TruncationScratch scratch;
      for (int64_t r; (r = shares.next(part)) >= 0;) {
        const bool truncated = (kp[r] > 0 && kp[r] < vocab) || pp[r] < 1.0f ||
                               mp[r] > -std::numeric_limits<float>::infinity();
        if (tp[r] > 0.0f && truncated)
          truncated_row(in + r * vocab, vocab, tp[r], kp[r], pp[r], mp[r], x.data(), out + r * vocab, ep[r], ip[r],
                        scratch);
        else
          softmax_row(in + r * vocab, vocab, tp[r], x.data(), out + r * vocab, ep[r], ip[r]);
      }
    });
  };
  if (logits.scalar_type() == at::kFloat)
    run(float{});
  else
    run(c10::BFloat16{});
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

// The running totals of a row's blocks (float32 sums of BLOCK entries, totalled in float64) into
// cumulative [blocks]. Not inlined, as draw_index: sample_rows and softmax_draw run this same code.
__attribute__((noinline)) void cumulate(const float* w, int64_t vocab, double* cumulative) {
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t size = std::min(BLOCK, vocab - b * BLOCK);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < size; ++i) sum += w[b * BLOCK + i];
    running += static_cast<double>(sum);
    cumulative[b] = running;
  }
}

// The index that u picks from a row of weights w with running block totals ``cumulative``; empty
// where the weights sum to zero (the index is then 0 and meaningless).
__attribute__((noinline)) int64_t draw_index(const float* w, int64_t vocab, const double* cumulative, double u,
                                             bool& empty) {
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  const double total = cumulative[blocks - 1];
  empty = !(total > 0.0);
  if (empty) return 0;
  const double target = u * total;
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
  return chosen;
}

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
  if (shared) {
    shared_cumulative.resize(blocks);
    cumulate(wp, vocab, shared_cumulative.data());
  }
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    std::vector<double> own(shared ? 0 : blocks);
    for (int64_t r = begin; r < end; ++r) {
      const float* w = wp + (shared ? 0 : r * vocab);
      if (!shared) cumulate(w, vocab, own.data());
      ip[r] = draw_index(w, vocab, shared ? shared_cumulative.data() : own.data(), up[r], ep[r]);
    }
  });
  return {index, empty};
}

// The k largest entries of some rows of a float32 [R, V] matrix (the target's probabilities), in
// descending order, ties to the lower index: the alternatives a drafter reads at the tokens a step
// appended. torch's top-k costs about 40 us a row of 49k here (the vocabulary ranked through a heap
// of its own, dispatched per call); the k here are a handful, so one pass keeps the k best so far
// and looks inside a block of BLOCK entries only where the block's maximum beats the k-th: after
// the first blocks almost none does. rows [N] int64 (rows of ``probs``, repeats allowed); returns
// values [N, k] float32 and tokens [N, k] int64.
void top_row(const float* w, int64_t vocab, int64_t k, float* values, int64_t* tokens) {
  int64_t have = 0;
  auto offer = [&](float v, int64_t i) {
    // Entered only where v beats the k-th (or fewer than k are held): a later index with an equal
    // value goes after the earlier one, never before it.
    int64_t j = have < k ? have++ : k - 1;
    while (j > 0 && values[j - 1] < v) {
      values[j] = values[j - 1];
      tokens[j] = tokens[j - 1];
      --j;
    }
    values[j] = v;
    tokens[j] = i;
  };
  for (int64_t i = 0; i < std::min(k, vocab); ++i) offer(w[i], i);
  for (int64_t start = k; start < vocab; start += BLOCK) {
    const int64_t size = std::min(BLOCK, vocab - start);
    float most = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : most)
    for (int64_t i = 0; i < size; ++i) most = w[start + i] > most ? w[start + i] : most;
    if (!(most > values[k - 1])) continue;
    for (int64_t i = 0; i < size; ++i)
      if (w[start + i] > values[k - 1]) offer(w[start + i], start + i);
  }
}

// softmax_rows and then sample_rows with one uniform per row, in one pass, for a step whose
// probabilities nobody reads but the drawn token's: each row's probabilities go to a buffer of the
// task's own, still in cache when the draw reads them, instead of a [rows, vocabulary] matrix
// written and read back. The same code as the two operators (softmax_row, cumulate, draw_index),
// so the same index, log-normaliser, one-hot index and probability of the drawn token, bit for bit.
// With k > 0 each row's k likeliest tokens too, ranked by top_row on the same buffer (what top_rows
// gives for the row of softmax_rows' matrix): a verification whose draws are all from p (copied
// drafts) reads nothing else of the matrix. Returns (index, lse, top, prob, empty, values [rows, k],
// tokens [rows, k]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> softmax_draw(
    const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u, int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "logits must be a contiguous CPU [rows, vocabulary]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.dim() == 1 && temperature.size(0) == rows &&
                  temperature.is_contiguous(),
              "temperature must be a contiguous float32 vector with one entry per row");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.dim() == 1 && u.size(0) == rows && u.is_contiguous(),
              "u must be a contiguous float64 vector with one entry per row");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "softmax_draw takes float32 or bfloat16 logits");
  TORCH_CHECK(k >= 0 && k <= vocab, "k must be in [0, vocabulary], got ", k);
  const auto options = logits.options();
  auto index = at::empty({rows}, options.dtype(at::kLong));
  auto lse = at::empty({rows}, options.dtype(at::kFloat));
  auto top = at::empty({rows}, options.dtype(at::kLong));
  auto prob = at::empty({rows}, options.dtype(at::kFloat));
  auto empty = at::empty({rows}, options.dtype(at::kBool));
  const float* tp = temperature.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* ip = index.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  int64_t* op = top.data_ptr<int64_t>();
  float* pp = prob.data_ptr<float>();
  bool* ep = empty.data_ptr<bool>();
  auto values = at::empty({rows, k}, options.dtype(at::kFloat));
  auto tokens = at::empty({rows, k}, options.dtype(at::kLong));
  float* vp = values.data_ptr<float>();
  int64_t* kp = tokens.data_ptr<int64_t>();
  auto run = [&](auto element) {
    using scalar_t = decltype(element);
    const scalar_t* in = logits.data_ptr<scalar_t>();
    multispec_kernels::balanced_for(rows, [&](int64_t part, multispec_kernels::Shares& shares) {
      std::vector<float> x(vocab), p(vocab);
      std::vector<double> cumulative((vocab + BLOCK - 1) / BLOCK);
      for (int64_t r; (r = shares.next(part)) >= 0;) {
        softmax_row(in + r * vocab, vocab, tp[r], x.data(), p.data(), lp[r], op[r]);
        cumulate(p.data(), vocab, cumulative.data());
        ip[r] = draw_index(p.data(), vocab, cumulative.data(), up[r], ep[r]);
        pp[r] = p[ip[r]];
        if (k > 0) top_row(p.data(), vocab, k, vp + r * k, kp + r * k);
      }
    });
  };
  if (logits.scalar_type() == at::kFloat)
    run(float{});
  else
    run(c10::BFloat16{});
  return {index, lse, top, prob, empty, values, tokens};
}

std::tuple<at::Tensor, at::Tensor> top_rows(const at::Tensor& probs, const at::Tensor& rows, int64_t k) {
  TORCH_CHECK(probs.device().is_cpu() && probs.dim() == 2 && probs.is_contiguous() &&
                  probs.scalar_type() == at::kFloat,
              "probs must be a contiguous float32 CPU [rows, vocabulary]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "rows must be a contiguous int64 vector");
  const int64_t vocab = probs.size(1), n = rows.size(0);
  TORCH_CHECK(k >= 1 && k <= vocab, "k must be in [1, vocabulary], got ", k);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(rp[r] >= 0 && rp[r] < probs.size(0), "row ", rp[r], " is outside probs' ", probs.size(0), " rows");
  auto values = at::empty({n, k}, probs.options());
  auto tokens = at::empty({n, k}, probs.options().dtype(at::kLong));
  const float* pp = probs.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  multispec_kernels::balanced_for(n, [&](int64_t part, multispec_kernels::Shares& shares) {
    for (int64_t r; (r = shares.next(part)) >= 0;) top_row(pp + rp[r] * vocab, vocab, k, vp + r * k, tp + r * k);
  });
  return {values, tokens};
}

// The prompt's log-probabilities (``prompt_logprobs``): for each row of logits [R, V] (float32 or
// bfloat16) and the token that follows it, the token's log-probability under the raw logits, its
// rank (1 + the tokens strictly likelier) and, for k > 0, the k likeliest tokens with their
// log-probabilities (top_row's order: descending, ties to the lower index). One pass widens the row
// and takes its maximum, one sums the exponentials while counting the likelier tokens; torch's path
// wrote the whole log-softmax out and counted through a boolean matrix (its count alone took 40 ms
// for 256 rows of 49k here). Returns (chosen [R], rank [R] int64, values [R, k], tokens [R, k]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_logprobs(const at::Tensor& logits,
                                                                           const at::Tensor& following, int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "logits must be a contiguous CPU [rows, vocabulary]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "token_logprobs takes float32 or bfloat16 logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(following.scalar_type() == at::kLong && following.dim() == 1 && following.size(0) == rows &&
                  following.is_contiguous(),
              "following must be a contiguous int64 vector with one token per row");
  TORCH_CHECK(k >= 0 && k <= vocab, "k must be in [0, vocabulary], got ", k);
  const int64_t* fp = following.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(fp[r] >= 0 && fp[r] < vocab, "token ", fp[r], " is outside the vocabulary of ", vocab);
  const auto options = logits.options().dtype(at::kFloat);
  auto chosen = at::empty({rows}, options);
  auto rank = at::empty({rows}, options.dtype(at::kLong));
  auto values = at::empty({rows, k}, options);
  auto tokens = at::empty({rows, k}, options.dtype(at::kLong));
  float* cp = chosen.data_ptr<float>();
  int64_t* rp = rank.data_ptr<int64_t>();
  float* vp = values.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  auto run = [&](auto element) {
    using scalar_t = decltype(element);
    const scalar_t* in = logits.data_ptr<scalar_t>();
    multispec_kernels::balanced_for(rows, [&](int64_t part, multispec_kernels::Shares& shares) {
      std::vector<float> x(vocab);
      for (int64_t r; (r = shares.next(part)) >= 0;) {
        const scalar_t* row = in + r * vocab;
        float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
        for (int64_t i = 0; i < vocab; ++i) {
          x[i] = widen(row[i]);
          top = x[i] > top ? x[i] : top;
        }
        const float c = x[fp[r]];
        float raw = 0.0f;
        int64_t likelier = 0;
#pragma omp simd reduction(+ : raw, likelier)
        for (int64_t i = 0; i < vocab; ++i) {
          raw += exp_nonpositive(x[i] - top);
          likelier += x[i] > c ? 1 : 0;
        }
        const float lse = top + std::log(raw);
        cp[r] = c - lse;
        rp[r] = likelier + 1;
        if (k > 0) {
          top_row(x.data(), vocab, k, vp + r * k, tp + r * k);
          for (int64_t j = 0; j < k; ++j) vp[r * k + j] -= lse;
        }
      }
    });
  };
  if (logits.scalar_type() == at::kFloat)
    run(float{});
  else
    run(c10::BFloat16{});
  return {chosen, rank, values, tokens};
}

// Tokens a grammar forbids get no probability: for row i of `bits` (one bit per token, 32 to an int32
// word, token w * 32 + b at bit b of word w, a set bit allowed), every token of logits row rows[i]
// whose bit is clear becomes -inf, in place. Words with every bit set (most of them inside a string
// of a JSON schema) are skipped whole.
void mask_rows(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == at::kFloat,
              "logits must be a contiguous float32 CPU [rows, vocabulary]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "rows must be a contiguous int64 vector");
  const int64_t vocab = logits.size(1), n = rows.size(0), words = (vocab + 31) / 32;
  TORCH_CHECK(bits.scalar_type() == at::kInt && bits.dim() == 2 && bits.is_contiguous() && bits.size(0) == n &&
                  bits.size(1) == words,
              "bits must be a contiguous int32 [rows, ceil(vocabulary / 32)]");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(rp[r] >= 0 && rp[r] < logits.size(0), "row ", rp[r], " is outside the logits' ", logits.size(0),
                " rows");
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  const float off = -std::numeric_limits<float>::infinity();
  multispec_kernels::balanced_for(n, [&](int64_t part, multispec_kernels::Shares& shares) {
    for (int64_t r; (r = shares.next(part)) >= 0;) {
      float* row = lp + rp[r] * vocab;
      const uint32_t* mask = bp + r * words;
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t word = mask[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t end = std::min<int64_t>(32, vocab - w * 32);
        float* x = row + w * 32;
        for (int64_t b = 0; b < end; ++b)
          if (!((word >> b) & 1u)) x[b] = off;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multispec, m) {
  m.def("softmax_rows(Tensor logits, Tensor temperature) -> (Tensor probs, Tensor lse, Tensor top)");
  m.def("softmax_truncated(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor log_min_p) -> "
        "(Tensor probs, Tensor lse, Tensor top)");
  m.def("sample_rows(Tensor weights, Tensor u) -> (Tensor index, Tensor empty)");
  m.def("softmax_draw(Tensor logits, Tensor temperature, Tensor u, int k=0) -> (Tensor index, Tensor lse, "
        "Tensor top, Tensor prob, Tensor empty, Tensor values, Tensor tokens)");
  m.def("top_rows(Tensor probs, Tensor rows, int k) -> (Tensor values, Tensor tokens)");
  m.def("mask_rows(Tensor(a!) logits, Tensor rows, Tensor bits) -> ()");
  m.def("token_logprobs(Tensor logits, Tensor following, int k) -> (Tensor chosen, Tensor rank, Tensor values, "
        "Tensor tokens)");
}

TORCH_LIBRARY_IMPL(multispec, CPU, m) {
  m.impl("softmax_rows", &softmax_rows);
  m.impl("softmax_truncated", &softmax_truncated);
  m.impl("sample_rows", &sample_rows);
  m.impl("softmax_draw", &softmax_draw);
  m.impl("top_rows", &top_rows);
  m.impl("mask_rows", &mask_rows);
  m.impl("token_logprobs", &token_logprobs);
}
