// Decode attention on AMX tiles, bf16 caches with head_dim 64, in two halves.
//
// The prompt half (attend_prompt) takes the query rows of all the samples that share a prompt
// sixteen at a time: their scores against the prompt's keys, the softmax relative to each row's
// own maximum and the weighted sum of the prompt's values, kept as a partial (the unnormalised sum,
// the row's maximum and its total weight). The own half (attend) takes one sample's rows over its
// own keys and merges them with those partials. Sharing the prompt's keys among the sixteen lanes
// of a tile is what makes plain samples (three query rows each) cheap: their prompt half costs a
// few tile products per sixteen keys instead of one vector dot product per key and row.
//
// Scores are computed transposed, S^T = K Q^T: the keys are the A operand straight from the cache
// (sixteen key rows of 32 dims a tile, at the cache's row stride), the query rows (up to sixteen
// at a time) the B operand in the tiles' pair layout. The softmax then runs on rows of S^T, one
// vector of sixteen query lanes per key, in float32. The weights, rounded to bf16, are transposed
// to the A layout (query rows of 32 keys) and multiplied by the values, which are interleaved in
// key pairs into the B layout. Each output row depends on its own query row, the keys it sees and
// the values only: not on the other rows in its tile, the other samples or the step's shape.

#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MULTISPEC_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace multispec_amx {

constexpr int64_t MAX_NODES = 64;  // draft nodes of one sample the tile path takes

// Whether this process may use the tile registers (Linux grants them on request, once) and
// MULTISPEC_AMX is not "0" (read at every call, so that a comparison can switch paths).
inline bool enabled() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  const char* flag = std::getenv("MULTISPEC_AMX");
  return granted && !(flag != nullptr && std::strcmp(flag, "0") == 0);
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads a tile configuration. GCC 12's _tile_loadconfig does not tell the compiler that it reads
// the configuration's memory, so the stores that fill it in can be dropped as dead (those of a
// configuration built in a loop were, and loading what was left faulted); the instruction
// written out with the configuration as its memory operand keeps them.
inline void load_config(const TileConfig& config) { asm volatile("ldtilecfg %0" : : "m"(config)); }

// Eight tiles of 16 rows x 64 bytes: tmm0-3 accumulate, tmm4-5 hold A and B operands, tmm6-7 the
// queries.
inline void configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  load_config(config);
}

// Releases the tiles when the worker's share of the items is done (the matrix library configures
// them again before its own use).
struct Release {
  bool on;
  ~Release() {
    if (on) _tile_release();
  }
};

// exp(x) for x <= 0, sixteen lanes: the polynomial of multispec_kernels::exp_nonpositive.
inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 vanishes = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~vanishes), p, _mm512_castsi512_ps(bits));
}

// In-place transpose of a 16 x 16 matrix of 32-bit elements held in sixteen vectors.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4a + b] now holds, in each 128-bit lane L, row (4a + lane element) ... of column block L:
  // element e of lane L of r[4a + b] = original[4a + e][4L + b].
  for (int i = 0; i < 4; ++i) {  // gather lanes: first pairs of 128-bit lanes, then halves
    const int a0 = i, a1 = 4 + i, a2 = 8 + i, a3 = 12 + i;
    const __m512i x0 = _mm512_shuffle_i32x4(r[a0], r[a1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i x1 = _mm512_shuffle_i32x4(r[a0], r[a1], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i x2 = _mm512_shuffle_i32x4(r[a2], r[a3], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i x3 = _mm512_shuffle_i32x4(r[a2], r[a3], _MM_SHUFFLE(3, 1, 3, 1));
    t[i] = _mm512_shuffle_i32x4(x0, x2, _MM_SHUFFLE(2, 0, 2, 0));
    t[4 + i] = _mm512_shuffle_i32x4(x1, x3, _MM_SHUFFLE(2, 0, 2, 0));
    t[8 + i] = _mm512_shuffle_i32x4(x0, x2, _MM_SHUFFLE(3, 1, 3, 1));
    t[12 + i] = _mm512_shuffle_i32x4(x1, x3, _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Thread-local scratch of one item.
struct Scratch {
  alignas(64) uint32_t queries[2][16][16];  // B operands: [dim half][dim pair][query row]
  alignas(64) uint16_t keys[16][64];        // a partial block of key rows, zero-padded
  alignas(64) uint16_t weights[16][32];     // A operand: [query row][32 keys]
  alignas(64) uint16_t values[4][16][32];   // B operands: [16 dims][key pair][dim, key, key...]
  alignas(64) float out[16][64];
  float* scores = nullptr;                  // S^T: [key][16 query lanes]
  int64_t capacity = 0;
  ~Scratch() { std::free(scores); }
  float* reserve(int64_t rows) {
    if (rows > capacity) {
      std::free(scores);
      scores = static_cast<float*>(std::aligned_alloc(64, rows * 16 * sizeof(float)));
      capacity = rows;
    }
    return scores;
  }
};

// One segment of keys (the prompt's or the sample's own): S^T rows [0, count) at ``st``.
// The keys two blocks ahead are prefetched: a sample's own keys come from memory, and the tile
// loads alone left the operator about 10% slower at 16-128 plain samples.
struct NoHook {
  void operator()() const {}
};

template <typename Hook = NoHook>
inline void score_segment(const c10::BFloat16* keys, int64_t step, int64_t count, float* st, Scratch& s,
                          Hook each_block = {}) {
  for (int64_t k0 = 0; k0 < count; k0 += 16) {
    const int64_t m = std::min<int64_t>(16, count - k0);
    each_block();
    for (int64_t r = k0 + 32; r < std::min<int64_t>(k0 + 48, count); ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(keys + r * step), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(keys + r * step + 32), _MM_HINT_T0);
    }
    if (m == 16) {
      _tile_loadd(4, keys + k0 * step, step * 2);
      _tile_loadd(5, keys + k0 * step + 32, step * 2);
    } else {
      std::memset(s.keys, 0, sizeof(s.keys));
      for (int64_t r = 0; r < m; ++r) std::memcpy(s.keys[r], keys + (k0 + r) * step, 128);
      _tile_loadd(4, s.keys, 128);
      _tile_loadd(5, &s.keys[0][32], 128);
    }
    _tile_zero(0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(0, 5, 7);
    _tile_stored(0, st + k0 * 16, 64);
  }
}

// out[q][:] += sum over the segment's keys of weight[q][key] * value[key][:], the weights (S^T
// rows after the softmax) at ``st``, into tiles 0-3.
template <typename Hook = NoHook>
inline void add_segment(const float* st, const c10::BFloat16* values, int64_t step, int64_t count, Scratch& s,
                        Hook each_chunk = {}) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j0 = 0; j0 < count; j0 += 32) {
    each_chunk();
    __m512i w[16];
    for (int p = 0; p < 16; ++p) {
      const int64_t a = j0 + 2 * p, b = a + 1;
      const __m512 ea = a < count ? _mm512_load_ps(st + a * 16) : _mm512_setzero_ps();
      const __m512 eb = b < count ? _mm512_load_ps(st + b * 16) : _mm512_setzero_ps();
      // lanes 0-15: bf16(ea), 16-31: bf16(eb); then lane q holds the pair (ea[q], eb[q])
      w[p] = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(eb, ea));
    }
    transpose16(w);  // w[q] lane p: the pair of keys (2p, 2p + 1) for query q
    for (int q = 0; q < 16; ++q) _mm512_store_si512(s.weights[q], w[q]);
    for (int p = 0; p < 16; ++p) {
      const int64_t a = j0 + 2 * p, b = a + 1;
      __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
      if (a < count) {
        a0 = _mm512_loadu_si512(values + a * step);
        a1 = _mm512_loadu_si512(values + a * step + 32);
      }
      if (b < count) {
        b0 = _mm512_loadu_si512(values + b * step);
        b1 = _mm512_loadu_si512(values + b * step + 32);
      }
      _mm512_store_si512(s.values[0][p], _mm512_permutex2var_epi16(a0, lo, b0));
      _mm512_store_si512(s.values[1][p], _mm512_permutex2var_epi16(a0, hi, b0));
      _mm512_store_si512(s.values[2][p], _mm512_permutex2var_epi16(a1, lo, b1));
      _mm512_store_si512(s.values[3][p], _mm512_permutex2var_epi16(a1, hi, b1));
    }
    _tile_loadd(4, s.weights, 64);
    _tile_loadd(5, s.values[0], 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, s.values[1], 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, s.values[2], 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, s.values[3], 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// A partial row of the prompt half: the unnormalised weighted sum of values, the row's maximum
// scaled score and its total weight exp(score - maximum) over the prompt's keys.
constexpr int64_t PARTIAL = 66;

// Loads up to sixteen bf16 query rows into the B operands (tiles 6 and 7); lanes past ``block``
// are zero.
template <typename Query>
inline void load_queries(int64_t i0, int64_t block, Query query, Scratch& s) {
  std::memset(s.queries, 0, sizeof(s.queries));
  for (int64_t i = 0; i < block; ++i) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(query(i0 + i));
    for (int k = 0; k < 16; ++k) {
      s.queries[0][k][i] = q[k];
      s.queries[1][k][i] = q[16 + k];
    }
  }
  _tile_loadd(6, s.queries[0], 64);
  _tile_loadd(7, s.queries[1], 64);
}

// The prompt half of ``rows`` query rows (row i at query(i)) that share the prompt's ``plen`` keys:
// writes row i's partial (PARTIAL floats) at partial(i).
template <typename Query, typename Partial>
void attend_prompt(int64_t rows, Query query, const c10::BFloat16* pk, const c10::BFloat16* pv, int64_t pk_step,
                   int64_t pv_step, int64_t plen, float scale, Partial partial, Scratch& s) {
  float* st = s.reserve((plen + 15) & ~int64_t{15});
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < rows; i0 += 16) {
    const int64_t block = std::min<int64_t>(16, rows - i0);
    load_queries(i0, block, query, s);
    score_segment(pk, pk_step, plen, st, s);
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < plen; ++j) top = _mm512_max_ps(top, _mm512_load_ps(st + j * 16));
    const __m512 shift = _mm512_mul_ps(top, scaled);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < plen; ++j) {
      const __m512 e = exp_nonpositive16(_mm512_min_ps(_mm512_fmsub_ps(_mm512_load_ps(st + j * 16), scaled, shift),
                                                      _mm512_setzero_ps()));
      _mm512_store_ps(st + j * 16, e);
      total = _mm512_add_ps(total, e);
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    add_segment(st, pv, pv_step, plen, s);
    _tile_stored(0, &s.out[0][0], 256);
    _tile_stored(1, &s.out[0][16], 256);
    _tile_stored(2, &s.out[0][32], 256);
    _tile_stored(3, &s.out[0][48], 256);
    alignas(64) float shifts[16], totals[16];
    _mm512_store_ps(shifts, shift);
    _mm512_store_ps(totals, total);
    for (int64_t i = 0; i < block; ++i) {
      float* dst = partial(i0 + i);
      std::memcpy(dst, s.out[i], 64 * sizeof(float));
      dst[64] = shifts[i];
      dst[65] = totals[i];
    }
  }
}

// Scores of up to sixteen query rows (row i at query(i)) against ``count`` keys, scaled, into
// out[i * stride + j]: the tile product S^T = K Q^T, read back row by row. For a plain sample's
// three rows, whose softmax and values' sum stay on the vector path.
template <typename Query, typename Hook = NoHook>
inline void score_rows(int64_t rows, Query query, const c10::BFloat16* keys, int64_t step, int64_t count, float scale,
                       float* out, int64_t stride, Scratch& s, Hook each_block = {}) {
  float* st = s.reserve((count + 15) & ~int64_t{15});
  load_queries(0, rows, query, s);
  score_segment(keys, step, count, st, s, each_block);
  // Row i of S is column i of S^T: sixteen keys at a time, one gather (lane t reads key j + t).
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < rows; ++i) {
    const __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(i)));
    for (int64_t j = 0; j < count; j += 16) {
      const __mmask16 valid = count - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - j)) - 1);
      const __m512 column = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, index, st + j * 16, 4);
      _mm512_mask_storeu_ps(out + i * stride + j, valid, _mm512_mul_ps(column, scaled));
    }
  }
}

// The own half of one sample's ``rows`` query rows (row i at query(i)) over its ``own_len`` keys,
// of which the last ``count`` are the step's new nodes, seen by row i only where visible(i, node),
// merged with the row's prompt partial at prior(i). Writes row i's output at out(i).
// ``each_key_block`` runs before each block of sixteen keys is scored, ``each_value_chunk`` before
// each thirty-two values are added, in the first block of rows (the caller asks for the next
// item's keys and values there).
template <typename Query, typename Visible, typename Prior, typename Out, typename KeyHook = NoHook,
          typename ValueHook = NoHook>
void attend(int64_t rows, Query query, const c10::BFloat16* ok, const c10::BFloat16* ov, int64_t ok_step,
            int64_t ov_step, int64_t own_len, int64_t count, Visible visible, float scale, Prior prior, Out out,
            Scratch& s, KeyHook each_key_block = {}, ValueHook each_value_chunk = {}) {
  float* st = s.reserve((own_len + 15) & ~int64_t{15});
  const int64_t old = own_len - count;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t i0 = 0; i0 < rows; i0 += 16) {
    const int64_t block = std::min<int64_t>(16, rows - i0);
    load_queries(i0, block, query, s);
    score_segment(ok, ok_step, own_len, st, s, [&] {
      if (i0 == 0) each_key_block();
    });
    // Which lanes see each new key (lanes past the block's rows: all, they are never read).
    __mmask16 seen[MAX_NODES];
    const int64_t nodes = std::min<int64_t>(count, MAX_NODES);
    for (int64_t node = 0; node < nodes; ++node) {
      __mmask16 bits = 0xFFFF;
      for (int64_t i = 0; i < block; ++i)
        if (!visible(i0 + i, node)) bits &= static_cast<__mmask16>(~(1u << i));
      seen[node] = bits;
    }
    __m512 top = _mm512_set1_ps(-inf);
    for (int64_t j = 0; j < own_len; ++j) {
      const __m512 v = _mm512_load_ps(st + j * 16);
      top = j < old ? _mm512_max_ps(top, v) : _mm512_mask_max_ps(top, seen[j - old], top, v);
    }
    // The prompt's partials: each lane's maximum joins the own keys' maximum, and its sum and
    // total weight are rescaled to the common maximum before the own values are added.
    alignas(64) float prompt_top[16], prompt_total[16];
    for (int64_t i = 0; i < 16; ++i) {
      prompt_top[i] = i < block ? prior(i0 + i)[64] : -inf;
      prompt_total[i] = i < block ? prior(i0 + i)[65] : 0.0f;
    }
    const __m512 scaled = _mm512_set1_ps(scale);
    const __m512 prompt_shift = _mm512_load_ps(prompt_top);
    const __m512 shift = _mm512_max_ps(_mm512_mul_ps(top, scaled), prompt_shift);
    const __m512 rescale = exp_nonpositive16(_mm512_sub_ps(prompt_shift, shift));
    __m512 total = _mm512_mul_ps(_mm512_load_ps(prompt_total), rescale);
    for (int64_t j = 0; j < own_len; ++j) {
      __m512 e = exp_nonpositive16(_mm512_min_ps(_mm512_fmsub_ps(_mm512_load_ps(st + j * 16), scaled, shift),
                                                _mm512_setzero_ps()));
      if (j >= old) e = _mm512_maskz_mov_ps(seen[j - old], e);
      _mm512_store_ps(st + j * 16, e);
      total = _mm512_add_ps(total, e);
    }
    alignas(64) float factors[16];
    _mm512_store_ps(factors, rescale);
    for (int64_t i = 0; i < 16; ++i) {
      if (i < block) {
        const float* p = prior(i0 + i);
        const __m512 f = _mm512_set1_ps(factors[i]);
        for (int c = 0; c < 4; ++c) _mm512_store_ps(&s.out[i][16 * c], _mm512_mul_ps(_mm512_loadu_ps(p + 16 * c), f));
      } else {
        std::memset(s.out[i], 0, sizeof(s.out[i]));
      }
    }
    _tile_loadd(0, &s.out[0][0], 256);
    _tile_loadd(1, &s.out[0][16], 256);
    _tile_loadd(2, &s.out[0][32], 256);
    _tile_loadd(3, &s.out[0][48], 256);
    add_segment(st, ov, ov_step, own_len, s, [&] {
      if (i0 == 0) each_value_chunk();
    });
    _tile_stored(0, &s.out[0][0], 256);
    _tile_stored(1, &s.out[0][16], 256);
    _tile_stored(2, &s.out[0][32], 256);
    _tile_stored(3, &s.out[0][48], 256);
    alignas(64) float totals[16];
    _mm512_store_ps(totals, total);
    for (int64_t i = 0; i < block; ++i) {
      const __m512 inv = _mm512_set1_ps(1.0f / totals[i]);
      c10::BFloat16* dst = out(i0 + i);
      for (int c = 0; c < 4; ++c) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&s.out[i][16 * c]), inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)h);
      }
    }
  }
}

}  // namespace multispec_amx
#endif
