"""Speculative decoding is lossless end to end on the default model.

Greedy: token ids identical to plain decoding for every drafter.
Sampled drafts: the law of the first three tokens under speculation equals the model's exact law.
(Copied drafts at temperature > 0: ``test_reproducible``; every configuration: ``test_configurations``.)
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2

from multispec import SamplingParams, SpecConfig
from multispec.drafters import DRAFTERS, ConsensusDrafter
from multispec.drafters.consensus import ALTERNATIVES
from multispec.drafters.suffix import MIN_ALTERNATIVE
from multispec.engine.sampler import target_probs
from multispec.reasoning import load_gsm8k
from tests.helpers import exact_cells, new_cache, prefill

# Fixed draft lengths (adaptive=False) so every step really speculates; "auto" is the default.
SPECS = {
    "consensus": SpecConfig(drafter="consensus", adaptive=False),
    "consensus-first-match": SpecConfig(drafter="consensus", aggregate=False, adaptive=False),
    "consensus-tree": SpecConfig(drafter="consensus", max_draft_tokens=4, max_draft_nodes=8, adaptive=False),
    "consensus-sampled": SpecConfig(drafter="consensus", sampled_drafts=True, adaptive=False),
    "ngram": SpecConfig(drafter="ngram", adaptive=False),
    "consensus-auto": SpecConfig(drafter="consensus"),
}


@pytest.fixture(scope="module")
def gsm8k_greedy(llm):
    conversations = [p.chat() for p in load_gsm8k(limit=2)]
    params = SamplingParams(n=3, temperature=0, max_tokens=40)
    plain = llm.chat(conversations, params, SpecConfig(drafter="none"))
    return conversations, params, plain


def assert_same_greedy_tokens(llm, prompt_ids: list[int], got: list[int], want: list[int]):
    """Identical ids, except where plain decoding itself stood on a numerical tie.

    Batches of different shapes round differently (~1e-6 in the logits), so when the top two
    logits are that close either token is the greedy choice; past such a tie the texts may part.
    A real bug moves logits by far more than the 1e-4 allowed here.
    """
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if k is None:
        assert len(got) == len(want)
        return
    with torch.inference_mode():
        ids = prompt_ids + want[:k]
        logits = prefill(llm.model, new_cache(llm.model, prompt_capacity=len(ids)), ids)[-1]
    top = logits.topk(2).values
    assert float(top[0] - top[1]) < 1e-4, f"token {k} differs ({got[k]} vs {want[k]}) without a tie"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_greedy_tokens_identical_to_plain(llm, gsm8k_greedy, name):
    conversations, params, plain = gsm8k_greedy
    outputs = llm.chat(conversations, params, SPECS[name])
    for out, ref in zip(outputs, plain):
        for got, want in zip(out.outputs, ref.outputs):
            assert_same_greedy_tokens(llm, ref.prompt_token_ids, got.token_ids, want.token_ids)
    stats = llm.last_stats
    assert stats.drafted_tokens > 0  # the adaptive budget explores too
    if not SPECS[name].adaptive:  # speculation really happened: fewer forwards than plain decoding
        longest = max(len(c.token_ids) for o in plain for c in o.outputs)
        assert stats.accepted_tokens > 0 and stats.decode_forwards < longest - 1


SAMPLED_SPEC = SpecConfig(drafter="consensus", max_draft_tokens=2, max_draft_nodes=2, sampled_drafts=True,
                          adaptive=False)


def test_sampled_drafts_first_tokens_follow_the_model(llm):
    """Chi-square of 4,000 samples of the first 3 tokens, speculating with sampled drafts (verified
    by the default multi-draft scheme), against their exact law. (Copied drafts are held to a
    stronger standard in ``test_reproducible``: token for token the seeded plain samples; every
    configuration's law is tested with 4,000 samples on the tiny model in ``test_configurations``.)

    Cells: every 3-token sequence with exact probability >= 1%, plus one cell for the rest. The
    prompt repeats a pattern so drafts (from the prompt and the siblings) are proposed and often
    accepted at tokens 2 and 3, where the model is unsure (the top sequence has p ~ 0.5). Power:
    the test asserts it would reject, at alpha = 1e-3 with probability >= 0.9, a sampler that moves
    3% of the probability mass from the most likely sequence to the second (a 3% total-variation
    bias), computed from the noncentral chi-square (0.98 here; 8,000 samples against a 2% bias
    gave 0.95 for twice the time, a minute and a half more on a 2-core CPU in float32).
    """
    prompt = "1, 2, 3, 1, 2, 3, 1, 2,"
    ids = llm.tokenizer.encode(prompt)
    temperature, length, per_call, calls = 1.0, 3, 1000, 4
    cells = exact_cells(llm, ids, temperature, length, threshold=0.01)
    keys = sorted(cells, key=cells.get, reverse=True)
    expected_p = [cells[k] for k in keys] + [1.0 - sum(cells.values())]
    total = per_call * calls

    # Power against the planted alternative, before looking at the data.
    shifted = list(expected_p)
    shifted[0] -= 0.03
    shifted[1] += 0.03
    noncentrality = total * sum((a - b) ** 2 / b for a, b in zip(shifted, expected_p))
    df = len(expected_p) - 1
    alpha = 1e-3
    assert ncx2.sf(chi2.isf(alpha, df), df, noncentrality) >= 0.9

    counts = dict.fromkeys(keys, 0)
    other = 0
    drafted = accepted = 0
    for seed in range(calls):
        out = llm.generate([ids], SamplingParams(n=per_call, temperature=temperature, max_tokens=length,
                                                 ignore_eos=True, seed=seed), SAMPLED_SPEC)[0]
        drafted += llm.last_stats.drafted_tokens
        accepted += llm.last_stats.accepted_tokens
        for completion in out.outputs:
            key = tuple(completion.token_ids)
            if key in counts:
                counts[key] += 1
            else:
                other += 1
    assert accepted > 0.2 * total, "too few accepted drafts for the test to exercise verification"
    observed = [counts[k] for k in keys] + [other]
    expected = [p * total for p in expected_p]
    assert chisquare(observed, expected).pvalue > alpha


def test_drafter_is_told_the_target_probability_of_each_appended_token(llm, monkeypatch):
    """What the engine passes to ``observe`` is p(token) under each request's own sampling law and
    the k most likely tokens of that law with their probabilities, for every token including the
    prefill's (two requests with different temperatures and top-p in one batch, so a row or
    request mix-up shows), checked against a plain forward over the finished texts. The most likely
    tokens may be left out only where the sampled token leaves less than the drafter's floor to
    all others. The recording drafter joins through the registry, as any new drafter does."""
    seen: dict[int, list[tuple[list[int], list[float] | None, list | None]]] = {}

    class Recording(ConsensusDrafter):
        def observe(self, sample_id, tokens, probs=None, alternatives=None):
            seen.setdefault(sample_id, []).append((list(tokens), probs, alternatives))
            super().observe(sample_id, tokens, probs, alternatives)

    monkeypatch.setitem(DRAFTERS, "recording", Recording)
    conversations = [p.chat() for p in load_gsm8k(limit=2)]
    params = [SamplingParams(n=3, temperature=0.7, max_tokens=24, seed=1),
              SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=24, seed=2)]
    spec = SpecConfig(drafter="recording", max_draft_tokens=3, max_draft_nodes=4, adaptive=False)
    outputs = llm.chat(conversations, params, spec)
    assert llm.last_stats.accepted_tokens > 0
    k = ALTERNATIVES
    sample_ids = sorted(seen)
    checked = given = 0
    for out, sp in zip(outputs, params):
        for completion in out.outputs:
            sample_id = sample_ids.pop(0)
            calls = seen[sample_id]
            assert [t for tokens, _, _ in calls for t in tokens] == completion.token_ids
            told = [p for _, probs, _ in calls for p in probs]
            told_top = [a for _, _, alternatives in calls for a in alternatives]
            ids = out.prompt_token_ids + completion.token_ids
            with torch.inference_mode():
                logits = prefill(llm.model, new_cache(llm.model, prompt_capacity=len(ids)), ids)
            rows = logits[len(out.prompt_token_ids) - 1:len(ids) - 1]
            m = rows.shape[0]
            law = target_probs(rows, torch.full((m,), sp.temperature), torch.zeros(m, dtype=torch.long),
                               torch.full((m,), sp.top_p))
            want = law[torch.arange(m), torch.tensor(completion.token_ids)].tolist()
            assert told == pytest.approx(want, abs=2e-3)
            assert len(told_top) == m
            for row, p, top in zip(law, want, told_top):
                if top is None:  # left out only where no other token can reach the drafter's floor
                    assert 1 - p < MIN_ALTERNATIVE + 2e-3
                    continue
                tokens, probs = top
                assert len(tokens) == k and probs == sorted(probs, reverse=True)
                assert probs == pytest.approx(row[tokens].tolist(), abs=2e-3)
                assert probs[-1] >= float(row.topk(k).values[-1]) - 2e-3  # none better left out
            checked += len(told)
            given += sum(top is not None for top in told_top)
    assert checked > 100 and given > 20
