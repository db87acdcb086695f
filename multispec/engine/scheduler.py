"""Admission and slots: which requests run, where their keys live, when the cache is laid out.

Requests wait in arrival order. Each step the scheduler admits waiting requests, first come first
served, while the one at the head fits: a free prompt slot and n free sample slots of the current
layout, whose capacities must hold its prompt and its samples' tokens, and room in the cache's
budget for the memory its slots would touch (see ``KVCache``: where layouts overcommit, the
budget binds before the slots run out). A request too big for the
current layout waits, and so do those behind it, until no sample is left running; the cache is
then laid out again for what waits (``plan``). A request that could not fit even alone in the
whole cache is refused when it is added (``check_fits``).

With prompt caching (``multispec.engine.prefix``) a request's prompt slot is chosen for what it
can reuse: a free slot that holds the longest prefix of its prompt, else the least recently used
free slot, into which a prefix held by a slot in use (or computed by a request admitted in the
same step) is copied.

Live samples always occupy sample slots 0..B-1, which attention reads in place: new samples take
the next slots, and a finished sample's slot is refilled by moving the last one down.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from multispec.engine.cache import KVCache, CacheShape
from multispec.engine.prefix import common_prefix
from multispec.engine.request import Request, Sample

SAMPLE_CAPACITY = 512
PROMPT_CAPACITY = 1024
"""Slot capacities (tokens) a layout grows to when everything waiting fits with room to spare,
so that requests arriving later (a server's) rarely find the layout too small. Memory is only
touched as far as live requests can read (see ``KVCache``), so room left in a slot costs nothing
resident."""
SPARE_PROMPTS = 0.25
"""Prompt slots per sample slot, at least, among the spare slots a layout adds beyond what waits:
those serve requests that have not arrived yet, whose n nobody knows. Sized from the waiting
requests alone, a server laid out during its first request (n = 16, a 4 GiB float32 cache) kept
10 prompt slots beside 161 sample slots, so at most 10 requests ran at once however many clients
waited (32 clients, n from {1, 4, 8, 16}: about half the sample slots idle, and a median time to
first token of 90 s)."""
SECOND_FORWARD_GAIN = 64
"""Prompt tokens a request must save by continuing the prompt of a request admitted in the same
step (which its prefill then has to follow, in a second forward) beyond what the slots already
hold, for the wait to be worth that forward's fixed cost."""


class Scheduler:
    def __init__(self, cache: KVCache, max_model_len: int, prefix_caching: bool = True):
        self.cache = cache
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching
        self.waiting: deque[Request] = deque()
        self.slots: list[Sample] = []
        """Live samples in slot order."""

    def check_fits(self, request: Request) -> None:
        """Refuse a request that could not run even alone in the whole cache."""
        tokens = request.n * request.sample_need + request.prompt_len
        if tokens > self.cache.capacity:
            per_token = self.cache.token_elements * 2 * self.cache.k_store.element_size()
            raise ValueError(
                f"request needs {tokens * per_token / (1 << 30):.2f} GiB of KV cache (n={request.n} samples x "
                f"{request.sample_need} tokens + a {request.prompt_len}-token prompt) but the cap is "
                f"kv_cache_memory={self.cache.capacity * per_token / (1 << 30):.2f} GiB; lower n or max_tokens, "
                f"or raise the cap")

    def fits_layout(self, request: Request) -> bool:
        return self.cache.shape is not None and _fits(request, self.cache.shape)

    def idle(self) -> bool:
        """No slot in use: the cache may be laid out again."""
        shape = self.cache.shape
        return not self.slots and (shape is None or len(self.cache.free_prompt_slots) == shape.prompt_slots)

    def admit(self) -> list[Request]:
        """Waiting requests that get their slots now, in arrival order: each has its prompt slot, and
        its samples take the next sample slots once the caller creates and places them."""
        admitted: list[Request] = []
        reserved = 0
        if self.waiting and self.idle():
            # Nothing runs, so the cache may be laid out again: where it has no layout yet, where
            # what waits first does not fit it, and where a layout left by earlier requests (8
            # prompts of 16 samples, say) holds too few prompt or sample slots for what waits now
            # (64 prompts of 2), which would then run in waves, each to its end.
            shape, current = self.plan(), self.cache.shape
            if current is None or _admissible(self.waiting, shape) > _admissible(self.waiting, current):
                self.cache.layout(shape)
        live = list({s.request: None for s in self.slots})
        while self.waiting:
            head = self.waiting[0]
            if not self.fits_layout(head):  # bigger than the layout in use: waits for it to drain
                break
            if not self.cache.free_prompt_slots or len(self.slots) + reserved + head.n > self.cache.shape.sample_slots:
                break
            choice = self._choose_prompt_slot(head, admitted)
            # Within a layout that fits the budget (no overcommit) the memory always fits too.
            if self.cache.overcommit > 1 and not self._resident_fits(live + admitted, head, reserved, choice[0]):
                # Hand back what finished requests left zeroed, then ask again.
                self.cache.release_unused(len(self.slots) + reserved, {r.prompt_slot for r in live + admitted})
                choice = self._choose_prompt_slot(head, admitted)
                if not self._resident_fits(live + admitted, head, reserved, choice[0]):
                    break
            self.waiting.popleft()
            self._take_prompt_slot(head, *choice)
            reserved += head.n
            admitted.append(head)
        if admitted:  # what attention may read from now on must be zeroed (see KVCache)
            live += admitted
            self.cache.ready(*self._zeroing(live, [r.prompt_slot for r in live], len(self.slots) + reserved))
        return admitted

    @staticmethod
    def _zeroing(requests: list[Request], prompt_slots: list[int], samples: int) -> tuple:
        """``KVCache.ready``'s arguments for these requests and the first ``samples`` sample slots:
        every slot zeroed as far as the longest of them may be read."""
        return samples, max(r.sample_need for r in requests), prompt_slots, max(r.prompt_len for r in requests)

    def _choose_prompt_slot(self, head: Request, admitted: list[Request]) -> tuple:
        """Where ``head``'s prompt goes: (free slot, prompt positions it need not compute, slot they
        are copied from or None, request admitted before it in this step that computes them or None)."""
        cache = self.cache
        free = cache.free_prompt_slots
        if not self.prefix_caching:
            return free[-1], 0, None, None
        prefixes = cache.prefixes
        ids = _array(head)
        taken = set(range(len(prefixes.tokens))).difference(free)
        (slot, shared), (used, in_use) = (
            (best, 0 if best is None else _reusable(head, length, prefixes.scores[best]))
            for best, length in (prefixes.best(ids, free), prefixes.best(ids, taken)))
        source, longer = None, max(shared, in_use) + SECOND_FORWARD_GAIN
        for other in admitted:
            if other.source is None:  # its prefill runs in the first forward
                length = _reusable(head, common_prefix(_array(other), ids), other)
                if length >= longer:
                    source, longer = other, length
        if source is not None:
            return prefixes.spare(free), longer, source.prompt_slot, source
        if shared and shared >= in_use:
            return slot, shared, None, None
        if in_use:
            return prefixes.spare(free), in_use, used, None
        return prefixes.spare(free), 0, None, None

    def _take_prompt_slot(self, head: Request, slot: int, cached: int, copy_from: int | None,
                          source: Request | None) -> None:
        prefixes = self.cache.prefixes
        head.prompt_slot = self.cache.take_prompt_slot(slot)
        head.cached, head.copy_from, head.source = cached, copy_from, source
        if not self.prefix_caching:  # (switched off while the engine ran: what slots held is now stale)
            prefixes.forget(slot)
            return
        held = prefixes.scores[slot if copy_from is None else copy_from]
        if head.params.prompt_logprobs is not None and source is None and cached:
            head.prompt_scores = held.prefix(cached + 1)  # the shared tokens' and the next one's
        # Until its prefill is done the slot holds only the part it keeps.
        if copy_from is None and cached:
            prefixes.hold(slot, head.prompt_ids[:cached], None if held is None else held.prefix(cached))
        else:
            prefixes.forget(slot)

    def _resident_fits(self, running: list[Request], head: Request, reserved: int, slot: int) -> bool:
        """Whether the cache stays within its budget once ``head`` joins the ``running`` requests
        (the memory ``ready`` would zero for them all; ``head`` gets prompt slot ``slot``)."""
        prompt_slots = [r.prompt_slot for r in running] + [slot]
        zeroing = self._zeroing(running + [head], prompt_slots, len(self.slots) + reserved + head.n)
        return self.cache.resident_after(*zeroing) <= self.cache.capacity

    def plan(self) -> CacheShape:
        """A layout for the waiting requests: capacities for the largest of them, slots for as many
        as fit the budget in arrival order (at least the first), and the rest of the room (the
        budget, or more where the cache overcommits) as more slots in
        the same proportion of prompts to samples, or at least ``SPARE_PROMPTS`` prompts per
        sample. When they all fit, capacities grow toward ``SAMPLE_CAPACITY`` and
        ``PROMPT_CAPACITY`` as far as they all still fit."""
        waiting = list(self.waiting)
        budget, room = self.cache.capacity, self.cache.room
        need_s = max(r.sample_need for r in waiting)
        need_p = max(r.prompt_len for r in waiting)
        samples, prompts = 0, 0
        for request in waiting:
            if prompts and (samples + request.n) * need_s + (prompts + 1) * need_p > budget:
                break
            samples, prompts = samples + request.n, prompts + 1
        cs, cp = need_s, need_p
        if prompts == len(waiting):
            grown = (max(need_s, min(SAMPLE_CAPACITY, self.max_model_len)), max(need_p, min(PROMPT_CAPACITY, self.max_model_len)))
            if samples * grown[0] + prompts * grown[1] <= room:
                cs, cp = grown
        ratio = max(prompts / samples, SPARE_PROMPTS)
        extra = int((room - samples * cs - prompts * cp) // (cs + ratio * cp))
        shape = CacheShape(samples + extra, cs, prompts + int(extra * ratio), cp)
        return shape if shape.tokens() <= room else CacheShape(samples, cs, prompts, cp)

    def place(self, samples: list[Sample]) -> None:
        self.slots.extend(samples)

    def retire(self) -> list[Sample]:
        """Drop finished samples, keeping the live ones packed in slots 0..B-1, and free the prompt
        slot of every request whose last sample went; returns the dropped samples."""
        finished = [b for b, s in enumerate(self.slots) if s.finished]
        dropped = []
        for b in reversed(finished):
            sample = self.slots[b]
            last = len(self.slots) - 1
            if b != last:
                self.cache.move_sample(last, b, self.slots[last].cached)
                self.slots[b] = self.slots[last]
            self.slots.pop()
            dropped.append(sample)
            request = sample.request
            request.unfinished -= 1
            if request.unfinished == 0:
                self.cache.release_prompt_slot(request.prompt_slot)
        return dropped


def _array(request: Request) -> np.ndarray:
    """The request's prompt as an array (made once)."""
    if request.prompt_array is None:
        request.prompt_array = np.asarray(request.prompt_ids, dtype=np.int64)
    return request.prompt_array


def _reusable(request: Request, shared: int, scores) -> int:
    """Of ``shared`` leading prompt tokens held elsewhere, how many ``request``'s prefill may skip:
    never its last (whose row gives its first tokens), and where it asks for its prompt's
    log-probabilities, only tokens whose scores are held too (``scores``: a ``PromptScores``, or
    the request computing them), with as many top tokens, and one fewer (the row before a token
    scores it)."""
    shared = min(shared, request.prompt_len - 1)
    top = request.params.prompt_logprobs
    if top is None or shared <= 0:
        return max(shared, 0)
    if isinstance(scores, Request):
        wanted = scores.params.prompt_logprobs
        held, held_top = (0, 0) if wanted is None else (scores.prompt_len, wanted)
    else:
        held, held_top = (0, 0) if scores is None else (len(scores), scores.top)
    if held_top < top:
        return 0
    return max(min(shared, held) - 1, 0)


def _fits(request: Request, shape: CacheShape) -> bool:
    """Whether ``request`` could run in a cache of ``shape`` (its slots large enough, enough of them)."""
    return (request.prompt_len <= shape.prompt_capacity and request.sample_need <= shape.sample_capacity
            and request.n <= shape.sample_slots)


def _admissible(waiting, shape: CacheShape) -> int:
    """How many of the waiting requests, in arrival order, an empty cache of ``shape`` takes at once."""
    count, samples = 0, 0
    for request in waiting:
        if count == shape.prompt_slots or samples + request.n > shape.sample_slots or not _fits(request, shape):
            break
        count, samples = count + 1, samples + request.n
    return count
