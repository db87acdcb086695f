// Matrix products of a few rows streaming the weight once: y = x W^T (+ bias), bf16.
//
// A decode step multiplies a handful of rows (its samples and their draft tokens) by every weight
// of the model, so its products are bound by reading the weights from memory, not by arithmetic.
// The CPU library's prepacked product reaches about half the machine's read bandwidth at 4 to 16
// rows. Here the weight is laid out once, at load, in exactly the order the products consume it, so
// a product is one sequential read of it: panels of 32 output columns, each panel's K in blocks of
// 32, each block two 1 KiB tiles (16 columns each) in the pair layout of the bf16 dot product (row r
// holds k = 2r, 2r + 1 of every column).
//
// Two engines read that layout. With AMX, up to 48 rows of x take one pass over the weight, in tile
// row blocks of up to 16 (the last block's tiles hold only the rows there are, so x is read in
// place, never padded); more rows take one pass per 48. Without AMX but with AVX512-BF16 (AMD Zen 4
// and later, Intel Cooper Lake), each 64-byte row of a tile is one vector of sixteen columns' k
// pairs, multiplied by a row's k pair broadcast to every lane (vdpbf16ps); twelve rows at a time
// share each weight vector, and a panel's later row blocks read it from cache. Either way each
// output row is a function of its own x row only, accumulated in float32 in the same order whatever
// the row count, then rounded once (with the bias added) to bf16.
//
// Float32 on CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2 and 3, Intel before Skylake-SP),
// where the model runs in float32: the weight laid out as panels of 16 output columns, each panel
// K rows of 16 floats (two vectors), and up to six rows of x share each pair of weight vectors
// (twelve accumulators: enough independent sums to hide the FMA's latency). Each output is its
// row's x times its column in k order, one FMA per k, plus the bias: again a function of its own
// row only. On a 2-core Zen 2 this ran the model's products at 0.16 TFLOP/s at 16 rows and
// 0.17-0.18 from 48 on, against 0.08-0.10 and 0.12-0.14 for the CPU library's prepacked product.
//
// A float32 weight that came from a GGUF file's quantised blocks can also be read as those blocks
// (affine_pack, affine_stream below): one byte a weight and a float32 scale and offset per 32,
// rebuilt into float32 in registers as the product runs, bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "amx_attention.h"
#include "common.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define MULTISPEC_VECTOR_STREAM 1
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define MULTISPEC_F32_STREAM 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 32;     // output columns a panel holds (two tiles of 16)
constexpr int64_t KBLOCK = 32;    // reduction depth of one tile product in bf16
constexpr int64_t MAX_ROWS = 48;  // rows of x one pass over the weight takes

bool layout_fits(int64_t n, int64_t k) { return n % PANEL == 0 && k % KBLOCK == 0 && n > 0 && k > 0; }

constexpr int64_t F32_PANEL = 16;  // output columns of a float32 panel (two 256-bit vectors)

// [N, K] bf16 -> [N / 32, K / 32, 2, 16, 32] bf16: panel, k block, column tile, k pair, (column, k) pair.
// [N, K] float32 -> [N / 16, K, 16] float32: panel, k, column.
at::Tensor stream_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "stream_pack takes a bf16 or float32 [out, in] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  if (weight.scalar_type() == at::kFloat) {
    TORCH_CHECK(n % F32_PANEL == 0 && k > 0, "stream_pack needs out % 16 == 0 for float32, got ", n, " x ", k);
    return weight.contiguous().view({n / F32_PANEL, F32_PANEL, k}).permute({0, 2, 1}).contiguous();
  }
  TORCH_CHECK(layout_fits(n, k), "stream_pack needs out % 32 == 0 and in % 32 == 0, got ", n, " x ", k);
  // [N/32, 2, 16 col, K/32, 16 pair, 2] -> [N/32, K/32, 2, 16 pair, 16 col, 2]
  return weight.contiguous()
      .view({n / PANEL, 2, 16, k / KBLOCK, 16, 2})
      .permute({0, 3, 1, 4, 2, 5})
      .contiguous()
      .view({n / PANEL, k / KBLOCK, 2, 16, 32});
}

// Float32 weights that are blocks of small integers on a scale: what a GGUF file's quantised
// weights (Q4_0, Q4_1, Q5_x, Q8_0) are once dequantised. Each block of 32 weights of an output
// column is scale * q + offset for integers q in [-128, 127], computed as one fused multiply-add,
// which is how the dequantised float32 values came about (scale * q is exact for a 16-bit scale and
// a small q, then one rounding) or they would not pass ``affine_pack``'s check. Stored as one byte
// a weight plus two floats a block, the weight is a third of its float32 size, and a product that
// reads it from memory waits a third as long; rebuilt bit for bit and multiplied in the float32
// panel kernels' order, the result is exactly the float32 product's.
constexpr int64_t AFFINE_BLOCK = 32;                                              // k a block
constexpr int64_t AFFINE_BYTES = 2 * F32_PANEL * 4 + AFFINE_BLOCK * F32_PANEL;  // scales, offsets, q

// One block of 32 floats as scale * q + offset, or false.
bool affine_block(const float* w, float& scale, float& offset, int8_t* q) {
  float lo = w[0], hi = w[0], amax = std::fabs(w[0]);
  for (int64_t i = 1; i < AFFINE_BLOCK; ++i) {
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
    amax = std::max(amax, std::fabs(w[i]));
  }
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  auto bits = [](float v) {
    uint32_t b;
    std::memcpy(&b, &v, sizeof(b));
    return b;
  };
  auto fits = [&](float s, float m) {
    for (int64_t i = 0; i < AFFINE_BLOCK; ++i) {
      const double r = s == 0.0f ? 0.0 : std::nearbyint((static_cast<double>(w[i]) - m) / s);
      if (!(r >= -128.0 && r <= 127.0)) return false;  // also a NaN
      q[i] = static_cast<int8_t>(r);
      if (bits(std::fma(s, static_cast<float>(q[i]), m)) != bits(w[i])) return false;
    }
    scale = s;
    offset = m;
    return true;
  };
  // Scales as a GGUF block stores them (float16), and as float32: with the block's minimum as the
  // offset (q from 0: Q4_1, Q5_1) and with none (q symmetric about 0: Q4_0, Q5_0, Q8_0).
  const std::pair<float, double> tries[] = {{lo, 15.0}, {lo, 31.0}, {0.0f, 127.0}, {0.0f, 8.0}, {0.0f, 16.0}};
  for (const auto& [m, levels] : tries) {
    const double span = m == 0.0f ? amax : static_cast<double>(hi) - lo;
    const float exact = static_cast<float>(span / levels);
    const float half = static_cast<float>(c10::Half(exact));
    for (float s : {half, exact})
      if (fits(s, m)) return true;
  }
  return false;
}

// [N, K] float32 -> [N / 16, K / 32, AFFINE_BYTES] uint8 (per panel and k block: the 16 columns'
// scales and offsets as float32, then q[32][16] as int8), or None when the weight is not such
// blocks (or N % 16 or K % 32 is not 0).
std::optional<at::Tensor> affine_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "affine_pack takes a float32 [out, in] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  if (n % F32_PANEL != 0 || k % AFFINE_BLOCK != 0 || n == 0 || k == 0) return std::nullopt;
  const at::Tensor w = weight.contiguous();
  const float* wp = w.data_ptr<float>();
  const int64_t panels = n / F32_PANEL, kblocks = k / AFFINE_BLOCK;
  at::Tensor out = at::empty({panels, kblocks, AFFINE_BYTES}, weight.options().dtype(at::kByte));
  uint8_t* op = out.data_ptr<uint8_t>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    int8_t q[AFFINE_BLOCK];
    for (int64_t p = begin; p < end && ok.load(std::memory_order_relaxed); ++p) {
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        uint8_t* block = op + (p * kblocks + kb) * AFFINE_BYTES;
        float* scales = reinterpret_cast<float*>(block);
        int8_t* qs = reinterpret_cast<int8_t*>(block + 2 * F32_PANEL * 4);
        for (int64_t c = 0; c < F32_PANEL; ++c) {
          const float* col = wp + (p * F32_PANEL + c) * k + kb * AFFINE_BLOCK;
          if (!affine_block(col, scales[c], scales[F32_PANEL + c], q)) {
            ok.store(false, std::memory_order_relaxed);
            return;
          }
          for (int64_t r = 0; r < AFFINE_BLOCK; ++r) qs[r * F32_PANEL + c] = q[r];
        }
      }
    }
  });
  if (!ok.load()) return std::nullopt;
  return out;
}

#ifdef MULTISPEC_AMX

// Tile shapes for a chunk of ``rows`` rows (up to 48): every row block but the last has 16 rows,
// the last the rest, so its x tile reads only rows that exist and its products only compute them.
// The weight tiles always have 16 rows (32 of the reduction in pairs).
void configure_stream(int64_t rows) {
  const int blocks = static_cast<int>((rows + 15) / 16);
  multispec_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  for (int b = 0; b < blocks; ++b) {
    const uint8_t r = static_cast<uint8_t>(b + 1 < blocks ? 16 : rows - 16 * b);
    if (blocks < 3) {  // panel_product: accumulators 2b and 2b + 1, x in 4 + b
      config.rows[2 * b] = config.rows[2 * b + 1] = config.rows[4 + b] = r;
    } else {  // panel_product3: accumulator b, x in 4 + b
      config.rows[b] = config.rows[4 + b] = r;
    }
  }
  multispec_amx::load_config(config);
}

// How far ahead (in elements) a pass of ASK_ROWS rows or more asks for its weight, into L2: four
// k blocks (8 KiB). From two row blocks on the tile products take about as long as reading their
// weights, and without asking ahead the two ran one after the other: 17 to 48 rows 0.91-0.93x the
// time with it (``experiments/stream_builds.py`` on a 2-core Xeon with AMX). A pass of a few rows
// does as well on the hardware prefetcher alone, but from 8 rows on asking ahead pays too: whole
// decode steps with and without it, alternating in one process, took 0.984x the time at 8
// samples, 0.973x at 12 and 0.952x at 16, against 0.997x at 6, 1.02x at 4 and 1.01x at 1 and 2 (on
// a 2-core Xeon with AMX). Asking 8 KiB ahead rather than 32 took 0.975x the step time at 8
// samples, 0.994x at 16, 0.993x at 32, 0.979x at 48 and 0.996x at 128 (in one process); 6 to 20
// KiB were within 1% of it.
constexpr int64_t AMX_PREFETCH = 4 * 1024;
constexpr int64_t ASK_ROWS = 8;

// The 32 cache lines of one k block's two weight tiles, into L2.
inline void prefetch_block(const uint16_t* tiles) {
  const char* lines = reinterpret_cast<const char*>(tiles);
#pragma GCC unroll 32
  for (int line = 0; line < 32; ++line) _mm_prefetch(lines + 64 * line, _MM_HINT_T1);
}

// Work run once per k block of a panel's product (see panels_deferred); none by default.
struct NoSlice {
  void operator()() const {}
};

// STREAM_LOADS: passes that ask ahead load their weight tiles with tileloaddt1, which does not
// keep them in L1; the rows of x and the accumulators keep it to themselves. Whole decode steps
// with and without, alternating in one process (2-core Xeon with AMX): 0.967x the time at 16
// samples, 0.958x at 32 (two row blocks), 0.998x at 8; at 4 samples, where the pass does not ask
// ahead, the hinted loads took 1.023x, and at 48 (three row blocks, each weight tile in a tile of
// its own for three products) 1.003x, so those keep the plain loads.
//
// Tiles have no renaming: a load into a tile waits for the product still reading it, so every
// operand of one k block gets its own tile.
//
// One or two row blocks: accumulators tmm0..tmm3 (row block i, column tile j: tile 2i + j), x's
// row blocks in tmm4 and tmm5, the two weight tiles in tmm6 and tmm7.
template <int BLOCKS, bool ASK = (BLOCKS > 1), typename Slice = NoSlice>
inline void panel_product(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t kblocks, float* out,
                          const Slice& slice = {}) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (BLOCKS > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t xs = x_stride * 2;  // bytes
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const uint16_t* tiles = w + kb * 2 * 512;
    const uint16_t* xk = x + kb * KBLOCK;
    if constexpr (ASK) {
      prefetch_block(tiles + AMX_PREFETCH);
      // Each weight tile is read once, from L2 where it was asked for: loaded with the hint not
      // to keep it in L1 (STREAM_LOADS, above).
      _tile_stream_loadd(6, tiles, 64);
      _tile_stream_loadd(7, tiles + 512, 64);
    } else {
      _tile_loadd(6, tiles, 64);
      _tile_loadd(7, tiles + 512, 64);
    }
    _tile_loadd(4, xk, xs);
    if constexpr (BLOCKS > 1) _tile_loadd(5, xk + 16 * x_stride, xs);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (BLOCKS > 1) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    slice();
  }
  // out: [BLOCKS * 16 rows][32 columns] float32
  _tile_stored(0, out, PANEL * 4);
  _tile_stored(1, out + 16, PANEL * 4);
  if constexpr (BLOCKS > 1) {
    _tile_stored(2, out + 16 * PANEL, PANEL * 4);
    _tile_stored(3, out + 16 * PANEL + 16, PANEL * 4);
  }
}

// Three row blocks: one column tile at a time (the panel's second pass reads its weight tiles
// from cache), accumulators tmm0..tmm2, x in tmm4..tmm6, the weight tile in tmm7.
template <typename Slice = NoSlice>
inline void panel_product3(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t kblocks, float* out,
                           const Slice& slice = {}) {
  const int64_t xs = x_stride * 2;
  for (int j = 0; j < 2; ++j) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const uint16_t* xk = x + kb * KBLOCK;
      if (j == 0) prefetch_block(w + kb * 2 * 512 + AMX_PREFETCH);
      _tile_loadd(7, w + kb * 2 * 512 + j * 512, 64);
      _tile_loadd(4, xk, xs);
      _tile_loadd(5, xk + 16 * x_stride, xs);
      _tile_loadd(6, xk + 32 * x_stride, xs);
      _tile_dpbf16ps(0, 4, 7);
      _tile_dpbf16ps(1, 5, 7);
      _tile_dpbf16ps(2, 6, 7);
      slice();
    }
    _tile_stored(0, out + j * 16, PANEL * 4);
    _tile_stored(1, out + 16 * PANEL + j * 16, PANEL * 4);
    _tile_stored(2, out + 32 * PANEL + j * 16, PANEL * 4);
  }
}

// body(r0, chunk) for each pass of at most MAX_ROWS rows (rows r0 .. r0 + chunk - 1), the tiles
// configured for it.
template <typename Body>
inline void for_row_passes(int64_t rows, const Body& body) {
  for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
    const int64_t chunk = std::min(MAX_ROWS, rows - r0);
    configure_stream(chunk);
    body(r0, chunk);
  }
}

// One panel's product for ``chunk`` rows (tiles configured by configure_stream(chunk)) into out.
//
// Its sums leave the tiles through memory, and the vector loads that round them must wait until
// the tile stores are done. The products below therefore round (and activate) each panel's sums
// after the thread's next panel has been multiplied, from a second buffer (DEFERRED): decode
// steps of 16 samples 0.981x the time (alternating in one process, 0.965-1.000), 4 and 128
// samples unchanged (1.004x, 0.992x). The outputs are the same bit for bit.
//
// SLICED: the rounding and the gate/up activation (a division and an exponential per element) of
// a whole panel held the memory reads up while it ran: the fused gate/up product of 16 rows took
// 1.09x the time of a plain product over the same weights, 1.02x with no activation at all. So
// from ASK_ROWS rows on the previous panel is finished a row at a time between the next panel's k
// blocks, while the tiles multiply and the asked-for weights arrive. Whole decode steps, sliced
// against finished at once, alternating in one process: 8 samples 0.981x, 16 0.979x, 32 0.962x, 48
// 0.970x, 128 1.000x; at 2 and 4 samples (1.000x, 1.006x) panels are still finished at once.
template <typename Slice = NoSlice>
inline void amx_panel(int64_t chunk, const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t kblocks,
                      float* out, const Slice& slice = {}) {
  switch ((chunk + 15) / 16) {
    case 1:
      if (chunk >= ASK_ROWS) panel_product<1, true>(x, x_stride, w, kblocks, out, slice);
      else panel_product<1, false>(x, x_stride, w, kblocks, out, slice);
      break;
    case 2: panel_product<2>(x, x_stride, w, kblocks, out, slice); break;
    default: panel_product3(x, x_stride, w, kblocks, out, slice); break;
  }
}

// compute(p, b, slice) for panels begin .. end - 1 in order, into buffer b = p & 1, and the rows
// 0 .. rows - 1 of each panel finished by finish(p, b, r0, r1) (rows r0 .. r1 - 1) after the next
// panel's product has begun (DEFERRED, above). A pass of ASK_ROWS rows or more finishes one row
// each time that product calls slice() (once per k block), and the rows left after it (and the
// last panel's) at once; a smaller pass finishes each panel at once after the next one's product
// (SLICED, above).
template <typename Compute, typename Finish>
inline void panels_deferred(int64_t begin, int64_t end, int64_t rows, const Compute& compute, const Finish& finish) {
  const bool sliced = rows >= ASK_ROWS;
  for (int64_t p = begin; p < end; ++p) {
    const int prev = static_cast<int>((p - 1) & 1);
    int64_t done = p > begin ? 0 : rows;
    auto slice = [&] {
      if (sliced && done < rows) {
        finish(p - 1, prev, done, done + 1);
        ++done;
      }
    };
    compute(p, static_cast<int>(p & 1), slice);
    if (done < rows) finish(p - 1, prev, done, rows);
  }
  if (end > begin) finish(end - 1, static_cast<int>((end - 1) & 1), 0, rows);
}

#endif


#ifdef MULTISPEC_VECTOR_STREAM

constexpr int64_t VECTOR_ROWS = 12;  // rows sharing each weight vector: 24 accumulators of 32
// Elements ahead that the weight is asked for (32 KiB: sixteen k blocks), into L2 rather than L1:
// on a Zen 4 core, 8 KiB ahead into L1 streamed the weights at 16-19 GB/s of the 26 that one core
// reads, and products of 16 rows or more paid the weight's read and their arithmetic one after the
// other; 32 KiB into L2 reaches 25-26 GB/s and overlaps the two (experiments/stream_gemm.py: its
// "layers cold" against "layers hot").
constexpr int64_t PREFETCH = 16 * 1024;

// Rows [0, ROWS) of x times one panel (32 columns), rounded to bf16 with the bias into y. Each
// row's two accumulators (16 columns each) take the k pairs in order, one vdpbf16ps each.
template <int ROWS>
inline void vector_panel(const uint16_t* x, int64_t k, const uint16_t* w, int64_t kblocks, __m512 bias_lo,
                         __m512 bias_hi, uint16_t* y, int64_t n) {
  __m512 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const uint16_t* block = w + kb * 2 * 512;
    const uint16_t* xk = x + kb * KBLOCK;
    for (int r = 0; r < 16; ++r) {
      // Ask for the weight sixteen k blocks ahead: with several rows to multiply, the loop issues its
      // loads too slowly for the hardware prefetcher to keep enough of memory's reads in flight.
      _mm_prefetch(reinterpret_cast<const char*>(block + PREFETCH + r * 32), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(block + PREFETCH + 512 + r * 32), _MM_HINT_T1);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(block + r * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(block + 512 + r * 32);
      for (int m = 0; m < ROWS; ++m) {
        int32_t pair;
        std::memcpy(&pair, xk + m * k + 2 * r, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    const __m512 lo = _mm512_add_ps(acc[m][0], bias_lo), hi = _mm512_add_ps(acc[m][1], bias_hi);
    _mm512_storeu_si512(y + m * n, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

using VectorPanel = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, __m512, __m512, uint16_t*, int64_t);

template <int... R>
constexpr std::array<VectorPanel, sizeof...(R)> vector_panels(std::integer_sequence<int, R...>) {
  return {&vector_panel<R + 1>...};
}

#endif


#ifdef MULTISPEC_F32_STREAM

constexpr int F32_ROWS = 6;  // rows sharing each pair of weight vectors: twelve accumulators
// With one row block a panel, floats ahead that the weight is asked for, into L2 (16 KiB, as the
// bf16 vector path; panels lie one after the other, so this runs on into the next).
constexpr int64_t F32_PREFETCH = 4096;

// acc[m] += x[m * k] * (w0, w1) for the ROWS rows of x (row stride k), one FMA per sum: a panel
// kernel's step at one k. The loops over rows unrolled before register allocation: left to the
// later unroller, GCC kept a copy of every accumulator on the stack and stored all twelve at every
// k (half the speed).
template <int ROWS>
inline __attribute__((always_inline)) void add_rows(__m256 (&acc)[ROWS][2], const float* x, int64_t k, __m256 w0,
                                                    __m256 w1) {
#pragma GCC unroll 8
  for (int m = 0; m < ROWS; ++m) {
    const __m256 xb = _mm256_broadcast_ss(x + m * k);
    acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
    acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
  }
}

// y[m] = acc[m] + bias for the ROWS rows of a panel's 16 columns (row stride n).
template <int ROWS>
inline void store_rows(const __m256 (&acc)[ROWS][2], __m256 bias_lo, __m256 bias_hi, float* y, int64_t n) {
#pragma GCC unroll 8
  for (int m = 0; m < ROWS; ++m) {
    _mm256_storeu_ps(y + m * n, _mm256_add_ps(acc[m][0], bias_lo));
    _mm256_storeu_ps(y + m * n + 8, _mm256_add_ps(acc[m][1], bias_hi));
  }
}

// Rows [0, ROWS) of x times one panel (16 columns) plus the bias into y: each row's two
// accumulators take k in order, one FMA each. With several row blocks a panel, each block asks
// for its share of the next panel (``next``, or nullptr) while it computes, into L2: block
// ``part`` of ``parts`` its rows part * k / parts onwards, one every ``parts`` k. Asked for a fixed
// distance ahead instead, a panel's weight came from memory during its first row block only, a
// third of the panel's time at 16 rows, and the product waited for it (all products of the
// stack at 16 rows: 29.7-31.3 ms with every weight read from memory against 22.4-23.3 in cache;
// spread over the blocks, 24.6 against 22.8).
template <int ROWS>
inline void f32_panel(const float* x, int64_t k, const float* w, __m256 bias_lo, __m256 bias_hi, float* y,
                      int64_t n, const float* next, int64_t part, int64_t parts) {
  __m256 acc[ROWS][2];
#pragma GCC unroll 8
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const float* ask = next != nullptr ? next + part * k / parts * F32_PANEL : nullptr;
  const float* ask_end = next != nullptr ? next + k * F32_PANEL : nullptr;
  int64_t countdown = 1;
  for (int64_t kk = 0; kk < k; ++kk) {
    if (parts == 1) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kk * F32_PANEL + F32_PREFETCH), _MM_HINT_T1);
    } else if (--countdown == 0 && ask < ask_end) {
      _mm_prefetch(reinterpret_cast<const char*>(ask), _MM_HINT_T1);
      ask += F32_PANEL;  // one 64-byte line
      countdown = parts;
    }
    const float* row = w + kk * F32_PANEL;
    add_rows<ROWS>(acc, x + kk, k, _mm256_loadu_ps(row), _mm256_loadu_ps(row + 8));
  }
  store_rows<ROWS>(acc, bias_lo, bias_hi, y, n);
}

using F32Panel = void (*)(const float*, int64_t, const float*, __m256, __m256, float*, int64_t, const float*, int64_t,
                          int64_t);

template <int... R>
constexpr std::array<F32Panel, sizeof...(R)> f32_panels(std::integer_sequence<int, R...>) {
  return {&f32_panel<R + 1>...};
}

// body(p, b, blocks, r0, chunk, bias_lo, bias_hi) for every (panel p, block b of rows) of a float32
// product of ``rows`` rows and ``panels`` panels of 16 columns into y (row stride n): the rows in
// ``blocks`` blocks of at most six whose sizes differ by one at most (16 rows: 5 + 5 + 6), block b
// rows r0 .. r0 + chunk - 1; the panel's bias (``bp``, or none) in two vectors. A thread claims a
// whole panel at a time and runs its blocks in order: claimed one block at a time, every block paid
// for a claim (a locked compare-and-swap, which waits for the block's stores to the output, and two
// divisions), and the products of a step took 2-4% longer at 16 and 128 rows
// (``experiments/stream_builds.py``).
template <typename Body>
inline void for_panel_blocks(int64_t rows, int64_t panels, const float* bp, float* y, int64_t n, const Body& body) {
  const int64_t blocks = (rows + F32_ROWS - 1) / F32_ROWS;
  multispec_kernels::balanced_for(panels, [&](int64_t part, multispec_kernels::Shares& shares) {
    for (int64_t p; (p = shares.next(part)) >= 0;) {
      // The panel's output lines asked for with intent to write before its products: written
      // without, each line's fetch was still under way when the thread claimed its next panel,
      // and the claim (a locked compare-and-swap) waited for those stores (a step's products
      // 0.97-0.99x the time from 8 to 128 rows).
      for (int64_t r = 0; r < rows; ++r) __builtin_prefetch(y + r * n + p * F32_PANEL, 1, 3);
      const __m256 lo = bp != nullptr ? _mm256_loadu_ps(bp + p * F32_PANEL) : _mm256_setzero_ps();
      const __m256 hi = bp != nullptr ? _mm256_loadu_ps(bp + p * F32_PANEL + 8) : _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r0 = b * rows / blocks, chunk = (b + 1) * rows / blocks - r0;  // 1 .. 6
        body(p, b, blocks, r0, chunk, lo, hi);
      }
    }
  });
}

// y [M, N] = x [M, K] @ W^T + bias, float32, W given as stream_pack(W) [N / 16, K, 16].
void f32_stream(const at::Tensor& x, const at::Tensor& packed, const float* bp, at::Tensor& y) {
  static constexpr auto kernels = f32_panels(std::make_integer_sequence<int, F32_ROWS>{});
  const int64_t rows = x.size(0), panels = packed.size(0), k = packed.size(1), n = panels * F32_PANEL;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_panel_blocks(rows, panels, bp, yp, n, [&](int64_t p, int64_t b, int64_t blocks, int64_t r0, int64_t chunk,
                                                 __m256 lo, __m256 hi) {
    const float* next = p + 1 < panels ? wp + (p + 1) * k * F32_PANEL : nullptr;
    kernels[chunk - 1](xp + r0 * k, k, wp + p * k * F32_PANEL, lo, hi, yp + r0 * n + p * F32_PANEL, n, next, b, blocks);
  });
}

// Rows [0, ROWS) of x times one panel of affine_pack'ed weight plus the bias into y, the weight
// rebuilt in registers as it is multiplied (scale * q + offset, one fused multiply-add: exactly the
// float32 weight), the packed bytes asked for two blocks ahead. Each row's sums take k in order,
// one FMA each, as f32_panel's: the same result bit for bit.
template <int ROWS>
inline void affine_panel(const float* x, int64_t k, const uint8_t* src, __m256 bias_lo, __m256 bias_hi, float* y,
                         int64_t n) {
  __m256 acc[ROWS][2];
#pragma GCC unroll 8
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const int64_t kblocks = k / AFFINE_BLOCK;
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const uint8_t* block = src + kb * AFFINE_BYTES;
    for (int64_t line = 0; line < AFFINE_BYTES; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + 2 * AFFINE_BYTES + line), _MM_HINT_T0);
    const float* scales = reinterpret_cast<const float*>(block);
    const __m256 s0 = _mm256_loadu_ps(scales), s1 = _mm256_loadu_ps(scales + 8);
    const __m256 m0 = _mm256_loadu_ps(scales + F32_PANEL), m1 = _mm256_loadu_ps(scales + F32_PANEL + 8);
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2 * F32_PANEL * 4);
    const float* xk = x + kb * AFFINE_BLOCK;
    // Each half of a k's sixteen bytes widened straight from memory: one shuffle fewer a k than
    // loading all sixteen and shifting the upper half down, on a Zen 2 core the difference between
    // 7.0 and 6.0 cycles a panel and k at four rows (a step's products of 4 rows 0.87x the time).
    for (int64_t r = 0; r < AFFINE_BLOCK; ++r) {
      const __m128i v0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + r * F32_PANEL));
      const __m128i v1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + r * F32_PANEL + 8));
      const __m256 w0 = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0)), m0);
      const __m256 w1 = _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1)), m1);
      add_rows<ROWS>(acc, xk + r, k, w0, w1);
    }
  }
  store_rows<ROWS>(acc, bias_lo, bias_hi, y, n);
}

using AffinePanel = void (*)(const float*, int64_t, const uint8_t*, __m256, __m256, float*, int64_t);

template <int... R>
constexpr std::array<AffinePanel, sizeof...(R)> affine_panels(std::integer_sequence<int, R...>) {
  return {&affine_panel<R + 1>...};
}

// y [M, N] = x [M, K] @ W^T + bias, float32, W given as affine_pack(W), rows in blocks of at most six
// as f32_stream. Rebuilding costs arithmetic, so this wins where the float32 product waits on
// memory: on a 2-core Zen 2 all of the default model's products took 0.44x the float32 stream's
// time at 4 rows, 0.75x at 8, 0.91x at 10, 1.02x at 11 and 1.08x at 12 (``Projection`` uses it up
// to ``AFFINE_ROWS``; blocks of at most four rows instead, which need no spilled scales, were
// slower at 5, 6 and 10 rows). Rebuilding once into a float32 buffer for all row blocks instead was
// slower from 8 rows on (1.19x at 8).
void affine_stream(const at::Tensor& x, const at::Tensor& packed, const float* bp, at::Tensor& y) {
  static constexpr auto fused = affine_panels(std::make_integer_sequence<int, F32_ROWS>{});
  const int64_t rows = x.size(0), panels = packed.size(0), kblocks = packed.size(1);
  const int64_t k = kblocks * AFFINE_BLOCK, n = panels * F32_PANEL;
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // A panel's later row blocks rebuild it from its packed bytes in cache.
  for_panel_blocks(rows, panels, bp, yp, n, [&](int64_t p, int64_t, int64_t, int64_t r0, int64_t chunk, __m256 lo,
                                                 __m256 hi) {
    fused[chunk - 1](xp + r0 * k, k, pp + p * kblocks * AFFINE_BYTES, lo, hi, yp + r0 * n + p * F32_PANEL, n);
  });
}

#endif

}  // namespace

namespace multispec {

// How products stream their weights here: 2 on AMX tiles (the CPU has them, Linux
// granted them, MULTISPEC_AMX is not "0"), 1 on AVX512-BF16 vectors (built for a CPU that has them),
// both for bf16 weights; 3 float32 weights on AVX2 vectors (a CPU with AVX2 and FMA but no AVX-512);
// 0 not at all (none of these, or MULTISPEC_STREAM is "0": the CPU library's product). Read at every
// call, so that a comparison can switch paths.
int64_t stream_kind() {
  const char* flag = std::getenv("MULTISPEC_STREAM");
  if (flag != nullptr && std::strcmp(flag, "0") == 0) return 0;
#ifdef MULTISPEC_AMX
  if (multispec_amx::enabled()) return 2;
#endif
#if defined(MULTISPEC_VECTOR_STREAM)
  return 1;
#elif defined(MULTISPEC_F32_STREAM)
  return 3;
#else
  return 0;
#endif
}

bool stream_available() { return stream_kind() > 0; }

// y [M, N] = x [M, K] @ W^T + bias, W given as stream_pack(W), on the product ``kind`` says runs here
// (stream_kind(), which the layer stack reads once a step rather than once a product).
at::Tensor stream_linear_on(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            int64_t kind) {
  if (x.scalar_type() == at::kFloat || packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kByte) {
    // float32 x and a stream_pack'ed float32 weight, or its integer blocks (affine_pack).
    const bool blocks = packed.scalar_type() == at::kByte;
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && packed.dim() == 3 &&
                    (blocks ? packed.size(2) == AFFINE_BYTES
                            : packed.scalar_type() == at::kFloat && packed.size(2) == F32_PANEL),
                "stream_linear takes float32 x [rows, in] and a stream_pack'ed float32 weight or its affine_pack");
    const int64_t rows = x.size(0), n = packed.size(0) * F32_PANEL;
    const int64_t k = blocks ? packed.size(1) * AFFINE_BLOCK : packed.size(1);
    TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
    if (bias.has_value() && bias->defined())
      TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat, "bias must be float32 [out]");
    at::Tensor y = at::empty({rows, n}, x.options());
    if (rows == 0) return y;
    TORCH_CHECK(kind == 3,
                "stream_linear in float32 needs AVX2 and FMA without AVX-512 on this CPU (and MULTISPEC_STREAM not 0)");
#ifdef MULTISPEC_F32_STREAM
    const at::Tensor xin = x.contiguous();
    const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
    (blocks ? affine_stream : f32_stream)(xin, packed.contiguous(), b.defined() ? b.data_ptr<float>() : nullptr, y);
#endif
    return y;
  }
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 32,
              "stream_linear takes bf16 x [rows, in] and a stream_pack'ed weight");
  const int64_t rows = x.size(0), panels = packed.size(0), kblocks = packed.size(1);
  const int64_t n = panels * PANEL, k = kblocks * KBLOCK;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kBFloat16, "bias must be bf16 [out]");
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  TORCH_CHECK(kind == 1 || kind == 2,
              "stream_linear in bf16 needs AMX tiles or AVX512-BF16 on this CPU (and MULTISPEC_STREAM not 0)");
#if defined(MULTISPEC_AMX) || defined(MULTISPEC_VECTOR_STREAM)
  const at::Tensor xin = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xin.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  const uint16_t* bp = b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t panel_elems = kblocks * 2 * 512;
  // The bias of panel p, widened to float32, sixteen columns a vector.
  auto panel_bias = [&](int64_t p, __m512& lo, __m512& hi) {
    lo = hi = _mm512_setzero_ps();
    if (bp == nullptr) return;
    const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + p * PANEL));
    const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + p * PANEL + 16));
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(first), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(second), 16));
  };
#endif
#ifdef MULTISPEC_AMX
  if (kind == 2) {
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      multispec_amx::Release release{true};
      alignas(64) float out[2][MAX_ROWS * PANEL];
      for_row_passes(rows, [&](int64_t r0, int64_t chunk) {
        const uint16_t* xc = xp + r0 * k;
        // Round each row's 32 sums of panel p (plus the bias) to bf16, nearest even, sixteen lanes
        // at a time.
        auto finish = [&](int64_t p, const float* sums, int64_t first, int64_t last) {
          __m512 bias_lo, bias_hi;
          panel_bias(p, bias_lo, bias_hi);
          for (int64_t r = first; r < last; ++r) {
            const float* o = sums + r * PANEL;
            const __m512 lo = _mm512_add_ps(_mm512_load_ps(o), bias_lo);
            const __m512 hi = _mm512_add_ps(_mm512_load_ps(o + 16), bias_hi);
            _mm512_storeu_si512(yp + (r0 + r) * n + p * PANEL, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
          }
        };
        panels_deferred(
            begin, end, chunk,
            [&](int64_t p, int b, const auto& slice) {
              amx_panel(chunk, xc, k, wp + p * panel_elems, kblocks, out[b], slice);
            },
            [&](int64_t p, int b, int64_t first, int64_t last) { finish(p, out[b], first, last); });
      });
    });
    return y;
  }
#endif
#ifdef MULTISPEC_VECTOR_STREAM
  static constexpr auto kernels = vector_panels(std::make_integer_sequence<int, VECTOR_ROWS>{});
  // Rows in blocks of equal size (16 rows: 8 + 8, not 12 + 4): a block of few rows has too few
  // accumulators to hide the dot product's latency.
  const int64_t blocks = (rows + VECTOR_ROWS - 1) / VECTOR_ROWS, per_block = (rows + blocks - 1) / blocks;
  // Items are (panel, block of rows), a panel's blocks adjacent: a thread's own share walks the
  // panels in order and reuses each panel's weights from cache across its row blocks; the items a
  // thread takes from another's share at the end are single row blocks.
  multispec_kernels::balanced_for(panels * blocks, [&](int64_t part, multispec_kernels::Shares& shares) {
    for (int64_t item; (item = shares.next(part)) >= 0;) {
      const int64_t p = item / blocks, r0 = item % blocks * per_block;
      __m512 bias_lo, bias_hi;
      panel_bias(p, bias_lo, bias_hi);
      const int64_t chunk = std::min(per_block, rows - r0);  // >= 1: (blocks - 1) * per_block < rows
      kernels[chunk - 1](xp + r0 * k, k, wp + p * panel_elems, kblocks, bias_lo, bias_hi, yp + r0 * n + p * PANEL, n);
    }
  });
#endif
  return y;
}

// silu(gate) * up of a fused gate/up product: x [M, K] times W^T, W = [gate; up] ([2I, K], the
// gate's I rows first, stream_pack'ed), plus the bias, gives the gate and up halves; the result
// [M, I] is what stream_linear followed by the layer stack's activation gives, bit for bit (each
// half rounded to bf16 with its bias, then silu_times, then rounded), without writing the [M, 2I]
// product or a second pass over it: a thread takes gate panel p and up panel p + I / 32 together
// and activates them while they are in cache. AMX tiles only (``kind``: stream_kind() 2), I % 32 == 0.
at::Tensor stream_gate_up_on(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                             int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  packed.dim() == 5 && packed.size(0) % 2 == 0 && packed.size(2) == 2 && packed.size(3) == 16 &&
                  packed.size(4) == 32,
              "stream_gate_up takes bf16 x [rows, in] and a stream_pack'ed gate/up weight of an even panel count");
  const int64_t rows = x.size(0), half = packed.size(0) / 2, kblocks = packed.size(1);
  const int64_t n = half * PANEL, k = kblocks * KBLOCK;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  if (b.defined()) TORCH_CHECK(b.numel() == 2 * n && b.scalar_type() == at::kBFloat16, "bias must be bf16 [out]");
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  TORCH_CHECK(kind == 2, "stream_gate_up needs AMX tiles on this CPU (and MULTISPEC_STREAM not 0)");
#ifdef MULTISPEC_AMX
  using multispec_kernels::rounded;
  using multispec_kernels::widen;
  const at::Tensor xin = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xin.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const c10::BFloat16* bp = b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t panel_elems = kblocks * 2 * 512;
  at::parallel_for(0, half, 1, [&](int64_t begin, int64_t end) {
    multispec_amx::Release release{true};
    alignas(64) float gates[2][MAX_ROWS * PANEL];
    alignas(64) float ups[2][MAX_ROWS * PANEL];
    float gate_bias[PANEL] = {}, up_bias[PANEL] = {};
    for_row_passes(rows, [&](int64_t r0, int64_t chunk) {
      const uint16_t* xc = xp + r0 * k;
      // Rows first .. last - 1 of panel pair p's activation from buffer b, during or after the next
      // pair's products (DEFERRED, SLICED).
      auto finish = [&](int64_t p, int b, int64_t first, int64_t last) {
        const float* gate = gates[b];
        const float* up = ups[b];
        if (bp != nullptr && first == 0)  // a panel's rows are finished in order, from row 0
          for (int64_t c = 0; c < PANEL; ++c) {
            gate_bias[c] = widen(bp[p * PANEL + c]);
            up_bias[c] = widen(bp[n + p * PANEL + c]);
          }
        for (int64_t r = first; r < last; ++r) {
          const float* g = gate + r * PANEL;
          const float* u = up + r * PANEL;
          c10::BFloat16* o = yp + (r0 + r) * n + p * PANEL;
          for (int64_t c = 0; c < PANEL; ++c)
            o[c] = multispec_kernels::narrow_to<c10::BFloat16>(multispec_kernels::silu_times<c10::BFloat16>(
                rounded<c10::BFloat16>(g[c] + gate_bias[c]), rounded<c10::BFloat16>(u[c] + up_bias[c])));
        }
      };
      panels_deferred(
          begin, end, chunk,
          [&](int64_t p, int b, const auto& slice) {
            amx_panel(chunk, xc, k, wp + p * panel_elems, kblocks, gates[b], slice);
            amx_panel(chunk, xc, k, wp + (p + half) * panel_elems, kblocks, ups[b], slice);
          },
          finish);
    });
  });
#endif
  return y;
}

// The operators: the kind read at every call, so that MULTISPEC_STREAM / MULTISPEC_AMX switch paths.
at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return stream_linear_on(x, packed, bias, stream_kind());
}

at::Tensor stream_gate_up(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return stream_gate_up_on(x, packed, bias, stream_kind());
}

}  // namespace multispec

TORCH_LIBRARY_FRAGMENT(multispec, m) {
  m.def("stream_pack(Tensor weight) -> Tensor");
  m.def("affine_pack(Tensor weight) -> Tensor?");
  m.def("stream_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("stream_gate_up(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("stream_available() -> bool", &multispec::stream_available);
  m.def("stream_kind() -> int", &multispec::stream_kind);
}

TORCH_LIBRARY_IMPL(multispec, CPU, m) {
  m.impl("stream_pack", &stream_pack);
  m.impl("affine_pack", &affine_pack);
  m.impl("stream_linear", &multispec::stream_linear);
  m.impl("stream_gate_up", &multispec::stream_gate_up);
}
