"""KV storage: one allocation made with the engine, laid out as prompt slots and sample slots.

A prompt's keys and values are computed once and stored once, in a *prompt slot*; its n samples
each own a *sample slot* that holds only the tokens generated after the prompt. Both kinds of slot
are views of one buffer each for keys and values, allocated once (``kv_cache_memory``) and never
resized; the scheduler lays the slots out again (``layout``) only while none is in use, to suit
the requests it has.

Slot-major ([slot, layer, kv_head, position, dim]): every slot is one contiguous range, zeroed the
first time it is handed out, so resident memory grows with the slots actually used, not with the
cap. Zeroed, not left as it was: attention reads masked positions too (as 0 * value), and
uninitialised memory can hold NaN, which a zero weight does not cancel. Memory once zeroed only
ever holds zeros or keys and values a forward wrote, so it never needs zeroing again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multispec.models.config import ModelConfig

GIB = 1 << 30
CHUNK = 1 << 20
"""Elements zeroed at a time on first use."""


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

    After ``layout``: ``prompt_k``/``prompt_v`` [prompt_slots, layers, kv_heads, prompt_capacity,
    head_dim] and ``sample_k``/``sample_v`` [sample_slots, layers, kv_heads, sample_capacity,
    head_dim]."""

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.config = config
        self.capacity = capacity
        self.dims = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        self.token_elements = self.dims[0] * self.dims[1] * self.dims[2]
        total = capacity * self.token_elements
        self.k_store = torch.empty(total, dtype=dtype, device=device)
        self.v_store = torch.empty(total, dtype=dtype, device=device)
        self._zeroed = bytearray((total + CHUNK - 1) // CHUNK)
        self.shape: CacheShape | None = None
        self.free_prompt_slots: list[int] = []

    def layout(self, shape: CacheShape) -> None:
        """View the buffers as ``shape``'s slots; only while no slot is in use."""
        if shape.tokens() > self.capacity:
            raise ValueError(f"cache layout needs {shape.tokens()} tokens, room for {self.capacity}")
        layers, heads, dim = self.dims
        self._prompt_elements = shape.prompt_capacity * self.token_elements
        self._sample_elements = shape.sample_capacity * self.token_elements
        split = shape.prompt_slots * self._prompt_elements
        end = split + shape.sample_slots * self._sample_elements
        prompt = (shape.prompt_slots, layers, heads, shape.prompt_capacity, dim)
        sample = (shape.sample_slots, layers, heads, shape.sample_capacity, dim)
        self.prompt_k, self.prompt_v = self.k_store[:split].view(prompt), self.v_store[:split].view(prompt)
        self.sample_k, self.sample_v = self.k_store[split:end].view(sample), self.v_store[split:end].view(sample)
        self._split = split
        self.shape = shape
        self.free_prompt_slots = list(range(shape.prompt_slots - 1, -1, -1))

    def _ready(self, start: int, end: int) -> None:
        """Zero the chunks of elements [start, end) that were never zeroed. A chunk never zeroed
        overlaps no slot in use (a slot is made ready when handed out), so zeroing it whole is safe."""
        for chunk in range(start // CHUNK, (end + CHUNK - 1) // CHUNK):
            if not self._zeroed[chunk]:
                lo, hi = chunk * CHUNK, min((chunk + 1) * CHUNK, self.k_store.numel())
                self.k_store[lo:hi].zero_()
                self.v_store[lo:hi].zero_()
                self._zeroed[chunk] = 1

    def take_prompt_slot(self) -> int:
        slot = self.free_prompt_slots.pop()
        self._ready(slot * self._prompt_elements, (slot + 1) * self._prompt_elements)
        return slot

    def release_prompt_slot(self, slot: int) -> None:
        self.free_prompt_slots.append(slot)

    def ready_sample_slots(self, first: int, stop: int) -> None:
        """Make sample slots ``first .. stop - 1`` safe to read before they are handed out."""
        self._ready(self._split + first * self._sample_elements, self._split + stop * self._sample_elements)

    def move_sample(self, src: int, dst: int, length: int) -> None:
        """Copy a sample's first ``length`` cached tokens from slot ``src`` into slot ``dst``."""
        self.sample_k[dst, :, :, :length] = self.sample_k[src, :, :, :length]
        self.sample_v[dst, :, :, :length] = self.sample_v[src, :, :, :length]

    def keep_paths(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Commit accepted tree paths: cache position ``src[i]`` of ``slots[i]`` moves to ``dst[i]``.

        Only nodes that are not already in place are passed; chains accepted from their start
        need no move at all. Everything past the new length is garbage that the next step
        overwrites.
        """
        if slots.numel() == 0:
            return
        self.sample_k[slots, :, :, dst] = self.sample_k[slots, :, :, src]
        self.sample_v[slots, :, :, dst] = self.sample_v[slots, :, :, src]
