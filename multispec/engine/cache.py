"""KV storage: one allocation made with the engine, laid out as prompt slots and sample slots.

A prompt's keys and values are computed once and stored once, in a *prompt slot*; its n samples
each own a *sample slot* that holds only the tokens generated after the prompt. Both kinds of slot
are views of one buffer each for keys and values, allocated once (``kv_cache_memory``) and never
resized; the scheduler lays the slots out again (``layout``) only while none is in use, to suit
the requests it has.

Layer-major ([layer, slot, kv_head, position, dim]), so that one layer's slots form one strided
block that attention's batched matrix products read in place (slot-major made them copy every
step: 3.5x slower). A slot's memory is zeroed the first time the slot is handed out, chunk by
chunk, so resident memory grows with the slots actually used, not with the cap. Zeroed, not left
as it was: attention reads masked positions too (as 0 * value), and uninitialised memory can hold
NaN, which a zero weight does not cancel. Memory once zeroed only ever holds zeros or keys and
values a forward wrote, so it never needs zeroing again.
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
        self._zeroed = bytearray((total + CHUNK - 1) // CHUNK)
        self.shape: CacheShape | None = None
        self.free_prompt_slots: list[int] = []

    def layout(self, shape: CacheShape) -> None:
        """View the buffers as ``shape``'s slots; only while no slot is in use."""
        if shape.tokens() > self.capacity:
            raise ValueError(f"cache layout needs {shape.tokens()} tokens, room for {self.capacity}")
        layers, heads, dim = self.dims
        # Elements of one slot in one layer, and of one layer of all slots, per kind of slot.
        self._prompt_slot = heads * shape.prompt_capacity * dim
        self._sample_slot = heads * shape.sample_capacity * dim
        self._prompt_layer = shape.prompt_slots * self._prompt_slot
        self._sample_layer = shape.sample_slots * self._sample_slot
        split = layers * self._prompt_layer
        end = split + layers * self._sample_layer
        prompt = (layers, shape.prompt_slots, heads, shape.prompt_capacity, dim)
        sample = (layers, shape.sample_slots, heads, shape.sample_capacity, dim)
        self.prompt_k, self.prompt_v = self.k_store[:split].view(prompt), self.v_store[:split].view(prompt)
        self.sample_k, self.sample_v = self.k_store[split:end].view(sample), self.v_store[split:end].view(sample)
        self._split = split
        self.shape = shape
        self.free_prompt_slots = list(range(shape.prompt_slots - 1, -1, -1))

    def _ready(self, base: int, layer_stride: int, start: int, end: int) -> None:
        """Zero the never-zeroed chunks of elements [start, end) past ``base`` in every layer. A
        chunk never zeroed overlaps no slot in use (a slot is made ready when handed out), so
        zeroing it whole is safe."""
        for layer in range(self.dims[0]):
            lo = base + layer * layer_stride
            for chunk in range((lo + start) // CHUNK, (lo + end + CHUNK - 1) // CHUNK):
                if not self._zeroed[chunk]:
                    first, last = chunk * CHUNK, min((chunk + 1) * CHUNK, self.k_store.numel())
                    self.k_store[first:last].zero_()
                    self.v_store[first:last].zero_()
                    self._zeroed[chunk] = 1

    def take_prompt_slot(self) -> int:
        slot = self.free_prompt_slots.pop()
        self._ready(0, self._prompt_layer, slot * self._prompt_slot, (slot + 1) * self._prompt_slot)
        return slot

    def release_prompt_slot(self, slot: int) -> None:
        self.free_prompt_slots.append(slot)

    def ready_sample_slots(self, first: int, stop: int) -> None:
        """Make sample slots ``first .. stop - 1`` safe to read before they are handed out."""
        self._ready(self._split, self._sample_layer, first * self._sample_slot, stop * self._sample_slot)

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
