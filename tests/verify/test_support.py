"""Draft distributions kept over a drafter's own vocabulary (``SupportQ``) read exactly as the dense
rows they stand for, and verification gives the same result, field for field, with either form."""

import numpy as np
import pytest
import torch

from multispec.drafters import DraftTree
from multispec.engine.step import packed_q
from multispec.verify import PositionKeys, verify_tree
from multispec.verify.support import SupportQ, concat_rows, dense_rows, entries, select_rows
from multispec.verify.tree import layout_of_trees

VOCAB = 10
SUPPORT = torch.tensor([7, 2, 9, 0, 4, 5, 1])  # not sorted: columns follow the drafter's order


def _dense(values: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(values.shape[0], VOCAB, dtype=values.dtype)
    out[:, SUPPORT] = values
    return out


def test_support_rows_read_as_their_dense_rows():
    g = torch.Generator().manual_seed(0)
    values = torch.rand(5, SUPPORT.numel(), generator=g)
    q = SupportQ(values, SUPPORT, VOCAB)
    full = _dense(values)
    assert tuple(q.shape) == (5, VOCAB) and len(q) == 5
    assert torch.equal(q.dense(), full) and torch.equal(dense_rows(q), full)
    index = torch.tensor([3, 0, 3])
    assert torch.equal(dense_rows(q, index), full[index])
    grid = torch.tensor([[1, 4], [2, 2]])
    assert torch.equal(q.dense(grid), full[grid])  # [2, 2, V]: a row per entry of the index
    rows = torch.tensor([0, 1, 2, 3, 4, 4])
    tokens = torch.tensor([7, 3, 1, 8, 0, 6])  # 3, 8 and 6 are off the support: probability 0
    assert torch.equal(entries(q, rows, tokens), full[rows, tokens])
    assert entries(q, rows, tokens)[[1, 3, 5]].eq(0).all()
    part = select_rows(q, [4, 1])
    assert isinstance(part, SupportQ) and torch.equal(part.dense(), full[[4, 1]])
    with pytest.raises(ValueError, match="K = 7 support tokens"):
        SupportQ(torch.rand(2, 6), SUPPORT, VOCAB)


def test_rows_split_from_one_tensor_are_joined_without_a_copy():
    """A drafter that fills all its trees' rows at once and splits them hands the verifier one view;
    other arrangements are concatenated, and rows over different supports come out dense."""
    values = torch.rand(6, SUPPORT.numel())
    parts = [SupportQ(v, SUPPORT, VOCAB) for v in values.split([2, 3, 1])]
    joined = concat_rows(parts)
    assert isinstance(joined, SupportQ) and joined.values.data_ptr() == values.data_ptr()
    assert torch.equal(joined.dense(), _dense(values))
    swapped = concat_rows([parts[1], parts[0]])
    assert isinstance(swapped, SupportQ) and torch.equal(swapped.values, torch.cat([values[2:5], values[:2]]))
    other = SupportQ(torch.rand(1, 3), torch.tensor([0, 1, 2]), VOCAB)
    mixed = concat_rows([parts[0], other, _dense(values[:1])])
    assert isinstance(mixed, torch.Tensor)
    assert torch.equal(mixed, torch.cat([_dense(values[:2]), other.dense(), _dense(values[:1])]))
    trees = [DraftTree([7] * len(q), [-1] + list(range(len(q) - 1)), q) for q in parts]
    q, q_index = packed_q(trees, "cpu")
    assert q_index is None and isinstance(q, SupportQ) and q.values.data_ptr() == values.data_ptr()


def _forest(rng, samples: int, wide: bool, mixed: bool):
    """Draft trees over VOCAB tokens whose drawn nodes come from q rows that are zero off SUPPORT
    (near the target's p there, so walks go deep and residuals are drawn): chains, or up to two
    drawn siblings without replacement (``wide``, sharing their parent's row), and with ``mixed``
    up to two copied children after the drawn ones. Returns the trees' parent lists, p, tokens,
    the q values over the support, and each node's q row (-1: copied)."""
    forest, tokens, values, q_index, p_rows = [], [], [], [], []
    for _ in range(samples):
        parents: list[int] = []
        p_rows.append(rng.dirichlet(np.ones(VOCAB)))
        frontier = [(-1, len(p_rows) - 1)]
        while frontier and len(parents) < 7:
            parent, row = frontier.pop(0)
            here = p_rows[row][SUPPORT.numpy()]
            q = 0.7 * here / here.sum() + 0.3 * rng.dirichlet(np.ones(SUPPORT.numel()))
            drawn = int(rng.integers(1, 3 if wide else 2)) if rng.random() < 0.85 else 0
            remaining = q.copy()
            used = set()
            for _ in range(drawn):
                column = int(rng.choice(SUPPORT.numel(), p=remaining / remaining.sum()))
                remaining[column] = 0.0
                used.add(int(SUPPORT[column]))
                parents.append(parent)
                tokens.append(int(SUPPORT[column]))
                q_index.append(len(values))
                values.append(q)
                p_rows.append(rng.dirichlet(np.ones(VOCAB)))
                frontier.append((len(parents) - 1, len(p_rows) - 1))
            for _ in range(int(rng.integers(0, 3)) if mixed else 0):
                left = [t for t in range(VOCAB) if t not in used]
                token = int(rng.choice(left))
                used.add(token)
                parents.append(parent)
                tokens.append(token)
                q_index.append(-1)
                p_rows.append(rng.dirichlet(np.ones(VOCAB)))
                frontier.append((len(parents) - 1, len(p_rows) - 1))
        forest.append(parents)
    # p's rows were made in the packed order: each sample's root row, then one row per node (the
    # distribution at the node's own position), as the engine packs them.
    p = torch.tensor(np.array(p_rows), dtype=torch.float32)
    return (forest, p, torch.tensor(tokens, dtype=torch.long),
            torch.tensor(np.array(values), dtype=torch.float32).reshape(-1, SUPPORT.numel()),
            torch.tensor(q_index, dtype=torch.long))


@pytest.mark.parametrize("shape", ["chains", "wide", "mixed chains", "mixed wide"])
def test_verification_is_the_same_with_support_rows(shape):
    """On random forests, every field of ``verify_tree``'s result is the same whether q comes dense
    or as a ``SupportQ`` (the chain walk, the tensor walk and the hybrid's mixed walk all run)."""
    rng = np.random.default_rng(7)
    wide, mixed = "wide" in shape, "mixed" in shape
    accepted = rejected = 0
    for trial in range(40):
        forest, p, tokens, values, q_index = _forest(rng, int(rng.integers(1, 6)), wide, mixed)
        if not tokens.numel() or not values.numel():
            continue
        offsets = torch.tensor(np.cumsum([0] + [len(ps) for ps in forest]))
        parents = torch.tensor([x for ps in forest for x in ps], dtype=torch.long)
        keys = PositionKeys(rng.integers(0, 2**63, size=len(forest), dtype=np.uint64),
                            rng.integers(0, 50, size=len(forest)))
        support = SupportQ(values, SUPPORT, VOCAB)
        index = q_index if mixed else None
        if not mixed:
            assert bool((q_index >= 0).all())
        results = [verify_tree(p, tokens, parents, offsets, q, scheme="without_replacement", rng=keys,
                               q_index=index, layout=layout_of_trees(forest))
                   for q in (_dense(values), support)]
        want, got = results
        assert got.accepted_nodes == want.accepted_nodes, (trial, forest)
        for field in ("num_accepted", "bonus_token", "accepted_path", "accepted_tokens"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (field, trial)
        accepted += int(want.num_accepted.sum())
        rejected += sum(len(nodes) < len(ps) for nodes, ps in zip(want.accepted_nodes, forest))
    assert accepted > 40 and rejected > 20  # acceptances and residual draws both exercised


def test_a_support_outside_the_vocabulary_is_refused():
    p = torch.full((3, VOCAB), 1.0 / VOCAB)
    tokens, parents, offsets = torch.tensor([7, 2]), torch.tensor([-1, 0]), torch.tensor([0, 2])
    values = torch.full((2, SUPPORT.numel()), 1.0 / SUPPORT.numel())
    good = verify_tree(p, tokens, parents, offsets, SupportQ(values, SUPPORT, VOCAB), scheme="without_replacement")
    assert good.num_accepted.shape == (1,)
    bad = SUPPORT.clone()
    bad[0] = VOCAB
    with pytest.raises(ValueError, match="q.support"):
        verify_tree(p, tokens, parents, offsets, SupportQ(values, bad, VOCAB), scheme="without_replacement")
    with pytest.raises(ValueError, match="distinct"):
        verify_tree(p, tokens, parents, offsets, SupportQ(values, torch.tensor([7, 2, 9, 0, 4, 5, 7]), VOCAB),
                    scheme="without_replacement")
