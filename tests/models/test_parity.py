"""The network equals transformers' own model on the same weights, in prefill and through the cache.

Checked on tiny random Llama, Mistral, Qwen2, Qwen3, SmolLM3, Granite, OLMo 2, Phi-3, Gemma,
Gemma 2 and Gemma 3 checkpoints (GQA, biases, tied and untied heads, rope scaling, Qwen3's per-head q/k norms and
heads wider than hidden / heads, SmolLM3's unrotated layers, Granite's multipliers, OLMo 2's
output norms and whole q/k norms, Phi-3's fused
products, LongRoPE and partial rotation, Gemma's norms, activation and scaled embeddings, Gemma
2's sandwich norms, soft caps and attention scale, sliding windows shorter than the prompt, Gemma
3's q/k norms and two rotations) and on the real default model. Tolerance: max
abs diff 1e-3 on fp32 logits; a wrong rope, mask or cache index moves logits by far more.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from multispec.models.config import ModelConfig
from multispec.models.llama import LlamaForCausalLM
from tests.helpers import new_cache, prefill, step
from tests.models.conftest import like_trained

TOL = 1e-3


def tiny(kind: str, **overrides):
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    common.update(overrides)
    torch.manual_seed(0)
    if kind == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    elif kind == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common)).eval()
        like_trained(hf, norms=True)  # or a q/k norm left out would go unnoticed
    elif kind in ("gemma", "gemma2", "gemma3"):
        config_class, model_class = {"gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
                                     "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
                                     "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[kind]
        hf = model_class(config_class(**common, pad_token_id=0)).eval()
        like_trained(hf, norms=True, sharpen=8)  # so that the attention's scale and cap matter
    elif kind == "olmo2":
        hf = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common)).eval()
        like_trained(hf, norms=True, sharpen=8)
    elif kind == "granite":
        hf = transformers.GraniteForCausalLM(transformers.GraniteConfig(**common)).eval()
        like_trained(hf, sharpen=8)  # so that the attention's scale matters
    elif kind == "smollm3":
        hf = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**common, pad_token_id=0)).eval()
        like_trained(hf, sharpen=8)  # a rotation where there is none must show
    elif kind == "mistral":
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(**common)).eval()
        like_trained(hf, sharpen=8)  # so that the keys the window drops matter
    elif kind == "phi3":
        hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, pad_token_id=0)).eval()
        like_trained(hf, sharpen=8)  # a wrong rotation or scale of a few dimensions must show
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    ours = LlamaForCausalLM.from_tensors(config, dict(hf.state_dict()))
    return hf, ours


CASES = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied-bias": ("llama", dict(tie_word_embeddings=False, attention_bias=True)),
    "llama3-rope": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-bias-untied": ("qwen3", dict(head_dim=16, attention_bias=True, tie_word_embeddings=False)),
    # Phi-3: fused q/k/v and gate/up in the checkpoint; Phi-3-mini-128k's LongRoPE (within the
    # original length: the 80 tokens below); Phi-4-mini's partial rotation, tied.
    "phi3": ("phi3", dict(tie_word_embeddings=False)),
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=96, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 1.9, 2.4, 3.0, 3.7, 4.5],
        "long_factor": [8.0] * 8})),
    # OLMo 2: norms on the blocks' outputs only, q and k normalised across their heads.
    "olmo2": ("olmo2", dict(rope_theta=500000.0)),
    "olmo2-tied-bias": ("olmo2", dict(tie_word_embeddings=True, attention_bias=True)),
    # Granite 3's multipliers (its 2B model's: embeddings x12, blocks x0.22, scores x1/64 against
    # this head width's 1/4, logits /8), untied and tied with biases.
    "granite": ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                                logits_scaling=8.0)),
    "granite-tied-bias": ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                          attention_multiplier=0.5, logits_scaling=0.5, tie_word_embeddings=True,
                                          attention_bias=True, mlp_bias=True)),
    # SmolLM3: an unrotated ("NoPE") layer, here the second of two; and the first of two, listed.
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2)),
    "smollm3-listed": ("smollm3", dict(no_rope_layers=[0, 1], attention_bias=True)),
    # Gemma: GELU, norms by 1 + weight, scaled embeddings, wide heads, tied. Gemma 2: its sandwich
    # norms, caps at their defaults (50 and 30, which these logits never come near) and at values
    # they reach, and an attention scale other than the head width (Gemma 2 27B's kind).
    "gemma": ("gemma", dict(head_dim=32)),
    "gemma2": ("gemma2", dict(head_dim=32)),
    "gemma2-caps-scale": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                                         final_logit_softcapping=2.0)),
    # Sliding windows shorter than the 60-token prompt: Gemma 2's on its first layer; Gemma 3's on
    # its first (q/k norms, the windowed layer rotating by its own base, the other by a scaled
    # rotation of another base).
    "gemma2-window": ("gemma2", dict(head_dim=16, sliding_window=24)),
    "gemma3": ("gemma3", dict(head_dim=32, sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                              rope_theta=5000.0, rope_local_base_freq=100.0,
                              rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "mistral-window": ("mistral", dict(sliding_window=24)),
    "phi4-mini-partial": ("phi3", dict(tie_word_embeddings=True, partial_rotary_factor=0.75, rope_theta=250000.0,
                                       original_max_position_embeddings=96, rope_scaling={
                                           "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0],
                                           "long_factor": [9.0] * 6})),
}


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def check_model(hf, ours, prompt: list[int], continuation: list[int]):
    with torch.inference_mode():
        cache = new_cache(ours, capacity=len(continuation) + 4, prompt_capacity=len(prompt))
        got = prefill(ours, cache, prompt)
        want = hf_logits(hf, prompt + continuation)
        assert (got - want[: len(prompt)]).abs().max() < TOL
        # Incremental decoding: one token a step through the sample's own cache.
        for i, token in enumerate(continuation):
            rows = step(ours, cache, [token], [([], [])], [i], [0], [len(prompt)])
            assert (rows[0][0] - want[len(prompt) + i]).abs().max() < TOL, f"step {i}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_models_match_transformers(case):
    kind, overrides = CASES[case]
    hf, ours = tiny(kind, **overrides)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (80,), generator=gen).tolist()
    check_model(hf, ours, ids[:60], ids[60:])


def assert_nodes_match_paths(hf, rows, histories, trees):
    """Row j + 1 of sample b (row 0: its root) equals the last logits of history + root-to-node path."""
    for b, (tokens, parents) in enumerate(trees):
        for j in range(-1, len(tokens)):
            path, node = [], j
            while node != -1:
                path.append(tokens[node])
                node = parents[node]
            want = hf_logits(hf, histories[b] + path[::-1])[-1]
            assert (rows[b][j + 1] - want).abs().max() < TOL, (b, j)


def test_tree_matches_paths():
    """Every node of a packed tree gets the logits of its root-to-node path run as a plain sequence."""
    hf, ours = tiny("llama")
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 101, (20,), generator=gen).tolist()
    # Two samples share the prompt; sample 0 has 3 cached tokens, sample 1 has 1.
    own = [[5, 6, 7], [9]]
    roots = [11, 12]
    trees = [([20, 21, 22, 23, 24], [-1, 0, 0, 1, -1]), ([30, 31, 32], [-1, 0, 1])]
    with torch.inference_mode():
        cache = new_cache(ours)
        prefill(ours, cache, prompt)
        for i in range(max(len(t) for t in own)):
            active = [b for b in range(2) if i < len(own[b])]
            step(ours, cache, [own[b][i] for b in active], [([], [])] * len(active), [i] * len(active),
                 [0] * len(active), [20] * len(active))
        rows = step(ours, cache, roots, trees, [len(t) for t in own], [0, 0], [20, 20])
    assert_nodes_match_paths(hf, rows, [prompt + own[b] + [roots[b]] for b in range(2)], trees)


def test_default_model_matches_transformers(default_checkpoint, hf_default_model):
    """The real SmolLM2 weights: a 60-token prompt, then 8 cached decoding steps."""
    ours = LlamaForCausalLM.from_tensors(default_checkpoint.config, default_checkpoint.tensors)
    text = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May? Let us think step by step. In April she "
            "sold 48 clips. In May she sold half of that, which is 24 clips, so the total is 72.")
    ids = default_checkpoint.tokenizer.encode(text)
    assert len(ids) >= 58
    check_model(hf_default_model, ours, ids[:50], ids[50:58])


@pytest.mark.parametrize("split", [False, True], ids=["one part", "root and draft parts"])
@pytest.mark.parametrize("sample_prompt", [[1, 0, 1], [2, 0, 1]])
def test_samples_of_several_prompts_in_one_step(sample_prompt, split):
    """Three samples of two or three prompts of different lengths, slots interleaved, each with
    its own history and tree, one of them without a draft: every node's logits equal the plain
    sequence's, in both layouts of the attention (see ``split_step``)."""
    hf, ours = tiny("llama")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (17, 29, 23)]
    own = [[4, 5], [6], [7, 8, 9]]
    roots = [10, 11, 12]
    trees = [([40, 41], [-1, 0]), ([], []), ([50, 51, 52], [-1, -1, 0])]
    lens = [len(prompts[p]) for p in sample_prompt]
    with torch.inference_mode():
        cache = new_cache(ours, samples=3, prompts=3)
        for slot, prompt in enumerate(prompts):
            prefill(ours, cache, prompt, slot=slot)
        for i in range(3):
            # A sample whose history is complete writes a scratch token at its next position,
            # which its root overwrites in the checked step.
            step(ours, cache, [own[b][i] if i < len(own[b]) else 0 for b in range(3)], [([], [])] * 3,
                 [min(i, len(own[b])) for b in range(3)], sample_prompt, lens, split)
        rows = step(ours, cache, roots, trees, [len(t) for t in own], sample_prompt, lens, split)
    histories = [prompts[sample_prompt[b]] + own[b] + [roots[b]] for b in range(3)]
    assert_nodes_match_paths(hf, rows, histories, trees)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,overrides", [CASES["llama-untied-bias"], ("qwen2", {})], ids=["llama-bias", "qwen2"])
def test_packed_weights_compute_the_same_products_and_give_back_the_checkpoint(kind, overrides, dtype):
    """Prepacked products (the CPU default) against plain ones on the same weights: the same
    logits within rounding (the two kernels may sum in another order), a state_dict equal to the
    checkpoint's tensors, and the plain copies of the packed weights released."""
    from multispec.models.llama import packing_available

    if not packing_available(dtype, "cpu"):
        pytest.skip(f"this CPU's matrix library cannot pack {dtype}")
    hf, _ = tiny(kind, **overrides)
    tensors = {k: v.to(dtype) for k, v in hf.state_dict().items()}
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    packed = LlamaForCausalLM.from_tensors(config, tensors, dtype)
    plain = LlamaForCausalLM.from_tensors(config, tensors, dtype, pack=False)
    assert packed.packed and not plain.packed
    assert packed.model.layers[0].self_attn.q_proj.weight.is_meta  # one copy of the weights, the packed one
    ids = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        got = prefill(packed, new_cache(packed, prompt_capacity=16), ids)
        want = prefill(plain, new_cache(plain, prompt_capacity=16), ids)
    assert torch.allclose(got, want, atol=1e-4 if dtype == torch.float32 else 3e-2)
    state = packed.state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_library_rms_norm_is_the_elementwise_one(dtype, atol):
    """The norm as it runs off the CPU (torch's ``rms_norm``, one call) against the element-wise
    form the CPU runs, on activations of the default model's size and spread: equal to float32
    rounding, and in bf16 to a rounding of the output (both cast to bf16 at the same point). Fails
    with the eps left out or the weight applied before the cast."""
    from multispec.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=gen) * 2)
    norm = norm.to(dtype)
    x = (torch.randn(37, 576, generator=gen) * torch.logspace(-3, 1, 37)[:, None]).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(norm.library_norm(x), norm(x), atol=atol, rtol=atol)
