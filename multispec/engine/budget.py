"""How many draft tokens a step should carry: the one that maximises expected tokens per second.

Drafting is free, verifying is not: every draft token is one more token in the target forward.
Where a forward is overhead- or memory-bound (small batches, GPUs) extra tokens cost almost
nothing and long drafts pay; where it is compute-bound (large batches on a CPU) each token costs
as much as a sample's plain step and drafts only pay when they are nearly always accepted. So the
budget weighs both sides with measurements instead of assuming either:

- the cost of a step of any shape, from ``StepCosts`` (``multispec.engine.costs``): decode steps
  of chosen shapes timed through the engine's own path, once per machine and model, and cached;
- the chance that a draft token is accepted, from what verification has accepted so far.

Deterministic drafts come with the drafter's confidence in each node (its estimate of the
target's probability of the token, and the length of the context match behind it). The budget
calibrates those against what verification actually accepts, per confidence bin and match length,
so a node's chance of being accepted is the product of calibrated values along its path. Each step
then ranks every candidate node of the whole batch by that chance and keeps the best k, the k that
maximises ``(B + sum of the k chances) / cost``, the cost of the step those k nodes make (its T
and its Qmax): a node earns its place in the forward only where its expected tokens beat what the
same compute buys elsewhere. Chances never grow from a node to its children, so the kept nodes
always form trees. A step drafts only where the best k beats a plain step by ``MARGIN``.

Sampled drafts must not be pruned by what was drawn (the multi-draft schemes need the drafts
exactly as sampled from q), so for them the budget picks one draft length L in [0, max] per step
from per-depth acceptance instead, the L that maximises ``B * (1 + E[accepted | L]) / cost`` with
``T = B * (1 + L)`` and ``Qmax = 1 + L``.

What verification has shown about the drafter's drafts belongs to the engine and outlives a call
(see ``Calibration``: a new request starts from what earlier ones measured, not from the
drafter's raw confidence).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from multispec.drafters.base import DraftTree
from multispec.engine.costs import Prices, StepCosts

CONFIDENCE_EDGES = (0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.98, 0.99)
"""Calibration bins of the drafter's confidence: finest near 1, where drafting pays on big batches."""
PRIOR_WEIGHT = 2.0
"""Pseudo-observations behind each calibration cell's prior (the raw confidence itself)."""
MARGIN = 1.05
"""Drafting must promise this much more tokens per second than a plain step. The measured prices
are off by a few percent either way for any one step shape (the machine's load moves them), and a
choice taken whenever the estimate says "gain" takes every overestimate with it: the steps where
drafting barely pays on paper are lost on average. The margin keeps the budget at plain speed
there and costs nothing where drafts pay well."""
IDLE_STEPS = 8
"""Steps in a row that kept no draft node, after which the drafter is asked only now and then
(probes ``PROBE_EVERY`` steps apart, the gap doubling after each probe that keeps nothing, up to
``PROBE_MAX``) until a step keeps one again. Where a forward is compute-bound (large batches on a
CPU) the budget keeps nothing for long stretches, and building every sample's draft tree each step
to throw it away cost 2-4% of the step; probing every fourth step still cost about 1.5% at 128
samples in flight (under cProfile, 8 x 16 GSM8K: 0.56 s of proposals in 35.8 s)."""
PROBE_EVERY = 4
PROBE_MAX = 32
MAX_WEIGHT = 2000.0
"""Observations a calibration cell (or a depth's acceptance) holds at most; past it, old ones
fade in proportion, so an engine that serves for days follows what its drafts do now."""


def _probe_due(since: int) -> bool:
    """Whether the step ``since`` steps into an idle stretch probes: steps 3, 11, 27, 59, 91, ...
    (gaps 4, 8, 16, 32, 32, ...)."""
    gap, at = PROBE_EVERY, PROBE_EVERY - 1
    while at < since:
        gap = min(2 * gap, PROBE_MAX)
        at += gap
    return at == since


@dataclass
class Calibration:
    """What verification has shown about one drafter's drafts at one sampling setting: acceptance
    per depth (sampled drafts) and per confidence bin and match length (scored drafts), as
    (tried, kept) counts over a prior.

    The engine keeps one per setting across calls, because a calibration that starts from the
    prior each call lets a request sent on its own draft from the drafter's raw confidence until
    its own steps correct it: at 2 x 16 one at a time, in the first 20 steps of a request the
    budget expected 40% more tokens than were accepted, against 5% with the calibration kept
    (measured with the default speculation on 2 GSM8K questions x 16 sent one at a time; see
    docs/results.md)."""

    tried: list[float]
    kept: list[float]
    cal_tried: list[list[float]]
    cal_kept: list[list[float]]
    rival_tried: list[list[float]]
    rival_kept: list[list[float]]
    drawn_tried: list[list[float]]
    drawn_kept: list[list[float]]
    """The same cells for two other kinds of node in a drawn hybrid's trees (``node_kinds``): copied
    nodes with a drawn sibling (tried only where the drawn one is rejected, then accepted on the
    residual) and the drawn nodes themselves (accepted by rejection sampling, most of the time where
    q is near p). Counted in one table, each moved the others': with 4 samples in flight at
    temperature 1.0 the budget expected 0.29 of the contested nodes accepted where 0.14 were, and
    0.5 of the copied nodes in a cell drawn nodes shared where 0.2-0.3 were."""

    @classmethod
    def prior(cls, max_depth: int, max_evidence: int) -> "Calibration":
        # Pseudo-counts: 50% acceptance per depth worth two observations; each confidence bin
        # at its own centre, worth PRIOR_WEIGHT.
        edges = (0.0,) + CONFIDENCE_EDGES + (1.0,)
        centers = [(lo + hi) / 2 for lo, hi in zip(edges, edges[1:])]

        def tried():
            return [[PRIOR_WEIGHT] * (max_evidence + 1) for _ in centers]

        def kept():
            return [[PRIOR_WEIGHT * c] * (max_evidence + 1) for c in centers]

        return cls([2.0] * (max_depth + 1), [1.0] * (max_depth + 1), tried(), kept(), tried(), kept(), tried(), kept())


COPIED_NODE, CONTESTED_NODE, DRAWN_NODE = 0, 1, 2


def node_kinds(tree: DraftTree) -> list[int]:
    """Per node, which calibration table it belongs to: ``DRAWN_NODE`` (drawn from a q),
    ``CONTESTED_NODE`` (copied, with a sibling drawn from a q: verification tries it only where the
    drawn one is rejected, on the residual, so it is accepted less often than the same node alone)
    or ``COPIED_NODE``."""
    drawn = tree.is_drawn()
    rivals = {parent for parent, d in zip(tree.parents, drawn) if d}
    return [DRAWN_NODE if d else CONTESTED_NODE if parent in rivals else COPIED_NODE
            for parent, d in zip(tree.parents, drawn)]


def _count(tried: list[float], kept: list[float], i: int, accepted: float, offered: float = 1.0) -> None:
    tried[i] += offered
    kept[i] += accepted
    if tried[i] > MAX_WEIGHT:
        scale = MAX_WEIGHT / tried[i]
        tried[i] *= scale
        kept[i] *= scale


class DraftBudget:
    """How many draft nodes (scored drafts, ``select``) or tokens per sample (sampled drafts,
    ``choose``) a step carries. ``costs``: the step prices (needed when ``max_depth`` > 0)."""

    def __init__(self, max_depth: int, costs: Prices | StepCosts | None = None, max_evidence: int = 4,
                 calibration: Calibration | None = None, width: int = 1):
        if max_depth and costs is None:
            raise ValueError("a draft budget with max_depth > 0 needs the step costs")
        self.max_depth = max_depth
        self.width = width
        """Sampled drafts: chains per sample (a draft of length L is ``width * L`` nodes)."""
        self.costs = costs
        self.idle = 0
        """Steps in a row whose drafts were all left out (or not asked for)."""
        self.model_idle = 0
        """Steps in a row where a draft model's own nodes did not repay its seconds (or it was not
        asked): see ``select`` and ``wants_model``."""
        self.cutoff: float | None = None
        """Scored drafts: the lowest chance among the nodes the last ``select`` kept (None where it
        kept none). A drafter that grows its trees itself (the hybrid's head) need not extend a
        node whose chance is far below it: its children's chances are lower still."""
        self.max_evidence = max_evidence
        calibration = calibration or Calibration.prior(max_depth, max_evidence)
        # The lists are the calibration's own: what this budget counts, the engine keeps.
        self.tried, self.kept = calibration.tried, calibration.kept
        self.cal_tried, self.cal_kept = calibration.cal_tried, calibration.cal_kept
        self._tables = ((self.cal_tried, self.cal_kept), (calibration.rival_tried, calibration.rival_kept),
                        (calibration.drawn_tried, calibration.drawn_kept))
        """(tried, kept) cells per kind of node (``COPIED_NODE``, ``CONTESTED_NODE``, ``DRAWN_NODE``)."""

    # ------------------------------------------------------------------ calibration
    def _cell(self, confidence: float, evidence: int) -> tuple[int, int]:
        return bisect_right(CONFIDENCE_EDGES, confidence), min(max(evidence, 0), self.max_evidence)

    def calibrated(self, confidence: float, evidence: int, kind: int = 0) -> float:
        """Measured acceptance of nodes of this kind (``node_kinds``; 0: copied) the drafter gave
        this confidence and match length."""
        k, e = self._cell(confidence, evidence)
        tried, kept = self._tables[kind]
        return kept[k][e] / tried[k][e]

    def chance_table(self, evidence: int = 0) -> list[float]:
        """Measured acceptance per confidence bin (``CONFIDENCE_EDGES``) of nodes with this match
        length: ``calibrated`` for every bin at once."""
        e = min(max(evidence, 0), self.max_evidence)
        return [kept[e] / tried[e] for kept, tried in zip(self.cal_kept, self.cal_tried)]

    def record_nodes(self, trees: list[DraftTree], paths: list[list[int]]) -> None:
        """Every node whose parent was accepted was tried; it was kept if it is on the accepted path."""
        for tree, path in zip(trees, paths):
            if not tree.tokens or tree.confidence is None or tree.evidence is None:
                continue
            accepted = set(path)
            for i, (parent, kind) in enumerate(zip(tree.parents, node_kinds(tree))):
                if parent < 0 or parent in accepted:
                    k, e = self._cell(tree.confidence[i], tree.evidence[i])
                    tried, kept = self._tables[kind]
                    _count(tried[k], kept[k], e, float(i in accepted))

    def wants_drafts(self) -> bool:
        """Whether this step should ask the drafter at all (see ``IDLE_STEPS``); a step it skips
        counts as one that kept nothing."""
        if self.idle < IDLE_STEPS or _probe_due(self.idle - IDLE_STEPS):
            return True
        self.idle += 1
        return False

    def select(self, trees: list[DraftTree], context: int, others: int = 0, drafting: float = 0.0,
               proposing: float = 0.0) -> list[DraftTree]:
        """Keep, across the whole batch, the draft nodes that maximise expected tokens per second.

        ``context``: keys the step's attention reads per query row (longest prompt plus longest
        sample cache); ``others``: samples of the step this budget does not draft for (other
        lanes), each one token of the step's cost and of its gain. ``drafting``: seconds a draft
        model spent building these trees. Spent already, it does not change which nodes are
        kept; but a step whose kept nodes do not repay it on top of their forward counts as one
        that kept nothing, so a draft model that costs more than it gains is asked only now and
        then (``IDLE_STEPS``), as drafts that do not pay are. ``proposing``: the rest of the
        proposal's seconds (the drafter's own lookups and trees), counted the same way: with 128
        samples in flight a consensus proposal costs several ms of a 76 ms step, and nodes that
        repay only their rows kept the drafter asked on a third of the steps for tau 1.00-1.05.

        Trees that merge the model's nodes with free ones (the hybrid: the model's carry evidence
        0, sibling matches more) also say whether the model itself paid: the best rate with its
        nodes, its seconds included, against the best rate of the free nodes alone. Where it did
        not, the step counts against the model only (``model_idle``, ``wants_model``).

        Nodes drawn from a q (``DraftTree.drawn``, the hybrid's head candidates) are all kept,
        whatever their chance: the multi-draft schemes need them exactly as drawn. They count
        first in the step's cost and gain; the copied nodes around them are ranked and cut."""
        own = len(trees)
        batch = own + others
        candidates = []  # (copied, -chance, depth, sample, node, evidence)
        pinned = 0
        for b, tree in enumerate(trees):
            if not tree.tokens or tree.confidence is None or tree.evidence is None:
                continue
            kinds = node_kinds(tree)
            chance: list[float] = []
            depth: list[int] = []
            for i, parent in enumerate(tree.parents):
                p = self.calibrated(tree.confidence[i], tree.evidence[i], kinds[i])
                chance.append(p if parent < 0 else p * chance[parent])
                depth.append(1 if parent < 0 else depth[parent] + 1)
                drawn = kinds[i] == DRAWN_NODE
                candidates.append((not drawn, -chance[i], depth[i], b, i, tree.evidence[i]))
                pinned += drawn
        candidates.sort()
        plain = batch / self.costs.seconds(batch, batch, 1, context)
        keep, gained, step = self._best(candidates, own, batch, context, plain, pinned)
        paid = keep > 0 and gained / (step + drafting + proposing) > plain
        if drafting > 0:
            free = [(True, *c[1:]) for c in candidates if c[5] > 0]  # closed under parents: a match's ancestors match
            free.sort()
            kept_free, gained_free, step_free = self._best(free, own, batch, context, plain)
            without = gained_free / step_free if kept_free else plain
            model_paid = keep > 0 and gained / (step + drafting) > without
            paid = paid or kept_free > 0
        else:
            model_paid = False
        self.model_idle = 0 if model_paid else self.model_idle + 1
        self.idle = 0 if paid else self.idle + 1
        # The bar a node had to clear: the least chance among the copied nodes kept, or where none
        # was, the best one left out (drawn nodes were kept whatever their chance).
        kept_copied = [-c[1] for c in candidates[:keep] if c[0]]
        left_copied = [-c[1] for c in candidates[keep:] if c[0]]
        self.cutoff = min(kept_copied) if kept_copied else (max(left_copied) if left_copied and keep else None)
        kept: list[list[int]] = [[] for _ in trees]
        for _, _, _, b, i, _ in candidates[:keep]:
            kept[b].append(i)
        return [tree.subtree(sorted(nodes)) for tree, nodes in zip(trees, kept)]

    def _best(self, candidates: list[tuple], own: int, batch: int, context: int,
              plain: float, least: int = 0) -> tuple[int, float, float]:
        """(k, expected tokens, step seconds) of the best first k of the ranked ``candidates``: the
        k of highest expected tokens per second, 0 (with a plain step's figures) unless it beats
        ``plain`` tokens per second by ``MARGIN``. ``least``: the first so many must be kept
        (drawn nodes), whatever they promise."""
        price = self.costs.pricer(batch, context)
        counts = [1] * own
        qmax, samples_drafting, gained = 1, 0, float(batch)
        best = (0, float(batch), price(batch, 1))
        best_rate = MARGIN * plain
        for k, (_, neg_chance, _, b, *_) in enumerate(candidates, 1):
            gained -= neg_chance
            samples_drafting += counts[b] == 1
            counts[b] += 1
            qmax = max(qmax, counts[b])
            if k < least:
                continue
            step = price(batch + k, qmax, samples_drafting)
            if gained / step > best_rate or k == least:
                best, best_rate = (k, gained, step), gained / step
        return best

    def wants_model(self) -> bool:
        """Whether this step should run the draft model of a drafter that also drafts for free
        (the hybrid's head): as ``wants_drafts``, over the steps where the model's nodes did not
        repay its seconds."""
        return self.model_idle < IDLE_STEPS or _probe_due(self.model_idle - IDLE_STEPS)

    # ------------------------------------------------------------------ sampled drafts
    def record_acceptance(self, drafted_by_depth: list[int], accepted_by_depth: list[int]) -> None:
        """Counts of draft tokens offered at each depth (parent accepted) and accepted there."""
        for depth in range(1, min(len(drafted_by_depth), self.max_depth + 1)):
            _count(self.tried, self.kept, depth, accepted_by_depth[depth], drafted_by_depth[depth])

    def expected_accepted(self, length: int) -> float:
        total, chain = 0.0, 1.0
        for depth in range(1, length + 1):
            chain *= self.kept[depth] / self.tried[depth]
            total += chain
        return total

    def choose(self, batch: int, context: int, others: int = 0, per_depth: float = 0.0) -> int:
        """Draft tokens per sample for ``batch`` samples (sampled drafts) in a step that also holds
        ``others`` samples without drafts. ``per_depth``: seconds the drafter itself spends per
        draft depth (a draft model's forward for the whole batch), paid on top of the step.

        A length of 0 draws nothing, so it teaches the budget nothing either: the acceptance and
        the draft model's price it chose 0 on would stay as they were for good (a first step that
        accepted little, or a draft model's first forward, which pays its warm-up, was enough to
        stop a draft model for a whole run). So after ``IDLE_STEPS`` steps of 0 in a row, the
        probe steps of ``wants_drafts`` draft the length that promises most even where it does
        not clear ``MARGIN``, and what they accept and cost is measured again. Only a length that
        could pay is probed: where a step of it would not clear ``MARGIN`` even with every draft
        token accepted (many samples in flight on a CPU, where a draft token costs about what a
        sample does), no acceptance a probe could measure would change the choice, and each probe
        cost a step of drafts that could not pay (one request of 16 samples, the drawn hybrid's
        head: probe steps of one token a sample cost 2.05 plain steps for 1.61 steps' tokens).
        The draft model's own seconds are left out of that test: they are what a probe measures
        again (a warm-up or a slow spell can price a depth far above what it costs)."""
        if self.max_depth == 0:
            return 0
        seconds = self.costs.seconds
        total = batch + others
        plain = total / seconds(total, total, 1, context)
        best, best_rate = 0, MARGIN * plain
        probe, probe_rate = 0, 0.0
        for length in range(1, self.max_depth + 1):
            gained = others + batch * (1.0 + self.expected_accepted(length))
            nodes = self.width * length
            forward = seconds(total + batch * nodes, total, 1 + nodes, context, batch)
            rate = gained / (forward + length * per_depth)
            if rate > best_rate * (1.02 if best else 1.0):  # prefer the shorter draft unless the longer clearly wins
                best, best_rate = length, rate
            # The step alone, without the draft model's seconds: those a probe measures again.
            could_pay = (others + batch * (1.0 + length)) / forward > MARGIN * plain
            if could_pay and rate > probe_rate * 1.02:
                probe, probe_rate = length, rate
        if best:
            self.idle = 0
            return best
        due = self.idle >= IDLE_STEPS and _probe_due(self.idle - IDLE_STEPS)
        self.idle += 1
        return probe if due else 0
