"""Each architecture end to end through ``LLM``: tiny random Qwen3 (per-head q/k norms, heads
wider than hidden / heads), SmolLM3 (an unrotated layer), Phi-3 (fused products, partial
rotation, LongRoPE), Gemma 2 (sandwich norms, soft caps, GELU), Gemma 3 (q/k norms, two
rotations) and Mistral checkpoints generate what transformers' own model generates, with and
without speculation, and their log-probabilities. The windows of Gemma 2, Gemma 3, SmolLM3 and
Mistral are shorter than the prompt, so they act in the prompt's forward and in every step; Phi-3's
LongRoPE keeps sequences within its original length.

Greedy decoding in float32: transformers and multispec agree to about 1e-5 on these logits
(tests/models/test_parity.py), and no top-two gap over the tokens compared is below 1e-3 with
the seeds below (Mistral's has the smallest), so any difference is a real one (a norm left out or
a key the window should drop moves every logit)."""

from __future__ import annotations

import pytest
import torch
import transformers

from multispec import LLM, SamplingParams, SpecConfig
from tests.models.conftest import like_trained, write_tiny_tokenizer

TOKENS = 24
SMALL = dict(vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def save_model(directory, kind: str, seed: int, norms: bool = False, sharpen: float | None = None, **config):
    """A tiny random transformers model of ``kind`` ("Qwen3", "Phi3", ...; ``SMALL`` and
    ``config``), made like a trained one (``like_trained``), saved with the tiny tokenizer."""
    config_name = {"Gemma3": "Gemma3TextConfig"}.get(kind, f"{kind}Config")  # Gemma3Config is the multimodal one
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, f"{kind}ForCausalLM")
    torch.manual_seed(seed)
    model = model_class(config_class(**SMALL, **config)).eval()
    like_trained(model, norms=norms, sharpen=sharpen)
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return model


def save_qwen3(directory):
    return save_model(directory, "Qwen3", 3, norms=True, head_dim=32, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    hf = save_qwen3(directory)
    return hf, LLM(str(directory), device="cpu", dtype="float32")


def test_qwen3_generates_what_transformers_generates(qwen3):
    hf, llm = qwen3
    assert llm.config.architecture == "Qwen3ForCausalLM" and llm.config.qk_norm and llm.config.head_dim == 32
    prompt = llm.tokenizer.encode("Hello world! The quick brown fox")
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    params = SamplingParams(n=2, temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    plain = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [list(c.token_ids) for c in plain.outputs] == [want, want]
    # Sibling drafts (the second sample copies the first) verified against the same forward.
    spec = SpecConfig(drafter="consensus", max_draft_tokens=4, adaptive=False)  # drafts every step
    drafted = llm.generate([{"prompt_token_ids": prompt}], params, spec=spec, use_tqdm=False)[0]
    assert [list(c.token_ids) for c in drafted.outputs] == [want, want]
    assert llm.last_stats.accepted_tokens > 0


def test_qwen3_samples_are_those_of_plain_sampling(qwen3):
    """Seeded samples at T 1.0: copied drafts leave each sample's draws keyed by (seed, sample,
    position), so the speculative run returns the plain run's samples."""
    _, llm = qwen3
    params = SamplingParams(n=6, temperature=1.0, max_tokens=16, ignore_eos=True, seed=5)
    prompt = "def f(x):"
    plain = llm.generate([prompt], params, use_tqdm=False)[0]
    drafted = llm.generate([prompt], params, spec=SpecConfig(drafter="consensus", adaptive=False), use_tqdm=False)[0]
    assert [list(c.token_ids) for c in drafted.outputs] == [list(c.token_ids) for c in plain.outputs]


def save_phi3(directory):
    """Phi-4-mini's kind of checkpoint, small: three quarters of each head rotated, LongRoPE with
    distinct short and long factors (so sequences stop at the original 64 positions), tied."""
    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.8, 4.0], "long_factor": [6.0] * 6}
    return save_model(directory, "Phi3", 4, sharpen=8, partial_rotary_factor=0.75, rope_scaling=rope,
                      original_max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0)


def save_gemma2(directory):
    """Gemma 2's kind of checkpoint, small: caps low enough to act on these scores and logits, an
    attention scale other than the head width, a window of 16 positions (every other layer)."""
    return save_model(directory, "Gemma2", 5, norms=True, sharpen=8, head_dim=16, query_pre_attn_scalar=24,
                      attn_logit_softcapping=4.0, final_logit_softcapping=3.0, sliding_window=WINDOW, pad_token_id=0)


def save_smollm3(directory):
    """SmolLM3's kind of checkpoint, small: the second of two layers unrotated ("NoPE"), with a
    window of 16 positions on it."""
    return save_model(directory, "SmolLM3", 6, sharpen=8, no_rope_layer_interval=2, use_sliding_window=True,
                      sliding_window=WINDOW, pad_token_id=0)


def save_gemma3(directory):
    """Gemma 3's kind of checkpoint, small: q/k norms, a window of 16 positions on the first of two
    layers, which rotates by its own base, the other by a scaled rotation."""
    return save_model(directory, "Gemma3", 10, norms=True, sharpen=8, head_dim=16, sliding_window=WINDOW,
                      layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=100.0,
                      rope_scaling={"rope_type": "linear", "factor": 4.0}, pad_token_id=0)


def save_mistral(directory):
    """Mistral's kind of checkpoint, small: a window of 16 positions on every layer."""
    return save_model(directory, "Mistral", 12, sharpen=8, sliding_window=WINDOW, pad_token_id=0)


WINDOW = 16
"""The sliding windows of the checkpoints above: shorter than the prompt below (23 tokens), so
that the window cuts what the prompt's own rows see and what every generated token sees."""


def save_gemma(directory):
    """Gemma's kind of checkpoint, small: norms by 1 + weight, GELU's tanh approximation, heads
    wider than hidden / heads."""
    return save_model(directory, "Gemma", 5, norms=True, sharpen=8, head_dim=32, pad_token_id=0)


def save_gemma3_wide(directory):
    """Gemma 3's kind as above with windows past every sequence here, a second rotation of its
    own base and linear scaling of the first."""
    return save_model(directory, "Gemma3", 10, norms=True, sharpen=8, head_dim=16, sliding_window=200,
                      layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=100.0,
                      rope_scaling={"rope_type": "linear", "factor": 4.0}, pad_token_id=0)


def save_smollm3_wide(directory):
    """SmolLM3's kind without a window (the unrotated layer left alone)."""
    return save_model(directory, "SmolLM3", 6, sharpen=8, no_rope_layer_interval=2, pad_token_id=0)


def save_olmo2(directory):
    """OLMo 2's kind of checkpoint, small: norms on the blocks' outputs only, q and k normalised
    across all their heads."""
    return save_model(directory, "Olmo2", 9, norms=True, sharpen=8, pad_token_id=0)


KINDS = {"phi3": save_phi3, "gemma2": save_gemma2, "gemma3": save_gemma3, "smollm3": save_smollm3,
         "mistral": save_mistral, "gemma": save_gemma, "gemma3-wide": save_gemma3_wide,
         "smollm3-wide": save_smollm3_wide, "olmo2": save_olmo2}
STACKED = tuple(KINDS)
"""The kinds whose decode steps run the compiled layer stack: all of them (windows, Gemma 2's
capped scores)."""


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_generates_what_transformers_generates(tmp_path, kind):
    hf = KINDS[kind](tmp_path)
    if kind == "phi3":
        with pytest.raises(ValueError, match=r"max_model_len=100.*\[2, 64\].*original_max_position_embeddings=64"):
            LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=100)
    else:  # a sliding window does not bound the sequence
        assert LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=100).engine.config.max_model_len == 100
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    assert llm.config.architecture == type(hf).__name__
    prompt = llm.tokenizer.encode("The lazy dog jumps over the quick brown fox. Hello world! def f(x): return x")
    assert len(prompt) > WINDOW and len(prompt) + TOKENS < 200
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS,
                          eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    want = out.sequences[0, len(prompt):].tolist()
    want_logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, want)]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    plain = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [list(c.token_ids) for c in plain.outputs] == [want, want]
    # Each token's log-probability as transformers computes it (a wrong rotation of a few
    # dimensions can leave the greedy tokens as they are, not these).
    got_logprobs = [step[t] for step, t in zip(plain.outputs[0].logprobs, want)]
    assert got_logprobs == pytest.approx(want_logprobs, abs=1e-3)
    spec = SpecConfig(drafter="consensus", max_draft_tokens=4, adaptive=False)
    drafted = llm.generate([{"prompt_token_ids": prompt}], params, spec=spec, use_tqdm=False)[0]
    assert [list(c.token_ids) for c in drafted.outputs] == [want, want]
    assert llm.last_stats.accepted_tokens > 0
    assert (llm.engine.model._stack_weights is not None) == (kind in STACKED)  # which path the steps ran
    if kind == "phi3":  # the original length bounds the sequence: 4 tokens after a prompt 4 short of it
        out = llm.generate([{"prompt_token_ids": list(range(10, 70))}],
                           SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_a_multimodal_gemma3_runs_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (Gemma 3 4B and up): its text_config and the
    language model's tensors are read (the vision tower's and the projector's are not), and text
    prompts generate what transformers' multimodal model generates from text."""
    text = dict(SMALL, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                rope_scaling={"rope_type": "linear", "factor": 4.0}, pad_token_id=0)
    text.pop("eos_token_id"), text.pop("bos_token_id")
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=399, boi_token_index=397, eoi_token_index=398,
                                       eos_token_id=2, bos_token_id=1)
    torch.manual_seed(16)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    like_trained(hf.model.language_model, norms=True, sharpen=8)
    hf.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    assert llm.config.architecture == "Gemma3ForCausalLM" and llm.config.window_layers == (True, False)
    assert set(llm.model.state_dict()) == {f"model.{k}" for k in hf.model.language_model.state_dict()}
    prompt = [1, *range(50, 261, 10)]  # 23 tokens (no top-two gap below 4e-3 over the tokens compared)
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False,
                           min_new_tokens=TOKENS, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    params = SamplingParams(n=2, temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [list(c.token_ids) for c in out.outputs] == [want, want]
    assert len(set(want)) > 3
