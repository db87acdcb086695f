// The compiled decode attention (decode_attention.cpp) as plain pointers and strides, for callers in
// C++: the layer stack (decode_layers.cpp) calls it thirty times a step, and building tensor views
// for each call (a layer's caches, q, k and v out of the fused product) cost more than the checks
// it needs once a step.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace multispec {

// [tokens, heads, dim] rows with a contiguous last dimension.
struct AttentionRows {
  void* data = nullptr;
  int64_t s0 = 0, s1 = 0;
};

// [slots, kv_heads, positions, dim] with a contiguous last dimension.
struct AttentionSlots {
  void* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
};

// The step's index tensors (see decode_attention's schema), read once a step.
struct AttentionIndex {
  const int64_t *sample_slot, *offsets, *counts, *written, *prompt_slot, *prompt_len;
  const bool* tree_mask;
  int64_t batch, qmax;
  // A draft model's step (``StepLayout.scratch``): sample b's last scratch[b] cached own keys are
  // this step's earlier draft nodes, of which a row sees those its scratch_mask row names
  // ([samples, qmax, scratch_width]); none where scratch is null.
  const int64_t* scratch = nullptr;
  const bool* scratch_mask = nullptr;
  int64_t scratch_width = 0;
};

struct AttentionCall {
  AttentionRows q, k_new, v_new, out;  // out: written, [tokens, heads, dim]
  AttentionSlots own_k, own_v, prompt_k, prompt_v;  // own_k, own_v: the step's keys and values written in
  int64_t tokens, heads, kv_heads, dim;
  at::ScalarType dtype, cache_dtype;  // q, k_new, v_new, out; the caches
  AttentionIndex index;
  double scale;
  bool amx;  // the prompt half on AMX tiles where the shapes allow (attention_amx(), read by the caller)
  int64_t window = 0;  // a sliding window: each row sees the keys of its last ``window`` positions; 0: all
  double softcap = 0.0;  // scores capped as cap * tanh(score / cap) (Gemma 2); 0: none
};

// The index tensors checked (int64 vectors of one entry per sample, a bool [samples, qmax, qmax]
// mask) and read.
AttentionIndex attention_index(const at::Tensor& sample_slot, const at::Tensor& offsets, const at::Tensor& counts,
                               const at::Tensor& written, const at::Tensor& prompt_slot, const at::Tensor& prompt_len,
                               const at::Tensor& tree_mask);

// The scratch tensors (an int64 vector of one entry per sample and a bool [samples, qmax, width]
// mask, both or neither) checked and added to ``index``.
void attach_scratch(AttentionIndex& index, const std::optional<at::Tensor>& scratch,
                    const std::optional<at::Tensor>& scratch_mask);

// Checks that caches of this dtype and shape ([slots, kv_heads, positions, dim] each, or with a
// leading layer dimension: ``dims`` 4 or 5) suit activations of ``dtype`` with ``heads`` heads of
// ``dim``.
void check_attention_caches(at::ScalarType dtype, int64_t heads, int64_t dim, int64_t dims, const at::Tensor& own_k,
                            const at::Tensor& own_v, const at::Tensor& prompt_k, const at::Tensor& prompt_v);

// Whether the attention may use AMX tiles now (built for them, granted, MULTISPEC_AMX not 0).
bool attention_amx();

// Runs one call whose pointers the caller has checked.
void attend(const AttentionCall& call);

}  // namespace multispec
