// A decode step's whole layer stack in one call, for the CPU: every decoder layer of a Llama-family
// model over the step's packed tokens, then the final norm. Gemma's norms (by 1 + weight, around
// each block for Gemma 2 and 3), GELU gates, SmolLM3's unrotated layers, Gemma 3's second
// rotation and OLMo 2's norms (on the blocks' outputs, and on q and k whole) run here too
// (``Extras``).
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
#include <ATen/record_function.h>
#include <torch/library.h>

#include "common.h"
#include "decode_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <optional>
#include <string_view>
#include <vector>

namespace multispec {
at::Tensor stream_linear_on(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            int64_t kind);
at::Tensor stream_gate_up_on(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                             int64_t kind);
int64_t stream_kind();
}

namespace {

using multispec_kernels::exp_nonpositive;
using multispec_kernels::narrow_to;
using multispec_kernels::rounded;
using multispec_kernels::silu_times;
using multispec_kernels::widen;

constexpr int64_t GRAIN = 8;  // rows per task of the element-wise loops

// How a norm scales its normalised row, as the Python path's RMSNorm does: Llama's weight *
// round(normalised), rounded; Gemma's round(normalised * (1 + weight)) in float32; OLMo 2's
// round(normalised * weight) in float32.
enum NormKind : int64_t { LLAMA_NORM = 0, GEMMA_NORM = 1, FLOAT32_NORM = 2 };

template <typename scalar_t>
inline scalar_t scaled(float normalised, scalar_t weight, int64_t kind) {
  if (kind == GEMMA_NORM) return narrow_to<scalar_t>(normalised * (1.0f + widen(weight)));
  if (kind == FLOAT32_NORM) return narrow_to<scalar_t>(normalised * widen(weight));
  return narrow_to<scalar_t>(widen(weight) * rounded<scalar_t>(normalised));
}

// x += delta (rounded to scalar_t, as the residual add of the Python path), then out = the norm of
// x (``kind``, see NormKind) over rsqrt(mean(x^2) + eps). delta may be undefined (no add).
template <typename scalar_t>
void add_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, at::Tensor& out, double eps,
              int64_t kind = LLAMA_NORM) {
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
      for (int64_t i = 0; i < n; ++i) o[i] = scaled<scalar_t>(v[i] * inv, wp[i], kind);
    }
  });
}

// x += delta in place, each sum rounded (a residual add with no norm after it: OLMo 2's).
template <typename scalar_t>
void add_to(at::Tensor& x, const at::Tensor& delta) {
  const int64_t count = x.numel();
  scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* dp = delta.data_ptr<scalar_t>();
  at::parallel_for(0, count, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) xp[i] = narrow_to<scalar_t>(widen(xp[i]) + widen(dp[i]));
  });
}

// ``dim`` values in place (a head, or OLMo 2's whole q or k): the RMSNorm of the Python path over
// them, of ``kind`` (see NormKind).
template <typename scalar_t>
inline void norm_head(scalar_t* x, const scalar_t* weight, int64_t dim, float eps, int64_t kind) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t d = 0; d < dim; ++d) squares += widen(x[d]) * widen(x[d]);
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
  for (int64_t d = 0; d < dim; ++d) x[d] = scaled<scalar_t>(widen(x[d]) * inv, weight[d], kind);
}

// Rotates the first ``heads`` heads of each of the ``rows`` rows of qkv (``rs`` elements apart, heads
// ``dim`` apart) in place (the halves layout): x * cos + rotate_half(x) * sin, each product and the
// sum rounded as in the Python path. With ``q_norm`` and ``k_norm`` (Qwen3; Gemma 3's of ``kind``
// GEMMA_NORM), each head is first RMS-normalised, the first ``q_heads`` by ``q_norm``, the rest by
// ``k_norm``. ``turn`` false (SmolLM3's unrotated layers): the norms only.
template <typename scalar_t>
void rotate(scalar_t* p, int64_t rows, int64_t rs, int64_t dim, const at::Tensor& cos, const at::Tensor& sin,
            int64_t heads, const scalar_t* q_norm = nullptr, const scalar_t* k_norm = nullptr, int64_t q_heads = 0,
            float eps = 0.0f, int64_t kind = LLAMA_NORM, bool turn = true) {
  const int64_t half = dim / 2, hs = dim;
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
        if (q_norm != nullptr) norm_head(x, h < q_heads ? q_norm : k_norm, dim, eps, kind);
        if (!turn) continue;
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
      for (int64_t i = 0; i < n; ++i) o[i] = narrow_to<scalar_t>(silu_times<scalar_t>(widen(g[i]), widen(u[i])));
    }
  });
}

using PackedLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                std::string_view, c10::List<std::optional<at::Scalar>>,
                                std::optional<std::string_view>);

// Each part of a layer runs under a profiler scope named ``multispec::layers.<part>`` (the torch
// profiler lists them with the operators; they cost a flag test when it is off), so that a
// profile shows where the compiled stack's time goes.
#define LAYER_PART(name) RECORD_FUNCTION("multispec::layers." name, std::vector<c10::IValue>())

// The product the Python path's ``Projection`` makes for these rows: the streaming product
// (stream_gemm.cpp, of the ``kind`` stream_kind() gave) where the weight has its layout and the rows
// are within stream_rows, else the library's.
at::Tensor product(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool packed,
                   const at::Tensor* stream, int64_t stream_rows, int64_t kind) {
  if (stream != nullptr && x.size(0) <= stream_rows && kind > 0)
    return multispec::stream_linear_on(x, *stream, bias, kind);
  if (!packed) return at::linear(x, weight, bias);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<PackedLinear>();
  return op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// What other members of the family add to Llama's layer (each empty or off for Llama's own):
// Gemma 2's and 3's norms around each block (``pre_ffn_norm``: the MLP's input norm, where
// ``post_norm`` then normalises the attention's output; ``post_ffn_norm``: the MLP's output),
// OLMo 2's norms on the blocks' outputs only (``post_only``: no norm before attention or MLP;
// ``post_norm`` and ``post_ffn_norm`` normalise their outputs) and on q and k across all their
// heads (``qk_whole``: ``q_norm`` and ``k_norm`` are that wide), the norms' kind (``norm_kind``,
// see NormKind), the gate's activation (0 SiLU, 1 GELU's tanh approximation, 2 GELU), which
// layers rotate q and k (``rotates``: SmolLM3 leaves every fourth alone) and which rotate by the
// second table (``local_layers``, ``local_cos``/``local_sin``: Gemma 3's windowed layers), and each
// layer's sliding window (``windows``: positions, 0 for none; Mistral's, Qwen's, Gemma's), and
// the attention scores' soft cap (``softcap``, Gemma 2's; 0 for none). ``scratch`` and
// ``scratch_mask`` (or None): a draft model's step over its earlier draft nodes (AttentionIndex).
struct Extras {
  at::TensorList pre_ffn_norm, post_ffn_norm;
  int64_t norm_kind = LLAMA_NORM;
  bool post_only = false, qk_whole = false;
  int64_t activation = 0;
  at::IntArrayRef rotates, local_layers, windows;
  double softcap = 0.0;
  const at::Tensor* local_cos = nullptr;
  const at::Tensor* local_sin = nullptr;
};

template <typename scalar_t>
at::Tensor layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList input_norm,
                  at::TensorList post_norm, at::TensorList qkv, const c10::List<std::optional<at::Tensor>>& qkv_bias,
                  at::TensorList o, const c10::List<std::optional<at::Tensor>>& o_bias, at::TensorList gate_up,
                  const c10::List<std::optional<at::Tensor>>& gate_up_bias, at::TensorList down,
                  const c10::List<std::optional<at::Tensor>>& down_bias, const at::Tensor& final_norm, bool packed,
                  at::TensorList stream, int64_t stream_rows, at::TensorList q_norm, at::TensorList k_norm,
                  int64_t heads, int64_t kv_heads, double eps,
                  const at::Tensor& sample_k, const at::Tensor& sample_v, const at::Tensor& prompt_k,
                  const at::Tensor& prompt_v, const multispec::AttentionIndex& index, double scale,
                  const Extras& extras) {
  // Below autograd: the products' outputs live only inside the step (the caches are ordinary
  // tensors, so even inference mode would track views of them).
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t tokens = x.size(0), dim = sample_k.size(-1), width = (heads + 2 * kv_heads) * dim;
  at::Tensor normed = at::empty_like(x);
  at::Tensor attended = at::empty({tokens, heads * dim}, x.options());  // each layer's, read by its o product
  at::Tensor delta;  // the last block's output, added to x by the next add_norm
  const size_t n = qkv.size();
  // Which streaming product runs here (MULTISPEC_STREAM / MULTISPEC_AMX), read once a step.
  const int64_t kind = multispec::stream_kind();
  // The tile-streaming layout of product ``part`` (0 q/k/v, 1 o, 2 gate/up, 3 down) of a layer, if any.
  auto streamed = [&](size_t part, size_t layer) { return stream.empty() ? nullptr : &stream[part * n + layer]; };
  // Whether the gate/up products stream on AMX tiles this step, and so carry their activation.
  const bool fused_activation = std::is_same_v<scalar_t, c10::BFloat16> && !stream.empty() &&
                                tokens <= stream_rows && kind == 2 && extras.activation == 0;
  const bool sandwich = !extras.pre_ffn_norm.empty();
  const bool post_only = extras.post_only;
  const int64_t norm_kind = extras.norm_kind;
  // The attention's arguments: a layer's caches are the layer's offset into each, q, k and v the
  // fused product's columns (no tensor views: some ten a layer cost more than the checks they
  // stood for, which decode_layers makes once a step).
  multispec::AttentionCall call;
  call.index = index;
  call.tokens = tokens, call.heads = heads, call.kv_heads = kv_heads, call.dim = dim;
  call.dtype = x.scalar_type(), call.cache_dtype = sample_k.scalar_type();
  call.scale = scale;
  call.amx = multispec::attention_amx();
  call.softcap = extras.softcap;
  call.out = {attended.data_ptr(), heads * dim, dim};
  const int64_t cache_bytes = sample_k.element_size();
  auto layer_slots = [&](const at::Tensor& cache, size_t layer) {
    return multispec::AttentionSlots{static_cast<char*>(cache.data_ptr()) + layer * cache.stride(0) * cache_bytes,
                                     cache.stride(1), cache.stride(2), cache.stride(3)};
  };
  for (size_t layer = 0; layer < n; ++layer) {
    if (post_only) {  // OLMo 2: the block reads the residual stream itself
      LAYER_PART("residual");
      if (delta.defined()) add_to<scalar_t>(x, delta);
    } else {
      LAYER_PART("norm");
      add_norm<scalar_t>(x, delta, input_norm[layer], normed, eps, norm_kind);
    }
    at::Tensor fused;
    {
      LAYER_PART("qkv_product");
      fused = product(post_only ? x : normed, qkv[layer], qkv_bias.get(layer), packed, streamed(0, layer),
                      stream_rows, kind);
      TORCH_CHECK(fused.is_contiguous() && fused.size(1) == width, "the q/k/v product is contiguous [tokens, ", width,
                  "]");
    }
    scalar_t* f = fused.data_ptr<scalar_t>();
    {
      LAYER_PART("rotary");
      const bool turn = extras.rotates.empty() || extras.rotates[layer] != 0;
      const bool local = !extras.local_layers.empty() && extras.local_layers[layer] != 0;
      const at::Tensor& c = local ? *extras.local_cos : cos;
      const at::Tensor& s = local ? *extras.local_sin : sin;
      if (extras.qk_whole) {  // OLMo 2: q and k each normalised across all their heads, then rotated
        const scalar_t* qn = q_norm[layer].data_ptr<scalar_t>();
        const scalar_t* kn = k_norm[layer].data_ptr<scalar_t>();
        at::parallel_for(0, tokens, GRAIN, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            norm_head(f + r * width, qn, heads * dim, static_cast<float>(eps), norm_kind);
            norm_head(f + r * width + heads * dim, kn, kv_heads * dim, static_cast<float>(eps), norm_kind);
          }
        });
      }
      if (q_norm.empty() || extras.qk_whole) {
        if (turn) rotate<scalar_t>(f, tokens, width, dim, c, s, heads + kv_heads);
      } else {
        rotate<scalar_t>(f, tokens, width, dim, c, s, heads + kv_heads, q_norm[layer].data_ptr<scalar_t>(),
                         k_norm[layer].data_ptr<scalar_t>(), heads, static_cast<float>(eps), norm_kind, turn);
      }
    }
    {
      LAYER_PART("attention");
      call.q = {f, width, dim};
      call.k_new = {f + heads * dim, width, dim};
      call.v_new = {f + (heads + kv_heads) * dim, width, dim};
      call.own_k = layer_slots(sample_k, layer), call.own_v = layer_slots(sample_v, layer);
      call.prompt_k = layer_slots(prompt_k, layer), call.prompt_v = layer_slots(prompt_v, layer);
      call.window = extras.windows.empty() ? 0 : extras.windows[layer];
      multispec::attend(call);
    }
    {
      LAYER_PART("o_product");
      delta = product(attended, o[layer], o_bias.get(layer), packed, streamed(1, layer), stream_rows, kind);
    }
    if (sandwich || post_only) {
      // Gemma 2 and 3, OLMo 2: the attention's output normalised before the residual add; Gemma's
      // MLP input by a norm of its own, OLMo 2's the residual stream itself.
      LAYER_PART("norm");
      at::Tensor out = at::empty_like(delta);
      at::Tensor none;
      add_norm<scalar_t>(delta, none, post_norm[layer], out, eps, norm_kind);
      if (post_only) {
        add_to<scalar_t>(x, out);
      } else {
        add_norm<scalar_t>(x, out, extras.pre_ffn_norm[layer], normed, eps, norm_kind);
      }
    } else {
      LAYER_PART("norm");
      add_norm<scalar_t>(x, delta, post_norm[layer], normed, eps, norm_kind);
    }
    const at::Tensor& mlp_in = post_only ? x : normed;
    at::Tensor activated;
    const at::Tensor* gate_up_stream = streamed(2, layer);
    if (fused_activation) {
      // On tiles the activation runs on each pair of gate and up panels as they come out of the
      // product: no [T, 2I] product written and read again, one parallel loop fewer a layer. (The
      // stack streams every product or none, so the down product's I is a multiple of 32 and the
      // up half starts on a panel.)
      LAYER_PART("gate_up_silu");
      activated = multispec::stream_gate_up_on(mlp_in, *gate_up_stream, gate_up_bias.get(layer), kind);
    } else {
      at::Tensor both;
      {
        LAYER_PART("gate_up_product");
        both = product(mlp_in, gate_up[layer], gate_up_bias.get(layer), packed, gate_up_stream, stream_rows, kind);
      }
      const int64_t half = both.size(1) / 2;
      if (extras.activation == 0) {
        activated = at::empty({tokens, half}, x.options());
        LAYER_PART("silu_mul");
        silu_mul<scalar_t>(both, activated);
      } else {
        // GELU (Gemma's tanh approximation, or exact): torch's own kernel, as the Python path
        // calls it, so the two round alike.
        LAYER_PART("gelu_mul");
        activated = at::gelu(both.narrow(1, 0, half), extras.activation == 1 ? "tanh" : "none") *
                    both.narrow(1, half, half);
      }
    }
    {
      LAYER_PART("down_product");
      delta = product(activated, down[layer], down_bias.get(layer), packed, streamed(3, layer), stream_rows, kind);
    }
    if (sandwich || post_only) {
      LAYER_PART("norm");
      at::Tensor out = at::empty_like(delta);
      at::Tensor none;
      add_norm<scalar_t>(delta, none, extras.post_ffn_norm[layer], out, eps, norm_kind);
      delta = out;
    }
  }
  at::Tensor out = at::empty_like(x);
  add_norm<scalar_t>(x, delta, final_norm, out, eps, norm_kind);
  return out;
}

at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList input_norm, at::TensorList post_norm, at::TensorList qkv,
                         const c10::List<std::optional<at::Tensor>>& qkv_bias, at::TensorList o,
                         const c10::List<std::optional<at::Tensor>>& o_bias, at::TensorList gate_up,
                         const c10::List<std::optional<at::Tensor>>& gate_up_bias, at::TensorList down,
                         const c10::List<std::optional<at::Tensor>>& down_bias, const at::Tensor& final_norm,
                         bool packed, at::TensorList stream, int64_t stream_rows, at::TensorList q_norm,
                         at::TensorList k_norm, int64_t heads, int64_t kv_heads, double eps, const at::Tensor& sample_k,
                         const at::Tensor& sample_v, const at::Tensor& prompt_k, const at::Tensor& prompt_v,
                         const at::Tensor& sample_slot, const at::Tensor& offsets, const at::Tensor& counts,
                         const at::Tensor& written, const at::Tensor& prompt_slot, const at::Tensor& prompt_len,
                         const at::Tensor& tree_mask, double scale, at::TensorList pre_ffn_norm,
                         at::TensorList post_ffn_norm, int64_t norm_kind, bool post_only, bool qk_whole,
                         int64_t activation, at::IntArrayRef rotates,
                         const std::optional<at::Tensor>& local_cos, const std::optional<at::Tensor>& local_sin,
                         at::IntArrayRef local_layers, at::IntArrayRef windows, double softcap,
                         const std::optional<at::Tensor>& scratch, const std::optional<at::Tensor>& scratch_mask) {
  const size_t n = qkv.size();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [tokens, hidden]");
  TORCH_CHECK(norm_kind >= LLAMA_NORM && norm_kind <= FLOAT32_NORM, "norm_kind is 0 (Llama), 1 (Gemma) or 2 (float32)");
  TORCH_CHECK(!post_only || (input_norm.empty() && pre_ffn_norm.empty() && post_ffn_norm.size() == n),
              "post_only: no input norms, and a norm of each block's output");
  TORCH_CHECK((post_only ? input_norm.empty() : input_norm.size() == n) && post_norm.size() == n && o.size() == n &&
                  gate_up.size() == n &&
                  down.size() == n && qkv_bias.size() == n && o_bias.size() == n && gate_up_bias.size() == n &&
                  down_bias.size() == n && sample_k.size(0) == static_cast<int64_t>(n),
              "one entry per layer in every weight list and in the caches");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == x.size(0) && sin.size(0) == x.size(0) &&
                  cos.size(1) == sample_k.size(-1) && cos.stride(1) == 1 && sin.stride(1) == 1,
              "cos and sin are [tokens, head_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin share the activations' dtype");
  TORCH_CHECK(post_only || (pre_ffn_norm.size() == post_ffn_norm.size() &&
                            (pre_ffn_norm.empty() || pre_ffn_norm.size() == n)),
              "the MLP's input and output norms: one of each per layer, or none");
  TORCH_CHECK(activation >= 0 && activation <= 2, "activation is 0 (SiLU), 1 (GELU, tanh) or 2 (GELU)");
  TORCH_CHECK(rotates.empty() || rotates.size() == n, "rotates: one flag per layer, or none");
  TORCH_CHECK(local_layers.empty() || (local_layers.size() == n && local_cos.has_value() && local_sin.has_value()),
              "local_layers: one flag per layer with the second rotation's tables, or none");
  TORCH_CHECK(windows.empty() || windows.size() == n, "windows: one per layer, or none");
  TORCH_CHECK(softcap >= 0.0, "softcap is the scores' cap, or 0 for none");
  for (int64_t window : windows) TORCH_CHECK(window >= 0, "a layer's window is a number of positions, or 0 for none");
  for (const std::optional<at::Tensor>& table : {local_cos, local_sin})
    TORCH_CHECK(!table.has_value() || (table->sizes() == cos.sizes() && table->strides() == cos.strides() &&
                                       table->scalar_type() == cos.scalar_type()),
                "the second rotation's tables are shaped as cos and sin");
  for (at::TensorList list : {input_norm, post_norm, pre_ffn_norm, post_ffn_norm})
    for (const at::Tensor& w : list)
      TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(1),
                  "norm weights are contiguous [hidden] in the activations' dtype");
  TORCH_CHECK(final_norm.scalar_type() == x.scalar_type() && final_norm.is_contiguous() &&
                  final_norm.numel() == x.size(1), "the final norm's weight is contiguous [hidden]");
  TORCH_CHECK(q_norm.size() == k_norm.size() && (q_norm.empty() || q_norm.size() == n),
              "q and k norms: one of each per layer, or none");
  TORCH_CHECK(!qk_whole || !q_norm.empty(), "qk_whole needs q and k norms");
  const int64_t head_dim = sample_k.size(-1);
  for (size_t i = 0; i < q_norm.size(); ++i)
    for (int64_t which = 0; which < 2; ++which) {
      const at::Tensor& w = which == 0 ? q_norm[i] : k_norm[i];
      const int64_t width = qk_whole ? (which == 0 ? heads : kv_heads) * head_dim : head_dim;
      TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == width,
                  "q and k norm weights are contiguous [head_dim] (qk_whole: [heads * head_dim]) in the "
                  "activations' dtype");
    }
  // What the attention checks at every call of its operator, once for the step's thirty.
  TORCH_CHECK(sample_k.device().is_cpu() && sample_v.device().is_cpu() && prompt_k.device().is_cpu() &&
                  prompt_v.device().is_cpu(), "the caches are on the CPU");
  multispec::check_attention_caches(x.scalar_type(), heads, sample_k.size(-1), 5, sample_k, sample_v, prompt_k,
                                    prompt_v);
  TORCH_CHECK(sample_k.size(2) == kv_heads && sample_v.sizes() == sample_k.sizes() &&
                  prompt_k.size(0) == sample_k.size(0) && prompt_v.sizes() == prompt_k.sizes(),
              "the caches are [layers, slots, kv_heads, positions, head_dim], keys and values alike");
  multispec::AttentionIndex index =
      multispec::attention_index(sample_slot, offsets, counts, written, prompt_slot, prompt_len, tree_mask);
  multispec::attach_scratch(index, scratch, scratch_mask);  // a draft model's step
  for (int64_t window : windows)
    TORCH_CHECK(window == 0 || !scratch.has_value(), "a sliding window and scratch positions do not go together");
  Extras extras;
  extras.pre_ffn_norm = pre_ffn_norm, extras.post_ffn_norm = post_ffn_norm;
  extras.norm_kind = norm_kind, extras.post_only = post_only, extras.qk_whole = qk_whole;
  extras.activation = activation;
  extras.rotates = rotates, extras.local_layers = local_layers, extras.windows = windows;
  extras.softcap = softcap;
  if (local_cos.has_value()) extras.local_cos = &*local_cos, extras.local_sin = &*local_sin;
  at::Tensor hidden = x.clone();  // the residual stream, updated in place
  switch (x.scalar_type()) {
    case at::kFloat:
      return layers<float>(hidden, cos, sin, input_norm, post_norm, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias,
                           down, down_bias, final_norm, packed, stream, stream_rows, q_norm, k_norm, heads, kv_heads,
                           eps, sample_k, sample_v, prompt_k, prompt_v, index, scale, extras);
    case at::kBFloat16:
      return layers<c10::BFloat16>(hidden, cos, sin, input_norm, post_norm, qkv, qkv_bias, o, o_bias, gate_up,
                                   gate_up_bias, down, down_bias, final_norm, packed, stream, stream_rows, q_norm,
                                   k_norm, heads, kv_heads, eps, sample_k, sample_v, prompt_k, prompt_v, index,
                                   scale, extras);
    default:
      TORCH_CHECK(false, "decode_layers runs float32 and bfloat16 models");
  }
}


// A draft head's decoder layer for one depth of its tree (multispec/models/draft_head.py), in one
// call: the head's input product over [target feature, token embedding], the layer's norms,
// products, rotation and activation as above, and the attention of each drafted node over its
// path. The head drafts some tens of rows a depth, so its products stream their weights once and
// cost little; what the Python path adds around them is some sixty small operators a depth
// (concatenations of the paths' keys, their repetition for the query groups, the mask, the fused
// attention's fixed cost), each dispatched from Python.
//
// The new rows come in groups of ``group`` (the window's pairs of a root, the root's own last;
// 1 for a drafted depth); the last row of each group is its query and the only row that goes on
// through the MLP, the others give keys and values. A query's keys are its parent path's
// (``past_k[parents[g]]``, L of them) followed by its group's own. The first ``window`` keys of a
// path are its root's window, of which ``window_mask[roots[g]]`` says which exist (empty: all).
// Returns the queries' output features [Q, H] and their paths' keys and values [Q, L + group, kv, D].
template <typename scalar_t>
std::vector<at::Tensor> head_rows(const at::Tensor& features, const at::Tensor& embedding, const at::Tensor& tokens,
                                  const at::Tensor& fc, const at::Tensor& input_norm, const at::Tensor& post_norm,
                                  const at::Tensor& qkv, const at::Tensor& o, const at::Tensor& gate_up,
                                  const at::Tensor& down, bool packed, at::TensorList stream, int64_t stream_rows,
                                  int64_t heads, int64_t kv_heads, double eps, const at::Tensor& cos,
                                  const at::Tensor& sin, int64_t group, const at::Tensor& past_k,
                                  const at::Tensor& past_v, const at::Tensor& parents, const at::Tensor& window_mask,
                                  const at::Tensor& roots, int64_t window, double scale) {
  const int64_t rows = features.size(0), hidden = features.size(1), queries = rows / group;
  const int64_t dim = qkv.size(0) / (heads + 2 * kv_heads), past = past_k.size(1);
  const int64_t length = past + group, groups = heads / kv_heads;
  auto streamed = [&](size_t part) { return stream.empty() ? nullptr : &stream[part]; };
  const std::optional<at::Tensor> none;
  const int64_t kind = multispec::stream_kind();

  // The input product's rows: each feature beside its token's embedding.
  at::Tensor joined = at::empty({rows, 2 * hidden}, features.options());
  {
    const scalar_t* fp = features.data_ptr<scalar_t>();
    const scalar_t* ep = embedding.data_ptr<scalar_t>();
    const int64_t* tp = tokens.data_ptr<int64_t>();
    scalar_t* jp = joined.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(jp + r * 2 * hidden, fp + r * hidden, hidden * sizeof(scalar_t));
      std::memcpy(jp + r * 2 * hidden + hidden, ep + tp[r] * hidden, hidden * sizeof(scalar_t));
    }
  }
  at::Tensor x = product(joined, fc, none, packed, streamed(0), stream_rows, kind);
  if (!x.is_contiguous()) x = x.contiguous();
  at::Tensor normed = at::empty_like(x);
  add_norm<scalar_t>(x, at::Tensor(), input_norm, normed, eps);
  at::Tensor fused = product(normed, qkv, none, packed, streamed(1), stream_rows, kind).contiguous();
  rotate<scalar_t>(fused.data_ptr<scalar_t>(), rows, fused.stride(0), dim, cos, sin, heads + kv_heads);

  // Each query's path: its parent's keys and values, then its group's own.
  at::Tensor keys = at::empty({queries, length, kv_heads, dim}, features.options());
  at::Tensor values = at::empty({queries, length, kv_heads, dim}, features.options());
  const int64_t step = kv_heads * dim;  // one position of a path
  {
    const scalar_t* pk = past > 0 ? past_k.data_ptr<scalar_t>() : nullptr;
    const scalar_t* pv = past > 0 ? past_v.data_ptr<scalar_t>() : nullptr;
    const int64_t* parent = past > 0 ? parents.data_ptr<int64_t>() : nullptr;
    const scalar_t* fp = fused.data_ptr<scalar_t>();
    const int64_t fs = fused.stride(0);
    scalar_t* kp = keys.data_ptr<scalar_t>();
    scalar_t* vp = values.data_ptr<scalar_t>();
    for (int64_t g = 0; g < queries; ++g) {
      if (past > 0) {
        std::memcpy(kp + g * length * step, pk + parent[g] * past * step, past * step * sizeof(scalar_t));
        std::memcpy(vp + g * length * step, pv + parent[g] * past * step, past * step * sizeof(scalar_t));
      }
      for (int64_t t = 0; t < group; ++t) {
        const scalar_t* row = fp + (g * group + t) * fs;
        std::memcpy(kp + (g * length + past + t) * step, row + heads * dim, step * sizeof(scalar_t));
        std::memcpy(vp + (g * length + past + t) * step, row + (heads + kv_heads) * dim, step * sizeof(scalar_t));
      }
    }
  }

  // The queries' attention over their paths, in float32, rounded once at the end.
  at::Tensor attended = at::empty({queries, heads * dim}, features.options());
  {
    const bool masked = window_mask.numel() > 0;
    const bool* mp = masked ? window_mask.data_ptr<bool>() : nullptr;
    const int64_t ms = masked ? window_mask.stride(0) : 0;
    const int64_t* root = masked ? roots.data_ptr<int64_t>() : nullptr;
    const scalar_t* fp = fused.data_ptr<scalar_t>();
    const int64_t fs = fused.stride(0);
    const scalar_t* kp = keys.data_ptr<scalar_t>();
    const scalar_t* vp = values.data_ptr<scalar_t>();
    scalar_t* ap = attended.data_ptr<scalar_t>();
    at::parallel_for(0, queries * heads, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> buffer(length + 2 * dim);
      float* score = buffer.data();
      float* q = score + length;
      float* acc = q + dim;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t g = item / heads, h = item % heads, kh = h / groups;
        const scalar_t* qr = fp + (g * group + group - 1) * fs + h * dim;
        for (int64_t d = 0; d < dim; ++d) q[d] = widen(qr[d]);
        float top = -INFINITY;
        for (int64_t j = 0; j < length; ++j) {
          if (masked && j < window && !mp[root[g] * ms + j]) {
            score[j] = -INFINITY;
            continue;
          }
          const scalar_t* k = kp + (g * length + j) * step + kh * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += q[d] * widen(k[d]);
          score[j] = dot * static_cast<float>(scale);
          top = std::max(top, score[j]);
        }
        float total = 0.0f;
        for (int64_t j = 0; j < length; ++j) {
          score[j] = score[j] == -INFINITY ? 0.0f : exp_nonpositive(score[j] - top);
          total += score[j];
        }
        for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;
        for (int64_t j = 0; j < length; ++j) {
          if (score[j] == 0.0f) continue;
          const float w = score[j] / total;
          const scalar_t* v = vp + (g * length + j) * step + kh * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) acc[d] += w * widen(v[d]);
        }
        scalar_t* out = ap + g * heads * dim + h * dim;
        for (int64_t d = 0; d < dim; ++d) out[d] = narrow_to<scalar_t>(acc[d]);
      }
    });
  }

  // The queries' residual rows (the last of each group), then o, the MLP and its residual.
  at::Tensor residual = group == 1 ? x : x.view({queries, group, hidden}).select(1, group - 1).contiguous();
  at::Tensor delta = product(attended, o, none, packed, streamed(2), stream_rows, kind);
  at::Tensor normed_q = at::empty_like(residual);
  add_norm<scalar_t>(residual, delta, post_norm, normed_q, eps);
  at::Tensor both = product(normed_q, gate_up, none, packed, streamed(3), stream_rows, kind);
  at::Tensor activated = at::empty({queries, both.size(1) / 2}, features.options());
  silu_mul<scalar_t>(both, activated);
  delta = product(activated, down, none, packed, streamed(4), stream_rows, kind);
  if (!delta.is_contiguous()) delta = delta.contiguous();
  {
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* dp = delta.data_ptr<scalar_t>();
    const int64_t n = queries * hidden;
    for (int64_t i = 0; i < n; ++i) rp[i] = narrow_to<scalar_t>(widen(rp[i]) + widen(dp[i]));
  }
  return {residual, keys, values};
}

std::vector<at::Tensor> head_layer(const at::Tensor& features, const at::Tensor& embedding, const at::Tensor& tokens,
                                   const at::Tensor& fc, const at::Tensor& input_norm, const at::Tensor& post_norm,
                                   const at::Tensor& qkv, const at::Tensor& o, const at::Tensor& gate_up,
                                   const at::Tensor& down, bool packed, at::TensorList stream, int64_t stream_rows,
                                   int64_t heads, int64_t kv_heads, double eps, const at::Tensor& cos,
                                   const at::Tensor& sin, int64_t group, const at::Tensor& past_k,
                                   const at::Tensor& past_v, const at::Tensor& parents, const at::Tensor& window_mask,
                                   const at::Tensor& roots, int64_t window, double scale) {
  const at::ScalarType dtype = features.scalar_type();
  TORCH_CHECK(features.device().is_cpu() && features.dim() == 2 && features.is_contiguous(),
              "features must be a contiguous CPU [rows, hidden]");
  TORCH_CHECK(group >= 1 && features.size(0) % group == 0, "the rows come in whole groups");
  const int64_t rows = features.size(0), hidden = features.size(1), queries = rows / group;
  TORCH_CHECK(embedding.scalar_type() == dtype && embedding.is_contiguous() && embedding.dim() == 2 &&
                  embedding.size(1) == hidden, "the embedding is contiguous [vocabulary, hidden] in the features' dtype");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.numel() == rows,
              "one int64 token per row");
  TORCH_CHECK(heads % kv_heads == 0 && (stream.empty() || stream.size() == 5),
              "heads a multiple of kv heads; five streaming layouts or none");
  for (const at::Tensor& w : {input_norm, post_norm})
    TORCH_CHECK(w.scalar_type() == dtype && w.is_contiguous() && w.numel() == hidden,
                "norm weights are contiguous [hidden] in the features' dtype");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == rows && sin.size(0) == rows &&
                  cos.stride(1) == 1 && sin.stride(1) == 1 && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "cos and sin are [rows, head_dim] in the features' dtype");
  TORCH_CHECK(past_k.dim() == 4 && past_k.is_contiguous() && past_v.is_contiguous() &&
                  past_k.sizes() == past_v.sizes() && past_k.size(2) == kv_heads && cos.size(1) == past_k.size(3) &&
                  (past_k.size(1) == 0 || past_k.scalar_type() == dtype),
              "past keys and values are contiguous [paths, length, kv_heads, head_dim]");
  if (past_k.size(1) > 0) {
    TORCH_CHECK(parents.scalar_type() == at::kLong && parents.is_contiguous() && parents.numel() == queries,
                "one int64 parent path per query");
    const int64_t* p = parents.data_ptr<int64_t>();
    for (int64_t g = 0; g < queries; ++g)
      TORCH_CHECK(p[g] >= 0 && p[g] < past_k.size(0), "a parent path out of range");
  }
  if (window_mask.numel() > 0) {
    TORCH_CHECK(window_mask.scalar_type() == at::kBool && window_mask.dim() == 2 && window_mask.stride(1) == 1 &&
                    window_mask.size(1) >= window && window <= past_k.size(1) + group,
                "the window mask is bool [roots, window]");
    TORCH_CHECK(roots.scalar_type() == at::kLong && roots.is_contiguous() && roots.numel() == queries,
                "one int64 root per query");
    const int64_t* p = roots.data_ptr<int64_t>();
    for (int64_t g = 0; g < queries; ++g)
      TORCH_CHECK(p[g] >= 0 && p[g] < window_mask.size(0), "a root out of range");
  }
  const int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(tp[r] >= 0 && tp[r] < embedding.size(0), "a token out of range");
  auto run = [&](auto element) {
    return head_rows<decltype(element)>(features, embedding, tokens, fc, input_norm, post_norm, qkv, o, gate_up, down,
                                        packed, stream, stream_rows, heads, kv_heads, eps, cos, sin, group, past_k,
                                        past_v, parents, window_mask, roots, window, scale);
  };
  switch (dtype) {
    case at::kFloat:
      return run(float{});
    case at::kBFloat16:
      return run(c10::BFloat16{});
    default:
      TORCH_CHECK(false, "head_layer runs float32 and bfloat16 heads");
  }
}

// The layer stack's activation as an operator, [T, 2I] -> [T, I]: what the fused gate/up
// product (stream_gate_up) must equal bit for bit.
at::Tensor silu_mul_op(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "silu_mul takes [rows, 2 * intermediate] with unit column stride");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  switch (gate_up.scalar_type()) {
    case at::kFloat:
      silu_mul<float>(gate_up, out);
      break;
    case at::kBFloat16:
      silu_mul<c10::BFloat16>(gate_up, out);
      break;
    default:
      TORCH_CHECK(false, "silu_mul runs float32 and bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multispec, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] input_norm, Tensor[] post_norm, Tensor[] qkv, "
        "Tensor?[] qkv_bias, Tensor[] o, Tensor?[] o_bias, Tensor[] gate_up, Tensor?[] gate_up_bias, Tensor[] down, "
        "Tensor?[] down_bias, Tensor final_norm, bool packed, Tensor[] stream, int stream_rows, Tensor[] q_norm, "
        "Tensor[] k_norm, int heads, int kv_heads, float eps, "
        "Tensor(a!) sample_k, Tensor(b!) sample_v, Tensor prompt_k, Tensor prompt_v, Tensor sample_slot, "
        "Tensor offsets, Tensor counts, Tensor written, Tensor prompt_slot, Tensor prompt_len, Tensor tree_mask, "
        "float scale, Tensor[] pre_ffn_norm, Tensor[] post_ffn_norm, int norm_kind, bool post_only, bool qk_whole, "
        "int activation, "
        "int[] rotates, Tensor? local_cos, Tensor? local_sin, int[] local_layers, int[] windows, "
        "float softcap, Tensor? scratch, Tensor? scratch_mask) -> Tensor");
  m.def("head_layer(Tensor features, Tensor embedding, Tensor tokens, Tensor fc, Tensor input_norm, "
        "Tensor post_norm, Tensor qkv, Tensor o, Tensor gate_up, Tensor down, bool packed, Tensor[] stream, "
        "int stream_rows, int heads, int kv_heads, float eps, Tensor cos, Tensor sin, int group, Tensor past_k, "
        "Tensor past_v, Tensor parents, Tensor window_mask, Tensor roots, int window, float scale) -> Tensor[]");
}

// Prepacked weights are tensors of the CPU library's own kind: the call dispatches on them too.
TORCH_LIBRARY_IMPL(multispec, CPU, m) {
  m.impl("silu_mul", &silu_mul_op);
  m.impl("decode_layers", &decode_layers);
  m.impl("head_layer", &head_layer);
}
TORCH_LIBRARY_IMPL(multispec, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("head_layer", &head_layer);
}
