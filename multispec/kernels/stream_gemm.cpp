// Matrix products of a few rows on AMX tiles, streaming the weight once: y = x W^T (+ bias), bf16.
//
// A decode step multiplies a handful of rows (its samples and their draft tokens) by every weight
// of the model, so its products are bound by reading the weights from memory, not by arithmetic.
// The CPU library's prepacked product reaches about half the machine's read bandwidth at 4 to 16
// rows. Here the weight is laid out once, at load, in exactly the order the tiles consume it, so a
// product is one sequential read of it: panels of 32 output columns, each panel's K in blocks of 32,
// each block two 1 KiB tiles (16 columns each) in the tiles' pair layout (row r holds k = 2r, 2r + 1
// of every column). Up to 48 rows of x take one pass over the weight, in row blocks of up to 16
// (the last block's tiles hold only the rows there are, so x is read in place, never padded); more
// rows take one pass per 48. Each output row is a function of its own x row only, accumulated in
// float32 in the same order whatever the row count, then rounded once (with the bias added) to bf16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx_attention.h"
#include "common.h"

#include <cstdint>

namespace {

constexpr int64_t PANEL = 32;     // output columns a panel holds (two tiles of 16)
constexpr int64_t KBLOCK = 32;    // reduction depth of one tile product in bf16
constexpr int64_t MAX_ROWS = 48;  // rows of x one pass over the weight takes

bool layout_fits(int64_t n, int64_t k) { return n % PANEL == 0 && k % KBLOCK == 0 && n > 0 && k > 0; }

// [N, K] bf16 -> [N / 32, K / 32, 2, 16, 32] bf16: panel, k block, column tile, k pair, (column, k) pair.
at::Tensor stream_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "stream_pack takes a bf16 [out, in] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(layout_fits(n, k), "stream_pack needs out % 32 == 0 and in % 32 == 0, got ", n, " x ", k);
  // [N/32, 2, 16 col, K/32, 16 pair, 2] -> [N/32, K/32, 2, 16 pair, 16 col, 2]
  return weight.contiguous()
      .view({n / PANEL, 2, 16, k / KBLOCK, 16, 2})
      .permute({0, 3, 1, 4, 2, 5})
      .contiguous()
      .view({n / PANEL, k / KBLOCK, 2, 16, 32});
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
  _tile_loadconfig(&config);
}

// Tiles have no renaming: a load into a tile waits for the product still reading it, so every
// operand of one k block gets its own tile.
//
// One or two row blocks: accumulators tmm0..tmm3 (row block i, column tile j: tile 2i + j), x's
// row blocks in tmm4 and tmm5, the two weight tiles in tmm6 and tmm7.
template <int BLOCKS>
inline void panel_product(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t kblocks, float* out) {
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
    _tile_loadd(6, tiles, 64);
    _tile_loadd(7, tiles + 512, 64);
    _tile_loadd(4, xk, xs);
    if constexpr (BLOCKS > 1) _tile_loadd(5, xk + 16 * x_stride, xs);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (BLOCKS > 1) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
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
inline void panel_product3(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t kblocks, float* out) {
  const int64_t xs = x_stride * 2;
  for (int j = 0; j < 2; ++j) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const uint16_t* xk = x + kb * KBLOCK;
      _tile_loadd(7, w + kb * 2 * 512 + j * 512, 64);
      _tile_loadd(4, xk, xs);
      _tile_loadd(5, xk + 16 * x_stride, xs);
      _tile_loadd(6, xk + 32 * x_stride, xs);
      _tile_dpbf16ps(0, 4, 7);
      _tile_dpbf16ps(1, 5, 7);
      _tile_dpbf16ps(2, 6, 7);
    }
    _tile_stored(0, out + j * 16, PANEL * 4);
    _tile_stored(1, out + 16 * PANEL + j * 16, PANEL * 4);
    _tile_stored(2, out + 32 * PANEL + j * 16, PANEL * 4);
  }
}

#endif

}  // namespace

namespace multispec {

// Whether the tiles may be used now (the CPU has them, Linux granted them, MULTISPEC_AMX is not "0").
bool stream_available() {
#ifdef MULTISPEC_AMX
  return multispec_amx::enabled();
#else
  return false;
#endif
}

// y [M, N] = x [M, K] @ W^T + bias, W given as stream_pack(W).
at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
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
#ifdef MULTISPEC_AMX
  TORCH_CHECK(stream_available(), "stream_linear needs the CPU's tile registers (AMX)");
  const at::Tensor xin = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xin.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  const uint16_t* bp = b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t panel_elems = kblocks * 2 * 512;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    multispec_amx::Release release{true};
    alignas(64) float out[MAX_ROWS * PANEL];
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
      const int64_t chunk = std::min(MAX_ROWS, rows - r0);
      configure_stream(chunk);
      const uint16_t* xc = xp + r0 * k;
      for (int64_t p = begin; p < end; ++p) {
        const uint16_t* w = wp + p * panel_elems;
        switch ((chunk + 15) / 16) {
          case 1: panel_product<1>(xc, k, w, kblocks, out); break;
          case 2: panel_product<2>(xc, k, w, kblocks, out); break;
          default: panel_product3(xc, k, w, kblocks, out); break;
        }
        // Round each row's 32 sums (plus the bias) to bf16, nearest even, sixteen lanes at a time.
        __m512 bias_lo = _mm512_setzero_ps(), bias_hi = _mm512_setzero_ps();
        if (bp != nullptr) {
          const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + p * PANEL));
          const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + p * PANEL + 16));
          bias_lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(first), 16));
          bias_hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(second), 16));
        }
        for (int64_t r = 0; r < chunk; ++r) {
          const float* o = out + r * PANEL;
          const __m512 lo = _mm512_add_ps(_mm512_load_ps(o), bias_lo);
          const __m512 hi = _mm512_add_ps(_mm512_load_ps(o + 16), bias_hi);
          _mm512_storeu_si512(yp + (r0 + r) * n + p * PANEL, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "stream_linear needs the CPU's tile registers (AMX)");
#endif
}

}  // namespace multispec

TORCH_LIBRARY_FRAGMENT(multispec, m) {
  m.def("stream_pack(Tensor weight) -> Tensor");
  m.def("stream_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("stream_available() -> bool", &multispec::stream_available);
}

TORCH_LIBRARY_IMPL(multispec, CPU, m) {
  m.impl("stream_pack", &stream_pack);
  m.impl("stream_linear", &multispec::stream_linear);
}
