"""The draft budget drafts where extra tokens are cheap and not where every token costs a full step.

The budgets here price steps with ``StepCosts`` fitted to the timings a cost law would give at the
calibration's own shapes, so every test also runs the fit the engine uses."""

import pytest
import torch

from multispec.drafters.base import DraftTree
from multispec.engine.budget import (COPIED_NODE, CONTESTED_NODE, DRAWN_NODE, IDLE_STEPS, MARGIN, MAX_WEIGHT,
                                    PRIOR_WEIGHT, PROBE_EVERY, PROBE_MAX, Calibration, DraftBudget, node_kinds)
from tests.engine.test_costs import law_costs

CONTEXT = 200


def costs(fixed: float, per_token: float, per_work: float = 0.0, speculative: float = 0.0):
    """Step prices fitted to a linear cost law: ``fixed`` a step, ``per_token``, ``per_work`` a
    unit of attention work and ``speculative`` for a step with drafts."""
    return law_costs(lambda tokens: fixed + per_token * tokens, per_work, speculative)


PRICES = costs(0.05, 0.002)
"""Any prices, for the tests of calibration alone."""


def trained(fixed: float, per_token: float, accept: float, per_work: float = 0.0) -> DraftBudget:
    budget = DraftBudget(6, costs(fixed, per_token, per_work))
    budget.record_acceptance([0] + [1000] * 6, [0] + [int(1000 * accept)] * 6)
    return budget


def test_a_budget_that_drafts_needs_the_step_costs():
    with pytest.raises(ValueError, match="step costs"):
        DraftBudget(4)
    assert DraftBudget(0).choose(16, CONTEXT) == 0


def test_a_fixed_price_for_drafting_at_all_stops_a_few_unsure_drafts():
    """One likely node in a batch of 8: worth a token, not worth the fixed cost of a step with drafts."""
    trees = [chain([0.85])] + [DraftTree.EMPTY] * 7
    assert len(DraftBudget(4, costs(0.05, 0.002)).select(trees, CONTEXT)[0]) == 1
    assert len(DraftBudget(4, costs(0.05, 0.002, speculative=0.01)).select(trees, CONTEXT)[0]) == 0


def test_overhead_bound_forwards_get_long_drafts():
    assert trained(fixed=0.1, per_token=0.0001, accept=0.6).choose(16, CONTEXT) == 6


def test_compute_bound_forwards_get_no_draft():
    assert trained(fixed=0.0, per_token=0.01, accept=0.6).choose(16, CONTEXT) == 0


def test_in_between_the_length_follows_acceptance():
    low = trained(fixed=0.05, per_token=0.003, accept=0.3).choose(16, CONTEXT)
    high = trained(fixed=0.05, per_token=0.003, accept=0.9).choose(16, CONTEXT)
    assert low < high


def test_a_draft_models_own_forwards_shorten_the_draft():
    """A draft model pays one forward per depth on top of the step: at a tenth of a step per depth
    the deepest draft no longer pays, at a full step per depth no draft does."""
    budget = trained(fixed=0.1, per_token=0.0001, accept=0.6)
    free = budget.choose(16, CONTEXT)
    dear = budget.choose(16, CONTEXT, per_depth=0.01)
    assert free == 6
    assert 0 < dear < free
    assert budget.choose(16, CONTEXT, per_depth=0.1) == 0


def test_sampled_drafts_probe_after_a_run_of_steps_without_drafts():
    """A length of 0 measures nothing, so a budget that chose 0 on one unlucky estimate would keep
    choosing it: after IDLE_STEPS steps of 0 it drafts, on the widening probe steps, the length that
    promises most, and once what those drafts accept pays again it drafts every step. Without the
    probes the first loop below never drafts and the second never recovers."""
    budget = DraftBudget(4, costs(fixed=0.1, per_token=0.0001))
    budget.record_acceptance([0] + [1000] * 4, [0] + [10] * 4)  # 1% accepted: nothing pays
    lengths = [budget.choose(16, CONTEXT) for _ in range(IDLE_STEPS + 3 * PROBE_EVERY + 1)]
    probes = [i for i, length in enumerate(lengths) if length]
    assert probes == [IDLE_STEPS + PROBE_EVERY - 1, IDLE_STEPS + 3 * PROBE_EVERY - 1]
    assert all(lengths[i] >= 1 for i in probes)
    budget.record_acceptance([0] + [10000] * 4, [0] + [9000] * 4)  # what a probe shows: drafts pay now
    assert budget.choose(16, CONTEXT) >= 1 and budget.idle == 0
    assert budget.choose(16, CONTEXT) >= 1


def test_sampled_drafts_do_not_probe_where_no_acceptance_could_pay():
    """Where a draft token costs what a sample does (a compute-bound step), even perfect drafts
    cannot beat plain decoding by ``MARGIN``: a probe there would only cost a step. The budget
    stays at 0 through the probe steps; the same loop on overhead-bound prices probes (the test
    above), so it fails if probes ignore what drafts could pay at best, or if they leave out a
    draft model whose price a probe should measure again."""
    budget = DraftBudget(4, costs(fixed=0.0, per_token=0.01))
    budget.record_acceptance([0] + [1000] * 4, [0] + [10] * 4)
    assert [budget.choose(16, CONTEXT) for _ in range(IDLE_STEPS + 3 * PROBE_EVERY + 1)] == [0] * (
        IDLE_STEPS + 3 * PROBE_EVERY + 1)
    # A draft model's seconds per depth are what a probe measures again (a warm-up can price a
    # depth far above its cost): cheap steps with a dear draft model are still probed.
    dear = DraftBudget(4, costs(fixed=0.1, per_token=0.0001))
    dear.record_acceptance([0] + [1000] * 4, [0] + [10] * 4)
    assert any(dear.choose(16, CONTEXT, per_depth=0.2) for _ in range(IDLE_STEPS + 3 * PROBE_EVERY + 1))


def test_expected_accepted_is_the_chain_sum():
    budget = trained(0.1, 0.001, accept=0.5)
    assert abs(budget.expected_accepted(3) - (0.5 + 0.25 + 0.125)) < 0.01


# ---------------------------------------------------------------- per-node selection

def chain(confidences: list[float], evidence: int = 4) -> DraftTree:
    n = len(confidences)
    return DraftTree(list(range(10, 10 + n)), [-1] + list(range(n - 1)), None, confidences, [evidence] * n)


def test_calibration_learns_what_verification_accepts():
    budget = DraftBudget(4, PRICES)
    before = budget.calibrated(0.97, 4)
    # The drafter says 0.97, but only 1 in 4 of those nodes is accepted.
    for accepted in ([0], [], [], []) * 50:
        budget.record_nodes([chain([0.97])], [accepted])
    assert before == pytest.approx(0.965, abs=0.01)
    assert budget.calibrated(0.97, 4) == pytest.approx(0.25, abs=0.03)
    assert budget.calibrated(0.97, 1) == before  # other cells keep their prior


def test_record_nodes_counts_a_node_only_when_its_parent_was_accepted():
    budget = DraftBudget(4, PRICES)
    tree = chain([0.5, 0.85, 0.97])
    budget.record_nodes([tree], [[]])  # first node rejected: the others were never tried
    assert budget.cal_tried[budget._cell(0.5, 4)[0]][4] == 3.0
    assert budget.cal_tried[budget._cell(0.85, 4)[0]][4] == 2.0
    assert budget.cal_tried[budget._cell(0.97, 4)[0]][4] == 2.0


def test_overhead_bound_steps_keep_whole_trees_and_compute_bound_steps_keep_only_sure_nodes():
    trees = [chain([0.995, 0.995, 0.5]), chain([0.3, 0.995]), DraftTree.EMPTY, chain([0.995])]
    cheap = DraftBudget(4, costs(fixed=0.2, per_token=0.0001)).select(trees, CONTEXT)
    assert [len(t) for t in cheap] == [3, 2, 0, 1]
    dear = DraftBudget(4, costs(fixed=0.01, per_token=0.004)).select(trees, CONTEXT)
    assert [len(t) for t in dear] == [2, 0, 0, 1]
    assert dear[0].tokens == trees[0].tokens[:2] and dear[0].parents == [-1, 0]
    assert DraftBudget(4, costs(fixed=0.0, per_token=0.01)).select(trees, CONTEXT) == [DraftTree.EMPTY] * 4


def test_kept_nodes_form_trees_in_chance_order():
    tree = DraftTree([1, 2, 3, 4, 5], [-1, 0, -1, 2, 0], None, [0.7, 0.995, 0.3, 0.995, 0.2], [4] * 5)
    budget = DraftBudget(4, costs(fixed=0.05, per_token=0.003))
    kept = budget.select([tree, chain([0.5])], CONTEXT)[0]
    for parent in kept.parents:
        assert parent < len(kept.tokens)
    assert kept.tokens[:2] == [1, 2]  # the likely branch, with its sure child
    assert 3 not in kept.tokens or 1 in kept.tokens


def test_costly_attention_padding_prefers_breadth_to_depth():
    """Same chances, but one deep chain would pad every drafting sample's rows: with attention
    work priced high, the budget spends its tokens on first nodes across samples instead."""
    trees = [chain([0.999] * 6)] + [chain([0.99])] * 7
    no_padding_cost = DraftBudget(6, costs(fixed=0.2, per_token=0.0003)).select(trees, CONTEXT)
    padding_cost = DraftBudget(6, costs(fixed=0.2, per_token=0.0003, per_work=0.5)).select(trees, CONTEXT)
    assert len(no_padding_cost[0]) == 6
    assert len(padding_cost[0]) < 6 and all(len(t) == 1 for t in padding_cost[1:])


def test_drafting_that_barely_pays_on_paper_is_left_out():
    """A node whose expected gain beats its cost by less than the margin is not drafted; the
    same node in a batch where it clearly pays is."""
    model_costs = costs(fixed=0.05, per_token=0.002)  # a token costs 4% of a plain 8-sample step
    budget = DraftBudget(4, model_costs)
    barely = [chain([0.5])] + [DraftTree.EMPTY] * 7  # 0.5 / 8 = 6% more tokens for 3% more time
    clearly = [chain([0.995])] + [DraftTree.EMPTY] * 7
    assert (0.5 / 8 + 1) / (1 + 0.002 / 0.066) < MARGIN  # the case is what its name says
    assert len(budget.select(barely, CONTEXT)[0]) == 0
    assert len(budget.select(clearly, CONTEXT)[0]) == 1


def test_after_a_stretch_of_empty_steps_the_drafter_is_asked_only_to_probe():
    """Compute-bound steps keep nothing: after ``IDLE_STEPS`` such steps the drafter is asked only
    to probe, ``PROBE_EVERY`` steps apart, then twice as far each time, up to ``PROBE_MAX``; the
    first probe whose drafts pay brings back drafting every step."""
    budget = DraftBudget(4, costs(fixed=0.0, per_token=0.01))  # every token costs a sample's step
    asked = []
    for _ in range(IDLE_STEPS + 200):
        asked.append(budget.wants_drafts())
        if asked[-1]:
            assert budget.select([chain([0.995])] * 8, CONTEXT) == [DraftTree.EMPTY] * 8
    assert asked[:IDLE_STEPS] == [True] * IDLE_STEPS
    probes = [i - IDLE_STEPS for i, a in enumerate(asked) if a and i >= IDLE_STEPS]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == PROBE_EVERY - 1
    assert gaps[:3] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY]
    assert max(gaps) == PROBE_MAX and gaps[-1] == PROBE_MAX

    budget.costs = costs(fixed=0.2, per_token=0.0001)  # forwards turn overhead-bound
    while not budget.wants_drafts():
        pass
    assert len(budget.select([chain([0.995])] * 8, CONTEXT)[0]) == 1
    assert all(budget.wants_drafts() for _ in range(3 * PROBE_EVERY))


def test_calibration_is_shared_and_fades_past_its_cap():
    """A budget counts into the Calibration it was given (the engine's, which outlives the call);
    past MAX_WEIGHT observations a cell keeps its acceptance ratio but weighs old evidence less."""
    calibration = Calibration.prior(4, 4)
    tree = DraftTree([1, 2], [-1, 0], None, confidence=[0.97, 0.97], evidence=[4, 4])
    first = DraftBudget(4, PRICES, calibration=calibration)
    first.record_nodes([tree], [[0]])  # node 0 accepted, node 1 tried and rejected
    k, e = first._cell(0.97, 4)
    assert calibration.cal_tried[k][e] == PRIOR_WEIGHT + 2
    second = DraftBudget(4, PRICES, calibration=calibration)  # the next call starts from there
    assert second.calibrated(0.97, 4) == first.calibrated(0.97, 4) != DraftBudget(4, PRICES).calibrated(0.97, 4)
    for _ in range(3 * int(MAX_WEIGHT)):
        second.record_nodes([tree], [[0, 1]] if _ % 4 else [[]])  # 3 of 4 steps accept both nodes
    assert calibration.cal_tried[k][e] <= MAX_WEIGHT
    # Every 4 steps the cell sees 7 tries (the first node 4 times, the second 3 times, after the
    # first was accepted) and 6 acceptances; long after the prior has faded it reads 6/7.
    assert abs(second.calibrated(0.97, 4) - 6 / 7) < 0.02
    second.record_acceptance([0, 5000], [0, 2500])
    assert calibration.tried[1] <= MAX_WEIGHT and abs(calibration.kept[1] / calibration.tried[1] - 0.5) < 0.01


def test_an_idle_budget_stops_asking_for_the_targets_likeliest_tokens():
    from multispec.engine.lane import Lane
    from multispec.params import SpecConfig

    lane = Lane(SpecConfig(drafter="consensus"), 400, lambda: costs(fixed=0.0, per_token=0.01))
    assert lane.wants_alternatives()
    for _ in range(IDLE_STEPS):
        lane.select([chain([0.995])] * 8, 8, CONTEXT)  # compute-bound: nothing kept
    assert not lane.wants_alternatives()
    assert Lane(SpecConfig(drafter="consensus", adaptive=False), 400).wants_alternatives()
    assert not Lane(SpecConfig(drafter="ngram"), 400, lambda: PRICES).wants_alternatives()


@pytest.mark.parametrize("spent, evidence, cheap_seconds", [("drafting", 0, 0.0), ("proposing", 4, 0.0005)],
                         ids=["a draft model's forwards", "the proposal's own seconds"])
def test_drafting_that_costs_more_than_its_drafts_gain_is_asked_only_to_probe(spent, evidence, cheap_seconds):
    """Sure nodes on an overhead-bound step are kept whatever was spent drafting them (that time
    is gone), but when their gain does not repay it the step counts as one that kept nothing, so
    after ``IDLE_STEPS`` such steps the drafter runs only on probes. Both what a draft model's
    forwards cost (its nodes carry no context match) and what the proposal itself cost (sibling
    text: a consensus proposal for 128 samples costs several ms of a step) count; cheap drafting
    keeps the drafter asked every step."""
    prices = costs(fixed=0.05, per_token=0.001)
    # About 0.9 tokens gained on a step of ~0.06 s.
    trees = [chain([0.9], evidence=evidence)] + [DraftTree.EMPTY] * 7
    cheap, dear = DraftBudget(4, prices), DraftBudget(4, prices)
    for _ in range(IDLE_STEPS + 2 * PROBE_EVERY):
        assert cheap.wants_drafts()
        assert len(cheap.select(trees, CONTEXT, **{spent: cheap_seconds})[0]) == 1
    asked = 0
    for _ in range(IDLE_STEPS + 2 * PROBE_EVERY):
        if dear.wants_drafts():
            asked += 1
            assert len(dear.select(trees, CONTEXT, **{spent: 0.05})[0]) == 1  # kept: already drafted
    assert asked < IDLE_STEPS + 2 * PROBE_EVERY and dear.idle >= IDLE_STEPS


def test_a_hybrid_model_that_does_not_repay_itself_stops_while_the_free_drafts_go_on():
    """Trees that merge free sibling nodes (evidence > 0) with a draft model's (evidence 0): where
    the free nodes pay and the model's add less than its seconds, the drafter stays asked every step
    (``idle`` 0) but the model runs only on probes (``wants_model``); where the model's nodes repay
    it, it runs every step. The free-only comparison is what decides: the same trees with the model
    free of cost would keep its nodes too."""
    prices = costs(fixed=0.05, per_token=0.001)

    def merged(model_confidence: float) -> DraftTree:  # a sibling match, and the model's guess beside it
        return DraftTree([10, 11], [-1, -1], None, [0.95, model_confidence], [3, 0])

    trees = [merged(0.3)] * 8
    assert all(len(tree) == 2 for tree in DraftBudget(4, prices).select(trees, CONTEXT))
    dear = DraftBudget(4, prices)
    runs = 0
    for _ in range(IDLE_STEPS + 4 * PROBE_EVERY):
        assert dear.wants_drafts()
        if dear.wants_model():
            runs += 1
            kept = dear.select(trees, CONTEXT, drafting=0.02)
        else:
            kept = dear.select([DraftTree([10], [-1], None, [0.95], [3])] * 8, CONTEXT)
        assert all(len(tree) >= 1 for tree in kept)  # the sibling node is kept every step
        assert dear.idle == 0
    assert IDLE_STEPS <= runs < IDLE_STEPS + 4 * PROBE_EVERY and dear.model_idle >= IDLE_STEPS

    worth = DraftBudget(4, prices)
    for _ in range(IDLE_STEPS + 4 * PROBE_EVERY):
        assert worth.wants_model()
        kept = worth.select([merged(0.95)] * 8, CONTEXT, drafting=0.002)
        assert all(len(tree) == 2 for tree in kept)
    assert worth.model_idle == 0


def test_a_lane_prices_its_draft_models_depths_from_what_they_cost():
    """What the drafter's model spent per depth (the median of recent steps, its first step's
    warm-up left out once another is measured) shortens the sampled drafts the lane's budget asks
    for; a step in which the model did not run leaves the price alone."""
    from types import SimpleNamespace

    from multispec.engine.lane import Lane
    from multispec.params import SpecConfig

    lane = Lane(SpecConfig(drafter="consensus", sampled_drafts=True), 400, lambda: costs(fixed=0.1, per_token=0.0001))
    lane.budget.record_acceptance([0] + [1000] * 6, [0] + [600] * 6)
    samples = [SimpleNamespace(remaining=100)] * 16
    free = lane.budgets(samples, 16, CONTEXT)
    lane.observe_drafting(0.5, 5)  # the first draft: the model's warm-up in it
    lane.observe_drafting(0.0, 0)
    assert lane.depth_seconds == pytest.approx(0.1)
    lane.observe_drafting(0.05, 5)  # a second one replaces it
    assert lane.depth_seconds == pytest.approx(0.01)
    lane.observe_drafting(0.15, 5)
    lane.observe_drafting(0.05, 5)
    assert lane.depth_seconds == pytest.approx(0.01)  # the median of what followed the first
    dear = lane.budgets(samples, 16, CONTEXT)
    assert 0 < dear[0] < free[0]


def test_drawn_nodes_are_kept_whatever_they_promise():
    """The hybrid's drawn head candidates must reach the verifier exactly as drawn: where every
    token costs as much as a sample's step and nothing pays, the copied nodes are cut but the
    drawn ones stay (and count in the step's cost); where drafts pay, the copied nodes are ranked
    as before around them. The cut the head grows against comes from the copied nodes only."""
    import torch

    q = torch.eye(16)[[10]]
    mixed = DraftTree([10, 11, 12], [-1, -1, 1], q, [0.1, 0.3, 0.8], [0, 3, 2], [True, False, False])
    dear = DraftBudget(4, costs(fixed=0.0, per_token=0.01))
    kept = dear.select([mixed] * 8, CONTEXT)
    assert all(tree.tokens == [10] and tree.drawn == [True] and torch.equal(tree.q, q) for tree in kept)
    assert dear.cutoff == pytest.approx(dear.calibrated(0.3, 3, CONTESTED_NODE))  # the best copied node left out
    cheap = DraftBudget(4, costs(fixed=0.05, per_token=0.0001))
    kept = cheap.select([mixed] * 8, CONTEXT)
    assert all(tree.tokens == [10, 11, 12] for tree in kept)
    assert cheap.cutoff == pytest.approx(cheap.calibrated(0.3, 3, CONTESTED_NODE) * cheap.calibrated(0.8, 2))


def test_drawn_contested_and_copied_nodes_are_calibrated_apart():
    """A drawn hybrid's tree holds three kinds of node whose acceptance differs at one confidence:
    drawn ones (rejection sampling), copied ones beside a drawn sibling (tried only where it is
    rejected, on the residual) and copied ones without. Each kind is calibrated in its own table,
    so a cell learns its own kind's rate, not a blend (here 0.64 for all three); and ``select``
    ranks a contested node by its own chance: it is cut where the copied node is kept."""
    q = torch.eye(16)[[10]]
    # Root children: the drawn 10 and the copied 11 beside it; the copied 12 under the drawn one.
    tree = DraftTree([10, 11, 12], [-1, -1, 0], q, [0.5, 0.5, 0.5], [1, 1, 1], [True, False, False])
    assert node_kinds(tree) == [DRAWN_NODE, CONTESTED_NODE, COPIED_NODE]
    assert node_kinds(DraftTree([3, 4], [-1, -1], None, [0.5, 0.5], [1, 1])) == [COPIED_NODE] * 2
    assert node_kinds(DraftTree([3, 4], [-1, -1], torch.eye(8)[[3, 4]], [0.5, 0.5], [0, 0])) == [DRAWN_NODE] * 2
    budget = DraftBudget(4, costs(fixed=0.05, per_token=0.002))
    for _ in range(200):  # drawn kept 3 of 4 times, the contested node 1 of 4, the copied child 3 of 3
        budget.record_nodes([tree] * 4, [[0, 2], [0, 2], [0, 2], [1]])
    assert budget.calibrated(0.5, 1, DRAWN_NODE) == pytest.approx(0.75, abs=0.01)
    assert budget.calibrated(0.5, 1, CONTESTED_NODE) == pytest.approx(0.25, abs=0.01)
    assert budget.calibrated(0.5, 1, COPIED_NODE) == pytest.approx(1.0, abs=0.01)
    kept = budget.select([tree] * 8, CONTEXT)
    assert all(t.tokens == [10, 12] and t.drawn == [True, False] for t in kept)


def test_a_hybrid_lane_counts_its_heads_acceptance_per_depth_apart():
    """Only the head's drawn nodes count for the head's own price per depth: a depth is tried
    where the node reached has a drawn child, kept where the accepted child is drawn."""
    from multispec.engine.lane import _acceptance_by_depth

    q = torch.full((2, 8), 1 / 8)
    # Root children: head node 0 (drawn) with head child 1; a sibling node 2 (copied) with child 3.
    tree = DraftTree([5, 6, 7, 1], [-1, 0, -1, 2], q, [0.5, 0.5, 0.9, 0.9], [0, 0, 3, 2], [True, True, False, False])
    tried, kept = _acceptance_by_depth([tree, tree, tree], [[0, 1], [2, 3], []], 3, heads=True)
    assert tried == [0, 3, 1, 0] and kept == [0, 1, 1, 0]
    tried, kept = _acceptance_by_depth([tree, tree, tree], [[0, 1], [2, 3], []], 3)
    assert tried == [0, 3, 2, 0] and kept == [0, 2, 2, 0]


def test_a_hybrid_lane_sizes_its_heads_chains_by_their_price():
    """The head's chains go as deep as its own acceptance and price per depth say pays: full depth
    where its forwards are free and it is accepted often, shallower as a depth costs more, and not
    at all (the head off, the sibling drafts alone) where nothing it drafts would pay."""
    from types import SimpleNamespace

    from multispec.engine.lane import Lane
    from multispec.params import SpecConfig

    class Stub:
        alternatives, min_alternative, sampled = 0, 0.0, False
        use_model, model_depth = True, None

        def limit(self, chances, floor):
            pass

    lane = Lane(SpecConfig(drafter="consensus", max_draft_tokens=4), 400, lambda: costs(fixed=0.1, per_token=0.0001))
    lane.drafter = Stub()
    lane.head_budget = DraftBudget(4, costs(fixed=0.1, per_token=0.0001))
    lane.head_budget.record_acceptance([0] + [1000] * 4, [0] + [700] * 4)
    samples = [SimpleNamespace(remaining=100)] * 4
    lane.budgets(samples, 4, CONTEXT)
    assert lane.drafter.model_depth == 4 and lane.drafter.use_model
    lane.observe_drafting(0.2, 4)  # the first draft (its warm-up) counts until a second one
    lane.observe_drafting(0.02, 1)  # 20 ms a depth: a fifth of a step
    lane.budgets(samples, 4, CONTEXT)
    assert 0 < lane.drafter.model_depth < 4 and lane.drafter.use_model
    lane.observe_drafting(0.5, 1)
    lane.observe_drafting(0.5, 1)  # half a second a depth: nothing the head drafts pays
    lane.budgets(samples, 4, CONTEXT)
    assert lane.drafter.model_depth == 0 and not lane.drafter.use_model
    # Its own probes run the head even while the step's budget has it idle (the two schedules
    # would rarely meet): the probe steps of a run of steps that kept the head off.
    lane.budget.model_idle = 1000  # not a probe step of wants_model
    assert not lane.budget.wants_model()
    ran = []
    for _ in range(IDLE_STEPS + PROBE_EVERY):
        lane.budgets(samples, 4, CONTEXT)
        ran.append(lane.drafter.use_model)
    assert ran.count(True) == 1
