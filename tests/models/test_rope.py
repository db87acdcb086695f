"""rope_inv_freq equals transformers' RoPE initialisation for every supported type.

The reference is what transformers' LlamaRotaryEmbedding computes (its default init,
or ``ROPE_INIT_FUNCTIONS`` for the scaled types) on the same config.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from multispec.models.config import ModelConfig
from multispec.models.rope import rope_inv_freq

BASE = dict(vocab_size=11, hidden_size=256, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=2048)

CASES = {
    "default": dict(rope_theta=10000.0),
    "default-head-dim": dict(rope_theta=500000.0, head_dim=64),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "dynamic": dict(rope_theta=100000.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    # Llama 3.1's published parameters, with a short original context so all three bands occur.
    "llama3": dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 512}),
    "yarn": dict(rope_theta=1000000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 512}),
    "yarn-tuned": dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                                     "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0,
                                     "truncate": False}),
    "yarn-attention-factor": dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.25,
                                                "original_max_position_embeddings": 1024}),
    "yarn-no-factor": dict(rope_scaling={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 512}),
}


def reference(hf_config, seq_len=None) -> tuple[torch.Tensor, float]:
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
        return rotary.inv_freq, rotary.attention_scaling
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, seq_len=seq_len)


def configs(case: str):
    hf_config = transformers.LlamaConfig(**BASE, **CASES[case])
    return hf_config, ModelConfig.from_hf_dict(hf_config.to_dict())


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case):
    hf_config, config = configs(case)
    want, want_scale = reference(hf_config)
    got, scale = rope_inv_freq(config)
    assert got.dtype == torch.float32 and got.shape == (config.head_dim // 2,)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-12)


@pytest.mark.parametrize("seq_len", [None, 100, 2048, 2049, 5000, 30000])
def test_dynamic_follows_sequence_length(seq_len):
    hf_config, config = configs("dynamic")
    want, _ = reference(hf_config, seq_len)
    got, _ = rope_inv_freq(config, seq_len)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_dynamic_changes_only_past_the_trained_length():
    _, config = configs("dynamic")
    short, _ = rope_inv_freq(config, 2048)
    long, _ = rope_inv_freq(config, 4096)
    assert torch.equal(short, rope_inv_freq(config)[0])
    assert (long[1:] < short[1:]).all()


def test_llama3_exercises_every_band():
    """The case above only tests the smoothing band if some frequencies fall in it."""
    _, config = configs("llama3")
    plain, _ = rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
    got, _ = rope_inv_freq(config)
    ratio = plain / got
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


PHI3_CASES = {
    "partial": dict(partial_rotary_factor=0.75),
    "longrope": dict(original_max_position_embeddings=512, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(64)],
        "long_factor": [2.0 + i for i in range(64)]}),
    "longrope-partial-theta": dict(
        partial_rotary_factor=0.5, rope_theta=250000.0, original_max_position_embeddings=512,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.5 - i / 64 for i in range(32)],
                      "long_factor": [3.0] * 32}),
    "longrope-given-factors": dict(original_max_position_embeddings=512, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.2] * 64, "long_factor": [1.2] * 64, "factor": 8.0,
        "attention_factor": 1.3}),
}


@pytest.mark.parametrize("case", sorted(PHI3_CASES))
def test_phi3_matches_transformers(case):
    """Phi-3's rotation (transformers' Phi3RotaryEmbedding): the first ``rotary_dim`` dimensions'
    frequencies, LongRoPE's short factors and its attention factor, within the original length."""
    hf_config = transformers.Phi3Config(**{**BASE, "pad_token_id": 0}, **PHI3_CASES[case])
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_config)
    got, scale = rope_inv_freq(config)
    assert got.shape == (config.rotary_dim // 2,) and config.rotary_dim == int(128 * hf_config.rope_parameters.get(
        "partial_rotary_factor", 1.0))
    torch.testing.assert_close(got, rotary.inv_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-12)
    if "longrope" in case:
        assert scale != 1.0
