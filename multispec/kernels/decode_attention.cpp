// Decode-step attention over the two-level KV cache, for the CPU: one pass per (sample, kv head).
//
// Each sample's query rows (its root and draft nodes, times the query heads that share a kv head)
// attend to its prompt's keys and to its own keys in one softmax: the prompt slot's keys
// 0..prompt_len-1, the own slot's keys 0..written-1, and of the step's new keys (written ..
// written+count-1) those the tree mask marks as ancestors-or-self. Scores, softmax and the
// weighted sum of values are float32 whatever the cache's dtype; one sample's result does not
// depend on the other samples of the step (no padding, no batch-dependent blocking). The step's
// new keys and values are written into the sample slots by the same pass.
//
// The generic kernels this replaces pay a fixed cost per (sample, kv head) matrix and per call
// (two calls a layer, then a log-sum-exp merge); here every key and value is read once per
// (sample, kv head) with all its query rows, and the prompt's keys stay in cache across samples.
//
// With AMX (bf16, head_dim 64) the prompt half runs first, on tiles, for sixteen query rows of a
// prompt's samples at a time, and the pass per (sample, kv head) then reads only the sample's own
// keys and merges the two halves (amx_attention.h). Scores and sums stay float32; the softmax
// weights are rounded to bf16 for the tile products. Each row's arithmetic is its own on both
// paths, so a sample's output is bit for bit the same whatever else is in the step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "amx_attention.h"
#include "decode_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// 256-bit vectors (AVX2 with FMA) where the CPU has no AVX-512: the scores and the weighted sum of
// values below are written for them too (the plain loops left the dot products' sums to scalar
// adds from the stack and kept the sums of values in memory; the operator took 15 ms of an 85 ms
// step of 16 float32 samples on a 2-core Zen 2).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define MULTISPEC_AVX2 1
#endif

namespace {

using multispec_kernels::exp_nonpositive;

// Gemma 2's soft cap of a score: cap * tanh(s / cap), tanh(|x|) = (1 - e) / (1 + e) with e =
// exp(-2|x|) (a vectorisable exponential; its relative error of 2e-7 moves a capped score by at
// most about 4e-7 of the cap); a hidden key's -inf stays -inf.
__attribute__((always_inline)) inline float soft_cap(float s, float cap, float inv_cap) {
  const float x = s * inv_cap;
  const float e = exp_nonpositive(-2.0f * std::fabs(x));
  const float t = std::copysign((1.0f - e) / (1.0f + e), x) * cap;
  return s == -std::numeric_limits<float>::infinity() ? s : t;
}

// The next (sample, kv head)'s own keys and values, asked for into L2 a few cache lines at a time
// while this one computes, so that reading them from memory overlaps this one's arithmetic (the
// hardware prefetcher starts each sample's short runs of keys too late: with every sample's own
// keys in cache the operator took 18 ms at 128 samples in flight, from memory 30). ``key_lines``
// per block of sixteen scored keys, ``value_lines`` per value row added: enough to cover the next
// item's keys and values within this item's loops (its keys are spread over the prompt's and its
// own, its values over all of them).
//
// ``paired``: the next item's key and value lines are asked for together (line i of each at once),
// half of them over this item's key blocks and the rest over its value rows, so that its values
// are on their way as early as its keys. Asked for only while this item's values were added, they
// came too late: on AMX, pairing took the operator 0.91-0.94x the time with the caches in memory
// (16 and 64 plain samples, 16 samples of 2 and 6 draft tokens, 128 keys each;
// experiments/attention_builds.py --cold) and a plain decode step 0.98x at 16 samples in flight,
// 0.96x at 32 to 128 (one process, alternating).
struct Ahead {
  const char* keys = nullptr;
  const char* values = nullptr;
  int64_t bytes = 0, key_done = 0, value_done = 0;
  int key_lines = 0, value_lines = 0;
  bool paired = false;
  inline void next_keys() {
    if (paired) return next_pairs(key_lines);
    for (int i = 0; i < key_lines && key_done < bytes; ++i, key_done += 64) __builtin_prefetch(keys + key_done, 0, 2);
  }
  inline void next_values() {
    if (paired) return next_pairs(value_lines);
    for (int i = 0; i < value_lines && value_done < bytes; ++i, value_done += 64)
      __builtin_prefetch(values + value_done, 0, 2);
  }
  // Paired asking for ``lines`` lines of each, half of them over ``key_steps`` calls of
  // ``next_keys`` and the rest over ``value_steps`` calls of ``next_values``.
  inline void pair(int64_t lines, int64_t key_steps, int64_t value_steps) {
    paired = true;
    key_lines = static_cast<int>((lines + 2 * key_steps - 1) / (2 * key_steps));
    const int64_t rest = lines - key_lines * key_steps;
    value_lines = static_cast<int>(std::max<int64_t>(1, (rest + value_steps - 1) / value_steps));
  }
  // ``lines`` more lines of both (paired: ``key_done`` counts both).
  inline void next_pairs(int lines) {
    for (int i = 0; i < lines && key_done < bytes; ++i, key_done += 64) {
      __builtin_prefetch(keys + key_done, 0, 2);
      __builtin_prefetch(values + key_done, 0, 2);
    }
  }
};

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = multispec_kernels::widen(src[d]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// Sixteen vectors of partial sums -> one vector whose lane t is the full sum of v[t].
inline __m512 sum_lanes16(__m512 v[16]) {
  __m512 z[8], w[4], u[2];
  for (int p = 0; p < 8; ++p)  // 256-bit halves: z[p] = [v(2p) folded | v(2p+1) folded]
    z[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int r = 0; r < 4; ++r)  // 128-bit lanes: w[r] = [v(4r), v(4r+1), v(4r+2), v(4r+3)], 4 partials each
    w[r] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * r], z[2 * r + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[2 * r], z[2 * r + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int s = 0; s < 2; ++s)  // lane l: two partials of v(8s+l) and v(8s+4+l), interleaved
    u[s] = _mm512_add_ps(_mm512_unpacklo_ps(w[2 * s], w[2 * s + 1]), _mm512_unpackhi_ps(w[2 * s], w[2 * s + 1]));
  // lane l, element m: the full sum of v(4m + l)
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, sums);
}

// Scores of bf16 query rows against ``count`` bf16 keys (row stride ``step``), scaled, into
// scores[i * stride + j]: pairs of bf16 products summed in float32 (AVX512-BF16), sixteen keys at
// a time so that one shuffle tree finishes sixteen dot products.
// PAIRS = head_dim / 32 known at compile time: the products of one key unroll, with no loop
// bookkeeping between them.
template <int PAIRS>
inline void score_keys_bf16_fixed(const c10::BFloat16* q, int64_t q_stride, int64_t rows,
                                  const c10::BFloat16* keys, int64_t step, int64_t count, float scale, float* scores,
                                  int64_t stride, Ahead* ahead) {
  constexpr int64_t pairs = PAIRS;
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < rows; ++i) {
    __m512bh qv[PAIRS];
    for (int64_t c = 0; c < pairs; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + i * q_stride + 32 * c);
    float* out = scores + i * stride;
    int64_t j = 0;
    for (; j + 16 <= count; j += 16) {
      if (ahead != nullptr) ahead->next_keys();
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) {
        const c10::BFloat16* key = keys + (j + t) * step;
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < pairs; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
        acc[t] = a;
      }
      _mm512_storeu_ps(out + j, _mm512_mul_ps(sum_lanes16(acc), scaled));
    }
    for (; j < count; ++j) {
      const c10::BFloat16* key = keys + j * step;
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < pairs; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
      out[j] = _mm512_reduce_add_ps(a) * scale;
    }
  }
}

inline void score_keys_bf16(const c10::BFloat16* q, int64_t q_stride, int64_t rows, int64_t dim,
                            const c10::BFloat16* keys, int64_t step, int64_t count, float scale, float* scores,
                            int64_t stride, Ahead* ahead = nullptr) {
  switch (dim / 32) {  // dim is a multiple of 32 up to 256 (see ``fast``)
    case 1: return score_keys_bf16_fixed<1>(q, q_stride, rows, keys, step, count, scale, scores, stride, ahead);
    case 2: return score_keys_bf16_fixed<2>(q, q_stride, rows, keys, step, count, scale, scores, stride, ahead);
    case 3: return score_keys_bf16_fixed<3>(q, q_stride, rows, keys, step, count, scale, scores, stride, ahead);
    case 4: return score_keys_bf16_fixed<4>(q, q_stride, rows, keys, step, count, scale, scores, stride, ahead);
    case 5: return score_keys_bf16_fixed<5>(q, q_stride, rows, keys, step, count, scale, scores, stride, ahead);
    case 6: return score_keys_bf16_fixed<6>(q, q_stride, rows, keys, step, count, scale, scores, stride, ahead);
    case 7: return score_keys_bf16_fixed<7>(q, q_stride, rows, keys, step, count, scale, scores, stride, ahead);
    default: return score_keys_bf16_fixed<8>(q, q_stride, rows, keys, step, count, scale, scores, stride, ahead);
  }
}
#endif

#ifdef MULTISPEC_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Eight vectors of partial sums -> one vector whose lane t is the sum of v[t]'s lanes, each summed
// as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline __m256 sum_lanes8(const __m256 v[8]) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// One vector's lanes summed in the same order as sum_lanes8 sums each of its eight: a key's score
// is the same float whether it was scored in a block of eight or alone (a sample's draft step and
// its plain steps see the same keys with different counts).
inline float sum_lanes(__m256 v) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v, v), v);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// One key's products with a query row of CHUNKS x 8 floats, chunk by chunk into one vector.
template <int CHUNKS, typename scalar_t>
inline __m256 key_products8(const __m256* qv, const scalar_t* key) {
  __m256 a = _mm256_mul_ps(qv[0], load8(key));
  for (int c = 1; c < CHUNKS; ++c) a = _mm256_fmadd_ps(qv[c], load8(key + 8 * c), a);
  return a;
}

// scores[i * stride + j] = qf_i . key_j for the float32 query rows qf (already scaled) and
// ``count`` keys (row stride ``step``): eight keys at a time, one shuffle tree per eight sums. Each
// block of eight keys is scored for every row before the next block, so the rows after the first
// read it from L1 (a sample's 255 keys, 64 KB in float32, do not fit there: a pass per row read
// them all again from L2).
template <int CHUNKS, typename scalar_t>
inline void score_keys_avx2_fixed(const float* qf, int64_t rows, const scalar_t* keys, int64_t step, int64_t count,
                                  float* scores, int64_t stride, Ahead* ahead) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    for (int64_t i = 0; i < rows; ++i) {
      if (ahead != nullptr) ahead->next_keys();
      __m256 qv[CHUNKS];
      for (int c = 0; c < CHUNKS; ++c) qv[c] = _mm256_loadu_ps(qf + i * 8 * CHUNKS + 8 * c);
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = key_products8<CHUNKS>(qv, keys + (j + t) * step);
      _mm256_storeu_ps(scores + i * stride + j, sum_lanes8(acc));
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    __m256 qv[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) qv[c] = _mm256_loadu_ps(qf + i * 8 * CHUNKS + 8 * c);
    for (int64_t k = j; k < count; ++k) scores[i * stride + k] = sum_lanes(key_products8<CHUNKS>(qv, keys + k * step));
  }
}

// False where the head size has no fixed variant (the plain loops then score).
template <typename scalar_t>
inline bool score_keys_avx2(const float* qf, int64_t rows, int64_t dim, const scalar_t* keys, int64_t step,
                            int64_t count, float* scores, int64_t stride, Ahead* ahead) {
  switch (dim) {
    case 32: score_keys_avx2_fixed<4>(qf, rows, keys, step, count, scores, stride, ahead); return true;
    case 48: score_keys_avx2_fixed<6>(qf, rows, keys, step, count, scores, stride, ahead); return true;
    case 64: score_keys_avx2_fixed<8>(qf, rows, keys, step, count, scores, stride, ahead); return true;
    default: return false;
  }
}

// acc_i += sum_j weights[i * stride + j] * value_j, for head sizes of a multiple of 64: one query
// row at a time, 64 columns at a time, its eight sums in registers while the value rows stream past.
// The value rows go in blocks of 32 (8 KB in float32), each block through every query row before
// the next, so the rows after the first read it from L1; each row's sums still take the value rows
// in order, one at a time, so the result is the same float as one pass per row.
// (No ``prefetch`` of rows ahead: that is for the AMX path, which needs AVX-512.)
template <typename scalar_t>
inline void add_values_avx2(const float* weights, int64_t rows, int64_t stride, int64_t dim, const scalar_t* values,
                            int64_t step, int64_t count, float* acc, Ahead* ahead) {
  constexpr int64_t block = 32;
  for (int64_t j0 = 0; j0 < count; j0 += block) {
    const int64_t j1 = std::min(count, j0 + block);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t col = 0; col < dim; col += 64) {
        float* a = acc + i * dim + col;
        __m256 sum[8];
        for (int c = 0; c < 8; ++c) sum[c] = _mm256_loadu_ps(a + 8 * c);
        for (int64_t j = j0; j < j1; ++j) {
          if (i == 0 && ahead != nullptr) ahead->next_values();
          const scalar_t* v = values + j * step + col;
          const __m256 w = _mm256_set1_ps(weights[i * stride + j]);
          for (int c = 0; c < 8; ++c) sum[c] = _mm256_fmadd_ps(w, load8(v + 8 * c), sum[c]);
        }
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(a + 8 * c, sum[c]);
      }
    }
  }
}
#endif

// scores[i * stride + col] = q_i . key for every query row i whose ``seen(i)``, -inf elsewhere.
template <typename scalar_t, typename Seen>
inline void score_key(const float* qf, int64_t rows, int64_t dim, const scalar_t* key, float* key_buf, float* scores,
                      int64_t stride, Seen seen) {
#if defined(__AVX512F__)
  if (dim % 16 == 0 && dim <= 256) {
    __m512 k[16];
    const int64_t chunks = dim / 16;
    for (int64_t c = 0; c < chunks; ++c) k[c] = load16(key + 16 * c);
    for (int64_t i = 0; i < rows; ++i) {
      if (!seen(i)) {
        scores[i * stride] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float* qi = qf + i * dim;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qi), k[0]);
      for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * c), k[c], acc);
      scores[i * stride] = _mm512_reduce_add_ps(acc);
    }
    return;
  }
#endif
  load_row(key, key_buf, dim);
  for (int64_t i = 0; i < rows; ++i)
    scores[i * stride] = seen(i) ? dot(qf + i * dim, key_buf, dim) : -std::numeric_limits<float>::infinity();
}

// acc_i += sum_j weights[i * stride + j] * value_j for the ``count`` value rows at ``values`` (row
// stride ``step``), for every query row i: four query rows at a time, their sums held in registers
// while the value rows stream past. ``prefetch``: fetch the rows sixteen ahead early (a sample's
// own values come from memory; on the AMX machines this was measured on, about 10% of the
// operator at 16-128 plain samples).
#if defined(__AVX512F__)
// add_values with AVX-512 for a head_dim of 16 * CHUNKS and a block of ROWS query rows known at
// compile time: the rows' sums stay in registers across the value rows (with a run-time chunk or
// row count the compiler kept them on the stack, a load and a store around every multiply-add).
template <int CHUNKS, int ROWS, typename scalar_t>
inline void add_values_block(const float* weights, int64_t stride, const scalar_t* values, int64_t step,
                             int64_t count, float* acc, bool prefetch, Ahead* ahead = nullptr) {
  constexpr int64_t dim = 16 * CHUNKS;
  __m512 sum[ROWS][CHUNKS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) sum[r][c] = _mm512_loadu_ps(acc + r * dim + 16 * c);
  for (int64_t j = 0; j < count; ++j) {
    if (ahead != nullptr) ahead->next_values();
    if (prefetch && j + 16 < count) {  // rows sixteen ahead, from memory (see the call)
      _mm_prefetch(reinterpret_cast<const char*>(values + (j + 16) * step), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(values + (j + 16) * step) + 64, _MM_HINT_T0);
    }
    __m512 v[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) v[c] = load16(values + j * step + 16 * c);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 w = _mm512_set1_ps(weights[r * stride + j]);
      for (int c = 0; c < CHUNKS; ++c) sum[r][c] = _mm512_fmadd_ps(w, v[c], sum[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(acc + r * dim + 16 * c, sum[r][c]);
}

// Four query rows at a time, then the one to three left (a plain sample of a three-head group is
// one block of three).
template <int CHUNKS, typename scalar_t>
inline void add_values_fixed(const float* weights, int64_t rows, int64_t stride, const scalar_t* values,
                             int64_t step, int64_t count, float* acc, bool prefetch, Ahead* ahead) {
  constexpr int64_t dim = 16 * CHUNKS;
  int64_t i0 = 0;
  for (; i0 + 4 <= rows; i0 += 4)
    add_values_block<CHUNKS, 4>(weights + i0 * stride, stride, values, step, count, acc + i0 * dim, prefetch, ahead);
  switch (rows - i0) {
    case 3:
      return add_values_block<CHUNKS, 3>(weights + i0 * stride, stride, values, step, count, acc + i0 * dim, prefetch,
                                         ahead);
    case 2:
      return add_values_block<CHUNKS, 2>(weights + i0 * stride, stride, values, step, count, acc + i0 * dim, prefetch,
                                         ahead);
    case 1:
      return add_values_block<CHUNKS, 1>(weights + i0 * stride, stride, values, step, count, acc + i0 * dim, prefetch,
                                         ahead);
    default:
      return;
  }
}
#endif

template <typename scalar_t>
inline void add_values(const float* weights, int64_t rows, int64_t stride, int64_t dim, const scalar_t* values,
                       int64_t step, int64_t count, float* value_buf, float* acc, bool prefetch = false,
                       Ahead* ahead = nullptr) {
#if defined(__AVX512F__)
  switch (dim) {  // head sizes 16 .. 128 in steps of 16, each with its own register layout
    case 16: return add_values_fixed<1>(weights, rows, stride, values, step, count, acc, prefetch, ahead);
    case 32: return add_values_fixed<2>(weights, rows, stride, values, step, count, acc, prefetch, ahead);
    case 48: return add_values_fixed<3>(weights, rows, stride, values, step, count, acc, prefetch, ahead);
    case 64: return add_values_fixed<4>(weights, rows, stride, values, step, count, acc, prefetch, ahead);
    case 80: return add_values_fixed<5>(weights, rows, stride, values, step, count, acc, prefetch, ahead);
    case 96: return add_values_fixed<6>(weights, rows, stride, values, step, count, acc, prefetch, ahead);
    case 112: return add_values_fixed<7>(weights, rows, stride, values, step, count, acc, prefetch, ahead);
    case 128: return add_values_fixed<8>(weights, rows, stride, values, step, count, acc, prefetch, ahead);
    default: break;
  }
#endif
#ifdef MULTISPEC_AVX2
  if (dim % 64 == 0) return add_values_avx2(weights, rows, stride, dim, values, step, count, acc, ahead);
#endif
  for (int64_t j = 0; j < count; ++j) {
    load_row(values + j * step, value_buf, dim);
    for (int64_t i = 0; i < rows; ++i) {
      const float w = weights[i * stride + j];
      if (w == 0.0f) continue;
      float* a = acc + i * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += w * value_buf[d];
    }
  }
}

// scalar_t: the queries', new keys' and output's dtype; cache_t: the caches' (the same, or bf16 caches
// under float32 activations: keys and values stored rounded to bf16, read back exactly as floats).
template <typename scalar_t, typename cache_t = scalar_t>
void run(const multispec::AttentionCall& call) {
  const int64_t heads = call.heads, dim = call.dim, kv_heads = call.kv_heads, group = heads / kv_heads;
  const int64_t batch = call.index.batch, qmax = call.index.qmax;
  const int64_t* sample_slot = call.index.sample_slot;
  const int64_t* offsets = call.index.offsets;
  const int64_t* counts = call.index.counts;
  const int64_t* written = call.index.written;
  const int64_t* prompt_slot = call.index.prompt_slot;
  const int64_t* prompt_len = call.index.prompt_len;
  const bool* tree_mask = call.index.tree_mask;
  const int64_t* scratch = call.index.scratch;
  const bool* scratch_mask = call.index.scratch_mask;
  const int64_t scratch_width = call.index.scratch_width;
  const double scale = call.scale;
  const int64_t window = call.window;
  const float cap = static_cast<float>(call.softcap), inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const scalar_t* qp = static_cast<const scalar_t*>(call.q.data);
  const cache_t* okp = static_cast<const cache_t*>(call.own_k.data);
  const cache_t* ovp = static_cast<const cache_t*>(call.own_v.data);
  const cache_t* pkp = static_cast<const cache_t*>(call.prompt_k.data);
  const cache_t* pvp = static_cast<const cache_t*>(call.prompt_v.data);
  scalar_t* op = static_cast<scalar_t*>(call.out.data);
  const scalar_t* knp = static_cast<const scalar_t*>(call.k_new.data);
  const scalar_t* vnp = static_cast<const scalar_t*>(call.v_new.data);
  cache_t* own_k_out = static_cast<cache_t*>(call.own_k.data);
  cache_t* own_v_out = static_cast<cache_t*>(call.own_v.data);
  constexpr bool same = std::is_same_v<scalar_t, cache_t>;
  const int64_t kn0 = call.k_new.s0, kn1 = call.k_new.s1, vn0 = call.v_new.s0, vn1 = call.v_new.s1;
  const int64_t qs0 = call.q.s0, qs1 = call.q.s1;
  const int64_t os0 = call.own_k.s0, os1 = call.own_k.s1, os2 = call.own_k.s2;
  const int64_t ovs0 = call.own_v.s0, ovs1 = call.own_v.s1, ovs2 = call.own_v.s2;
  const int64_t ps0 = call.prompt_k.s0, ps1 = call.prompt_k.s1, ps2 = call.prompt_k.s2;
  const int64_t pvs0 = call.prompt_v.s0, pvs1 = call.prompt_v.s1, pvs2 = call.prompt_v.s2;
  const int64_t out0 = call.out.s0, out1 = call.out.s1;
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Scores straight from the bf16 rows with AVX512-BF16 dot products where the CPU has them.
  bool fast = false;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  fast = same && std::is_same_v<scalar_t, c10::BFloat16> && dim % 32 == 0 && dim <= 256 && qs1 == dim;
#endif

  // With AMX, the prompt half of every sample runs first on tiles, the query rows of all the
  // samples that share a prompt sixteen at a time (see amx_attention.h); the loop below then
  // attends to each sample's own keys only and merges the two halves. ``partial`` holds one
  // PARTIAL-float row per (token, query head).
  bool amx = false;
  std::unique_ptr<float[]> partial;
#ifdef MULTISPEC_AMX
  // (Not under a sliding window or a soft cap, nor in a draft model's step: the tile passes read
  // every key and leave scores as they are; the vector path skips the keys out of the window, caps
  // and hides the scratch keys a row does not descend from.)
  amx = same && std::is_same_v<scalar_t, c10::BFloat16> && dim == 64 && qs1 == dim && out1 == dim && call.amx &&
        call.window <= 0 && call.softcap <= 0.0 && call.index.scratch == nullptr;
  if constexpr (same && std::is_same_v<scalar_t, c10::BFloat16>) {
    if (amx) {
      const int64_t tokens = call.tokens;
      partial.reset(new float[tokens * heads * multispec_amx::PARTIAL]);
      // Samples grouped by prompt (slot and length), in batch order within a group; a group's rows
      // are its samples' (token, query head of the kv head) in that order, cut into blocks of 16.
      std::vector<int64_t> order(batch);
      for (int64_t b = 0; b < batch; ++b) order[b] = b;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return prompt_slot[a] != prompt_slot[b] ? prompt_slot[a] < prompt_slot[b] : prompt_len[a] < prompt_len[b];
      });
      std::vector<int64_t> token_of;  // the group-ordered tokens
      struct Block {
        int64_t first, rows, slot, len;  // group-ordered rows first .. first + rows - 1 of one prompt
      };
      std::vector<Block> blocks;
      for (int64_t g0 = 0; g0 < batch;) {
        int64_t g1 = g0;
        const int64_t start = static_cast<int64_t>(token_of.size());
        while (g1 < batch && prompt_slot[order[g1]] == prompt_slot[order[g0]] &&
               prompt_len[order[g1]] == prompt_len[order[g0]]) {
          for (int64_t r = 0; r < counts[order[g1]]; ++r) token_of.push_back(offsets[order[g1]] + r);
          ++g1;
        }
        const int64_t rows = (static_cast<int64_t>(token_of.size()) - start) * group;
        for (int64_t r0 = 0; r0 < rows; r0 += 16)
          blocks.push_back({start * group + r0, std::min<int64_t>(16, rows - r0), prompt_slot[order[g0]],
                            prompt_len[order[g0]]});
        g0 = g1;
      }
      float* part = partial.get();
      at::parallel_for(0, static_cast<int64_t>(blocks.size()) * kv_heads, 1, [&](int64_t begin, int64_t end) {
        auto scratch = std::make_unique<multispec_amx::Scratch>();
        multispec_amx::configure();
        const multispec_amx::Release release{true};
        for (int64_t item = begin; item < end; ++item) {
          const Block& blk = blocks[item / kv_heads];
          const int64_t h = item % kv_heads;
          auto row = [&](int64_t i) {  // (token, query head) of the block's row i
            const int64_t r = blk.first + i;
            return std::pair{token_of[r / group], h * group + r % group};
          };
          multispec_amx::attend_prompt(
              blk.rows,
              [&](int64_t i) {
                const auto [t, hq] = row(i);
                return qp + t * qs0 + hq * qs1;
              },
              pkp + blk.slot * ps0 + h * ps1, pvp + blk.slot * pvs0 + h * pvs1, ps2, pvs2, blk.len, fscale,
              [&](int64_t i) {
                const auto [t, hq] = row(i);
                return part + (t * heads + hq) * multispec_amx::PARTIAL;
              },
              *scratch);
        }
      });
    }
  }
#endif
  // Cache lines of the next item asked for per block of 16 keys scored (an item scores about group
  // x its keys / 16 blocks and must cover dim * 2 / 64 lines a key) and per value row added.
  const int key_lines = static_cast<int>(dim * static_cast<int64_t>(sizeof(cache_t)) / (4 * group)) + 2;
  const int value_lines = static_cast<int>(std::max<int64_t>(1, dim * static_cast<int64_t>(sizeof(cache_t)) / 64));
  auto work = [&](int64_t part, multispec_kernels::Shares& shares) {
    std::vector<float> qf, scores, acc, totals, row_buf(dim);  // grown once a call, not once an item
    std::vector<int64_t> lowest;
#ifdef MULTISPEC_AMX
    std::unique_ptr<multispec_amx::Scratch> scratch;
    if (amx) {
      scratch = std::make_unique<multispec_amx::Scratch>();
      multispec_amx::configure();
    }
    const multispec_amx::Release release{amx};
#endif
    // Each item claims the thread's next one before it runs, so that it can ask for the next one's
    // keys and values while it computes.
    for (int64_t item = shares.next(part), following; item >= 0; item = following) {
      following = shares.next(part);
      const int64_t b = item / kv_heads, h = item % kv_heads;
      Ahead next_item;
      Ahead* ahead = nullptr;
      if (following >= 0) {
        const int64_t b2 = following / kv_heads, h2 = following % kv_heads;
        next_item.keys = reinterpret_cast<const char*>(okp + sample_slot[b2] * os0 + h2 * os1);
        next_item.values = reinterpret_cast<const char*>(ovp + sample_slot[b2] * ovs0 + h2 * ovs1);
        next_item.bytes = written[b2] * os2 * static_cast<int64_t>(sizeof(cache_t));
        next_item.key_lines = key_lines;
        next_item.value_lines = value_lines;
        ahead = &next_item;
      }
      // With AMX the prompt's keys were seen by the tile pass: only the own keys remain.
      const int64_t count = counts[b], old = written[b], plen = amx ? 0 : prompt_len[b];
      const int64_t rows = count * group, own_len = old + count, keys = plen + own_len;
      // Under a sliding window a row at position p sees the keys at positions p - window + 1 .. p
      // (a key's position is its index in the row of scores: the prompt's keys, then the sample's
      // own), the root from plen + old - window + 1 on and each draft node as many further as its
      // depth in the tree. The keys before the root's first are neither scored nor weighed: the
      // prompt's from ``prompt_from`` on, the own from ``own_from`` on (each rounded down to a
      // multiple of sixteen, so that every key is scored in the same block of keys as without a
      // window); ``first`` is where the scores start, ``lowest[r]`` node r's first key seen.
      int64_t prompt_from = 0, own_from = 0;
      if (window > 0) {
        const int64_t root_first = plen + old - window + 1;
        if (root_first <= plen) {
          prompt_from = std::max<int64_t>(0, root_first) & ~int64_t{15};
        } else {
          prompt_from = plen;
          own_from = (root_first - plen) & ~int64_t{15};
        }
        lowest.resize(count);
        const bool* sees = tree_mask + b * qmax * qmax;
        for (int64_t r = 0; r < count; ++r) {
          int64_t depth = -1;
          for (int64_t node = 0; node < count; ++node) depth += sees[r * qmax + node];
          lowest[r] = plen + old + depth - window + 1;
        }
      }
      const int64_t first = prompt_from < plen ? prompt_from : plen + own_from;
#ifdef MULTISPEC_AVX2
      // On AVX2 the next item's lines are spread evenly over this item's blocks of eight keys scored
      // and its value rows added. The rates above (tuned on AMX tiles) asked for all of them in the
      // first quarter of the scoring and the first half of the values; on a 2-core Zen 2 such bursts
      // stalled the arithmetic (the operator ran faster with no prefetch at all), evenly spread the
      // operator took 0.83x the time at 16 samples and 0.85x at 64, a decode step of 64 samples 0.87x.
      if (ahead != nullptr) {
        const int64_t lines = (next_item.bytes + 63) / 64;
        const int64_t blocks = std::max<int64_t>(1, rows * (plen / 8 + own_len / 8));
        next_item.key_lines = static_cast<int>((lines + blocks - 1) / blocks);
        next_item.value_lines = static_cast<int>((lines + keys - 1) / keys);
      }
#endif
      qf.resize(rows * dim);
      scores.resize(rows * keys);
      acc.assign(rows * dim, 0.0f);
      // The step's new keys and values go into the sample's slot first (this item alone writes
      // this (sample, kv head)).
      for (int64_t r = 0; r < count; ++r) {
        cache_t* kd = own_k_out + sample_slot[b] * os0 + h * os1 + (old + r) * os2;
        cache_t* vd = own_v_out + sample_slot[b] * ovs0 + h * ovs1 + (old + r) * ovs2;
        const scalar_t* ks = knp + (offsets[b] + r) * kn0 + h * kn1;
        const scalar_t* vs = vnp + (offsets[b] + r) * vn0 + h * vn1;
        if constexpr (same) {
          std::memcpy(kd, ks, dim * sizeof(scalar_t));
          std::memcpy(vd, vs, dim * sizeof(scalar_t));
        } else {  // rounded to the cache's dtype (to nearest even, as torch's copy rounds)
          for (int64_t d = 0; d < dim; ++d) {
            kd[d] = static_cast<cache_t>(static_cast<float>(ks[d]));
            vd[d] = static_cast<cache_t>(static_cast<float>(vs[d]));
          }
        }
      }
#ifdef MULTISPEC_AMX
      // The own keys of samples with draft nodes (six query rows or more) on the tile unit too; a
      // plain sample's three rows are as fast on the vector path.
      if constexpr (same && std::is_same_v<scalar_t, c10::BFloat16>) {
        if (amx && count >= 2 && count <= multispec_amx::MAX_NODES) {
          const bool* mask = tree_mask + b * qmax * qmax;
          const int64_t base = offsets[b];
          if (ahead != nullptr) {  // the next item's lines, paired: half over this one's first rows' key
                                   // blocks, the rest over their value chunks
            next_item.pair((next_item.bytes + 63) / 64, (own_len + 15) / 16, (own_len + 31) / 32);
          }
          multispec_amx::attend(
              rows, [&](int64_t i) { return qp + (base + i / group) * qs0 + (h * group + i % group) * qs1; },
              okp + sample_slot[b] * os0 + h * os1, ovp + sample_slot[b] * ovs0 + h * ovs1, os2, ovs2, own_len, count,
              [&](int64_t i, int64_t node) { return mask[(i / group) * qmax + node]; }, fscale,
              [&](int64_t i) {
                return partial.get() + ((base + i / group) * heads + h * group + i % group) * multispec_amx::PARTIAL;
              },
              [&](int64_t i) { return op + (base + i / group) * out0 + (h * group + i % group) * out1; }, *scratch,
              [&] {
                if (ahead != nullptr) ahead->next_keys();
              },
              [&] {
                if (ahead != nullptr) ahead->next_values();
              });
          continue;
        }
      }
#endif
      // Queries as float32, scaled: row i = (node r, head g) of query head h * group + g (the
      // bf16 path reads them as they are).
      if (!fast) {
        for (int64_t r = 0; r < count; ++r) {
          for (int64_t g = 0; g < group; ++g) {
            const scalar_t* src = qp + (offsets[b] + r) * qs0 + (h * group + g) * qs1;
            float* dst = qf.data() + (r * group + g) * dim;
            load_row(src, dst, dim);
            for (int64_t d = 0; d < dim; ++d) dst[d] *= fscale;
          }
        }
      }
      // Scores against the prompt's keys, then the sample's own.
      const cache_t* pk = pkp + prompt_slot[b] * ps0 + h * ps1;
      const cache_t* ok = okp + sample_slot[b] * os0 + h * os1;
      const bool* mask = tree_mask + b * qmax * qmax;
      // After scoring every key: the step's new keys outside each row's ancestors get -inf.
      [[maybe_unused]] auto hide_non_ancestors = [&] {
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t node = 0; node < count; ++node)
            if (!mask[(i / group) * qmax + node]) scores[i * keys + plen + old + node] = neg_inf;
      };
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (same && std::is_same_v<scalar_t, c10::BFloat16>) {
#ifdef MULTISPEC_AMX
        if (amx && count == 1 && rows <= 16) {  // a plain sample: scores on tiles (a few % faster)
          const int64_t base = offsets[b];
          if (ahead != nullptr) {  // the next item's lines, paired: half over the key blocks, half over the values
            next_item.pair((next_item.bytes + 63) / 64, (own_len + 15) / 16, own_len);
          }
          multispec_amx::score_rows(
              rows, [&](int64_t i) { return qp + base * qs0 + (h * group + i) * qs1; }, ok, os2, own_len, fscale,
              scores.data(), keys, *scratch, [&] {
                if (ahead != nullptr) ahead->next_keys();
              });
        } else
#endif
        if (fast) {
          for (int64_t r = 0; r < count; ++r) {  // one node's query heads are adjacent rows
            const scalar_t* qrow = qp + (offsets[b] + r) * qs0 + h * group * qs1;
            float* s = scores.data() + r * group * keys;
            score_keys_bf16(qrow, qs1, group, dim, pk + prompt_from * ps2, ps2, plen - prompt_from, fscale,
                            s + prompt_from, keys, ahead);
            score_keys_bf16(qrow, qs1, group, dim, ok + own_from * os2, os2, own_len - own_from, fscale,
                            s + plen + own_from, keys, ahead);
          }
          hide_non_ancestors();
        }
      }
#endif
#ifdef MULTISPEC_AVX2
      if (!fast && score_keys_avx2(qf.data(), rows, dim, pk + prompt_from * ps2, ps2, plen - prompt_from,
                                   scores.data() + prompt_from, keys, ahead)) {
        score_keys_avx2(qf.data(), rows, dim, ok + own_from * os2, os2, own_len - own_from,
                        scores.data() + plen + own_from, keys, ahead);
        hide_non_ancestors();
      } else
#endif
      if (!fast) {
        auto all = [](int64_t) { return true; };
        for (int64_t j = prompt_from; j < plen; ++j)
          score_key(qf.data(), rows, dim, pk + j * ps2, row_buf.data(), scores.data() + j, keys, all);
        for (int64_t j = own_from; j < old; ++j)
          score_key(qf.data(), rows, dim, ok + j * os2, row_buf.data(), scores.data() + plen + j, keys, all);
        for (int64_t node = 0; node < count; ++node) {
          auto seen = [&](int64_t i) { return mask[(i / group) * qmax + node]; };
          score_key(qf.data(), rows, dim, ok + (old + node) * os2, row_buf.data(), scores.data() + plen + old + node,
                    keys, seen);
        }
      }
      if (cap > 0.0f) {  // Gemma 2: every score capped (before the window's -inf, which the cap keeps)
        for (int64_t i = 0; i < rows; ++i) {
          float* s = scores.data() + i * keys;
#pragma omp simd
          for (int64_t j = first; j < keys; ++j) s[j] = soft_cap(s[j], cap, inv_cap);
        }
      }
      if (scratch != nullptr && scratch[b] > 0) {  // a draft model's step: of this step's earlier draft
        // nodes (the last scratch[b] cached own keys) each row sees only its ancestors
        const int64_t count_scratch = scratch[b], from = plen + old - count_scratch;
        for (int64_t i = 0; i < rows; ++i) {
          const bool* sees = scratch_mask + (b * qmax + i / group) * scratch_width;
          for (int64_t j = 0; j < count_scratch; ++j)
            if (!sees[j]) scores[i * keys + from + j] = neg_inf;
        }
      }
      if (window > 0) {  // each row's keys out of its window hidden (-inf), as the non-ancestors are
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t end = std::min(keys, lowest[i / group]);
          for (int64_t j = first; j < end; ++j) scores[i * keys + j] = neg_inf;
        }
      }
      // Softmax per row (every row sees at least its own new key, so its maximum is finite), merged
      // with the row's prompt half where the tile pass computed it: its maximum joins the row's, its
      // sum and total weight are rescaled to the common maximum.
      totals.resize(rows);
      for (int64_t i = 0; i < rows; ++i) {
        float* s = scores.data() + i * keys;
        float top = neg_inf;
#pragma omp simd reduction(max : top)  // a vector reduction, not a chain of compares (exact)
        for (int64_t j = first; j < keys; ++j) top = s[j] > top ? s[j] : top;
        float total = 0.0f;
#ifdef MULTISPEC_AMX
        if (amx) {
          const float* prior =
              partial.get() + ((offsets[b] + i / group) * heads + h * group + i % group) * multispec_amx::PARTIAL;
          top = std::max(top, prior[64]);
          const float rescale = prior[64] == neg_inf ? 0.0f : exp_nonpositive(prior[64] - top);
          total = prior[65] * rescale;
          float* a = acc.data() + i * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] = prior[d] * rescale;
        }
#endif
        // (A hidden key's -inf score gives exp_nonpositive(-inf) = 0, without a branch to vectorize.)
#pragma omp simd
        for (int64_t j = first; j < keys; ++j) s[j] = exp_nonpositive(s[j] - top);
        // The weights summed in an order fixed by the keys the row sees, not by where they sit: key j
        // of the cached ones (all seen) into running sum j % 8, then the step's new keys the row sees
        // (its ancestors and itself, in order) as if they followed the cached ones directly, then
        // one fixed tree. So a row's total is the same float whether its token is a sample's root
        // or a draft node at any depth of any tree, and whether its sample drafted or not: the same
        // token as a root of a later step sees the same keys in the same ranks. (An OpenMP vector
        // reduction over all keys put them in lanes by position, with its remainder where the key
        // count ended: roots and draft nodes parted from plain steps by rounding, and seeded
        // speculative runs from plain ones.)
        float lanes[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        const int64_t cached = plen + old;
        int64_t j = first;  // (the keys before ``first`` weigh 0: not added)
        for (; j < cached && (j & 7) != 0; ++j) lanes[j & 7] += s[j];
        for (; j + 8 <= cached; j += 8)
          for (int l = 0; l < 8; ++l) lanes[l] += s[j + l];
        for (; j < cached; ++j) lanes[j & 7] += s[j];
        const bool* sees = mask + (i / group) * qmax;
        for (int64_t node = 0, rank = cached; node < count; ++node)
          if (sees[node]) lanes[rank++ & 7] += s[cached + node];
        total += ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        totals[i] = total;
      }
      // Weighted sum of values, each value row read once for all query rows.
      add_values(scores.data() + prompt_from, rows, keys, dim,
                 pvp + prompt_slot[b] * pvs0 + h * pvs1 + prompt_from * pvs2, pvs2, plen - prompt_from,
                 row_buf.data(), acc.data(), false, ahead);
      add_values(scores.data() + plen + own_from, rows, keys, dim,
                 ovp + sample_slot[b] * ovs0 + h * ovs1 + own_from * ovs2, ovs2, own_len - own_from, row_buf.data(),
                 acc.data(), amx, ahead);
      for (int64_t r = 0; r < count; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t i = r * group + g;
          const float inv = 1.0f / totals[i];
          scalar_t* dst = op + (offsets[b] + r) * out0 + (h * group + g) * out1;
          const float* a = acc.data() + i * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inv);
        }
      }
    }
  };
  multispec_kernels::balanced_for(batch * kv_heads, work);
}

void check_index(const at::Tensor& t, const char* name, int64_t batch) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == batch && t.is_contiguous(), name,
              " must be a contiguous int64 vector with one entry per sample");
}

}  // namespace

namespace multispec {

AttentionIndex attention_index(const at::Tensor& sample_slot, const at::Tensor& offsets, const at::Tensor& counts,
                               const at::Tensor& written, const at::Tensor& prompt_slot, const at::Tensor& prompt_len,
                               const at::Tensor& tree_mask) {
  const int64_t batch = counts.size(0);
  for (auto [t, name] : {std::pair{&sample_slot, "sample_slot"}, {&offsets, "offsets"}, {&counts, "counts"},
                         {&written, "written"}, {&prompt_slot, "prompt_slot"}, {&prompt_len, "prompt_len"}})
    check_index(*t, name, batch);
  TORCH_CHECK(tree_mask.scalar_type() == at::kBool && tree_mask.dim() == 3 && tree_mask.size(0) == batch &&
                  tree_mask.size(1) == tree_mask.size(2) && tree_mask.is_contiguous(),
              "tree_mask must be a contiguous bool [samples, qmax, qmax]");
  return {sample_slot.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), counts.data_ptr<int64_t>(),
          written.data_ptr<int64_t>(), prompt_slot.data_ptr<int64_t>(), prompt_len.data_ptr<int64_t>(),
          tree_mask.data_ptr<bool>(), batch, tree_mask.size(1)};
}

void attach_scratch(AttentionIndex& index, const std::optional<at::Tensor>& scratch,
                    const std::optional<at::Tensor>& scratch_mask) {
  TORCH_CHECK(scratch.has_value() == scratch_mask.has_value(), "scratch and scratch_mask come together");
  if (!scratch.has_value()) return;
  check_index(*scratch, "scratch", index.batch);
  const at::Tensor& mask = *scratch_mask;
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 3 && mask.size(0) == index.batch &&
                  mask.size(1) == index.qmax && mask.is_contiguous(),
              "scratch_mask must be a contiguous bool [samples, qmax, width]");
  const int64_t* counts = scratch->data_ptr<int64_t>();
  for (int64_t b = 0; b < index.batch; ++b)
    TORCH_CHECK(counts[b] >= 0 && counts[b] <= mask.size(2) && counts[b] <= index.written[b],
                "a sample's scratch count is within its mask's width and its cached keys");
  index.scratch = counts;
  index.scratch_mask = mask.data_ptr<bool>();
  index.scratch_width = mask.size(2);
}

void check_attention_caches(at::ScalarType dtype, int64_t heads, int64_t dim, int64_t dims, const at::Tensor& own_k,
                            const at::Tensor& own_v, const at::Tensor& prompt_k, const at::Tensor& prompt_v) {
  TORCH_CHECK(own_k.dim() == dims && own_v.dim() == dims && prompt_k.dim() == dims && prompt_v.dim() == dims,
              "the caches are [slots, kv_heads, positions, dim]", dims == 5 ? ", one per layer" : "");
  const at::ScalarType cache_type = own_k.scalar_type();
  TORCH_CHECK(cache_type == dtype || (dtype == at::kFloat && cache_type == at::kBFloat16),
              "the caches share q's dtype, or are bfloat16 under float32 q");
  const int64_t kv_heads = own_k.size(-3);
  for (const at::Tensor* t : {&own_k, &own_v, &prompt_k, &prompt_v}) {
    TORCH_CHECK(t->scalar_type() == cache_type, "the four caches share one dtype");
    TORCH_CHECK(t->stride(-1) == 1 && t->size(-1) == dim, "the last dimension must be contiguous head_dim");
    TORCH_CHECK(t->size(-3) == kv_heads, "the four caches have the same kv heads");
  }
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of kv heads");
}

bool attention_amx() {
#ifdef MULTISPEC_AMX
  return multispec_amx::enabled();
#else
  return false;
#endif
}

void attend(const AttentionCall& call) {
  if (call.dtype == at::kFloat && call.cache_dtype == at::kBFloat16)
    run<float, c10::BFloat16>(call);
  else if (call.dtype == at::kFloat)
    run<float, float>(call);
  else if (call.dtype == at::kBFloat16)
    run<c10::BFloat16, c10::BFloat16>(call);
  else
    TORCH_CHECK(false, "decode_attention takes float32 or bfloat16, got ", call.dtype);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            const at::Tensor& own_k, const at::Tensor& own_v,
                            const at::Tensor& prompt_k, const at::Tensor& prompt_v, const at::Tensor& sample_slot,
                            const at::Tensor& offsets, const at::Tensor& counts, const at::Tensor& written,
                            const at::Tensor& prompt_slot, const at::Tensor& prompt_len,
                            const at::Tensor& tree_mask, double scale, int64_t window, double softcap,
                            const std::optional<at::Tensor>& scratch, const std::optional<at::Tensor>& scratch_mask) {
  TORCH_CHECK(q.device().is_cpu(), "decode_attention runs on the CPU");
  TORCH_CHECK(window >= 0, "window is a number of positions, or 0 for none");
  TORCH_CHECK(softcap >= 0.0, "softcap is a score's cap, or 0 for none");
  TORCH_CHECK(window == 0 || !scratch.has_value(), "a sliding window and scratch positions do not go together");
  TORCH_CHECK(q.dim() == 3, "q is [tokens, heads, dim]");
  check_attention_caches(q.scalar_type(), q.size(1), q.size(2), 4, own_k, own_v, prompt_k, prompt_v);
  TORCH_CHECK(k_new.dim() == 3 && v_new.dim() == 3 && k_new.size(0) == q.size(0) && v_new.size(0) == q.size(0) &&
                  k_new.size(1) == own_k.size(1) && v_new.size(1) == own_k.size(1),
              "k_new and v_new are [tokens, kv_heads, dim]");
  for (const at::Tensor* t : {&q, &k_new, &v_new}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "k_new and v_new share q's dtype");
    TORCH_CHECK(t->stride(-1) == 1 && t->size(-1) == q.size(2), "the last dimension must be contiguous head_dim");
  }
  AttentionCall call;
  call.index = attention_index(sample_slot, offsets, counts, written, prompt_slot, prompt_len, tree_mask);
  attach_scratch(call.index, scratch, scratch_mask);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto rows = [](const at::Tensor& t) { return AttentionRows{t.data_ptr(), t.stride(0), t.stride(1)}; };
  auto slots = [](const at::Tensor& t) { return AttentionSlots{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; };
  call.q = rows(q), call.k_new = rows(k_new), call.v_new = rows(v_new), call.out = rows(out);
  call.own_k = slots(own_k), call.own_v = slots(own_v);
  call.prompt_k = slots(prompt_k), call.prompt_v = slots(prompt_v);
  call.tokens = q.size(0), call.heads = q.size(1), call.kv_heads = own_k.size(1), call.dim = q.size(2);
  call.dtype = q.scalar_type(), call.cache_dtype = own_k.scalar_type();
  call.scale = scale;
  call.amx = attention_amx();
  call.window = window;
  call.softcap = softcap;
  attend(call);
  return out;
}

}  // namespace multispec

TORCH_LIBRARY(multispec, m) {
  m.def("decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) own_k, Tensor(b!) own_v, Tensor prompt_k, Tensor prompt_v, "
        "Tensor sample_slot, Tensor offsets, Tensor counts, Tensor written, Tensor prompt_slot, "
        "Tensor prompt_len, Tensor tree_mask, float scale, int window=0, float softcap=0.0, Tensor? scratch=None, "
        "Tensor? scratch_mask=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(multispec, CPU, m) { m.impl("decode_attention", &multispec::decode_attention); }
