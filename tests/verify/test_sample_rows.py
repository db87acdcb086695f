"""``sample_rows``, the one inverse-CDF draw every token goes through, against a full-row reference.

The draw searches two levels (block sums, then inside one block). With the same uniforms, a
float64 cumulative sum over the whole row must pick the same index: rows can disagree only where
the target falls within rounding of a boundary, which 2,000 rows of random weights do not reach.
So any misplaced block, off-by-one inside a block, or mishandled padding changes many of the
2,000 indices and fails; the distribution test on top checks the law itself (200,000 draws,
false-alarm rate 1e-4, zero-weight entries never drawn). On a CPU the search is one compiled call
(``multispec/kernels/sampling.cpp``); the tests below also hold it to the torch operators' path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multispec import kernels
from multispec.verify import sampling
from multispec.verify.sampling import BLOCK, TOKEN, Uniforms, derive, keyed_uniforms, sample_rows
from tests.verify.verify_stats import ALPHA, chi_square_pvalue

ROWS = 2000


def weights_with_holes(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Unnormalised positive weights with a third of the entries zero, and whole empty blocks."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(rows, vocab, generator=gen) ** 3 * 3.7
    weights[torch.rand(rows, vocab, generator=gen) < 0.33] = 0
    weights[:, BLOCK:3 * BLOCK] = 0
    return weights


def reference(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = weights.double().cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)


@pytest.mark.parametrize("vocab", [4 * BLOCK, 1000, 49152], ids=["whole-blocks", "padded", "default-vocab"])
def test_two_level_search_picks_the_full_cumulative_sums_index(vocab):
    weights = weights_with_holes(ROWS if vocab < 10_000 else 200, vocab, seed=vocab)
    keys = derive(np.arange(weights.shape[0]), 11)
    got = sample_rows(weights, Uniforms(weights.shape[0], keys=keys))
    want = reference(weights, keyed_uniforms(derive(keys, TOKEN, 0)))
    assert (got == want).all()
    assert (weights.gather(1, got[:, None]) > 0).all()


def test_one_row_shared_by_many_uniforms_equals_the_row_repeated():
    weights = weights_with_holes(1, 1000, seed=3)
    keys = derive(np.arange(500), 12)
    shared = sample_rows(weights, Uniforms(500, keys=keys))
    repeated = sample_rows(weights.expand(500, -1).contiguous(), Uniforms(500, keys=keys))
    assert torch.equal(shared, repeated)


def test_draws_follow_the_weights_and_never_a_zero():
    weights = weights_with_holes(1, 1000, seed=4)
    draws = sample_rows(weights, Uniforms(200_000, generator=torch.Generator().manual_seed(0)))
    counts = torch.bincount(draws, minlength=1000)
    assert chi_square_pvalue(counts, weights[0] / weights[0].sum()) > ALPHA


def test_a_row_without_weight_draws_from_its_fallback():
    weights = torch.zeros(3, 200)
    weights[0, 5], weights[2, 150] = 1.0, 2.0
    fallback = torch.zeros(3, 200)
    fallback[:, 77] = 1.0
    got = sample_rows(weights, Uniforms(3, generator=torch.Generator().manual_seed(1)), fallback=fallback)
    assert got.tolist() == [5, 77, 150]


needs_kernels = pytest.mark.skipif(kernels.sample_rows() is None, reason="compiled kernels unavailable here")


@needs_kernels
@pytest.mark.parametrize("vocab", [1000, 49152])
def test_compiled_and_torch_searches_pick_the_same_indices(monkeypatch, vocab):
    """On a CPU ``sample_rows`` runs one compiled call; the operator path (other devices, no
    compiler) must agree with it index for index. Their float32 block sums may round apart, which
    moves an index only for a target within rounding of a boundary: none of these rows."""
    weights = weights_with_holes(500, vocab, seed=vocab + 1)
    keys = derive(np.arange(500), 13)
    compiled = sample_rows(weights, Uniforms(500, keys=keys))
    monkeypatch.setattr(sampling, "_compiled", lambda weights: None)
    assert torch.equal(sample_rows(weights, Uniforms(500, keys=keys)), compiled)
    # Empty rows drawn from the fallback, on both paths.
    weights[::7] = 0
    fallback = weights_with_holes(500, vocab, seed=vocab + 2)
    on_torch = sample_rows(weights, Uniforms(500, keys=keys), fallback=fallback)
    monkeypatch.undo()
    assert torch.equal(sample_rows(weights, Uniforms(500, keys=keys), fallback=fallback), on_torch)
    assert (fallback[::7].gather(1, on_torch[::7, None]) > 0).all()


@needs_kernels
def test_a_target_at_the_total_never_takes_a_zero_weight():
    """u * total may round up to the total; the draw then takes the last entry of positive weight,
    even where the row's last blocks have none."""
    weights = torch.zeros(2, 5 * BLOCK)
    weights[0, 3] = weights[0, BLOCK + 9] = 1.0
    weights[1, :] = 1.0
    index, empty = torch.ops.multispec.sample_rows(weights, torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert index.tolist() == [BLOCK + 9, 5 * BLOCK - 1] and not empty.any()
    index, empty = torch.ops.multispec.sample_rows(torch.zeros(1, 100), torch.tensor([0.5], dtype=torch.float64))
    assert empty.tolist() == [True]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_softmax_and_draw_is_the_two_operators_bit_for_bit(dtype):
    """A step without drafts draws inside the compiled softmax (``softmax_draw``), where a drafted
    step takes ``softmax_rows`` then ``sample_rows``; a seeded run repeats the seeded plain run only
    if the two draw the same token from the same logits and uniform. Rows at temperatures 0 (one-
    hot), 1 and others, peaked and flat logits, uniforms across [0, 1) and at its ends; every output
    must agree exactly (a draw from probabilities rounded or summed in another order moves some of
    the 4,000 draws here)."""
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 4000, 3001
    logits = (torch.randn(rows, vocab, generator=gen) * torch.linspace(0.5, 12.0, rows)[:, None]).to(dtype)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.2]).repeat(rows // 5)
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    u[:3] = torch.tensor([0.0, 1.0 - 2.0 ** -53, 0.5], dtype=torch.float64)
    index, lse, top, prob, *_ = torch.ops.multispec.softmax_draw(logits, temperature, u)
    probs, want_lse, want_top = torch.ops.multispec.softmax_rows(logits, temperature)
    want_index, _ = torch.ops.multispec.sample_rows(probs, u)
    assert torch.equal(index, want_index) and torch.equal(lse, want_lse) and torch.equal(top, want_top)
    assert torch.equal(prob, probs[torch.arange(rows), want_index])
    greedy = temperature == 0
    assert torch.equal(index[greedy], top[greedy])
