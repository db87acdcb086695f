"""Drafting with a causal LM checkpoint: a smaller model that shares the target's tokenizer,
run by the same packed forward as the target, with its own KV cache.

Its cache is laid out as the target's (``multispec.engine.cache``), one per prompt: the prompt
once, in a prompt slot, prefilled when the request joins and shared by its n samples; each
sample's generated tokens in its own slot. Each step, for the samples asked to draft:

Every prompt in flight shares the step's forwards: their rows are packed together, the products
run once, and attention runs prompt by prompt over each prompt's cache.

1. *Catch up*: one forward over each sample's tokens that its cache lacks: the root (the token
   the target sampled last) and whatever verification appended that was not drafted. Their keys
   are kept; the root's row gives q of the first draft token.
2. *Grow the tree* as the head drafter does (``ModelDrafter``: W candidates from the root's q,
   each extended as a chain, every node with the q it was drawn from), one forward a depth over
   the nodes that grow. A node's keys go right after its sample's text, and it attends to the
   text and to its own ancestors only (``StepLayout.scratch``).
3. *Commit* (``observe``): the accepted nodes whose keys were computed move into place, exactly
   as the target's cache commits its accepted path; only what was never forwarded (the bonus
   token, an accepted leaf) waits for the next catch-up. A node's keys depend only on the tokens
   of its path, so accepted tokens are matched to drafted nodes by their path from the root,
   whatever tree verification actually saw (the hybrid drafter merges trees, a budget may prune).

With ``decision_threshold`` a chain stops where the draft's own probability of its likeliest
next token falls below it (its confidence; it reads only q, so the drafts' law is unchanged).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from multispec.drafters.base import DraftTree
from multispec.drafters.model import ModelDrafter
from multispec.engine.attention import DecodeAttention, PrefillAttention, StepLayout
from multispec.engine.cache import CacheShape, KVCache
from multispec.models.draft_lm import DraftLM

FIRST_CAPACITY = 128
"""Positions per sample slot a prompt's cache starts with; it doubles when a sample needs more."""


@dataclass(eq=False)
class _Group:
    """One prompt's cache: prompt slot 0, sample slot i for the prompt's i-th sample. It lives as
    long as one of its samples does (they alone refer to it)."""

    cache: KVCache
    prompt_len: int
    moves: list[tuple[int, int, int]] = field(default_factory=list)
    """Accepted nodes' keys to move (slot, from, to) before the cache is next read."""


@dataclass(eq=False)
class _Sample:
    group: _Group
    slot: int
    committed: int = 0
    """Generated tokens whose keys are in the slot (its first positions)."""
    pending: list[int] = field(default_factory=list)
    """Generated tokens the cache lacks, oldest first; the last is the root."""
    paths: dict[tuple[int, ...], int] | None = None
    """After drafting: where each forwarded node's keys are (after ``committed``), by its tokens
    from the root; until verification says which were accepted."""


class CheckpointDrafter(ModelDrafter):
    """Drafts with a ``DraftLM`` and its own KV cache (see the module docstring)."""

    wants_features = False

    def __init__(self, *, draft: DraftLM, max_depth: int, max_nodes: int, num_candidates: int = 1,
                 temperature: float = 1.0, replacement: bool = False, threshold: float = 0.0, copied: bool = False):
        self.head = None
        self.draft = draft
        self.model = draft.model
        self._drafting(max_depth, max_nodes, num_candidates, temperature, replacement, threshold, copied)
        self.vocab_size = draft.target_vocab_size
        self.device = draft.model.output_weight().device
        self.vocab_ids = torch.arange(draft.vocab_size, device=self.device)
        self.samples: dict[int, _Sample] = {}
        self.model_time = 0.0
        self.model_forwards = 0

    # ------------------------------------------------------------------ state
    def add_group(self, group_id: int, prompt_ids: list[int], sample_ids: list[int]) -> None:
        """Prefill the prompt into a new cache with a slot for each of its samples; where the draft
        model keeps earlier prompts (``DraftLM.kept``), the part one of them shares is copied and
        only the rest computed (nothing, for a prompt seen whole: no row of it is read but as keys
        and values)."""
        length = len(prompt_ids)
        cache = KVCache(self.draft.config, len(sample_ids) * FIRST_CAPACITY + length,
                        self.model.output_weight().dtype, self.device)
        cache.layout(CacheShape(len(sample_ids), FIRST_CAPACITY, 1, length))
        slot = cache.take_prompt_slot()
        cache.ready(0, 0, [slot], length)  # before the prefill writes it: later readies leave it alone
        kept = self.draft.kept
        source, cached = kept.longest(prompt_ids) if kept is not None else (None, 0)
        with torch.inference_mode():
            if cached:
                cache.prompt_k[:, slot, :, :cached] = source.k[:, :, :cached]
                cache.prompt_v[:, slot, :, :cached] = source.v[:, :, :cached]
                kept.hits += cached
            if cached < length:
                self.model.hidden_states(torch.tensor(prompt_ids[cached:], device=self.device),
                                         torch.arange(cached, length, device=self.device),
                                         PrefillAttention(cache, [(slot, length - cached)], [cached]))
            if kept is not None:
                kept.keep(prompt_ids, cache.prompt_k[:, slot, :, :length], cache.prompt_v[:, slot, :, :length])
        group = _Group(cache, length)
        for i, sample_id in enumerate(sample_ids):
            self.samples[sample_id] = _Sample(group, i)

    def observe(self, sample_id: int, new_tokens: list[int], token_probs=None, alternatives=None) -> None:
        state = self.samples.get(sample_id)
        if state is None:
            return
        tokens = [int(t) for t in new_tokens]
        if state.paths is not None and not state.pending:
            matched, path = 0, ()
            for token in tokens:
                path += (token,)
                where = state.paths.get(path)
                if where is None:
                    break
                if where != matched:
                    state.group.moves.append((state.slot, state.committed + where, state.committed + matched))
                matched += 1
            state.committed += matched
            tokens = tokens[matched:]
        state.paths = None
        state.pending.extend(tokens)

    def observe_features(self, sample_ids: list[int], features: Sequence[Sequence[torch.Tensor]]) -> None:
        """A checkpoint drafts from text, not from the target's features (the hybrid drafter
        hands them to whichever model drafter it holds)."""

    def remove(self, sample_id: int) -> None:
        self.samples.pop(sample_id, None)

    # ------------------------------------------------------------------ drafting
    def propose(self, sample_ids: list[int], budgets: list[int],
                uniforms: Sequence[Sequence[float]] | None = None) -> list[DraftTree]:
        trees = [DraftTree.EMPTY] * len(sample_ids)
        groups: dict[_Group, list[tuple[int, int]]] = {}
        for i, (sample_id, budget) in enumerate(zip(sample_ids, budgets)):
            state = self.samples.get(sample_id)
            if budget <= 0 or state is None or not state.pending:
                continue
            # Deepest node the draft model's window allows after the root.
            room = self.draft.max_len - (state.group.prompt_len + state.committed + len(state.pending))
            if room >= 1:
                groups.setdefault(state.group, []).append((i, min(budget, room * max(1, self.width))))
        if not groups:
            return trees
        # Prompt by prompt, so that every forward's rows are one block per prompt's cache.
        chosen = [pick for picks in groups.values() for pick in picks]
        self._calls = [self.samples[sample_ids[i]] for i, _ in chosen]
        bounds = [0]
        for picks in groups.values():
            bounds.append(bounds[-1] + len(picks))
        self._segments = [(group, first, last) for group, first, last in zip(groups, bounds, bounds[1:])]
        start = time.perf_counter()
        with torch.inference_mode():
            built = self._draft([sample_ids[i] for i, _ in chosen], [b for _, b in chosen],
                                None if uniforms is None else [uniforms[i] for i, _ in chosen])
        for (i, _), tree in zip(chosen, built):
            trees[i] = tree
        self._calls, self._segments = None, None
        self.model_time += time.perf_counter() - start
        return trees

    def _ready(self, group: _Group, need: int, key_len: int) -> KVCache:
        """The group's cache with room for ``need`` positions in every sample slot (grown if not),
        its pending moves done, and readable up to ``key_len`` positions."""
        cache = group.cache
        if group.moves:
            slots, src, dst = (torch.tensor(x, dtype=torch.long, device=self.device) for x in zip(*group.moves))
            cache.keep_paths(slots, src, dst)
            group.moves.clear()
        if need > cache.shape.sample_capacity:
            cache = group.cache = cache.grown(max(need, 2 * cache.shape.sample_capacity))
        cache.ready(cache.shape.sample_slots, key_len, [0], group.prompt_len)
        return cache

    def _forward(self, parts: list[tuple[_Group, StepLayout, int, int, int]], tokens: list[int] | torch.Tensor,
                 positions: list[int] | torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One packed forward of the draft model over every prompt's rows; ``parts``: per prompt,
        in row order, its group, its layout, its row count, the room its slots need and how far
        its attention reads. Returns q (over the ids both models have) at ``rows``."""
        attention = _PerPrompt([(DecodeAttention(self._ready(group, need, reads), layout), count)
                                for group, layout, count, need, reads in parts])
        hidden = self.model.hidden_states(torch.as_tensor(tokens, device=self.device),
                                          torch.as_tensor(positions, device=self.device), attention)
        logits = self.model.logits(hidden[rows.to(self.device)])[:, : self.draft.vocab_size]
        return self._probs(logits)

    def _root_probs(self, sample_ids: list[int]) -> torch.Tensor:
        """Catch up: every pending token of each sample, its keys kept; q at each root."""
        states = self._calls
        counts = torch.tensor([len(s.pending) for s in states])
        written = torch.tensor([s.committed for s in states])
        parts = []
        for group, first, last in self._segments:
            size, qmax = last - first, int(counts[first:last].max())
            reads = int((written + counts)[first:last].max())
            causal = torch.ones(qmax, qmax, dtype=torch.bool).tril().expand(size, qmax, qmax).clone()
            layout = StepLayout(counts=counts[first:last], written=written[first:last],
                                prompt_slot=torch.zeros(size, dtype=torch.long),
                                prompt_len=torch.full((size,), group.prompt_len), tree_mask=causal,
                                slots=torch.tensor([s.slot for s in states[first:last]]))
            # Room for the catch-up and the tree drafted after it.
            parts.append((group, layout, int(counts[first:last].sum()), reads + self.max_nodes, reads))
        tokens = [t for s in states for t in s.pending]
        positions = [s.group.prompt_len + s.committed + i for s in states for i in range(len(s.pending))]
        probs = self._forward(parts, tokens, positions, counts.cumsum(0) - 1)
        for state in states:
            state.committed += len(state.pending)
            state.pending = []
            state.paths = {}
        # Per row of the last forward: its path from the root, where its keys are among this
        # step's drafted nodes (-1: the sample's text) and which of those are its ancestors.
        self._row_paths = [()] * len(states)
        self._row_at = torch.full((len(states),), -1, dtype=torch.long)
        self._row_ancestors = torch.zeros(len(states), 1, dtype=torch.bool)
        self._drafted = torch.zeros(len(states), dtype=torch.long)  # nodes forwarded so far, per sample
        return probs

    def _child_probs(self, rows: torch.Tensor, samples: torch.Tensor, picks: torch.Tensor, depth: int) -> torch.Tensor:
        """One forward over the growing nodes at ``depth`` (sorted by sample), each attending to its
        sample's text and its ancestors; their keys are kept for the commit."""
        states = self._calls
        rows, samples, tokens = rows.cpu(), samples.cpu(), picks.cpu()
        count = len(states)
        grown = torch.bincount(samples, minlength=count)
        rank = torch.arange(samples.numel()) - (grown.cumsum(0) - grown)[samples]
        before = self._drafted
        at = before[samples] + rank  # each node's place among its sample's drafted nodes
        width = max(1, int((before + grown).max()))
        ancestors = torch.zeros(samples.numel(), width, dtype=torch.bool)
        previous = self._row_ancestors[rows]
        ancestors[:, : previous.shape[1]] = previous
        parent_at = self._row_at[rows]
        drafted_parent = torch.nonzero(parent_at >= 0)[:, 0]
        ancestors[drafted_parent, parent_at[drafted_parent]] = True
        committed = torch.tensor([s.committed for s in states])
        written = committed + before

        parts = []
        for group, first, last in self._segments:
            members = torch.nonzero(grown[first:last] > 0)[:, 0] + first
            if members.numel() == 0:
                continue
            mine = (samples >= first) & (samples < last)
            size, qmax = members.numel(), int(grown[members].max())
            batch_of = torch.full((count,), -1, dtype=torch.long)
            batch_of[members] = torch.arange(size)
            sees = torch.zeros(size, qmax, max(1, int(before[members].max())), dtype=torch.bool)
            sees[batch_of[samples[mine]], rank[mine]] = ancestors[mine, : sees.shape[2]]
            reads = int((written + grown)[members].max())
            layout = StepLayout(counts=grown[members], written=written[members],
                                prompt_slot=torch.zeros(size, dtype=torch.long),
                                prompt_len=torch.full((size,), group.prompt_len),
                                tree_mask=torch.eye(qmax, dtype=torch.bool).expand(size, qmax, qmax).clone(),
                                slots=torch.tensor([states[b].slot for b in members.tolist()]),
                                scratch=before[members], scratch_mask=sees)
            parts.append((group, layout, int(mine.sum()), reads, reads))
        prompt_len = torch.tensor([s.group.prompt_len for s in states])
        positions = (prompt_len + committed)[samples] - 1 + depth
        probs = self._forward(parts, tokens, positions, torch.arange(samples.numel()))
        paths = []
        for row, sample, token, place in zip(rows.tolist(), samples.tolist(), tokens.tolist(), at.tolist()):
            path = self._row_paths[row] + (token,)
            states[sample].paths[path] = place
            paths.append(path)
        self._row_paths, self._row_at, self._row_ancestors = paths, at, ancestors
        self._drafted = before + grown
        return probs

    def _decide(self, depth: int, node_prob: torch.Tensor, child_probs: torch.Tensor) -> torch.Tensor:
        """The draft's confidence in a node's likeliest child."""
        return child_probs.max(-1).values


class _PerPrompt:
    """Attention of a forward whose rows are one block per prompt, each over its own cache: the
    model's products run once for every prompt's rows, attention block by block."""

    def __init__(self, parts: list[tuple[DecodeAttention, int]]):
        self.parts = parts
        if len(parts) == 1:  # one prompt: the compiled layer stack may run the forward (kernel_args)
            self.kernel_args = parts[0][0].kernel_args
            self.scratch_args = getattr(parts[0][0], "scratch_args", (None, None))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0][0].attend(layer, q, k, v)
        out, start = [], 0
        for attention, count in self.parts:
            end = start + count
            out.append(attention.attend(layer, q[start:end], k[start:end], v[start:end]))
            start = end
        return torch.cat(out)
