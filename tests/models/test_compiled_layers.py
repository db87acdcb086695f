"""The compiled layer stack (``multispec.kernels.decode_layers``) against the layer-by-layer path.

A decode step on a CPU with the compiled kernels runs every decoder layer in one call; the
layer-by-layer path (torch operators from Python) is the reference. Both read and write the same
cache, so each case runs one step of draft trees on two copies of a prefilled cache and compares
the logits and every key and value the step wrote. bf16 rounds after each operator exactly where
the reference does, so only a sum taken in another order (the norm's mean of squares) can move an
element by one unit of the last place; float32 agrees to summation order. A wrong rotation, norm,
residual, activation, bias or layer order moves the logits by far more than these bounds (the
mutation check below swaps two layers' weights and must fail them).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from multispec import kernels
from multispec.engine.attention import DecodeAttention, StepLayout
from multispec.models.config import ModelConfig
from multispec.models.llama import LlamaForCausalLM
from tests.helpers import new_cache, prefill, tree_mask_of

pytestmark = pytest.mark.skipif(kernels.decode_layers() is None, reason="the compiled kernels are not built here")

TREES = [([], []), ([5, 6, 7], [-1, 0, 0]), ([9], [-1]), ([11, 12, 13, 14], [-1, 0, 1, -1])]


def build(kind: str, dtype: torch.dtype, pack: bool) -> LlamaForCausalLM:
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "qwen2":  # biases on q, k and v
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif kind == "qwen3":  # q and k heads normalised, heads wider than hidden / heads
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32))
    elif kind == "phi3":  # fused products in the checkpoint, half of each head rotated, LongRoPE's scale
        rope = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.0], "long_factor": [4.0] * 4}
        hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **common, partial_rotary_factor=0.5, rope_scaling=rope, original_max_position_embeddings=128,
            pad_token_id=0))
    elif kind == "gemma":  # norms by 1 + weight, GELU's tanh approximation, embeddings scaled
        hf = transformers.GemmaForCausalLM(transformers.GemmaConfig(**common, head_dim=16, pad_token_id=0))
    elif kind == "gemma3":  # norms around each block, q/k norms, a second rotation on windowed layers, a scale
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(   # folded into q's norm
            **common, head_dim=16, query_pre_attn_scalar=24, sliding_window=200, sliding_window_pattern=2,
            rope_scaling={"rope_type": "linear", "factor": 4.0}, pad_token_id=0))
    elif kind == "gemma3-window":  # as gemma3, with windows shorter than the prompts: rows see part of them
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=24, sliding_window=16, sliding_window_pattern=2,
            pad_token_id=0))
    elif kind == "mistral-window":  # every layer windowed
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=20))
    elif kind == "qwen2-window":  # the layers from the second on windowed
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=True,
                                                                    sliding_window=12, max_window_layers=1))
    elif kind == "gemma2":  # sandwich norms, scores soft-capped, a window on every other layer
        hf = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
            sliding_window=16, pad_token_id=0))
    elif kind == "olmo2":  # norms on the blocks' outputs only, q and k normalised across all their heads
        hf = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common, pad_token_id=0))
    elif kind == "smollm3":  # every second layer unrotated
        hf = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**common, no_rope_layer_interval=2,
                                                                        pad_token_id=0))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, attention_bias=kind == "llama-bias",
                                                                    mlp_bias=kind == "llama-bias"))
    state = {k: v + 0.02 * torch.randn_like(v) if k.endswith("norm.weight") else v for k, v in hf.state_dict().items()}
    return LlamaForCausalLM.from_tensors(ModelConfig.from_hf_dict(hf.config.to_dict()), state, dtype=dtype, pack=pack)


@torch.inference_mode()
def run_step(model: LlamaForCausalLM, compiled: bool):
    """Prefill two prompts, then one step of four samples (plain, a branching tree, one draft, two
    chains); returns the step's logits and the sample caches."""
    gen = torch.Generator().manual_seed(4)
    cache = new_cache(model, samples=4, capacity=32, prompts=2, prompt_capacity=40)
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (23, 37)]
    for slot, prompt in enumerate(prompts):
        prefill(model, cache, prompt, slot)
    # Some text of each sample's own already in its slot, as after earlier steps.
    written = [3, 0, 7, 5]
    for name in ("sample_k", "sample_v"):
        getattr(cache, name).copy_(torch.randn(getattr(cache, name).shape, generator=gen).to(model.output_weight().dtype))
    prompt_slots, prompt_lens = [0, 1, 1, 0], [23, 37, 37, 23]
    tokens, positions, counts = [], [], []
    for b, (toks, parents) in enumerate(TREES):
        depth = [0]
        for p in parents:
            depth.append(depth[p + 1] + 1)
        tokens += [17 + b] + toks
        positions += [prompt_lens[b] + written[b] + d for d in depth]
        counts.append(1 + len(toks))
    layout = StepLayout(torch.tensor(counts), torch.tensor(written), torch.tensor(prompt_slots),
                        torch.tensor(prompt_lens), tree_mask_of([p for _, p in TREES]))
    model.compiled_layers = compiled
    attention = DecodeAttention(cache, layout)
    assert (model._compiled_stack(attention) is not None) == compiled
    logits = model(torch.tensor(tokens), torch.tensor(positions), attention)
    model.compiled_layers = True
    return logits, cache.sample_k.clone(), cache.sample_v.clone()


@pytest.mark.parametrize("kind", ["llama", "llama-bias", "qwen2", "qwen3", "phi3", "gemma", "gemma3", "smollm3",
                                  "olmo2", "gemma3-window", "mistral-window", "qwen2-window", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain"])
def test_compiled_stack_matches_the_layer_by_layer_path(kind, dtype, pack):
    model = build(kind, dtype, pack)
    if kind.endswith("-window"):  # windows that end inside the step's sequences, on the layers named
        config = model.config
        assert 8 < config.sliding_window < 23
        assert [config.layer_window(i) for i in range(3)] == {
            "gemma3": [16, None, 16], "mistral": [20] * 3, "qwen2": [None, 12, 12]}[kind.split("-")[0]]
    got, got_k, got_v = run_step(model, compiled=True)
    want, want_k, want_v = run_step(model, compiled=False)
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        assert torch.allclose(got_k, want_k, atol=1e-5) and torch.allclose(got_v, want_v, atol=1e-5)
    else:
        # One unit of bf16's last place is 2**-8 relative; logits are float32 products of bf16 rows.
        assert torch.allclose(got, want, atol=0.05, rtol=2 ** -7) and (got == want).float().mean() > 0.99
        assert (got_k == want_k).float().mean() > 0.99 and torch.allclose(got_k.float(), want_k.float(), rtol=2 ** -7)
        assert (got_v == want_v).float().mean() > 0.99 and torch.allclose(got_v.float(), want_v.float(), rtol=2 ** -7)


def test_the_comparison_detects_a_wrong_layer():
    """Mutation check of the bounds above: the compiled stack reads its weights in a cached list;
    two layers swapped in it must fail the comparison."""
    model = build("llama", torch.bfloat16, True)
    want, _, _ = run_step(model, compiled=False)
    stack = model._compiled_stack(DecodeAttention(new_cache(model), StepLayout(
        torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), tree_mask_of([[]]))))
    assert stack is not None
    weights = list(model._stack_weights)
    weights[2] = [weights[2][1], weights[2][0], weights[2][2]]  # the q/k/v products of layers 0 and 1
    stream = weights[12]  # their layouts for the tile product, where a step of few rows runs on it
    if stream:
        weights[12] = [stream[1], stream[0], *stream[2:]]
    model._stack_weights = tuple(weights)
    got, _, _ = run_step(model, compiled=True)
    assert not torch.allclose(got, want, atol=0.05, rtol=2 ** -7)
