"""The cache's bookkeeping: commit of tree paths in place, slot moves, and the memory plan."""

from __future__ import annotations

import pytest
import torch

from multispec.engine.kv_cache import CacheShape, KVCache, kv_bytes_per_token, split_step
from multispec.engine.llm_engine import Engine, EngineConfig
from multispec.models.config import ModelConfig
from multispec.params import SamplingParams, SpecConfig

CONFIG = ModelConfig.from_hf_dict(dict(
    architectures=["LlamaForCausalLM"], vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))


def labelled_cache() -> KVCache:
    cache = KVCache(CONFIG, CacheShape(3, 10, 1, 4), torch.float32)
    positions = torch.arange(10, dtype=torch.float32)
    slots = torch.arange(3, dtype=torch.float32)[:, None] * 100
    cache.sample_k[:] = (slots + positions)[None, :, None, :, None]
    cache.sample_v[:] = -(slots + positions)[None, :, None, :, None]
    return cache


def test_keep_paths_moves_accepted_nodes_into_place_for_every_layer():
    cache = labelled_cache()
    # Slot 1 accepted nodes at cache positions 6 and 8 -> they become positions 4 and 5.
    cache.keep_paths(torch.tensor([1, 1]), torch.tensor([6, 8]), torch.tensor([4, 5]))
    assert cache.sample_k[:, 1, :, 4, 0].eq(106).all() and cache.sample_k[:, 1, :, 5, 0].eq(108).all()
    assert cache.sample_v[:, 1, :, 4, 0].eq(-106).all() and cache.sample_v[:, 1, :, 5, 0].eq(-108).all()
    # Untouched: other positions and other slots.
    assert cache.sample_k[:, 1, :, 3, 0].eq(103).all() and cache.sample_k[:, 0, :, 4, 0].eq(4).all()


def test_move_sample_copies_only_the_used_prefix():
    cache = labelled_cache()
    cache.move_sample(2, 0, length=5)
    assert cache.sample_k[:, 0, :, :5, 0].eq(torch.arange(200, 205, dtype=torch.float32)).all()
    assert cache.sample_k[:, 0, :, 5, 0].eq(5).all()


def test_plan_refuses_before_allocating_and_shrinks_to_queue():
    engine = Engine.__new__(Engine)  # plan_cache needs only the config, dtype and model config
    engine.config = EngineConfig(max_model_len=512, kv_cache_bytes=0)
    engine.dtype = torch.float32
    engine.model = type("M", (), {"config": CONFIG})()
    per_token = kv_bytes_per_token(CONFIG, torch.float32)

    class R:  # the fields plan_cache reads
        def __init__(self, n, prompt, max_tokens):
            self.params, self.prompt_len, self.max_tokens = SamplingParams(n=n), prompt, max_tokens

    requests = [R(4, 10, 20) for _ in range(6)]
    one = 4 * (20 + 1) + 10
    engine.config.kv_cache_bytes = per_token * (one - 1)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        engine.plan_cache(requests, SpecConfig())
    engine.config.kv_cache_bytes = per_token * one * 2
    shape = engine.plan_cache(requests, SpecConfig())
    assert shape.tokens() * per_token <= engine.config.kv_cache_bytes
    assert 4 <= shape.sample_slots < 24 and shape.prompt_slots >= 1
    engine.config.kv_cache_bytes = per_token * one * 100
    assert engine.plan_cache(requests, SpecConfig()).sample_slots == 24


def test_admission_respects_both_prompt_and_sample_slots():
    """Samples of running requests can free sample slots faster than prompts free prompt slots:
    admission then stops at the free prompt slots, not only at the free sample slots."""
    from collections import deque
    from types import SimpleNamespace

    from multispec.engine.llm_engine import _admit

    def request(n):
        return SimpleNamespace(params=SimpleNamespace(n=n))

    waiting = deque([request(4), request(4), request(4)])
    assert len(_admit(waiting, free_prompt_slots=1, free_sample_slots=40)) == 1 and len(waiting) == 2
    waiting = deque([request(4), request(8), request(1)])
    assert [r.params.n for r in _admit(waiting, free_prompt_slots=3, free_sample_slots=10)] == [4]  # in order
    assert _admit(deque([request(4)]), free_prompt_slots=0, free_sample_slots=40) == []


def test_a_step_is_split_only_where_one_part_would_pad_more_rows_than_it_has():
    # Every sample drafts, or none does: one part, nothing padded.
    assert not split_step(16, 1, 0, 16)
    assert not split_step(16, 3, 16, 48)
    # Most samples draft a token: padding the rest is cheaper than a second pass.
    assert not split_step(16, 2, 15, 31)
    assert not split_step(16, 4, 8, 40)
    # One sample drafts four tokens: one part would pad 15 x 4 rows for 20 real ones.
    assert split_step(16, 5, 1, 20)
