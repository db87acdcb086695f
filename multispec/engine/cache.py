"""KV storage: one allocation made with the engine, laid out as prompt slots and sample slots.

A prompt's keys and values are computed once and stored once, in a *prompt slot*; its n samples
each own a *sample slot* that holds only the tokens generated after the prompt. Both kinds of slot
are views of one buffer each for keys and values, allocated once (``kv_cache_memory``) and never
resized; the scheduler lays the slots out again (``layout``) only while none is in use, to suit
the requests it has.

Layer-major ([layer, slot, kv_head, position, dim]), so that one layer's slots form one strided
block that attention's batched matrix products read in place (slot-major made them copy every
step: 3.5x slower). Memory is zeroed only as far as it can be read: attention reads every slot of
a step up to the longest sample of the step (masked, as 0 * value), so sample slots in use are
zeroed up to the longest sample any live request may write, and prompt slots up to the longest
live prompt, when requests are admitted. Resident memory therefore follows what the requests
need, not the slots' capacity. Zeroed, not left as it was, because uninitialised memory can hold
NaN, which a zero weight does not cancel; memory once zeroed only ever holds zeros or keys and
values a forward wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multispec.models.config import ModelConfig

GIB = 1 << 30


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one token occupies in the cache over all layers (keys and values)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


@dataclass(frozen=True)
class CacheShape:
    """How many slots of which capacity (tokens)."""

    sample_slots: int
    sample_capacity: int
    prompt_slots: int
    prompt_capacity: int

    def tokens(self) -> int:
        return self.sample_slots * self.sample_capacity + self.prompt_slots * self.prompt_capacity


class KVCache:
    """Room for ``capacity`` tokens of keys and values, laid out by ``layout(shape)``.

    After ``layout``: ``prompt_k``/``prompt_v`` [layers, prompt_slots, kv_heads, prompt_capacity,
    head_dim] and ``sample_k``/``sample_v`` [layers, sample_slots, kv_heads, sample_capacity,
    head_dim]."""

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.config = config
        self.capacity = capacity
        self.dims = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        self.token_elements = self.dims[0] * self.dims[1] * self.dims[2]
        total = capacity * self.token_elements
        self.k_store = torch.empty(total, dtype=dtype, device=device)
        self.v_store = torch.empty(total, dtype=dtype, device=device)
        self.shape: CacheShape | None = None
        self.free_prompt_slots: list[int] = []

    def layout(self, shape: CacheShape) -> None:
        """View the buffers as ``shape``'s slots; only while no slot is in use."""
        if shape.tokens() > self.capacity:
            raise ValueError(f"cache layout needs {shape.tokens()} tokens, room for {self.capacity}")
        layers, heads, dim = self.dims
        split = shape.prompt_slots * shape.prompt_capacity * self.token_elements
        end = split + shape.sample_slots * shape.sample_capacity * self.token_elements
        prompt = (layers, shape.prompt_slots, heads, shape.prompt_capacity, dim)
        sample = (layers, shape.sample_slots, heads, shape.sample_capacity, dim)
        self.prompt_k, self.prompt_v = self.k_store[:split].view(prompt), self.v_store[:split].view(prompt)
        self.sample_k, self.sample_v = self.k_store[split:end].view(sample), self.v_store[split:end].view(sample)
        self.shape = shape
        self.free_prompt_slots = list(range(shape.prompt_slots - 1, -1, -1))
        # Positions zeroed (or written) so far in each slot of this layout.
        self._prompt_ready = [0] * shape.prompt_slots
        self._sample_ready = [0] * shape.sample_slots

    def grown(self, sample_capacity: int) -> KVCache:
        """A cache of the same slots with room for ``sample_capacity`` tokens per sample slot,
        holding this one's contents (for owners that size their cache as they go, such as a draft
        model's per-prompt cache)."""
        shape = self.shape
        bigger = CacheShape(shape.sample_slots, sample_capacity, shape.prompt_slots, shape.prompt_capacity)
        cache = KVCache(self.config, bigger.tokens(), self.k_store.dtype, self.k_store.device)
        cache.layout(bigger)
        # Everything this cache holds is made finite first, so that all of it can be copied.
        self.ready(shape.sample_slots, shape.sample_capacity, list(range(shape.prompt_slots)), shape.prompt_capacity)
        for mine, theirs in ((cache.prompt_k, self.prompt_k), (cache.prompt_v, self.prompt_v)):
            mine.copy_(theirs)
        old = shape.sample_capacity
        cache.sample_k[:, :, :, :old] = self.sample_k
        cache.sample_v[:, :, :, :old] = self.sample_v
        cache.free_prompt_slots = list(self.free_prompt_slots)
        cache._prompt_ready = [shape.prompt_capacity] * shape.prompt_slots
        cache._sample_ready = [old] * shape.sample_slots
        return cache

    def take_prompt_slot(self) -> int:
        return self.free_prompt_slots.pop()

    def release_prompt_slot(self, slot: int) -> None:
        self.free_prompt_slots.append(slot)

    def ready(self, sample_slots: int, sample_length: int, prompt_slots: list[int], prompt_length: int) -> None:
        """Make sample slots ``0 .. sample_slots - 1`` readable up to ``sample_length`` positions
        and the given prompt slots up to ``prompt_length``, zeroing what was never zeroed."""
        _zero_up_to(self.sample_k, self.sample_v, self._sample_ready, list(range(sample_slots)), sample_length)
        _zero_up_to(self.prompt_k, self.prompt_v, self._prompt_ready, prompt_slots, prompt_length)

    def move_sample(self, src: int, dst: int, length: int) -> None:
        """Copy a sample's first ``length`` cached tokens from slot ``src`` into slot ``dst``."""
        self.sample_k[:, dst, :, :length] = self.sample_k[:, src, :, :length]
        self.sample_v[:, dst, :, :length] = self.sample_v[:, src, :, :length]

    def keep_paths(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Commit accepted tree paths: cache position ``src[i]`` of ``slots[i]`` moves to ``dst[i]``.

        Only nodes that are not already in place are passed; chains accepted from their start
        need no move at all. Everything past the new length is garbage that the next step
        overwrites.
        """
        if slots.numel() == 0:
            return
        self.sample_k[:, slots, :, dst] = self.sample_k[:, slots, :, src]
        self.sample_v[:, slots, :, dst] = self.sample_v[:, slots, :, src]


def _zero_up_to(k: torch.Tensor, v: torch.Tensor, ready: list[int], slots: list[int], length: int) -> None:
    """Zero positions ``ready[slot] .. length - 1`` of each slot (runs of neighbouring slots with
    the same starting point at once)."""
    todo = sorted(slot for slot in slots if ready[slot] < length)
    i = 0
    while i < len(todo):
        j = i + 1
        while j < len(todo) and todo[j] == todo[j - 1] + 1 and ready[todo[j]] == ready[todo[i]]:
            j += 1
        first, stop, start = todo[i], todo[j - 1] + 1, ready[todo[i]]
        k[:, first:stop, :, start:length].zero_()
        v[:, first:stop, :, start:length].zero_()
        for slot in range(first, stop):
            ready[slot] = length
        i = j
