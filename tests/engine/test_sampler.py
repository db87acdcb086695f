import pytest
import torch

from multispec import SamplingParams, kernels
from multispec.engine.sampler import target_probs, target_probs_and_lse


def rows(n, value, dtype=torch.float32):
    return torch.full((n,), value, dtype=dtype)


def test_temperature_scales_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = target_probs(logits, rows(3, 0.5), rows(3, 0, torch.long), rows(3, 1.0))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1), atol=1e-6)


def test_greedy_rows_are_one_hot_and_others_untouched():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    p = target_probs(logits, torch.tensor([0.0, 1.0]), rows(2, 0, torch.long), rows(2, 1.0))
    assert p[0, logits[0].argmax()] == 1 and p[0].sum() == 1
    assert torch.allclose(p[1], torch.softmax(logits[1], -1), atol=1e-6)


def test_top_k_keeps_k_largest_renormalised():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    p = target_probs(logits, rows(2, 1.0), torch.tensor([5, 0]), rows(2, 1.0))
    top = logits[0].topk(5).indices
    assert set(p[0].nonzero().squeeze(1).tolist()) == set(top.tolist())
    assert torch.allclose(p[0, top], torch.softmax(logits[0, top], -1), atol=1e-6)
    assert (p[1] > 0).all()


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, rows(1, 1.0), rows(1, 0, torch.long), rows(1, 0.7))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    p = target_probs(logits, rows(1, 1.0), rows(1, 0, torch.long), rows(1, 0.81))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95, atol=1e-6)


def test_min_p_drops_tokens_below_its_share_of_the_likeliest_then_top_p_reads_the_rest():
    """min_p keeps p_i >= min_p * p_max after the temperature, renormalised; top-p then reads the
    renormalised law (vLLM's order), so the two do not commute."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, rows(2, 1.0), rows(2, 0, torch.long), rows(2, 1.0), torch.tensor([0.2, 0.0]))
    assert torch.allclose(p[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=1e-6)
    assert torch.allclose(p[1], torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6)
    # At temperature 2 the ratios are square roots: 0.05 / 0.5 -> 0.316 >= 0.3 stays.
    p = target_probs(logits[:1], rows(1, 2.0), rows(1, 0, torch.long), rows(1, 1.0), rows(1, 0.3))
    assert (p > 0).all()
    # top-p 0.81 alone keeps three of the four tokens (the test above); after min-p 0.2 the
    # renormalised law [0.526, 0.316, 0.158] passes 0.81 with two.
    p = target_probs(logits[:1], rows(1, 1.0), rows(1, 0, torch.long), rows(1, 0.81), rows(1, 0.2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    p = target_probs(logits[:1], rows(1, 1.0), rows(1, 0, torch.long), rows(1, 1.0), rows(1, 1.0))
    assert torch.equal(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


COMPILED_SOFTMAX = kernels.softmax_rows() is not None


@pytest.mark.skipif(not COMPILED_SOFTMAX, reason="the compiled kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_softmax_matches_torch_with_the_raw_logsumexp(dtype):
    """The decode step's compiled softmax against torch: p = softmax(logits / T) over a 49k
    vocabulary at temperatures below, at and above 1, greedy rows one-hot, a -inf logit at
    probability 0, and the logsumexp of the raw logits (what log-probabilities are read from).
    The bounds are float32 rounding (an exponent error of 2e-7 relative, times logits / T up to 100)."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 49152, generator=gen) * 4).to(dtype)
    logits[1, 7] = float("-inf")
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.2, 1.0])
    probs, lse, top = target_probs_and_lse(logits, temperature, rows(6, 0, torch.long), rows(6, 1.0))
    assert lse is not None
    want = target_probs(logits, temperature, rows(6, 0, torch.long), rows(6, 1.0))
    assert torch.allclose(probs, want, rtol=5e-5, atol=1e-9)
    assert probs[1, 7] == 0 and probs[2].max() == 1 and probs[2].sum() == 1
    assert torch.allclose(lse, torch.logsumexp(logits.float(), -1), atol=1e-5)


@pytest.mark.skipif(not COMPILED_SOFTMAX, reason="the compiled kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_greedy_rows_are_one_hot_at_the_first_maximum(dtype):
    """Greedy rows of the compiled softmax: one-hot where torch's argmax points, the first of tied
    maxima included (bf16 logits tie often), the last token included, beside sampled rows."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 49152, generator=gen).to(dtype)
    logits[0, [9000, 200, 31000]] = 12.0  # a three-way tie: the first index wins
    logits[2, -1] = 30.0
    logits[3, 0] = 30.0
    temperature = torch.tensor([0.0, 0.8, 0.0, 0.0, 0.0])
    probs, lse, top = target_probs_and_lse(logits, temperature, rows(5, 0, torch.long), rows(5, 1.0))
    want = target_probs(logits, temperature, rows(5, 0, torch.long), rows(5, 1.0))
    assert torch.equal(probs[[0, 2, 3, 4]], want[[0, 2, 3, 4]])
    assert probs[0, 200] == 1 and probs[2, -1] == 1 and probs[3, 0] == 1
    assert torch.equal(probs.argmax(-1)[[0, 2, 3, 4]], logits.argmax(-1)[[0, 2, 3, 4]])
    assert top.tolist() == [200, -1, 49151, 0, int(logits[4].argmax())]  # greedy rows' tokens, -1 elsewhere
    assert torch.allclose(lse, torch.logsumexp(logits.float(), -1), atol=1e-5)




def test_tokens_tied_at_a_truncation_boundary_are_kept_together():
    """top-k keeps every token tied with the k-th largest logit; top-p keeps a token when the tokens
    strictly more likely than it hold less than top_p, so a tie at the boundary is kept whole."""
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0]]).clamp_min(1e-9))
    p = target_probs(logits, rows(1, 1.0), torch.tensor([2]), rows(1, 1.0))
    assert (p[0, :4] > 0).all() and p[0, 4] == 0
    p = target_probs(logits, rows(1, 1.0), rows(1, 0, torch.long), rows(1, 0.5))
    assert torch.allclose(p[0], torch.tensor([0.4, 0.2, 0.2, 0.2, 0.0]), atol=1e-6)
    p = target_probs(logits, rows(1, 1.0), rows(1, 0, torch.long), rows(1, 0.4))
    assert torch.allclose(p[0], torch.tensor([1.0, 0, 0, 0, 0]), atol=1e-6)


TRUNCATIONS = {"top_p": (0, 0.9, 0.0), "top_p_wide": (0, 0.99, 0.0), "min_p": (0, 1.0, 0.05),
               "top_k": (40, 1.0, 0.0), "top_k_many": (1000, 1.0, 0.0), "all": (50, 0.95, 0.02)}


@pytest.mark.skipif(not COMPILED_SOFTMAX, reason="the compiled kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("law", TRUNCATIONS)
def test_compiled_truncation_keeps_the_reference_tokens(dtype, law):
    """The compiled softmax with top-k, top-p and min-p (``softmax_truncated``) against
    ``target_probs`` on a 49k vocabulary: peaked and flat rows (a flat row's top-p takes the
    histogram path), temperatures below and above 1, a greedy row and a row without truncation
    beside them. Every row keeps the same tokens (bf16 logits tie often, so the tie rule is
    exercised), with float32 rounding in the probabilities; the rows without truncation are
    softmax_rows' to the bit."""
    k, top_p, min_p = TRUNCATIONS[law]
    gen = torch.Generator().manual_seed(21)
    scale = torch.tensor([4.0, 4.0, 1.5, 0.8, 4.0, 3.0, 6.0, 4.0])[:, None]
    logits = (torch.randn(8, 49152, generator=gen) * scale).to(dtype)
    temperature = torch.tensor([0.7, 1.0, 1.0, 1.3, 0.0, 0.6, 1.0, 0.9])
    top_k = torch.full((8,), k)
    top_p = torch.full((8,), top_p)
    min_p = torch.full((8,), min_p)
    top_k[7], top_p[7], min_p[7] = 0, 1.0, 0.0  # no truncation on the last row
    probs, lse, top = target_probs_and_lse(logits, temperature, top_k, top_p, min_p)
    assert lse is not None
    want = target_probs(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(probs > 0, want > 0)
    assert torch.allclose(probs, want, rtol=5e-5, atol=1e-8)
    assert probs[4].max() == 1 and top[4] == int(logits[4].float().argmax())
    plain, plain_lse, _ = target_probs_and_lse(logits[7:], temperature[7:], top_k[7:] * 0, top_p[7:] * 0 + 1)
    assert torch.equal(probs[7:], plain) and torch.equal(lse[7:], plain_lse)
    assert torch.allclose(lse, torch.logsumexp(logits.float(), -1), atol=1e-5)


@pytest.mark.skipif(not COMPILED_SOFTMAX, reason="the compiled kernels are not built here")
def test_plain_steps_draw_in_the_softmax_pass_with_the_same_tokens(llm, monkeypatch):
    """Steps without drafts, whose probabilities nobody else reads, draw each token inside the
    compiled softmax (``softmax_draw``) instead of writing the probabilities for ``sample_rows``;
    the same seeded requests through both paths must give the same tokens, log-probabilities
    included, and the fused path must be the one plain decoding takes."""
    prompt = llm.tokenizer.encode("Natalia sold clips to 48 of her friends in April, and then")
    params = [SamplingParams(n=3, temperature=t, max_tokens=24, seed=11, logprobs=1) for t in (0.7, 1.0, 0.0)]
    fused = kernels.softmax_draw()
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return fused(*args)

    monkeypatch.setattr(kernels, "softmax_draw", lambda: counted)
    got = llm.generate([prompt] * 3, params)
    assert calls
    monkeypatch.setattr(kernels, "softmax_draw", lambda: None)
    llm.reset_prefix_cache()  # the prompt computed as the first time, in the same shapes
    want = llm.generate([prompt] * 3, params)
    for a, b in zip(got, want):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.logprobs for o in a.outputs] == [o.logprobs for o in b.outputs]


@pytest.mark.skipif(not COMPILED_SOFTMAX, reason="the compiled kernels are not built here")
def test_compiled_top_rows_ranks_like_torch_with_ties_to_the_lower_index():
    """The drafter's alternatives (the k likeliest tokens of the rows a step appended at): the
    compiled ranking against torch's top-k on distinct values (the same tokens and values, in
    order), rows taken in any order and more than once, the best entry in the first k or the last
    block, and exact ties (bf16 logits make them common): equal values in ascending index order."""
    op = kernels.top_rows()
    gen = torch.Generator().manual_seed(11)
    probs = torch.softmax(torch.randn(5, 49152, generator=gen, dtype=torch.float64) * 3, -1).float()
    probs[3, 1] = 0.9  # inside the first k entries
    probs[4, 49151] = 0.9  # in the last, partial block
    chosen = torch.tensor([4, 0, 3, 0, 2], dtype=torch.long)
    for k in (1, 4, 70):
        values, tokens = op(probs, chosen, k)
        want_values, want_tokens = probs[chosen].topk(k, dim=-1)
        assert torch.equal(tokens, want_tokens) and torch.equal(values, want_values)
    tied = torch.zeros(1, 300)
    tied[0, [250, 5, 130, 64]] = 0.25  # four equal maxima, three of them past the first block
    tied[0, 7] = 0.125
    values, tokens = op(tied, torch.tensor([0]), 5)
    assert tokens.tolist() == [[5, 64, 130, 250, 7]] and values.tolist() == [[0.25] * 4 + [0.125]]
    with pytest.raises(RuntimeError, match="outside"):
        op(tied, torch.tensor([1]), 2)
    with pytest.raises(RuntimeError, match="k must be"):
        op(tied, torch.tensor([0]), 301)


@pytest.mark.skipif(not COMPILED_SOFTMAX, reason="the compiled kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_prompt_logprobs_match_torchs_log_softmax(dtype):
    """The prompt's log-probabilities from one pass a row: each following token's log-probability
    (as torch's log-softmax of the raw logits, to float rounding), its rank (1 + the strictly
    likelier tokens, exact; ties share the better rank, which bf16 logits make common) and the k
    likeliest with theirs (torch's top-k on rows without ties at the k-th)."""
    op = kernels.token_logprobs()
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 49152, generator=gen) * 4).to(dtype)
    following = torch.tensor([0, 49151, 17, 17, 300, 9])
    logits[2, 17] = logits[2].max() + 1  # the likeliest token (rank 1)
    logits[3, 17] = logits[3, 18]  # tied with another token
    reference = torch.log_softmax(logits.float(), -1)
    want = reference.gather(1, following[:, None])[:, 0]
    want_rank = (reference > want[:, None]).sum(-1) + 1
    for k in (0, 1, 5):
        chosen, rank, values, tokens = op(logits.contiguous(), following, k)
        assert torch.allclose(chosen, want, atol=1e-5, rtol=0) and torch.equal(rank, want_rank)
        assert rank[2] == 1 and values.shape == tokens.shape == (6, k)
        if k:
            top_values, top_tokens = reference.topk(k, -1)
            assert torch.equal(tokens, top_tokens) and torch.allclose(values, top_values, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        op(logits.contiguous(), torch.tensor([0, 1, 2, 3, 4, 49152]), 1)


def test_grammar_bitmasks_clear_exactly_their_tokens_on_either_path(monkeypatch):
    """A grammar's bitmask on some rows of the logits: token w * 32 + b at bit b of word w, a
    clear bit -inf, the other rows untouched. The compiled ``mask_rows`` (where it runs) and
    torch's operators against the bits read one by one, on a vocabulary that ends inside a word,
    with all-ones words (skipped whole by the kernel), all-zero ones and rows taken in any order."""
    from multispec.engine.grammar import apply_masks

    vocab = 1000  # 31 full words and 8 tokens of a 32nd
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=gen)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 32), dtype=torch.int32, generator=gen)
    bits[0, :10] = -1
    bits[1, 20:] = 0
    rows_ = [4, 0, 2]
    want = logits.clone()
    for i, row in enumerate(rows_):
        for token in range(vocab):
            if not (int(bits[i, token // 32]) >> (token % 32)) & 1:
                want[row, token] = float("-inf")
    compiled = kernels.mask_rows
    paths = [("compiled", compiled)] if COMPILED_SOFTMAX else []
    for name, op in paths + [("torch", lambda: None)]:
        monkeypatch.setattr(kernels, "mask_rows", op)
        got = logits.clone()
        apply_masks(got, rows_, bits)
        assert torch.equal(got, want), name
    assert torch.isinf(want[2]).sum() > vocab // 2 and not torch.isinf(want[[1, 3, 5]]).any()


def test_most_likely_gives_each_row_its_alternatives_on_either_path(monkeypatch):
    """``most_likely`` (what a drafter reads at each appended token) on the compiled ranking and on
    torch's: the same tokens and values; a row whose sampled token leaves less than the floor to
    the rest gets None, and rows that repeat share one ranking."""
    from multispec.engine import step

    gen = torch.Generator().manual_seed(12)
    probs = torch.softmax(torch.randn(4, 49152, generator=gen) * 3, -1)
    probs[2] = 0.0
    probs[2, 9] = 1.0
    rows_ = [0, 2, 3, 3, 1]
    token_probs = [0.5, 1.0, 0.2, 0.2, 0.3]
    compiled = step.most_likely(probs, rows_, token_probs, 4, 0.05)
    monkeypatch.setattr(step, "_top_rows", lambda probs: None)
    reference = step.most_likely(probs, rows_, token_probs, 4, 0.05)
    assert compiled == reference and compiled[1] is None and compiled[2] == compiled[3]
    values, tokens = probs[3].topk(4)
    assert reference[2] == (tokens.tolist(), values.tolist())


@pytest.mark.skipif(not COMPILED_SOFTMAX, reason="the compiled kernels are not built here")
def test_copied_drafts_are_verified_in_the_softmax_pass_with_the_same_tokens(llm, monkeypatch):
    """Steps whose samples all verify copied drafts (consensus, the deterministic scheme) draw
    every row inside the compiled softmax and walk the drawn tokens (``_draw_copied``) instead of
    writing the probabilities for the walk's draws. On every such step of seeded requests the
    general path must give the same result, field for field: accepted nodes, bonus token, each
    appended token's probability and the alternatives the drafter reads (tokens and values), and
    the same log-normalisers; the fused path must be the one drafted steps take."""
    from multispec import SpecConfig
    from multispec.engine import step

    prompt = llm.tokenizer.encode("Natalia sold clips to 48 of her friends in April, and then")
    params = [SamplingParams(n=4, temperature=t, max_tokens=40, seed=5, logprobs=1) for t in (0.7, 1.0)]
    spec = SpecConfig(drafter="consensus", max_draft_tokens=3, adaptive=False)
    fused = step._draw_copied
    checked = {"nodes": 0, "accepted": 0, "alternatives": 0}

    def compared(step_, logits, requests, counts, alternatives):
        got = fused(step_, logits, requests, counts, alternatives)
        lse = step_.logsumexp
        monkeypatch.setattr(step, "_draw_copied", lambda *args: None)
        try:
            want = step.verify(step_, logits, alternatives)
        finally:
            monkeypatch.setattr(step, "_draw_copied", compared)
        assert got == want and torch.equal(lse, step_.logsumexp)
        checked["nodes"] += sum(len(tree.tokens) for tree in step_.trees)
        checked["accepted"] += sum(len(v.path) for v in got)
        checked["alternatives"] += sum(a is not None for v in got for a in v.alternatives or [])
        return got

    monkeypatch.setattr(step, "_draw_copied", compared)
    llm.generate([prompt] * 2, params, spec)
    assert checked["nodes"] > 20 and checked["accepted"] > 5 and checked["alternatives"] > 20, checked
