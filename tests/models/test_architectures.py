"""Each architecture end to end through ``LLM``: a tiny random Qwen3 checkpoint (per-head q/k
norms, heads wider than hidden / heads) generates what transformers' own model generates, with
and without speculation; a Mistral checkpoint with a sliding window keeps its sequences within
the window, where attending to the whole sequence is the same thing.

Greedy decoding in float32: transformers and multispec agree to about 1e-5 on these logits
(tests/models/test_parity.py), and no top-two gap over the tokens compared is below 4e-3 with
the seed below, so any difference is a real one (a norm left out moves every logit).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from multispec import LLM, SamplingParams, SpecConfig
from tests.models.conftest import write_tiny_tokenizer

TOKENS = 24


def save_qwen3(directory):
    config = transformers.Qwen3Config(vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                                      eos_token_id=2)
    torch.manual_seed(3)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norm weights of their own, as a trained model has
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.add_(0.3 * torch.randn_like(weight))
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return model


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


def test_a_sliding_window_bounds_the_context(tmp_path):
    config = transformers.MistralConfig(vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        sliding_window=48, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"max_model_len=100.*\[2, 48\].*sliding_window=48"):
        LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=100)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    prompt = list(range(10, 50))  # 40 tokens: room for 8 more within the window
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=20, ignore_eos=True, seed=0),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len=48"):
        llm.generate([{"prompt_token_ids": list(range(10, 60))}], SamplingParams(max_tokens=4), use_tqdm=False)
