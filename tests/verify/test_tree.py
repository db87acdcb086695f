"""Tree verification: the walk over a packed batch of draft trees is lossless and well formed.

Every scheme is walked against every law of sibling drafts: where the registry's preconditions
accept the pairing the joint law of the output must be the target's; where they refuse it, the
engine never runs it (``tests/engine/test_configurations.py``), and for the refusal the issue
was found with (recursive rejection without replacement on i.i.d. drafts) the bias is shown.
"""

import numpy as np
import pytest
import torch

from multispec.verify import DraftLaw, PositionKeys, check_drafts, verify_tree
from multispec.verify.sampling import sample_rows
from multispec.verify.schemes import COPIED, IID, INDEPENDENT, MIXED, SCHEMES, WITHOUT_REPLACEMENT
from tests.verify.verify_stats import ALPHA, chi_square_pvalue, dirichlet, np_counts

VOCAB = 4
SAMPLES = 100_000
# Per sample: root -> 2 children -> 2 children each -> 1 child each (depth 3, 10 nodes), parents first.
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 1, 2, 3, 4, 5])
DEPTH = torch.tensor([1, 1, 2, 2, 2, 2, 3, 3, 3, 3])


class Language:
    """A random autoregressive target and draft over VOCAB tokens: p(. | prefix), q(. | prefix) for prefixes of length <= 3."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.p = [torch.cat([dirichlet(VOCAB, 0.7, g) for _ in range(VOCAB**d)]) for d in range(4)]
        self.q = [torch.cat([dirichlet(VOCAB, 0.7, g) for _ in range(VOCAB**d)]) for d in range(4)]
        self.q_other = [torch.cat([dirichlet(VOCAB, 0.7, g) for _ in range(VOCAB**d)]) for d in range(4)]
        """A second draft distribution: independent siblings alternate between q and this."""

    def joint(self) -> torch.Tensor:
        """Target probability of every 3-token sequence, indexed x1 * V^2 + x2 * V + x3."""
        p1 = self.p[0][0]
        p2 = self.p[1]
        p3 = self.p[2]
        return (p1[:, None, None] * p2[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)).flatten()


def _draft_batch(lang: Language, law: str, g: torch.Generator):
    """Packed inputs for SAMPLES copies of the tree, drafted under ``law``: copied (the siblings are
    q's most likely tokens, fixed before any draw), i.i.d. from q, independently from q and
    q_other in turn, from q without replacement, or mixed (the hybrid's trees: a drawn sibling
    first and a copied one after it, which here depends on what was drawn; single children copied
    under even nodes, drawn under odd ones). Also returns each node's row of q, -1 where copied."""
    n_nodes = len(PARENTS)
    tokens = torch.zeros(SAMPLES, n_nodes, dtype=torch.long)
    prefix = torch.zeros(SAMPLES, n_nodes, dtype=torch.long)  # index of the prefix ending at the node
    q_rows = torch.zeros(SAMPLES, n_nodes, VOCAB, dtype=torch.float64)
    q_index = torch.arange(n_nodes).repeat(SAMPLES, 1)
    for first in range(0, n_nodes):
        parent = int(PARENTS[first])
        if first > 0 and parent == int(PARENTS[first - 1]):
            continue  # drawn with its elder sibling
        siblings = [j for j in range(n_nodes) if int(PARENTS[j]) == parent]
        depth = int(DEPTH[first]) - 1
        context = torch.zeros(SAMPLES, dtype=torch.long) if parent < 0 else prefix[:, parent]
        q = lang.q[depth][context]
        q_each = [lang.q_other[depth][context] if law == INDEPENDENT and column % 2 else q
                  for column in range(len(siblings))]
        if law == COPIED:
            drawn = q.topk(len(siblings), -1).indices
        elif law == MIXED:
            drawn = torch.multinomial(q, 1, generator=g)
            if len(siblings) > 1:  # the copied one: the next token after the drawn one
                drawn = torch.cat([drawn, (drawn + 1) % VOCAB], 1)
                q_index[:, siblings[1]] = -1
            elif parent >= 0 and parent % 2 == 0:
                drawn = lang.q_other[depth][context].argmax(-1, keepdim=True)
                q_index[:, first] = -1
        elif law == WITHOUT_REPLACEMENT and len(siblings) > 1:
            u = torch.rand(SAMPLES, VOCAB, generator=g, dtype=torch.float64).clamp_min(1e-300)
            drawn = (q.log() - (-u.log()).log()).topk(len(siblings), -1).indices
        else:
            drawn = torch.stack([torch.multinomial(row, 1, generator=g)[:, 0] for row in q_each], 1)
        for column, j in enumerate(siblings):
            tokens[:, j] = drawn[:, column]
            prefix[:, j] = context * VOCAB + drawn[:, column]
            q_rows[:, j] = q_each[column]
    root = lang.p[0].expand(SAMPLES, 1, VOCAB)
    after = torch.stack([lang.p[int(DEPTH[j])][prefix[:, j]] for j in range(n_nodes)], 1)
    p = torch.cat([root, after], 1).reshape(-1, VOCAB)
    offsets = torch.arange(SAMPLES + 1) * n_nodes
    q_index = torch.where(q_index >= 0, q_index + offsets[:-1, None], -1)
    return p, tokens.flatten(), PARENTS.repeat(SAMPLES), offsets, q_rows.reshape(-1, VOCAB), q_index.flatten()


def _first_three(lang: Language, result, g: torch.Generator) -> torch.Tensor:
    """Index of the first three emitted tokens, completing short outputs by plain sampling from p."""
    emitted = torch.cat([result.accepted_tokens, torch.full((SAMPLES, 1), -1)], 1)
    emitted[torch.arange(SAMPLES), result.num_accepted] = result.bonus_token
    seq = emitted[:, :3]
    context = torch.zeros(SAMPLES, dtype=torch.long)
    for t in range(3):
        missing = seq[:, t] < 0
        draw = torch.multinomial(lang.p[t][context[missing]], 1, generator=g)[:, 0]
        seq[missing, t] = draw
        context = context * VOCAB + seq[:, t]
    return context


WIDTH = 2  # the most children a node of PARENTS has
PAIRS = [(scheme, law) for scheme in SCHEMES for law in (COPIED, IID, INDEPENDENT, WITHOUT_REPLACEMENT, MIXED)]


def _accepts(scheme: str, law: str) -> bool:
    try:
        check_drafts(scheme, DraftLaw(law, WIDTH), temperature=1.0)
    except ValueError:
        return False
    return True


def _walk(scheme: str, law: str, seed: int = 5):
    """Index of the first three output tokens of SAMPLES walks, the draws keyed per sample and
    position as the engine keys them."""
    lang = Language(seed=11)
    g = torch.Generator().manual_seed(seed)
    p, tokens, parents, offsets, q, q_index = _draft_batch(lang, law, g)
    keys = PositionKeys(np.arange(SAMPLES, dtype=np.uint64) + np.uint64(seed << 32), np.zeros(SAMPLES, dtype=np.int64))
    result = verify_tree(p, tokens, parents, offsets, None if law == COPIED else q, scheme=scheme, rng=keys,
                         q_index=q_index if law == MIXED else None)
    assert int(result.num_accepted.max()) == 3  # full paths occur, so every depth is exercised
    return lang, _first_three(lang, result, g)


@pytest.mark.parametrize("scheme,law", [pair for pair in PAIRS if _accepts(*pair)])
def test_first_three_tokens_follow_target(scheme, law):
    """Joint law of the first 3 output tokens (64 outcomes) vs the target's, chi-square at alpha = 1e-4,
    for every (scheme, law of the siblings) pairing the preconditions accept.

    100,000 walks of a depth-3 branching tree in one call; at each depth p depends on the prefix.
    Detects 0.5% of the mass moved between two sequences of probability 1/64 with power above
    0.99 (noncentrality about 320, 63 degrees of freedom). A wrong conditional at any depth, a walk
    into the wrong child, or a bonus drawn from the wrong row all shift the joint law.
    """
    lang, index = _walk(scheme, law)
    assert chi_square_pvalue(np_counts(index, VOCAB**3), lang.joint()) > ALPHA


def test_the_walk_covers_every_scheme_and_law():
    """Every scheme runs under some law, and every law of drafts has an exact scheme besides the
    draft-blind deterministic one (greedy runs only at temperature 0, tested elsewhere)."""
    accepted = [pair for pair in PAIRS if _accepts(*pair)]
    assert {scheme for scheme, _ in accepted} == set(SCHEMES) - {"greedy", "single"}
    assert {law for scheme, law in accepted if scheme != "deterministic"} == {IID, INDEPENDENT, WITHOUT_REPLACEMENT,
                                                                              MIXED}


def test_a_refused_pairing_is_biased():
    """Why the preconditions matter: recursive rejection without replacement on siblings drawn
    with replacement (what sampled consensus drafts are) changes the output law, and the same
    chi-square test that passes the accepted pairings rejects it."""
    assert not _accepts("without_replacement", IID)
    lang, index = _walk("without_replacement", IID)
    assert chi_square_pvalue(np_counts(index, VOCAB**3), lang.joint()) < ALPHA


def test_accepted_path_is_a_path():
    """Accepted nodes run root-child first, each the child of the previous, with matching tokens."""
    lang = Language(seed=3)
    g = torch.Generator().manual_seed(0)
    p, tokens, parents, offsets, q, _ = _draft_batch(lang, IID, g)
    result = verify_tree(p[: 11 * 50], tokens[:500], parents[:500], offsets[:51], q[:500], scheme="spectr", rng=g)
    for b, nodes in enumerate(result.accepted_nodes):
        expected_parent = -1
        for depth, node in enumerate(nodes):
            assert int(PARENTS[node]) == expected_parent
            assert int(result.accepted_tokens[b, depth]) == int(tokens[10 * b + node])
            expected_parent = node
        assert result.accepted_path[b, : len(nodes)].tolist() == nodes
        assert bool((result.accepted_path[b, len(nodes) :] == -1).all())
    assert result.accepted_path.shape == (50, 3)


def test_greedy_walks_the_argmax_path():
    """Greedy descends while a child holds argmax p and emits argmax p where it stops."""
    # One sample, chain 2 -> 0 -> 1 and a side child 3 under the root; V = 4.
    p = torch.tensor([
        [0.1, 0.1, 0.7, 0.1],  # root: argmax 2 -> node 0
        [0.6, 0.2, 0.1, 0.1],  # after node 0 (token 2): argmax 0 -> node 1
        [0.1, 0.1, 0.1, 0.7],  # after node 1 (token 0): argmax 3, node 2 holds 1 -> stop, bonus 3
        [0.25, 0.25, 0.25, 0.25],
        [0.25, 0.25, 0.25, 0.25],
    ])
    result = verify_tree(p, torch.tensor([2, 0, 1, 3]), torch.tensor([-1, 0, 1, -1]), torch.tensor([0, 4]), scheme="greedy")
    assert result.accepted_nodes == [[0, 1]]
    assert result.bonus_token.tolist() == [3]
    assert result.num_accepted.tolist() == [2]


def test_samples_without_drafts_sample_plainly():
    """Samples with no nodes (and an all-empty batch) just draw their bonus from the root row."""
    # Sample 0: no nodes, root row 0. Sample 1: root row 1 (certainly token 2), node 0 = token 2, row 2 after it.
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    result = verify_tree(p, torch.tensor([2]), torch.tensor([-1]), torch.tensor([0, 0, 1]), q=None, rng=torch.Generator().manual_seed(0))
    assert result.accepted_nodes == [[], [0]]
    assert result.bonus_token.tolist() == [1, 0]
    empty = verify_tree(p[:2], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.tensor([0, 0, 0]))
    assert empty.bonus_token.tolist() == [1, 2] and empty.accepted_path.shape == (2, 0)


def test_single_rejects_branching_trees():
    """Single-draft verification has no rule for several children; it must say so."""
    p = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="single"):
        verify_tree(p, torch.tensor([0, 1]), torch.tensor([-1, -1]), torch.tensor([0, 2]), torch.full((2, 4), 0.25), scheme="single")


def _emitted(result) -> torch.Tensor:
    """[B, depth_max + 1] tokens each sample emits (accepted path, then the bonus), -1 after."""
    b = result.bonus_token.shape[0]
    emitted = torch.cat([result.accepted_tokens, torch.full((b, 1), -1)], 1)
    emitted[torch.arange(b), result.num_accepted] = result.bonus_token
    return emitted


@pytest.mark.parametrize("law", [COPIED, IID])
def test_keyed_draws_make_draft_blind_schemes_repeat_plain_sampling(law):
    """With position-keyed draws the deterministic scheme emits, at every position, the token plain
    sampling draws there with the same keys, whatever the drafts were: the property that lets a
    seeded speculative run repeat the seeded plain run token for token."""
    lang = Language(seed=4)
    g = torch.Generator().manual_seed(1)
    p, tokens, parents, offsets, q, _ = _draft_batch(lang, law, g)
    n = 5000
    p, tokens, parents, offsets = p[: n * 11], tokens[: n * 10], parents[: n * 10], offsets[: n + 1]
    keys = PositionKeys(np.arange(n, dtype=np.uint64) * np.uint64(7919), np.full(n, 3, dtype=np.int64))
    emitted = _emitted(verify_tree(p, tokens, parents, offsets, scheme="deterministic", rng=keys))
    context = torch.zeros(n, dtype=torch.long)
    for depth in range(3):
        plain = sample_rows(lang.p[depth][context], keys.at(torch.arange(n), depth))
        live = emitted[:, depth] >= 0
        assert torch.equal(emitted[live, depth], plain[live])
        context = context * VOCAB + torch.where(live, emitted[:, depth], 0)
    assert bool((emitted[:, 2] >= 0).any())  # some samples accepted two drafts: three positions compared


def test_keyed_draws_do_not_depend_on_the_batch():
    """A sample's accepted path and bonus are the same whether it is verified with the whole batch,
    alone, or in another order, because its draws are keyed by its own key and position."""
    lang = Language(seed=8)
    g = torch.Generator().manual_seed(2)
    p, tokens, parents, offsets, q, _ = _draft_batch(lang, IID, g)
    n = 40
    # Trees of different sizes: sample b keeps its first b % 11 nodes (a prefix of PARENTS is a tree).
    keep = [b % 11 for b in range(n)]
    rows = torch.cat([torch.arange(11 * b, 11 * b + 1 + k) for b, k in enumerate(keep)])
    nodes = torch.cat([torch.arange(10 * b, 10 * b + k) for b, k in enumerate(keep)])
    batch = dict(p=p[rows], node_tokens=tokens[nodes], node_parents=parents[nodes],
                 node_offsets=torch.tensor([0, *np.cumsum(keep)]), q=q[nodes])
    sample_keys = np.arange(n, dtype=np.uint64) + np.uint64(12345)
    start = np.arange(n, dtype=np.int64) * 3

    def run(order: list[int], scheme: str):
        sub_rows = torch.cat([torch.arange(int(batch["node_offsets"][b]) + b, int(batch["node_offsets"][b + 1]) + b + 1)
                              for b in order])
        sub_nodes = torch.cat([torch.arange(int(batch["node_offsets"][b]), int(batch["node_offsets"][b + 1]))
                               for b in order])
        result = verify_tree(batch["p"][sub_rows], batch["node_tokens"][sub_nodes], batch["node_parents"][sub_nodes],
                             torch.tensor([0, *np.cumsum([keep[b] for b in order])]), q=batch["q"][sub_nodes],
                             scheme=scheme, rng=PositionKeys(sample_keys[order], start[order]))
        return {b: (result.accepted_nodes[i], int(result.bonus_token[i])) for i, b in enumerate(order)}

    for scheme in ("canonical_wis", "specinfer", "deterministic"):
        whole = run(list(range(n)), scheme)
        assert any(path for path, _ in whole.values())
        assert run(list(reversed(range(n))), scheme) == whole
        assert {b: run([b], scheme)[b] for b in range(0, n, 7)} == {b: whole[b] for b in range(0, n, 7)}


def test_copied_candidates_after_drawn_ones_take_the_residuals_draw():
    """Recursive rejection with copied candidates after the drawn ones draws exactly the tokens it
    draws without them (the copied ones only decide whether the residual's draw counts as an
    accepted draft), so its output law is the drawn-only rule's; a copied candidate is accepted
    exactly where every drawn one was rejected and the draw equals it."""
    from multispec.verify import recursive_rejection

    g = torch.Generator().manual_seed(3)
    rows = 20_000
    p = torch.cat([dirichlet(VOCAB, 0.7, g) for _ in range(rows)])
    q = torch.cat([dirichlet(VOCAB, 0.7, g) for _ in range(rows)])
    drawn = torch.multinomial(q, 1, generator=g)
    copies = torch.stack([(drawn[:, 0] + 1) % VOCAB, (drawn[:, 0] + 2) % VOCAB], 1)
    candidates = torch.cat([drawn, copies], 1)
    copied = torch.tensor([False, True, True]).expand(rows, 3)
    keys = PositionKeys(np.arange(rows, dtype=np.uint64), np.zeros(rows, dtype=np.int64))
    alone = recursive_rejection(p, drawn, q, keys.at(torch.arange(rows), 0), without_replacement=True)
    mixed = recursive_rejection(p, candidates, q, keys.at(torch.arange(rows), 0), without_replacement=True,
                                copied=copied.clone())
    assert torch.equal(mixed.token, alone.token)
    rejected = alone.index < 0
    matched = rejected[:, None] & (copies == alone.token[:, None])
    want = torch.where(alone.index == 0, 0, torch.where(matched.any(1), 1 + matched.float().argmax(1), -1))
    assert torch.equal(mixed.index, want)
    assert int((mixed.index > 0).sum()) > rows // 20  # the copied candidates do get accepted
    with pytest.raises(ValueError, match="copied candidates must follow"):
        recursive_rejection(p, candidates, q, keys.at(torch.arange(rows), 0), without_replacement=True,
                            copied=torch.tensor([True, False, False]).expand(rows, 3).clone())


def test_a_mixed_call_without_any_drawn_node_is_the_deterministic_walk():
    """A step in which the hybrid's head drew nothing: every node copied (q_index -1, no q), which
    recursive rejection verifies as the deterministic rule does, draw for draw."""
    from multispec.engine.step import packed_q
    from multispec.drafters import DraftTree

    lang = Language(seed=11)
    g = torch.Generator().manual_seed(2)
    p, tokens, parents, offsets, _, _ = _draft_batch(lang, COPIED, g)
    keys = PositionKeys(np.arange(SAMPLES, dtype=np.uint64), np.zeros(SAMPLES, dtype=np.int64))
    copied_trees = [DraftTree([1, 2], [-1, 0], None), DraftTree.EMPTY, DraftTree([3], [-1], None)]
    q, q_index = packed_q(copied_trees, "cpu")
    assert q is None and q_index.tolist() == [-1, -1, -1]
    q_index = torch.full_like(tokens, -1)
    mixed = verify_tree(p, tokens, parents, offsets, None, scheme="without_replacement", rng=keys, q_index=q_index)
    plain = verify_tree(p, tokens, parents, offsets, None, scheme="deterministic", rng=keys)
    assert torch.equal(mixed.bonus_token, plain.bonus_token) and torch.equal(mixed.accepted_path, plain.accepted_path)
    assert int(plain.num_accepted.sum()) > 0


def test_packed_q_takes_rows_split_from_one_tensor_without_a_copy():
    """A drafter that fills all its trees' q rows at once and splits them hands the verifier one
    view of that tensor; rows that do not lie one after another (another tensor, another order, a
    gap) are concatenated as before. Either way the packed rows are those of the trees in order."""
    from multispec.drafters import DraftTree
    from multispec.engine.step import packed_q

    g = torch.Generator().manual_seed(0)
    full = torch.rand(6, 11, generator=g)
    parts = full.split([2, 3, 1])
    trees = [DraftTree([1] * len(q), [-1] + list(range(len(q) - 1)), q) for q in parts]
    q, q_index = packed_q(trees, "cpu")
    assert q_index is None and torch.equal(q, full) and q.data_ptr() == full.data_ptr()
    arrangements = ([trees[1], trees[0], trees[2]],  # another order
                    [trees[0], trees[2]],  # a gap
                    [trees[0], DraftTree([5], [-1], torch.rand(1, 11, generator=g))])  # another tensor
    for chosen in arrangements:
        q, _ = packed_q(chosen, "cpu")
        assert torch.equal(q, torch.cat([t.q for t in chosen]))
        q.zero_()  # a copy: the trees' rows are untouched
    assert torch.equal(torch.cat(parts), full) and bool((full > 0).all())


@pytest.mark.parametrize("name", ["without_replacement", "specinfer"])
@pytest.mark.parametrize("at_once", [64, 0], ids=["every row drawn at once", "rows drawn as reached"])
def test_the_chain_walk_is_the_generic_walk(name, at_once, monkeypatch):
    """Chains of drawn nodes (the draft head's candidates one wide) are walked in Python lists
    (``_walk_chains``) when the draws are keyed, as the engine's are; on random chain forests over a
    6-token vocabulary, with q near p so that walks go deep and residuals are drawn, every field
    of its result equals the tensor walk's with recursive rejection (``_walk``) on the same keys. A
    wrong acceptance test, residual or draw fails here; ``verify_tree`` takes the list walk."""
    from multispec.verify import tree as tree_module
    from multispec.verify.tree import _walk, _walk_chains, layout_of_trees

    monkeypatch.setattr(tree_module, "ALL_ROWS_AT_ONCE", at_once)
    rng = np.random.default_rng(4)
    scheme = SCHEMES[name]
    depths, residuals = 0, 0
    for trial in range(60):
        forest = [[j - 1 for j in range(int(rng.integers(0, 6)))] for _ in range(int(rng.integers(1, 6)))]
        count = sum(len(ps) for ps in forest)
        p = torch.from_numpy(rng.dirichlet(np.ones(6), size=len(forest) + count)).float()
        q = 0.7 * p[torch.from_numpy(rng.integers(0, len(forest) + count, size=count))] + 0.3 * torch.from_numpy(
            rng.dirichlet(np.ones(6), size=count)).float()
        tokens = torch.from_numpy(np.array([rng.choice(6, p=row / row.sum()) for row in q.double().numpy()],
                                           dtype=np.int64).reshape(count))
        layout = layout_of_trees(forest)
        keys = PositionKeys(rng.integers(0, 2**63, size=len(forest), dtype=np.uint64),
                            rng.integers(0, 50, size=len(forest)))
        want = _walk(scheme, p, tokens, layout, q, keys, 1, None, None)
        got = _walk_chains(p, tokens, layout, q, keys)
        offsets = torch.tensor(np.cumsum([0] + [len(ps) for ps in forest]))
        parents = torch.tensor([x for ps in forest for x in ps], dtype=torch.long)
        public = verify_tree(p, tokens, parents, offsets, q, scheme=name, rng=keys, layout=layout)
        for result in (got, public):
            assert result.accepted_nodes == want.accepted_nodes, (trial, forest)
            for field in ("num_accepted", "bonus_token", "accepted_path", "accepted_tokens"):
                assert torch.equal(getattr(result, field), getattr(want, field)), (field, trial, forest)
        depths += int(want.num_accepted.sum())
        residuals += sum(len(nodes) < len(ps) for nodes, ps in zip(want.accepted_nodes, forest))
    assert depths > 100 and residuals > 50  # both outcomes exercised many times


def _mixed_forest(rng, samples: int, wide: bool = False):
    """A forest of the drawn hybrid's trees over a 6-token vocabulary: every node (the root
    included) has at most one drawn child (two at some nodes with ``wide``), drawn from a q near
    the target's p at that node, then up to two copied children with other tokens, likely under p.
    Returns parent lists, p [B + M, 6], tokens [M], q [R, 6] and q_index [M] (-1: copied)."""
    forest, tokens, q_rows, q_index, p_rows = [], [], [], [], []
    for _ in range(samples):
        parents: list[int] = []
        p_rows.append(rng.dirichlet(np.ones(6)))
        frontier = [(-1, len(p_rows) - 1)]
        while frontier and len(parents) < 7:
            parent, row = frontier.pop(0)
            here = p_rows[row]
            used: set[int] = set()
            drawn = int(rng.integers(0, 3 if wide else 2)) if rng.random() < 0.8 else 0
            for _ in range(drawn):
                q = 0.7 * here + 0.3 * rng.dirichlet(np.ones(6))
                for token in used:
                    q[token] = 0.0  # a second candidate: drawn without replacement
                q /= q.sum()
                token = int(rng.choice(6, p=q))
                used.add(token)
                parents.append(parent)
                tokens.append(token)
                q_index.append(len(q_rows))
                q_rows.append(q)
                p_rows.append(rng.dirichlet(np.ones(6)))
                frontier.append((len(parents) - 1, len(p_rows) - 1))
            for _ in range(int(rng.integers(0, 3))):
                left = [t for t in range(6) if t not in used]
                weights = here[left] / here[left].sum()
                token = int(rng.choice(left, p=weights))
                used.add(token)
                parents.append(parent)
                tokens.append(token)
                q_index.append(-1)
                p_rows.append(rng.dirichlet(np.ones(6)))
                frontier.append((len(parents) - 1, len(p_rows) - 1))
        forest.append(parents)
    # p rows in packed order: each sample's root row, then its nodes' rows
    order, k = [], 0
    for parents in forest:
        order += list(range(k, k + 1 + len(parents)))
        k += 1 + len(parents)
    p = torch.tensor(np.array(p_rows)[order], dtype=torch.float32)
    q = torch.tensor(np.array(q_rows), dtype=torch.float32) if q_rows else None
    return forest, p, torch.tensor(tokens, dtype=torch.long), q, torch.tensor(q_index, dtype=torch.long)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("at_once", [64, 0], ids=["every row drawn at once", "rows drawn as reached"])
def test_the_mixed_chain_walk_is_the_generic_walk(wide, at_once, monkeypatch):
    """The drawn hybrid's trees (one drawn child a node, copied sibling text after it) are walked
    in Python lists too (``_walk_chains`` with ``q_index``): on random mixed forests every field of
    its result equals the tensor walk's with recursive rejection and the copied candidates after
    the drawn ones (``_walk``) on the same keys; drawn children accepted, residual draws that land
    on a copied child and plain draws from p among copied children are all exercised. Where a node
    has two drawn children the list walk declines (None) and ``verify_tree`` takes the tensor walk."""
    from multispec.verify import tree as tree_module
    from multispec.verify.tree import _walk, _walk_chains, layout_of_trees

    monkeypatch.setattr(tree_module, "ALL_ROWS_AT_ONCE", at_once)
    rng = np.random.default_rng(7)
    scheme = SCHEMES["without_replacement"]
    seen = {"drawn": 0, "copied": 0, "declined": 0}
    for trial in range(80):
        forest, p, tokens, q, q_index = _mixed_forest(rng, int(rng.integers(1, 6)), wide)
        layout = layout_of_trees(forest)
        keys = PositionKeys(rng.integers(0, 2**63, size=len(forest), dtype=np.uint64),
                            rng.integers(0, 50, size=len(forest)))
        want = _walk(scheme, p, tokens, layout, q, keys, 1, None, q_index)
        got = _walk_chains(p, tokens, layout, q, keys, q_index)
        offsets = torch.tensor(np.cumsum([0] + [len(ps) for ps in forest]))
        parents = torch.tensor([x for ps in forest for x in ps], dtype=torch.long)
        public = verify_tree(p, tokens, parents, offsets, q, scheme="without_replacement", rng=keys, layout=layout,
                             q_index=q_index)
        if got is None:
            seen["declined"] += 1
            assert wide
        for result in (public,) if got is None else (got, public):
            assert result.accepted_nodes == want.accepted_nodes, (trial, forest)
            for field in ("num_accepted", "bonus_token", "accepted_path", "accepted_tokens"):
                assert torch.equal(getattr(result, field), getattr(want, field)), (field, trial, forest)
        first = np.cumsum([0] + [len(ps) for ps in forest])
        for b, nodes in enumerate(want.accepted_nodes):
            for node in nodes:
                seen["drawn" if int(q_index[first[b] + node]) >= 0 else "copied"] += 1
    assert seen["drawn"] > 40 and seen["copied"] > 20, seen
    assert (seen["declined"] > 5) == wide, seen


def test_layout_from_parent_lists_equals_the_tensor_layout():
    """The engine's layout built from Python lists (``layout_of_trees``) is field for field the one
    ``verify_tree`` derives from the packed tensors, on random forests with empty trees, chains,
    branching and several roots' children; a wrong row, child order or depth fails here."""
    from multispec.verify.tree import layout_of_trees, tree_layout

    rng = np.random.default_rng(0)
    for _ in range(200):
        forest = []
        for _ in range(int(rng.integers(1, 6))):
            size = int(rng.integers(0, 8))
            forest.append([int(rng.integers(-1, j)) for j in range(size)])  # parents before children
        offsets = torch.tensor(np.cumsum([0] + [len(ps) for ps in forest]), dtype=torch.long)
        parents = torch.tensor([p for ps in forest for p in ps], dtype=torch.long)
        want, got = tree_layout(parents, offsets), layout_of_trees(forest)
        for name in ("root_row", "node_row", "first_node", "children"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, forest)
        assert got.depth_max == want.depth_max, forest


@pytest.mark.parametrize("name", ["deterministic", "greedy"])
@pytest.mark.parametrize("keyed", [True, False], ids=["position keys", "generator"])
@pytest.mark.parametrize("at_once", [64, 0], ids=["every row drawn at once", "depth by depth"])
def test_the_direct_walk_is_the_generic_walk(name, keyed, at_once, monkeypatch):
    """``verify_tree`` walks greedy and deterministic trees in Python lists (``_walk_direct``); on
    random forests over a 5-token vocabulary (so that drawn tokens often match a child and walks go
    deep), with the engine's position keys or a seeded generator, every field of its result equals
    the tensor walk's (``_walk``) on the same random numbers, whether the keyed walk draws every
    row of the forest in one call first or the walking rows depth by depth. A different draw, a
    row keyed at the wrong depth or sample, child order or path bookkeeping fails here."""
    from multispec.verify import tree as tree_module
    from multispec.verify.tree import _walk, _walk_direct, layout_of_trees

    monkeypatch.setattr(tree_module, "ALL_ROWS_AT_ONCE", at_once)

    rng = np.random.default_rng(1)
    scheme = SCHEMES[name]
    for trial in range(60):
        forest = []
        for _ in range(int(rng.integers(1, 6))):
            size = int(rng.integers(0, 7))
            forest.append([int(rng.integers(-1, j)) for j in range(size)])
        count = sum(len(ps) for ps in forest)
        p = torch.from_numpy(rng.dirichlet(np.ones(5), size=len(forest) + count)).float()
        tokens = torch.from_numpy(rng.integers(0, 5, size=count)).long()
        layout = layout_of_trees(forest)
        if keyed:
            keys = PositionKeys(rng.integers(0, 2**63, size=len(forest), dtype=np.uint64),
                                rng.integers(0, 50, size=len(forest)))
            want_rng, got_rng = keys, keys
        else:
            want_rng, got_rng = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        want = _walk(scheme, p, tokens, layout, None, want_rng, 1, None, None)
        got = _walk_direct(p, tokens, layout, got_rng, greedy=name == "greedy")
        # Greedy with each row's argmax handed over (the engine's softmax gives it): the same walk.
        given = _walk_direct(p, tokens, layout, None, greedy=True, argmax=p.argmax(-1)) if name == "greedy" else got
        assert got.accepted_nodes == want.accepted_nodes == given.accepted_nodes, (trial, forest)
        for field in ("num_accepted", "bonus_token", "accepted_path", "accepted_tokens"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (field, trial, forest)
            assert torch.equal(getattr(given, field), getattr(want, field)), (field, trial, forest)
