"""A lane: the drafter and draft budget that requests with the same speculation and sampling
settings share.

Drafting state is per prompt inside a drafter (siblings draft for each other), and what verification
has shown about a drafter's drafts depends on the sampling settings, so a lane is the unit the
engine drafts, calibrates and budgets for. The calibration outlives its requests (a request sent
on its own drafts from what earlier ones measured); the cost of a step is measured once per
machine and model (``multispec.engine.costs``) and shared by every lane.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Callable

from multispec.drafters import DraftTree, make_drafter
from multispec.engine.budget import IDLE_STEPS, Calibration, DraftBudget
from multispec.engine.costs import Prices
from multispec.engine.request import Request, Sample
from multispec.params import SpecConfig
from multispec.verify import DraftLaw


GROW_SLACK = 0.5
"""A hybrid lane's head extends a node while its calibrated chance is at least this fraction of the
lowest chance the budget kept last step (the cut moves a little from step to step)."""
DEPTH_WINDOW = 8
"""Recent steps whose draft model's price per depth the lane's budget weighs (their median)."""


def lane_key(spec: SpecConfig, request_params) -> tuple:
    """Requests with equal keys share a lane."""
    sp = request_params
    return (spec.drafter, spec.max_draft_tokens, spec.max_draft_nodes, spec.scheme, spec.sampled,
            spec.aggregate, spec.max_ngram, spec.min_ngram, spec.max_batch_tokens, spec.adaptive, spec.draft_model,
            spec.num_candidates, spec.decision_threshold, round(sp.temperature, 2), sp.top_k, round(sp.top_p, 2),
            round(sp.min_p, 2), round(sp.repetition_penalty, 2), round(sp.frequency_penalty, 2),
            round(sp.presence_penalty, 2), frozenset((sp.logit_bias or {}).items()),
            None if sp.allowed_token_ids is None else frozenset(sp.allowed_token_ids), tuple(sp.bad_words or ()),
            None if sp.structured_outputs is None else sp.structured_outputs.kind)


class Lane:
    def __init__(self, spec: SpecConfig, vocab_size: int, prices: Callable[[], Prices] | None = None, *,
                 temperature: float = 1.0, draft=None):
        """``prices`` gives the engine's step prices; asked only by a lane whose budget adapts
        (the engine may measure them then, once). ``temperature``: the lane's sampling temperature
        (a draft model drafts at it); ``draft``: the draft head or draft LM of a ``drafter="model"``
        or ``"hybrid"`` lane."""
        self.spec = spec
        self.law: DraftLaw | None = spec.draft_law
        self.drafter = make_drafter(spec.drafter if spec.speculates else "none", vocab_size=vocab_size,
                                    max_depth=spec.max_draft_tokens, max_nodes=spec.max_draft_nodes,
                                    sampled=spec.sampled, aggregate=spec.aggregate, max_ngram=spec.max_ngram,
                                    min_ngram=spec.min_ngram, draft=draft, num_candidates=spec.num_candidates,
                                    temperature=temperature, scheme=spec.scheme,
                                    decision_threshold=spec.decision_threshold)
        self.sampled = bool(self.drafter.sampled) and not getattr(self.drafter, "scored", False)
        """Drafts drawn from a q: never pruned by what was drawn, the budget picks their length. A
        drafter whose trees are ``scored`` (the hybrid) is budgeted node by node even where some
        of its nodes are drawn: ``DraftBudget.select`` keeps those whole."""
        self.width = spec.num_candidates if spec.drafter == "model" else 1
        depth = spec.max_draft_tokens if spec.speculates and spec.adaptive else 0
        if depth and prices is None:
            raise ValueError("an adaptive draft budget needs the engine's step prices")
        priced = prices() if depth else None
        self.budget = DraftBudget(depth, priced, max_evidence=spec.max_ngram,
                                  calibration=Calibration.prior(depth, spec.max_ngram), width=self.width)
        self.head_budget = DraftBudget(depth, priced, width=spec.num_candidates) if (
            depth and hasattr(self.drafter, "use_model") and spec.sampled) else None
        """A hybrid's drawn head alone, priced as sampled drafts are (``DraftBudget.choose``): how
        deep its chains may go this step, from what its own (drawn) nodes were accepted at each
        depth and what a depth of it costs. Without it the head grew every chain as deep as its
        nodes looked likelier than the sibling text, and its forwards (4.6-10 ms a step with 4
        samples in flight at temperature 1.0) cost more than the nodes gained. A copied hybrid's
        head nodes cannot be told apart where the sibling text holds the same token (the merged
        node is one), so their acceptance per depth would be measured low; there the budget's cut
        (``limit``) bounds the chains."""
        self.warned = False
        """Whether the engine has warned that this lane's drafter raised for a whole step's
        samples but for no request alone (``Engine._propose``)."""
        self._depth_costs: deque[float] = deque(maxlen=DEPTH_WINDOW)
        self._first_cost: float | None = None

    @property
    def depth_seconds(self) -> float:
        """What one draft depth of the drafter's own model has cost lately (seconds for the lane's
        samples of a step; 0 until measured, and for drafters without a model): the median of the
        last ``DEPTH_WINDOW`` steps that ran it. The first such step in a lane pays the model's
        warm-up (its first draft here cost about twice the next ones) and counts only until a second
        one is measured."""
        if self._depth_costs:
            return statistics.median(self._depth_costs)
        return self._first_cost or 0.0

    def observe_drafting(self, seconds: float, depths: int) -> None:
        """The drafter's model spent ``seconds`` on ``depths`` forwards this step: the budget
        weighs the next steps' depths against that price."""
        if depths > 0:
            if self._first_cost is None:
                self._first_cost = seconds / depths
            else:
                self._depth_costs.append(seconds / depths)

    def budgets(self, samples: list[Sample], batch: int, context: int) -> list[int]:
        """Draft nodes each sample may get this step (all 0: no drafts). ``batch``: samples in the
        whole step (other lanes' included), ``context``: keys its attention reads per row."""
        spec = self.spec
        none = [0] * len(samples)
        if not spec.speculates:
            return none
        nodes = spec.max_draft_nodes
        extra = batch - len(samples)
        head = None
        if spec.adaptive and self.head_budget is not None:
            # A drawn hybrid's head: its depth this step, priced on its own (0: it sits out).
            head = self.head_budget.choose(len(samples), context, extra, self.depth_seconds)
        if spec.adaptive and self.sampled:
            length = self.budget.choose(len(samples), context, extra, self.depth_seconds)
            if length == 0:
                return none
            nodes = min(nodes, length * self.width) if length < spec.max_draft_tokens else nodes
        elif spec.adaptive and not head and not self.budget.wants_drafts():
            return none
        elif spec.adaptive and hasattr(self.drafter, "limit"):
            # A drafter that grows its own trees (the hybrid's head) stops a chain where its
            # calibrated chance falls well below what the budget kept last step.
            cutoff = self.budget.cutoff
            self.drafter.limit(self.budget.chance_table(0), 0.0 if cutoff is None else GROW_SLACK * cutoff)
            if hasattr(self.drafter, "use_model"):
                # A drawn head runs where its own budget says it pays. A copied head's nodes are
                # judged inside the step's ranking (``wants_model``): its calibrated chances are
                # those of copied tokens, which drawn ones are not (a drawn node is accepted with
                # the overlap of q and the target's p, whatever q gave the token drawn).
                self.drafter.model_depth = head
                self.drafter.use_model = bool(head) if head is not None else self.budget.wants_model()
        budgets = [max(0, min(nodes, s.remaining - 1)) for s in samples]
        if spec.max_batch_tokens is not None:
            spare = max(0, spec.max_batch_tokens - batch)
            if sum(budgets) > spare:
                share = spare // len(samples)
                budgets = [min(b, share) for b in budgets]
        return budgets

    def wants_alternatives(self) -> bool:
        """Whether this step should compute the target's likeliest tokens for the drafter: not
        while the budget has kept no draft for ``IDLE_STEPS`` steps (large batches on a CPU), where
        ranking the vocabulary for every row costs a few percent of a step and feeds drafts that
        are left out; the drafter then sees only the sampled tokens until drafting pays again."""
        if not self.drafter.alternatives:
            return False
        return not (self.spec.adaptive and self.budget.max_depth and self.budget.idle >= IDLE_STEPS)

    def select(self, trees: list[DraftTree], batch: int, context: int, drafting: float = 0.0,
               proposing: float = 0.0) -> list[DraftTree]:
        """The nodes worth their place in the forward (copied drafts under the adaptive budget);
        sampled drafts must reach the verifier exactly as drawn. ``drafting``: seconds the
        drafter's model spent on these trees, ``proposing``: the rest of the proposal's seconds
        (see ``DraftBudget.select``)."""
        if self.spec.adaptive and not self.sampled and self.spec.speculates:
            return self.budget.select(trees, context, batch - len(trees), drafting, proposing)
        return trees

    def record(self, trees: list[DraftTree], paths: list[list[int]]) -> None:
        """What verification accepted, for the budget's calibration."""
        if not self.budget.max_depth:
            return
        if self.sampled:
            self.budget.record_acceptance(*_acceptance_by_depth(trees, paths, self.budget.max_depth))
        else:
            self.budget.record_nodes(trees, paths)
            if self.head_budget is not None:
                self.head_budget.record_acceptance(*_acceptance_by_depth(trees, paths, self.head_budget.max_depth,
                                                                         heads=True))

    def add(self, request: Request) -> None:
        self.drafter.add_group(request.prompt_slot, request.prompt_ids, [s.sample_id for s in request.samples])


def _acceptance_by_depth(trees: list[DraftTree], paths: list[list[int]], max_depth: int,
                         heads: bool = False) -> tuple[list[int], list[int]]:
    """Per depth d: how many samples reached d - 1 with a draft child to try at d, and how many
    accepted it (the statistics the draft budget learns from). ``heads``: only the drawn nodes
    count (a hybrid's head's): a depth is tried where the node reached has a drawn child, kept
    where the accepted child is one."""
    tried = [0] * (max_depth + 1)
    kept = [0] * (max_depth + 1)
    for tree, path in zip(trees, paths):
        if not tree.tokens:
            continue
        head = tree.is_drawn() if heads else None
        node = -1
        for depth in range(1, max_depth + 1):
            children = [i for i, parent in enumerate(tree.parents) if parent == node]
            if head is not None:
                children = [i for i in children if head[i]]
            if not children:
                break
            tried[depth] += 1
            if depth > len(path) or (head is not None and not head[path[depth - 1]]):
                break
            kept[depth] += 1
            node = path[depth - 1]
    return tried, kept
