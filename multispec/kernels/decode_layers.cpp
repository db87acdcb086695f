// A decode step's whole layer stack in one call, for the CPU: every decoder layer of a Llama-family
// model over the step's packed tokens, then the final norm.
//
// At a few samples in flight the matrix products of a step stream the weights once and are near
// their floor; what makes the step cost twice that is everything between them: some thirty small
// operators a layer (norms, rotary embedding, residual adds, the gate's activation, dtype
// conversions, views), each dispatched from Python. Here each layer is eight calls made from C++:
// add + norm, the fused q/k/v product, the rotation of q and k in place, the compiled attention
// (decode_attention.cpp), the output product, add + norm, the fused gate/up product, the gate's
// activation times up, the down product. The products are the same calls the Python path makes
// (the streaming product, on AMX tiles or AVX512-BF16 vectors, up to the row limit the caller
// passes, else the CPU library's prepacked product, or at::linear), and every element-wise step rounds where
// the Python path rounds (to the model's dtype after each operator), so both paths agree to the
// last bit except where a sum runs in another order (the norm's mean of squares).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <optional>
#include <string_view>
#include <vector>

namespace multispec {
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            const at::Tensor& own_k, const at::Tensor& own_v, const at::Tensor& prompt_k,
                            const at::Tensor& prompt_v, const at::Tensor& sample_slot, const at::Tensor& offsets,
                            const at::Tensor& counts, const at::Tensor& written, const at::Tensor& prompt_slot,
                            const at::Tensor& prompt_len, const at::Tensor& tree_mask, double scale);
at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
bool stream_available();
}

namespace {

using multispec_kernels::exp_nonpositive;
using multispec_kernels::narrow_to;
using multispec_kernels::rounded;
using multispec_kernels::widen;

constexpr int64_t GRAIN = 8;  // rows per task of the element-wise loops

// x += delta (rounded to scalar_t, as the residual add of the Python path), then
// out = weight * round(x * rsqrt(mean(x^2) + eps)), rounded. delta may be undefined (no add).
template <typename scalar_t>
void add_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* dp = delta.defined() ? delta.data_ptr<scalar_t>() : nullptr;
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    float* v = row.data();
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = xp + r * n;
      if (dp != nullptr) {
        const scalar_t* d = dp + r * n;
        for (int64_t i = 0; i < n; ++i) {
          v[i] = rounded<scalar_t>(widen(xr[i]) + widen(d[i]));
          xr[i] = narrow_to<scalar_t>(v[i]);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) v[i] = widen(xr[i]);
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) squares += v[i] * v[i];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(n) + static_cast<float>(eps));
      scalar_t* o = op + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = narrow_to<scalar_t>(widen(wp[i]) * rounded<scalar_t>(v[i] * inv));
    }
  });
}

// Rotates the first ``heads`` heads of each row of qkv [T, all_heads, D] in place (the halves
// layout): x * cos + rotate_half(x) * sin, each product and the sum rounded as in the Python path.
template <typename scalar_t>
void rotate(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  const int64_t rows = qkv.size(0), dim = qkv.size(2), half = dim / 2;
  const int64_t rs = qkv.stride(0), hs = qkv.stride(1);
  scalar_t* p = qkv.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> table(2 * dim);
    float* c = table.data();
    float* s = c + dim;
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t d = 0; d < dim; ++d) {
        c[d] = widen(cp[r * cs + d]);
        s[d] = widen(sp[r * ss + d]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* x = p + r * rs + h * hs;
        for (int64_t d = 0; d < half; ++d) {
          const float a = widen(x[d]), b = widen(x[d + half]);
          const float lo = rounded<scalar_t>(a * c[d]) + rounded<scalar_t>(-b * s[d]);
          const float hi = rounded<scalar_t>(b * c[d + half]) + rounded<scalar_t>(a * s[d + half]);
          x[d] = narrow_to<scalar_t>(lo);
          x[d + half] = narrow_to<scalar_t>(hi);
        }
      }
    }
  });
}

// out[T, I] = round(silu(gate)) * up, rounded; gate_up is [T, 2I] with the gate first.
// silu(x) = x * sigmoid(x), the sigmoid from exp(-|x|) so that the exponent is never positive.
template <typename scalar_t>
void silu_mul(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = out.size(0), n = out.size(1), gs = gate_up.stride(0);
  const scalar_t* gp = gate_up.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gp + r * gs;
      const scalar_t* u = g + n;
      scalar_t* o = op + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float x = widen(g[i]);
        const float e = exp_nonpositive(-std::fabs(x));
        const float sigmoid = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
        o[i] = narrow_to<scalar_t>(rounded<scalar_t>(x * sigmoid) * widen(u[i]));
      }
    }
  });
}

using PackedLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                std::string_view, c10::List<std::optional<at::Scalar>>,
                                std::optional<std::string_view>);

// The product the Python path's ``Projection`` makes for these rows: the streaming product
// (stream_gemm.cpp) where the weight has its layout and the rows are within stream_rows, else the
// library's.
at::Tensor product(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool packed,
                   const at::Tensor* stream, int64_t stream_rows) {
  if (stream != nullptr && x.size(0) <= stream_rows && multispec::stream_available())
    return multispec::stream_linear(x, *stream, bias);
  if (!packed) return at::linear(x, weight, bias);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<PackedLinear>();
  return op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

template <typename scalar_t>
at::Tensor layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList input_norm,
                  at::TensorList post_norm, at::TensorList qkv, const c10::List<std::optional<at::Tensor>>& qkv_bias,
                  at::TensorList o, const c10::List<std::optional<at::Tensor>>& o_bias, at::TensorList gate_up,
                  const c10::List<std::optional<at::Tensor>>& gate_up_bias, at::TensorList down,
                  const c10::List<std::optional<at::Tensor>>& down_bias, const at::Tensor& final_norm, bool packed,
                  at::TensorList stream, int64_t stream_rows, int64_t heads, int64_t kv_heads, double eps,
                  const at::Tensor& sample_k, const at::Tensor& sample_v,
                  const at::Tensor& prompt_k, const at::Tensor& prompt_v, const at::Tensor& sample_slot,
                  const at::Tensor& offsets, const at::Tensor& counts, const at::Tensor& written,
                  const at::Tensor& prompt_slot, const at::Tensor& prompt_len, const at::Tensor& tree_mask,
                  double scale) {
  const int64_t tokens = x.size(0), dim = sample_k.size(-1);
  at::Tensor normed = at::empty_like(x);
  at::Tensor delta;  // the last block's output, added to x by the next add_norm
  const size_t n = qkv.size();
  // The tile-streaming layout of product ``kind`` (0 q/k/v, 1 o, 2 gate/up, 3 down) of a layer, if any.
  auto streamed = [&](size_t kind, size_t layer) { return stream.empty() ? nullptr : &stream[kind * n + layer]; };
  for (size_t layer = 0; layer < n; ++layer) {
    add_norm<scalar_t>(x, delta, input_norm[layer], normed, eps);
    at::Tensor fused = product(normed, qkv[layer], qkv_bias.get(layer), packed, streamed(0, layer), stream_rows)
                           .view({tokens, heads + 2 * kv_heads, dim});
    rotate<scalar_t>(fused, cos, sin, heads + kv_heads);
    at::Tensor q = fused.narrow(1, 0, heads), k = fused.narrow(1, heads, kv_heads);
    at::Tensor v = fused.narrow(1, heads + kv_heads, kv_heads);
    at::Tensor attended = multispec::decode_attention(
        q, k, v, sample_k.select(0, layer), sample_v.select(0, layer), prompt_k.select(0, layer),
        prompt_v.select(0, layer), sample_slot, offsets, counts, written, prompt_slot, prompt_len, tree_mask, scale);
    delta = product(attended.view({tokens, heads * dim}), o[layer], o_bias.get(layer), packed, streamed(1, layer),
                    stream_rows);
    add_norm<scalar_t>(x, delta, post_norm[layer], normed, eps);
    at::Tensor both = product(normed, gate_up[layer], gate_up_bias.get(layer), packed, streamed(2, layer), stream_rows);
    at::Tensor activated = at::empty({tokens, both.size(1) / 2}, x.options());
    silu_mul<scalar_t>(both, activated);
    delta = product(activated, down[layer], down_bias.get(layer), packed, streamed(3, layer), stream_rows);
  }
  at::Tensor out = at::empty_like(x);
  add_norm<scalar_t>(x, delta, final_norm, out, eps);
  return out;
}

at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList input_norm, at::TensorList post_norm, at::TensorList qkv,
                         const c10::List<std::optional<at::Tensor>>& qkv_bias, at::TensorList o,
                         const c10::List<std::optional<at::Tensor>>& o_bias, at::TensorList gate_up,
                         const c10::List<std::optional<at::Tensor>>& gate_up_bias, at::TensorList down,
                         const c10::List<std::optional<at::Tensor>>& down_bias, const at::Tensor& final_norm,
                         bool packed, at::TensorList stream, int64_t stream_rows, int64_t heads, int64_t kv_heads,
                         double eps, const at::Tensor& sample_k,
                         const at::Tensor& sample_v, const at::Tensor& prompt_k, const at::Tensor& prompt_v,
                         const at::Tensor& sample_slot, const at::Tensor& offsets, const at::Tensor& counts,
                         const at::Tensor& written, const at::Tensor& prompt_slot, const at::Tensor& prompt_len,
                         const at::Tensor& tree_mask, double scale) {
  const size_t n = qkv.size();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [tokens, hidden]");
  TORCH_CHECK(input_norm.size() == n && post_norm.size() == n && o.size() == n && gate_up.size() == n &&
                  down.size() == n && qkv_bias.size() == n && o_bias.size() == n && gate_up_bias.size() == n &&
                  down_bias.size() == n && sample_k.size(0) == static_cast<int64_t>(n),
              "one entry per layer in every weight list and in the caches");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == x.size(0) && sin.size(0) == x.size(0) &&
                  cos.size(1) == sample_k.size(-1) && cos.stride(1) == 1 && sin.stride(1) == 1,
              "cos and sin are [tokens, head_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin share the activations' dtype");
  for (at::TensorList list : {input_norm, post_norm})
    for (const at::Tensor& w : list)
      TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(1),
                  "norm weights are contiguous [hidden] in the activations' dtype");
  TORCH_CHECK(final_norm.scalar_type() == x.scalar_type() && final_norm.is_contiguous() &&
                  final_norm.numel() == x.size(1), "the final norm's weight is contiguous [hidden]");
  at::Tensor hidden = x.clone();  // the residual stream, updated in place
  switch (x.scalar_type()) {
    case at::kFloat:
      return layers<float>(hidden, cos, sin, input_norm, post_norm, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias,
                           down, down_bias, final_norm, packed, stream, stream_rows, heads, kv_heads, eps, sample_k,
                           sample_v, prompt_k, prompt_v, sample_slot, offsets, counts, written, prompt_slot,
                           prompt_len, tree_mask, scale);
    case at::kBFloat16:
      return layers<c10::BFloat16>(hidden, cos, sin, input_norm, post_norm, qkv, qkv_bias, o, o_bias, gate_up,
                                   gate_up_bias, down, down_bias, final_norm, packed, stream, stream_rows, heads,
                                   kv_heads, eps, sample_k, sample_v, prompt_k, prompt_v, sample_slot, offsets,
                                   counts, written, prompt_slot, prompt_len, tree_mask, scale);
    default:
      TORCH_CHECK(false, "decode_layers runs float32 and bfloat16 models");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multispec, m) {
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] input_norm, Tensor[] post_norm, Tensor[] qkv, "
        "Tensor?[] qkv_bias, Tensor[] o, Tensor?[] o_bias, Tensor[] gate_up, Tensor?[] gate_up_bias, Tensor[] down, "
        "Tensor?[] down_bias, Tensor final_norm, bool packed, Tensor[] stream, int stream_rows, int heads, "
        "int kv_heads, float eps, "
        "Tensor(a!) sample_k, Tensor(b!) sample_v, Tensor prompt_k, Tensor prompt_v, Tensor sample_slot, "
        "Tensor offsets, Tensor counts, Tensor written, Tensor prompt_slot, Tensor prompt_len, Tensor tree_mask, "
        "float scale) -> Tensor");
}

// Prepacked weights are tensors of the CPU library's own kind: the call dispatches on them too.
TORCH_LIBRARY_IMPL(multispec, CPU, m) { m.impl("decode_layers", &decode_layers); }
TORCH_LIBRARY_IMPL(multispec, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
