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

Where memory is committed only when first touched (a CPU under Linux, transparent huge pages not
forced on), the engine's cache lays out ``OVERCOMMIT`` times its budget in address space: more
slots, or larger ones, than the budget could fill, since requests use only part of a slot
(a server's layout must also suit requests that have not arrived). The budget then bounds what
is resident: the scheduler admits a request only while the zeroed positions of all slots, its
own included, fit ``capacity`` (``resident_after``), and when they would not, it hands the pages
of slots nobody uses back to the system first (``release_unused``, ``madvise(MADV_DONTNEED)``;
they are zeroed again before anyone reads them). A layout that replaces another hands back
everything. Elsewhere (a GPU, whose memory is committed when allocated) the layout stays within
the budget and the accounting never binds.
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass

import torch

from multispec.engine.prefix import PromptPrefixes
from multispec.models.config import ModelConfig
from multispec.models.pages import transparent_huge_pages

GIB = 1 << 30
OVERCOMMIT = 4
"""Address space the engine's cache lays out, in multiples of its budget, where memory is
committed lazily (see the module's description)."""
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python 3.11 does not name it


def lazy_memory(device: torch.device | str) -> bool:
    """Whether memory allocated on ``device`` is committed only as it is touched, page by page,
    and can be handed back by range: a CPU under Linux where transparent huge pages are not
    forced on (``always`` would commit 2 MiB around every touched byte)."""
    if torch.device(device).type != "cpu" or not sys.platform.startswith("linux"):
        return False
    return transparent_huge_pages() != "always"  # None: no transparent huge pages at all


class _Reserved:
    """Address space for ``count`` elements of ``dtype``, mapped without reserving memory for it
    (``MAP_NORESERVE``: the kernel charges nothing until pages are touched, so a process holding
    it can still fork, to run a sandboxed program say), as a flat tensor; ``hand_back`` returns
    the whole pages inside one of its views to the system."""

    def __init__(self, count: int, dtype: torch.dtype):
        size = max(1, count * torch.empty((), dtype=dtype).element_size())
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self.tensor = torch.frombuffer(self.map, dtype=dtype, count=count) if count else torch.empty(0, dtype=dtype)

    def hand_back(self, view: torch.Tensor) -> None:
        """The pages of a contiguous view read as zeros when next touched; partial pages at its
        ends keep their contents."""
        base = self.tensor.data_ptr()
        start = view.data_ptr() - base
        end = start + view.numel() * view.element_size()
        first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)


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

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 overcommit: int = 1, compute_dtype: torch.dtype | None = None):
        """``capacity``: the budget, tokens that may be resident; ``overcommit``: layouts may span
        that many times as much address space (only where ``lazy_memory``; else 1).
        ``compute_dtype``: the activations' dtype, where the cache stores keys and values narrower
        (bfloat16 under float32); None: ``dtype``."""
        self.config = config
        self.compute_dtype = compute_dtype or dtype
        self.capacity = capacity
        self.overcommit = overcommit if overcommit > 1 and lazy_memory(device) else 1
        self.dims = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        self.token_elements = self.dims[0] * self.dims[1] * self.dims[2]
        if self.overcommit > 1:
            total = capacity * self.overcommit * self.token_elements
            try:
                self._reserved = (_Reserved(total, dtype), _Reserved(total, dtype))
                self.k_store, self.v_store = (reserved.tensor for reserved in self._reserved)
            except OSError:  # the kernel refuses unreserved address space (strict overcommit)
                self.overcommit = 1
        if self.overcommit == 1:
            self.k_store = torch.empty(capacity * self.token_elements, dtype=dtype, device=device)
            self.v_store = torch.empty(capacity * self.token_elements, dtype=dtype, device=device)
        self.room = capacity * self.overcommit
        """Tokens a layout may span."""
        self.shape: CacheShape | None = None
        self.free_prompt_slots: list[int] = []
        self.prefixes = PromptPrefixes()
        """What each prompt slot still holds, for prompts that continue it (``multispec.engine.prefix``)."""
        self._prompt_ready: list[int] = []
        self._sample_ready: list[int] = []

    def layout(self, shape: CacheShape) -> None:
        """View the buffers as ``shape``'s slots; only while no slot is in use. An overcommitted
        cache hands back all its memory first (the old layout's zeroed positions mean nothing in
        the new one)."""
        if shape.tokens() > self.room:
            raise ValueError(f"cache layout needs {shape.tokens()} tokens, room for {self.room}")
        if self.overcommit > 1 and self.resident():
            for reserved in self._reserved:
                reserved.hand_back(reserved.tensor)
        layers, heads, dim = self.dims
        split = shape.prompt_slots * shape.prompt_capacity * self.token_elements
        end = split + shape.sample_slots * shape.sample_capacity * self.token_elements
        prompt = (layers, shape.prompt_slots, heads, shape.prompt_capacity, dim)
        sample = (layers, shape.sample_slots, heads, shape.sample_capacity, dim)
        self.prompt_k, self.prompt_v = self.k_store[:split].view(prompt), self.v_store[:split].view(prompt)
        self.sample_k, self.sample_v = self.k_store[split:end].view(sample), self.v_store[split:end].view(sample)
        self.shape = shape
        self.free_prompt_slots = list(range(shape.prompt_slots - 1, -1, -1))
        self.prefixes.reset(shape.prompt_slots)
        # Positions zeroed (or written) so far in each slot of this layout.
        self._prompt_ready = [0] * shape.prompt_slots
        self._sample_ready = [0] * shape.sample_slots

    def grown(self, sample_capacity: int) -> KVCache:
        """A cache of the same slots with room for ``sample_capacity`` tokens per sample slot,
        holding this one's contents (for owners that size their cache as they go, such as a draft
        model's per-prompt cache)."""
        shape = self.shape
        bigger = CacheShape(shape.sample_slots, sample_capacity, shape.prompt_slots, shape.prompt_capacity)
        cache = KVCache(self.config, bigger.tokens(), self.k_store.dtype, self.k_store.device,
                        compute_dtype=self.compute_dtype)
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

    def take_prompt_slot(self, slot: int | None = None) -> int:
        """A free prompt slot: ``slot`` (which must be free), or the last freed."""
        if slot is None:
            return self.free_prompt_slots.pop()
        self.free_prompt_slots.remove(slot)
        return slot

    def copy_prompt(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of prompt slot ``src`` into prompt slot ``dst``."""
        self.prompt_k[:, dst, :, :length] = self.prompt_k[:, src, :, :length]
        self.prompt_v[:, dst, :, :length] = self.prompt_v[:, src, :, :length]

    def release_prompt_slot(self, slot: int) -> None:
        self.free_prompt_slots.append(slot)

    def ready(self, sample_slots: int, sample_length: int, prompt_slots: list[int], prompt_length: int) -> None:
        """Make sample slots ``0 .. sample_slots - 1`` readable up to ``sample_length`` positions
        and the given prompt slots up to ``prompt_length``, zeroing what was never zeroed."""
        _zero_up_to(self.sample_k, self.sample_v, self._sample_ready, list(range(sample_slots)), sample_length)
        _zero_up_to(self.prompt_k, self.prompt_v, self._prompt_ready, prompt_slots, prompt_length)

    def resident(self) -> int:
        """Positions zeroed or written so far in this layout, over all slots: what it holds resident."""
        return sum(self._sample_ready) + sum(self._prompt_ready)

    def resident_after(self, sample_slots: int, sample_length: int, prompt_slots: list[int], prompt_length: int) -> int:
        """``resident()`` once ``ready`` had been called with these arguments."""
        grown = sum(max(0, sample_length - r) for r in self._sample_ready[:sample_slots])
        grown += sum(max(0, prompt_length - self._prompt_ready[p]) for p in set(prompt_slots))
        return self.resident() + grown

    def release_unused(self, sample_slots: int, prompt_slots: set[int]) -> None:
        """Hand back the memory of sample slots from ``sample_slots`` on and of the prompt slots not
        in ``prompt_slots`` (slots nobody uses; overcommitted caches only, elsewhere nothing)."""
        if self.overcommit == 1:
            return
        if any(self._sample_ready[sample_slots:]):
            for layer in range(self.dims[0]):
                self._reserved[0].hand_back(self.sample_k[layer, sample_slots:])
                self._reserved[1].hand_back(self.sample_v[layer, sample_slots:])
            self._sample_ready[sample_slots:] = [0] * (len(self._sample_ready) - sample_slots)
        for slot, ready in enumerate(self._prompt_ready):
            if ready and slot not in prompt_slots:
                for layer in range(self.dims[0]):
                    self._reserved[0].hand_back(self.prompt_k[layer, slot])
                    self._reserved[1].hand_back(self.prompt_v[layer, slot])
                self._prompt_ready[slot] = 0
                self.prefixes.forget(slot)

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
