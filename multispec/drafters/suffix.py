"""Bookkeeping shared by the drafters that copy what followed a sample's suffix elsewhere.

Each sample's text is kept as its prompt followed by its tokens, so a suffix that spans the end
of the prompt matches too. The prompt is indexed once per group (n-grams ending inside it); the
n-grams ending at or after the end of the prompt go into the samples' index, either one shared by
the whole group (consensus: siblings draft for each other) or one per sample (prompt lookup).
A finished sample's text stays in the index; a group's state is freed with its last sample.

Copied drafts keep all of this in a compiled store where it can be built
(``multispec/kernels/suffix_store.cpp``): the same texts, index, lookup and trie, drafting the same
trees to the last bit (``tests/drafters/test_compiled_store.py``). The Python below is the path for
sampled drafts and for machines without the store, and the reference the store is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from multispec.drafters.base import DraftTree
from multispec.drafters.index import Alternatives, NgramIndex, Text
from multispec.drafters.lookup import find_continuations
from multispec.drafters.trie import Trie


MIN_ALTERNATIVE = 0.05
"""Alternatives less likely than this are not kept: they are almost never worth a draft node, and
every kept one costs a trie insertion per vote that reaches it."""


def _likely(alternatives: Alternatives, keep: int) -> Alternatives | None:
    tokens, probs = alternatives
    n = 0
    while n < min(keep, len(probs)) and probs[n] >= MIN_ALTERNATIVE:
        n += 1
    return (tokens[:n], probs[:n]) if n else None


def _compiled_store(drafter: SuffixDrafter):
    """The compiled store with the drafter's settings, or None where it cannot serve them (the
    kernels are off or cannot be built, n-grams longer than it keys, no occurrence kept)."""
    from multispec import kernels
    from multispec.drafters import lookup, trie

    if drafter.max_ngram > 8 or drafter.max_matches < 1:
        return None
    module = kernels.suffix_store()
    if module is None:
        return None
    return module.SuffixStore(
        min_n=drafter.min_ngram, max_n=drafter.max_ngram, keep=drafter.max_matches, max_votes=drafter.max_votes,
        max_depth=drafter.max_depth, max_nodes=drafter.max_nodes, shared=drafter.share_siblings,
        first_only=not drafter.aggregate, alternatives=drafter.alternatives, min_alternative=MIN_ALTERNATIVE,
        length_decay=lookup.LENGTH_DECAY, unknown_confidence=trie.UNKNOWN_CONFIDENCE,
        alternative_depth=lookup.ALTERNATIVE_DEPTH)


@dataclass(eq=False)
class _Sample:
    text: Text
    index: NgramIndex
    """Where the sample's new n-grams go."""
    lookup: list[NgramIndex]
    """Where the sample's suffix is looked up, most recent text first."""


class SuffixDrafter:
    """Drafts by suffix lookup; subclasses choose the sources and whether continuations vote.

    ``max_matches``: occurrences of an n-gram kept and examined per lookup (the most recent);
    ``max_votes``: continuations aggregated per draft. Both bound a step's cost whatever the
    number of siblings and the length of their texts. ``alternatives``: how many of the target's
    most likely tokens per position the drafter keeps from ``observe`` (soft votes, see ``trie``);
    0 keeps none.
    """

    share_siblings: bool

    def __init__(self, *, vocab_size: int, max_depth: int, max_nodes: int, sampled: bool, aggregate: bool,
                 max_ngram: int, min_ngram: int, num_drafts: int | None, max_matches: int, max_votes: int,
                 alternatives: int = 0):
        if max_depth < 1 or max_nodes < 0 or not 1 <= min_ngram <= max_ngram or alternatives < 0:
            raise ValueError(f"need max_depth >= 1, max_nodes >= 0, 1 <= min_ngram <= max_ngram, alternatives >= 0; "
                             f"got {max_depth}, {max_nodes}, {min_ngram}, {max_ngram}, {alternatives}")
        self.alternatives = alternatives
        self.min_alternative = MIN_ALTERNATIVE
        self.vocab_size = vocab_size
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.sampled = sampled
        self.aggregate = aggregate
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.num_drafts = num_drafts
        self.max_matches = max_matches
        self.max_votes = max_votes
        self._samples: dict[int, _Sample] = {}
        self._store = None if sampled else _compiled_store(self)

    @property
    def compiled(self) -> bool:
        """Whether this drafter's texts, index and tries are the compiled store's
        (``multispec/kernels/suffix_store.cpp``: the same drafts as the Python path, bit for bit,
        for a fraction of the time); sampled drafts and a machine that cannot build it use Python."""
        return self._store is not None

    def _new_index(self) -> NgramIndex:
        return NgramIndex(self.min_ngram, self.max_ngram, self.max_matches)

    def add_group(self, group_id: int, prompt_ids: list[int], sample_ids: list[int]) -> None:
        if self._store is not None:
            self._store.add_group(prompt_ids, sample_ids)
            return
        taken = [s for s in sample_ids if s in self._samples]
        if taken:
            raise ValueError(f"sample ids already live: {taken}")
        prompt = Text(list(prompt_ids))
        prompt_index = self._new_index()
        prompt_index.add(prompt, 1)
        shared = self._new_index() if self.share_siblings else None
        for sample_id in sample_ids:
            text = Text(list(prompt_ids))
            index = shared if shared is not None else self._new_index()
            index.add(text, len(prompt_ids))
            self._samples[sample_id] = _Sample(text, index, [index, prompt_index])

    def observe(self, sample_id: int, new_tokens: list[int], token_probs: list[float] | None = None,
                alternatives: list[Alternatives] | None = None) -> None:
        if self._store is not None:
            self._store.observe(sample_id, new_tokens, token_probs, alternatives)
            return
        sample = self._samples[sample_id]
        start = len(sample.text.tokens)
        if alternatives is not None and self.alternatives:
            keep = self.alternatives
            alternatives = [None if a is None else _likely(a, keep) for a in alternatives]
        else:
            alternatives = None
        sample.text.extend(new_tokens, token_probs, alternatives)
        sample.index.add(sample.text, start + 1)

    def observe_many(self, sample_ids: list[int], new_tokens: list[list[int]],
                     token_probs: list[list[float] | None], alternatives: list[list[Alternatives] | None]) -> None:
        """``observe`` for several samples, in order (one call a request each step; a subclass that
        overrides ``observe`` hears every sample through it)."""
        if self._store is not None and type(self).observe is SuffixDrafter.observe:
            self._store.observe_many(sample_ids, new_tokens, token_probs, alternatives)
            return
        for each in zip(sample_ids, new_tokens, token_probs, alternatives):
            self.observe(*each)

    def remove(self, sample_id: int) -> None:
        if self._store is not None:
            self._store.remove(sample_id)
            return
        self._samples.pop(sample_id, None)

    def propose(self, sample_ids: list[int], budgets: list[int],
                uniforms: Sequence[Sequence[float]] | None = None) -> list[DraftTree]:
        if self._store is not None:
            return [DraftTree(tokens, parents, None, confidence, evidence) if tokens else DraftTree.EMPTY
                    for tokens, parents, confidence, evidence in self._store.propose(sample_ids, budgets)]
        budgets = [max(0, min(b, self.max_nodes)) for b in budgets]
        if not self.sampled:
            return [self._propose_one(self._samples[s], b, None) for s, b in zip(sample_ids, budgets)]
        if uniforms is None or len(uniforms) != len(sample_ids):
            raise ValueError("sampled drafts need one sequence of uniforms per sample")
        return [self._propose_one(self._samples[s], b, iter(u)) for s, b, u in zip(sample_ids, budgets, uniforms)]

    def _propose_one(self, sample: _Sample, budget: int, uniforms: Iterator[float] | None) -> DraftTree:
        if budget == 0:
            return DraftTree.EMPTY
        depth = min(self.max_depth, budget)
        continuations = find_continuations(sample.text, sample.lookup, depth, not self.aggregate, self.max_votes)
        if not continuations:
            return DraftTree.EMPTY
        trie = Trie(continuations)
        if uniforms is None:
            return trie.heaviest(budget)
        num_drafts = self.num_drafts or max(1, budget // self.max_depth)
        return trie.sampled(budget, num_drafts, uniforms, self.vocab_size)
