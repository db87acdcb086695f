"""Prompt caching across requests: what each prompt slot still holds, and which one a new prompt
can start from.

A prompt's keys and values stay in its prompt slot after its request finishes, until the slot is
taken by a prompt that shares nothing with it, the cache is laid out again, or its memory is
handed back. A new prompt that begins with tokens some slot holds (a chat's earlier turns, a shared
system prompt or few-shot examples, the context of continuations scored one by one) computes only
the rest: it takes that slot if it is free, or a free one into which the shared keys and values are
copied (a copy costs a few milliseconds where the forward it saves costs a second). Keys and values
at a position depend only on the tokens up to it, so a shared prefix's are the same whichever
prompt computed them; the continued prompt's rows attend to them as its own prefill would (up to
the rounding of a different batch shape, as in vLLM's prefix caching).

Where a request asks for its prompt's log-probabilities, those of the shared part come from the
prompt that computed it (kept with the slot, when it asked for as many top tokens or more), and
the rest from its own forward, which then starts one position earlier (the row before a token is
what scores it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PromptScores:
    """A prompt's log-probabilities as computed (``LLMEngine._prompt_scores``): per token the
    chosen token's value and rank, and the ``top`` likeliest (indices, values); entry 0 (the first
    token, which nothing scores) holds None."""

    top: int
    chosen: list
    ranks: list
    best: list

    def __len__(self) -> int:
        return len(self.chosen)

    def prefix(self, length: int) -> PromptScores:
        return PromptScores(self.top, self.chosen[:length], self.ranks[:length], self.best[:length])

    def extend(self, other: PromptScores) -> PromptScores:
        return PromptScores(min(self.top, other.top), self.chosen + other.chosen, self.ranks + other.ranks,
                            self.best + other.best)

    def entries(self, ids: list[int], top: int) -> tuple[list, list]:
        """``RequestOutput.prompt_logprobs`` and ``prompt_token_ranks`` for the prompt ``ids``
        with ``top`` likeliest tokens each (at most ``self.top``)."""
        out: list = [None]
        for token, chosen, best in zip(ids[1:], self.chosen[1:], self.best[1:]):
            entry = {token: chosen}
            if top:
                entry.update(zip(best[0][:top], best[1][:top]))
                entry[token] = chosen
            out.append(entry)
        return out, list(self.ranks)


class PromptPrefixes:
    """Per prompt slot: the tokens whose keys and values it holds (a prefix of the last prompt
    prefilled there), the log-probabilities computed for them if any, and when it was last used."""

    def __init__(self, slots: int = 0):
        self.reset(slots)

    def reset(self, slots: int) -> None:
        """A new layout of ``slots`` prompt slots: nothing held."""
        self.tokens: list[np.ndarray | None] = [None] * slots
        self.scores: list[PromptScores | None] = [None] * slots
        self.used = [0] * slots
        self._clock = 0

    def forget(self, slot: int) -> None:
        self.tokens[slot] = None
        self.scores[slot] = None

    def hold(self, slot: int, ids: list[int], scores: PromptScores | None) -> None:
        """Slot ``slot`` now holds the keys and values of ``ids`` (and ``scores`` for them, if any)."""
        self.tokens[slot] = np.asarray(ids, dtype=np.int64)
        self.scores[slot] = scores
        self._clock += 1
        self.used[slot] = self._clock

    def shared(self, slot: int, ids: np.ndarray) -> int:
        """How many leading tokens of ``ids`` slot ``slot`` holds."""
        held = self.tokens[slot]
        if held is None or not len(held) or not len(ids) or held[0] != ids[0]:
            return 0
        return common_prefix(held, ids)

    def best(self, ids: np.ndarray, slots) -> tuple[int | None, int]:
        """The slot among ``slots`` that holds the longest prefix of ``ids``, and its length
        (None, 0 where none holds any); ties go to the most recently used."""
        best, length = None, 0
        for slot in slots:
            shared = self.shared(slot, ids)
            if shared > length or (shared == length and shared and self.used[slot] > self.used[best]):
                best, length = slot, shared
        return best, length

    def spare(self, free: list[int]) -> int:
        """The free slot to give a prompt that reuses none of them: one holding nothing, else the
        least recently used."""
        return min(free, key=lambda slot: (self.tokens[slot] is not None, self.used[slot]))


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


KEPT_PROMPT_POSITIONS = 4096
"""How many prompt positions a draft model's ``KeptPrompts`` holds at most (some 94 MB of keys and
values for the 135M default model in bfloat16)."""


@dataclass(eq=False)
class _Kept:
    tokens: np.ndarray
    k: object  # [layers, kv_heads, length, head_dim]
    v: object


class KeptPrompts:
    """Keys and values of a draft model's recent prompts (``SpecConfig.draft_model`` a causal LM,
    whose own cache lives only as long as its request), kept after their requests for later prompts
    that begin alike, as the target's prompt slots are: such a prompt copies the shared part and
    prefills only the rest. Bounded by ``positions`` (the oldest go first); a prompt that begins
    with a kept one replaces it. ``hits`` counts the positions copied rather than computed."""

    def __init__(self, positions: int = KEPT_PROMPT_POSITIONS):
        self.positions = positions
        self.kept: list[_Kept] = []  # oldest first
        self.hits = 0

    def longest(self, tokens: list[int]) -> tuple[_Kept | None, int]:
        """The kept prompt sharing the longest prefix with ``tokens``, and that prefix's length."""
        array = np.asarray(tokens)
        best, length = None, 0
        for kept in self.kept:
            shared = common_prefix(kept.tokens, array)
            if shared > length:
                best, length = kept, shared
        return best, length

    def keep(self, tokens: list[int], k, v) -> None:
        """Keep a copy of ``k`` and ``v`` ([layers, kv_heads, len(tokens), head_dim]) for ``tokens``."""
        if len(tokens) > self.positions:
            return
        array = np.asarray(tokens)
        for i, kept in enumerate(self.kept):
            if len(kept.tokens) >= len(array) and common_prefix(kept.tokens, array) == len(array):
                self.kept.append(self.kept.pop(i))  # it holds all of it: now the most recent
                return
        self.kept = [kept for kept in self.kept if common_prefix(kept.tokens, array) < len(kept.tokens)]
        self.kept.append(_Kept(array, k.clone(), v.clone()))
        while sum(len(kept.tokens) for kept in self.kept) > self.positions:
            self.kept.pop(0)

    def reset(self) -> None:
        self.kept = []
