"""The cache's storage and bookkeeping: allocated once, zeroed lazily, commit in place, slot moves,
resident memory accounted and handed back where layouts overcommit."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from multispec.engine.attention import split_step
from multispec.engine.cache import CacheShape, KVCache, lazy_memory
from multispec.models.config import ModelConfig

CONFIG = ModelConfig.from_hf_dict(dict(
    architectures=["LlamaForCausalLM"], vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))


def labelled_cache() -> KVCache:
    shape = CacheShape(3, 10, 1, 4)
    cache = KVCache(CONFIG, shape.tokens(), torch.float32)
    cache.layout(shape)
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


def test_memory_is_zeroed_only_as_far_as_it_can_be_read():
    """The storage is allocated once and never filled as a whole: slots in use read zeros up to
    the length asked for and are left untouched past it (here: the NaN planted before), and what
    was zeroed or written is not zeroed again when the readable length grows."""
    shape = CacheShape(64, 256, 4, 256)
    cache = KVCache(CONFIG, shape.tokens(), torch.float32)
    cache.k_store.fill_(math.nan)
    cache.v_store.fill_(math.nan)
    cache.layout(shape)
    slot = cache.take_prompt_slot()
    cache.ready(8, 100, [slot], 50)
    assert not cache.sample_k[:, :8, :, :100].isnan().any() and not cache.prompt_v[:, slot, :, :50].isnan().any()
    assert cache.sample_k[:, :8, :, 100:].isnan().all() and cache.sample_v[:, 8:].isnan().all()
    assert cache.prompt_k[:, slot, :, 50:].isnan().all()
    cache.sample_k[:, 0, :, :100] = 7.0
    cache.ready(10, 150, [slot], 50)
    assert cache.sample_k[:, 0, :, :100].eq(7.0).all() and cache.sample_k[:, 0, :, 100:150].eq(0).all()
    assert not cache.sample_k[:, :10, :, :150].isnan().any() and cache.sample_k[:, :10, :, 150:].isnan().all()


def test_a_step_is_split_only_where_one_part_would_pad_more_rows_than_it_has():
    # Every sample drafts, or none does: one part, nothing padded.
    assert not split_step(16, 1, 0, 16)
    assert not split_step(16, 3, 16, 48)
    # Most samples draft a token: padding the rest is cheaper than a second pass.
    assert not split_step(16, 2, 15, 31)
    assert not split_step(16, 4, 8, 40)
    # One sample drafts four tokens: one part would pad 15 x 4 rows for 20 real ones.
    assert split_step(16, 5, 1, 20)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not lazy_memory("cpu"), reason="memory here is not committed page by page")
def test_an_overcommitted_cache_hands_back_the_memory_of_unused_slots():
    """Slots nobody uses any more give their pages back: the process's resident memory drops by
    about their size, they read as zeros again, and the slots still in use keep their contents."""
    cache = KVCache(CONFIG, 100_000, torch.float32, overcommit=4)
    assert cache.room == 400_000
    shape = CacheShape(96, 4096, 4, 1024)  # 397,312 tokens of address space
    cache.layout(shape)
    cache.ready(64, 3000, [0, 1], 1000)
    assert cache.resident() == 64 * 3000 + 2 * 1000
    assert cache.resident_after(70, 3500, [0, 2], 1000) == cache.resident() + 64 * 500 + 6 * 3500 + 1000
    cache.sample_k[:, :64, :, :3000] = 5.0
    cache.sample_v[:, :64, :, :3000] = 5.0
    cache.prompt_k[:, :2, :, :1000] = 3.0
    before = resident_bytes()
    cache.release_unused(16, {1})  # samples 0..15 and prompt slot 1 stay in use
    released = 48 * 3000 + 1000  # tokens
    dropped = before - resident_bytes()
    assert dropped > 0.9 * released * cache.token_elements * 4 * 2, dropped
    assert cache.resident() == 16 * 3000 + 1000
    assert cache.sample_k[:, :16, :, :3000].eq(5.0).all() and cache.prompt_k[:, 1, :, :1000].eq(3.0).all()
    cache.ready(64, 3000, [0, 1], 1000)  # the handed-back slots are zeroed again before anyone reads them
    assert cache.sample_k[:, 16:64, :, :3000].eq(0).all() and cache.prompt_k[:, 0, :, :1000].eq(0).all()
    assert cache.sample_k[:, :16, :, :3000].eq(5.0).all() and cache.prompt_k[:, 1, :, :1000].eq(3.0).all()
    cache.layout(shape)  # a layout again hands back everything
    assert cache.resident() == 0


def test_a_cache_overcommits_only_where_memory_is_committed_lazily():
    cache = KVCache(CONFIG, 1000, torch.float32, overcommit=4)
    assert cache.room == (4000 if lazy_memory("cpu") else 1000)
    assert not lazy_memory("meta")
    with pytest.raises(ValueError, match="room for"):
        cache.layout(CacheShape(cache.room // 10 + 1, 10, 0, 0))


@pytest.mark.skipif(not lazy_memory("cpu"), reason="memory here is not committed page by page")
def test_a_process_holding_an_overcommitted_cache_can_still_fork():
    """The address space is mapped without reserving memory, so a process with a large cache
    (here 4 x 12 GiB, more than this machine's memory) still forks a child, as the code sandbox
    does; reserved the ordinary way, the fork failed with ENOMEM."""
    caches = [KVCache(CONFIG, 3 * (1 << 30) // (CONFIG.num_hidden_layers * 2 * 4 * 4), torch.float32, overcommit=4)
              for _ in range(2)]
    assert sum(c.k_store.numel() + c.v_store.numel() for c in caches) * 4 >= 48 * (1 << 30)
    done = subprocess.run([sys.executable, "-c", "print('child')"], capture_output=True, text=True,
                          preexec_fn=lambda: None, check=True)  # preexec_fn: a real fork, not vfork
    assert done.stdout == "child\n"


def test_a_cache_falls_back_to_its_budget_where_unreserved_address_space_is_refused(monkeypatch):
    """Under strict overcommit accounting the kernel refuses MAP_NORESERVE mappings it cannot
    back; the cache then allocates its budget the ordinary way and lays out within it."""
    import multispec.engine.cache as cache_module

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(cache_module, "lazy_memory", lambda device: True)
    monkeypatch.setattr(cache_module._Reserved, "__init__", refuse)
    cache = KVCache(CONFIG, 1000, torch.float32, overcommit=4)
    assert (cache.overcommit, cache.room, cache.k_store.numel()) == (1, 1000, 1000 * cache.token_elements)
    cache.layout(CacheShape(90, 10, 10, 10))
    cache.release_unused(0, set())  # nothing to hand back: a no-op
