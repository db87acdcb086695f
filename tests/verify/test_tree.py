"""Tree verification: the walk over a packed batch of draft trees is lossless and well formed."""

import pytest
import torch

from multispec.verify import verify_tree
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

    def joint(self) -> torch.Tensor:
        """Target probability of every 3-token sequence, indexed x1 * V^2 + x2 * V + x3."""
        p1 = self.p[0][0]
        p2 = self.p[1]
        p3 = self.p[2]
        return (p1[:, None, None] * p2[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)).flatten()


def _draft_batch(lang: Language, without_replacement: bool, g: torch.Generator):
    """Packed inputs for SAMPLES copies of the tree, each drafted independently from q."""
    n_nodes = len(PARENTS)
    tokens = torch.zeros(SAMPLES, n_nodes, dtype=torch.long)
    prefix = torch.zeros(SAMPLES, n_nodes, dtype=torch.long)  # index of the prefix ending at the node
    q_rows = torch.zeros(SAMPLES, n_nodes, VOCAB, dtype=torch.float64)
    for first in range(0, n_nodes):
        parent = int(PARENTS[first])
        if first > 0 and parent == int(PARENTS[first - 1]):
            continue  # drawn with its elder sibling
        siblings = [j for j in range(n_nodes) if int(PARENTS[j]) == parent]
        depth = int(DEPTH[first]) - 1
        context = torch.zeros(SAMPLES, dtype=torch.long) if parent < 0 else prefix[:, parent]
        q = lang.q[depth][context]
        if without_replacement and len(siblings) > 1:
            u = torch.rand(SAMPLES, VOCAB, generator=g, dtype=torch.float64).clamp_min(1e-300)
            drawn = (q.log() - (-u.log()).log()).topk(len(siblings), -1).indices
        else:
            drawn = torch.multinomial(q, len(siblings), replacement=True, generator=g)
        for column, j in enumerate(siblings):
            tokens[:, j] = drawn[:, column]
            prefix[:, j] = context * VOCAB + drawn[:, column]
            q_rows[:, j] = q
    root = lang.p[0].expand(SAMPLES, 1, VOCAB)
    after = torch.stack([lang.p[int(DEPTH[j])][prefix[:, j]] for j in range(n_nodes)], 1)
    p = torch.cat([root, after], 1).reshape(-1, VOCAB)
    offsets = torch.arange(SAMPLES + 1) * n_nodes
    return p, tokens.flatten(), PARENTS.repeat(SAMPLES), offsets, q_rows.reshape(-1, VOCAB)


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


@pytest.mark.parametrize("scheme", ["deterministic", "specinfer", "without_replacement", "spectr", "canonical_lp", "canonical_wis"])
def test_first_three_tokens_follow_target(scheme):
    """Joint law of the first 3 output tokens (64 outcomes) vs the target's, chi-square at alpha = 1e-4.

    100,000 walks of a depth-3 branching tree in one call; at each depth p depends on the prefix.
    Detects 0.5% of the mass moved between two sequences of probability 1/64 with power above
    0.99 (noncentrality about 320, 63 degrees of freedom). A wrong conditional at any depth, a walk
    into the wrong child, or a bonus drawn from the wrong row all shift the joint law.
    """
    lang = Language(seed=11)
    g = torch.Generator().manual_seed(5)
    p, tokens, parents, offsets, q = _draft_batch(lang, scheme == "without_replacement", g)
    result = verify_tree(p, tokens, parents, offsets, None if scheme == "deterministic" else q, scheme=scheme, generator=g)
    assert int(result.num_accepted.max()) == 3  # full paths occur, so every depth is exercised
    index = _first_three(lang, result, g)
    assert chi_square_pvalue(np_counts(index, VOCAB**3), lang.joint()) > ALPHA


def test_accepted_path_is_a_path():
    """Accepted nodes run root-child first, each the child of the previous, with matching tokens."""
    lang = Language(seed=3)
    g = torch.Generator().manual_seed(0)
    p, tokens, parents, offsets, q = _draft_batch(lang, False, g)
    result = verify_tree(p[: 11 * 50], tokens[:500], parents[:500], offsets[:51], q[:500], scheme="spectr", generator=g)
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
    result = verify_tree(p, torch.tensor([2]), torch.tensor([-1]), torch.tensor([0, 0, 1]), q=None, generator=torch.Generator().manual_seed(0))
    assert result.accepted_nodes == [[], [0]]
    assert result.bonus_token.tolist() == [1, 0]
    empty = verify_tree(p[:2], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.tensor([0, 0, 0]))
    assert empty.bonus_token.tolist() == [1, 2] and empty.accepted_path.shape == (2, 0)


def test_single_rejects_branching_trees():
    """Single-draft verification has no rule for several children; it must say so."""
    p = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="single"):
        verify_tree(p, torch.tensor([0, 1]), torch.tensor([-1, -1]), torch.tensor([0, 2]), torch.full((2, 4), 0.25), scheme="single")
