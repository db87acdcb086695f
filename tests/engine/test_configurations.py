"""No configuration breaks the output distribution: every (drafter, sampled_drafts, scheme) either
runs exactly or is refused before any work.

Walked end to end on the tiny successor model (``tests.tiny_models``), where a call of 1,000
samples takes a fraction of a second, in three draft shapes: a chain (one child per node), a fork
(three children of the root) and a tree. Allowed configurations whose scheme ignores the drafts'
distribution must return the seeded plain samples token for token; those that use it must give
the first three tokens their exact law (chi-square, power asserted). Refused ones must raise a
ValueError before the engine runs. The draft model drafts with a copy head
(``tests.tiny_models.write_copy_head``); its fork and tree are its candidates (three at the root,
or two chains two deep), and it always samples, so only ``sampled_drafts=False`` is walked for it.
The hybrid drafter (consensus and the same head) is walked as the others are: copied, and with
``sampled_drafts=True`` the head's candidates drawn and the sibling text copied after them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2

from multispec import LLM, SamplingParams, SpecConfig, StructuredOutputsParams
from multispec.drafters import DRAFTERS
from multispec.verify.schemes import NAMES, resolve
from tests.helpers import exact_cells, last_logits, sampled_cells
from tests.tiny_models import chain, cycle_start, write_copy_head, write_successor_model

TEMPERATURE = 1.0
LENGTH = 3
MAX_TOKENS = 6  # past the tokens tested, so the end of a sample never clips the drafts
SHAPES = {"chain": (2, 2), "fork": (1, 3), "tree": (2, 4)}  # (max_draft_tokens, max_draft_nodes)
CALLS, PER_CALL = 4, 1000
ALPHA = 1e-3


@pytest.fixture(scope="module")
def successor(tmp_path_factory):
    """The model, a prompt running three times around its short cycle, and the exact law of the
    first LENGTH tokens after it (cells of probability >= 0.4%, plus the rest)."""
    directory = tmp_path_factory.mktemp("successor")
    successor = write_successor_model(directory)
    llm = LLM(str(directory), device="cpu", dtype="float32")
    head = tmp_path_factory.mktemp("head") / "head.safetensors"  # not beside the checkpoint's own files
    write_copy_head(head, llm)
    HEAD["path"] = str(head)
    prompt = chain(successor, cycle_start(successor), 24)
    cells = exact_cells(llm, prompt, TEMPERATURE, LENGTH, threshold=0.004)
    return llm, prompt, cells


HEAD = {"path": "head.safetensors"}
"""The model drafter's copy head (written by the fixture; SpecConfig alone does not read it)."""


def configure(drafter: str, sampled: bool, scheme: str, shape: str) -> SpecConfig | ValueError:
    depth, nodes = SHAPES[shape]
    model = {}
    if drafter in ("model", "hybrid"):
        model = {"draft_model": HEAD["path"], "num_candidates": nodes // depth}
    try:
        return SpecConfig(drafter=drafter, sampled_drafts=sampled, scheme=scheme, max_draft_tokens=depth,
                          max_draft_nodes=nodes, adaptive=False, **model)
    except ValueError as error:
        return error


def params(seed: int, n: int = PER_CALL, **law) -> SamplingParams:
    return SamplingParams(n=n, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed, **law)


def power(expected_p: list[float], total: int, moved: float, to: int) -> float:
    """Power of the chi-square test at ALPHA against a sampler that moves ``moved`` of the
    probability mass from the likeliest cell to cell ``to`` (from the noncentral chi-square)."""
    shifted = list(expected_p)
    shifted[0] -= moved
    shifted[to] += moved
    df = len(expected_p) - 1
    return ncx2.sf(chi2.isf(ALPHA, df), df, total * sum((a - b) ** 2 / b for a, b in zip(shifted, expected_p)))


def assert_first_tokens_follow_the_law(llm, prompt, cells, spec, **law):
    """Chi-square of CALLS x PER_CALL samples' first LENGTH tokens against the exact law (``law``:
    top-k, top-p or min-p besides the temperature). Its power at alpha = 1e-3 is asserted >= 0.9
    first against two biases: 5% of the mass moved from the likeliest sequence to the second, and
    2% moved to the rarest tested one."""
    keys = sorted(cells, key=cells.get, reverse=True)
    expected_p = [cells[k] for k in keys] + [1.0 - sum(cells.values())]
    total = CALLS * PER_CALL
    assert power(expected_p, total, 0.05, 1) >= 0.9 and power(expected_p, total, 0.02, len(keys) - 1) >= 0.9
    observed, accepted = sampled_cells(llm, prompt, keys, LENGTH, [params(seed, **law) for seed in range(CALLS)], spec)
    assert accepted > 0.2 * total, "too few accepted drafts for the test to exercise verification"
    assert chisquare(observed, [p * total for p in expected_p]).pvalue > ALPHA


COMBINATIONS = [(d, s, scheme) for d in DRAFTERS for s in (False, True) for scheme in NAMES
                if not (d == "model" and s)]


@pytest.mark.parametrize("drafter,sampled,scheme", COMBINATIONS,
                         ids=[f"{d}-{'sampled' if s else 'copied'}-{scheme}" for d, s, scheme in COMBINATIONS])
def test_every_configuration_is_exact_or_refused(successor, drafter, sampled, scheme):
    llm, prompt, cells = successor
    plain = None
    for shape in SHAPES:
        spec = configure(drafter, sampled, scheme, shape)
        if isinstance(spec, ValueError):
            assert any(name in str(spec) for name in ("scheme=", "drafter=", "sampled_drafts"))
            continue
        before = llm.last_stats
        try:
            spec.check_temperature(TEMPERATURE)
        except ValueError:
            with pytest.raises(ValueError, match="temperature"):
                llm.generate([prompt], params(0, n=4), spec, use_tqdm=False)
            assert llm.last_stats is before  # refused before the engine ran
            continue
        if spec.speculates and resolve(scheme, spec.draft_law, TEMPERATURE).needs_q:
            assert_first_tokens_follow_the_law(llm, prompt, cells, spec)
            continue
        if plain is None:
            plain = [c.token_ids for c in llm.generate([prompt], params(7, n=200), SpecConfig(), use_tqdm=False)[0].outputs]
        got = [c.token_ids for c in llm.generate([prompt], params(7, n=200), spec, use_tqdm=False)[0].outputs]
        if spec.speculates:
            assert llm.last_stats.accepted_tokens > 0
        assert got == plain


TRUNCATED_LAWS = {"min_p": {"min_p": 0.008}, "min_p+top_p": {"min_p": 0.004, "top_p": 0.97},
                  "top_k": {"top_k": 2}}
"""Laws that drop tokens: the plain law puts 13-15% of its mass on sequences of the first three
tokens that these laws drop (or leave below the cells' 0.4%), so a step that read the untruncated
law would fill the last cell, which the truncated laws leave nearly empty (at most 0.8%)."""


@pytest.mark.parametrize("law", TRUNCATED_LAWS)
@pytest.mark.parametrize("drafter,sampled", [("consensus", True), ("model", False), ("hybrid", True)])
def test_truncated_laws_hold_under_speculation(successor, drafter, sampled, law):
    """min-p, top-k and top-p under drafts verified against the truncated law (drawn or sampled
    drafts, whose q knows nothing of the truncation): the first tokens follow the exact truncated
    law."""
    llm, prompt, plain_cells = successor
    cells = exact_cells(llm, prompt, TEMPERATURE, LENGTH, threshold=0.004, **TRUNCATED_LAWS[law])
    assert 1 - sum(cells.values()) < 0.02 < 1 - sum(plain_cells[k] for k in cells if k in plain_cells) - 0.08
    spec = configure(drafter, sampled, "auto", "tree")
    assert_first_tokens_follow_the_law(llm, prompt, cells, spec, **TRUNCATED_LAWS[law])


@pytest.mark.parametrize("law", TRUNCATED_LAWS)
def test_copied_drafts_under_truncated_laws_return_the_plain_samples(successor, law):
    llm, prompt, _ = successor
    spec = configure("consensus", False, "auto", "tree")
    plain = llm.generate([prompt], params(7, n=200, **TRUNCATED_LAWS[law]), SpecConfig(), use_tqdm=False)[0]
    got = llm.generate([prompt], params(7, n=200, **TRUNCATED_LAWS[law]), spec, use_tqdm=False)[0]
    assert llm.last_stats.accepted_tokens > 0
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in plain.outputs]


PENALTY_LAWS = {"repetition": {"repetition_penalty": 1.5},
                "all three": {"repetition_penalty": 1.2, "frequency_penalty": 1.5, "presence_penalty": 1.0}}


@pytest.mark.parametrize("law", PENALTY_LAWS)
@pytest.mark.parametrize("drafter,sampled", [("consensus", True), ("model", False), ("hybrid", True)])
def test_penalties_hold_under_speculation(successor, drafter, sampled, law):
    """Penalties make each row's law depend on the text before it, a draft node's path included:
    the first three tokens follow the exact penalised law under sampled, drawn and copied-beside-
    drawn drafts. The penalised law moves more than a tenth of the plain law's mass, which a step
    that ignored the penalty would show at once."""
    llm, prompt, plain_cells = successor
    cells = exact_cells(llm, prompt, TEMPERATURE, LENGTH, threshold=0.004, **PENALTY_LAWS[law])
    moved = sum(abs(cells.get(k, 0.0) - plain_cells.get(k, 0.0)) for k in set(cells) | set(plain_cells)) / 2
    assert moved > 0.1
    spec = configure(drafter, sampled, "auto", "tree")
    assert_first_tokens_follow_the_law(llm, prompt, cells, spec, **PENALTY_LAWS[law])


@pytest.mark.parametrize("law", PENALTY_LAWS)
def test_copied_drafts_under_penalties_return_the_plain_samples(successor, law):
    """Seeded copied drafts (trees 2 deep) give the seeded plain samples token for token over 8
    tokens, so every draft row was penalised with its own path's text."""
    llm, prompt, _ = successor
    spec = configure("consensus", False, "auto", "tree")
    sampling = SamplingParams(n=200, temperature=TEMPERATURE, max_tokens=8, ignore_eos=True, seed=7,
                              **PENALTY_LAWS[law])
    plain = llm.generate([prompt], sampling, SpecConfig(), use_tqdm=False)[0]
    got = llm.generate([prompt], sampling, spec, use_tqdm=False)[0]
    assert llm.last_stats.accepted_tokens > 100
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in plain.outputs]


def token_laws(cells) -> dict[str, dict]:
    """Laws that rule tokens whatever the text, built on the plain law's cells: a logit bias
    against the likeliest second token and for the second-likeliest first token, and allowed
    tokens: those of the eight likeliest sequences but the second likeliest's last (a third of
    the mass)."""
    ranked = sorted(cells, key=cells.get, reverse=True)
    second_first = next(k[0] for k in ranked if k[0] != ranked[0][0])
    return {"logit_bias": {"logit_bias": {ranked[0][1]: -2.5, second_first: 1.0}},
            "allowed_token_ids": {"allowed_token_ids": sorted({t for k in ranked[:8] for t in k} - {ranked[1][2]})}}


@pytest.mark.parametrize("law", ["logit_bias", "allowed_token_ids"])
@pytest.mark.parametrize("drafter,sampled", [("consensus", True), ("model", False), ("hybrid", True)])
def test_token_rules_hold_under_speculation(successor, drafter, sampled, law):
    """A logit bias and allowed tokens rule every row, a draft node's too: the first three tokens
    follow the exact law, which moves more than a tenth of the plain law's mass."""
    llm, prompt, plain_cells = successor
    rule = token_laws(plain_cells)[law]
    cells = exact_cells(llm, prompt, TEMPERATURE, LENGTH, threshold=0.004, **rule)
    moved = sum(abs(cells.get(k, 0.0) - plain_cells.get(k, 0.0)) for k in set(cells) | set(plain_cells)) / 2
    assert moved > 0.1
    spec = configure(drafter, sampled, "auto", "tree")
    assert_first_tokens_follow_the_law(llm, prompt, cells, spec, **rule)


@pytest.mark.parametrize("law", ["logit_bias", "allowed_token_ids"])
def test_copied_drafts_under_token_rules_return_the_plain_samples(successor, law):
    llm, prompt, cells = successor
    sampling = SamplingParams(n=200, temperature=TEMPERATURE, max_tokens=8, ignore_eos=True, seed=7,
                              **token_laws(cells)[law])
    plain = llm.generate([prompt], sampling, SpecConfig(), use_tqdm=False)[0]
    got = llm.generate([prompt], sampling, configure("consensus", False, "auto", "tree"), use_tqdm=False)[0]
    assert llm.last_stats.accepted_tokens > 100
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in plain.outputs]


@pytest.mark.parametrize("speculate", [False, True])
def test_log_probabilities_under_rules_are_the_raw_logits(successor, speculate):
    """The tokens follow the ruled law, but the log-probabilities reported (each token's and the
    top ones) are the raw logits' log-softmax, as vLLM reports them: read at every position from a
    plain prefill, with and without drafts."""
    llm, prompt, cells = successor
    rule = {**token_laws(cells)["logit_bias"], "repetition_penalty": 1.3, "frequency_penalty": 0.5}
    spec = configure("consensus", False, "auto", "tree") if speculate else SpecConfig()
    out = llm.generate([prompt], params(3, n=40, logprobs=2, **rule), spec, use_tqdm=False)[0]
    for completion in out.outputs:
        for position, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            raw = torch.log_softmax(last_logits(llm, prompt + completion.token_ids[:position]), -1)
            assert entry[token] == pytest.approx(raw[token].item(), abs=1e-5)
            assert set(raw.topk(2).indices.tolist()) <= set(entry)
    if speculate:
        assert llm.last_stats.accepted_tokens > 0


def held_law(cells, min_tokens: int) -> dict:
    """``min_tokens`` with the likeliest third token as the stop: held back at the root row of the
    step after the prefill and at the first draft nodes' rows, where it is likeliest."""
    return {"stop_token_ids": [max(cells, key=cells.get)[2]], "min_tokens": min_tokens}


@pytest.mark.parametrize("drafter,sampled", [("consensus", True), ("model", False), ("hybrid", True)])
def test_min_tokens_holds_under_speculation(successor, drafter, sampled):
    """min_tokens takes the stops' probability from every row less deep than it, a draft node's
    row by its path: the first three tokens (none of them the stop) follow the exact law, which
    moves more than a tenth of the plain law's mass."""
    llm, prompt, plain_cells = successor
    law = held_law(plain_cells, LENGTH)
    cells = exact_cells(llm, prompt, TEMPERATURE, LENGTH, threshold=0.004, **law)
    moved = sum(abs(cells.get(k, 0.0) - plain_cells.get(k, 0.0)) for k in set(cells) | set(plain_cells)) / 2
    assert moved > 0.1
    spec = configure(drafter, sampled, "auto", "tree")
    assert_first_tokens_follow_the_law(llm, prompt, cells, spec, **law)


def test_copied_drafts_under_min_tokens_return_the_plain_samples(successor):
    """Seeded copied drafts give the seeded plain samples token for token, with no stop among the
    first ``min_tokens`` tokens and samples ending at a stop after them."""
    llm, prompt, cells = successor
    law = held_law(cells, 4)
    sampling = SamplingParams(n=200, temperature=TEMPERATURE, max_tokens=10, ignore_eos=True, seed=7, **law)
    plain = llm.generate([prompt], sampling, SpecConfig(), use_tqdm=False)[0]
    got = llm.generate([prompt], sampling, configure("consensus", False, "auto", "tree"), use_tqdm=False)[0]
    assert llm.last_stats.accepted_tokens > 100
    assert {c.finish_reason for c in plain.outputs} == {"stop", "length"}
    assert not any(set(c.token_ids[:4]) & set(law["stop_token_ids"]) for c in plain.outputs)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in plain.outputs]


def grammar_law(llm, cells) -> tuple[dict, object]:
    """``structured_outputs`` with a Lark grammar whose text starts with one of the eight likeliest
    sequences of three tokens but the second likeliest, then goes on freely (written with
    llguidance's token terminals ``<[id]>``: the tiny tokenizer's tokens are fragments of UTF-8);
    and the tokens it allows after a prefix, read from llguidance's own mask (each bit a token,
    unpacked apart from the engine's code). What it allows at a row depends on the tokens before
    the row, so a draft node's row needs its own path's mask; after an end of sequence nothing is
    masked (``ignore_eos``), as in the engine."""
    ranked = sorted(cells, key=cells.get, reverse=True)[:8]
    vocab = llm.engine.vocab_size
    heads = " | ".join(" ".join(f"<[{t}]>" for t in k) for i, k in enumerate(ranked) if i != 1)
    lark = f"start: head rest\nhead: {heads}\nrest: <[0-{vocab - 1}]>*\n"
    template = llm.engine.grammars.matcher(StructuredOutputsParams(grammar=lark))
    eos = set(llm.tokenizer.eos_token_ids)

    def allows(prefix) -> torch.Tensor:
        if eos & set(prefix):
            return torch.ones(vocab, dtype=torch.bool)
        matcher = template.deep_copy()
        assert matcher.consume_tokens(list(prefix))
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[:vocab].astype(bool))

    return {"structured_outputs": {"grammar": lark}}, allows


@pytest.mark.parametrize("drafter,sampled", [("consensus", True), ("model", False), ("hybrid", True)])
def test_structured_outputs_hold_under_speculation(successor, drafter, sampled):
    """A grammar masks every row by the text before it, a draft node's by its path: the first three
    tokens follow the exact constrained law, which moves more than a tenth of the plain law's
    mass."""
    llm, prompt, plain_cells = successor
    law, allows = grammar_law(llm, plain_cells)
    cells = exact_cells(llm, prompt, TEMPERATURE, LENGTH, threshold=0.004, allows=allows)
    moved = sum(abs(cells.get(k, 0.0) - plain_cells.get(k, 0.0)) for k in set(cells) | set(plain_cells)) / 2
    assert moved > 0.1
    spec = configure(drafter, sampled, "auto", "tree")
    assert_first_tokens_follow_the_law(llm, prompt, cells, spec, **law)


def test_copied_drafts_under_structured_outputs_return_the_plain_samples(successor):
    """Seeded copied drafts give the seeded plain samples token for token under a grammar, and
    every sample's tokens are ones the grammar allows."""
    llm, prompt, cells = successor
    law, allows = grammar_law(llm, cells)
    sampling = SamplingParams(n=200, temperature=TEMPERATURE, max_tokens=8, ignore_eos=True, seed=7, **law)
    plain = llm.generate([prompt], sampling, SpecConfig(), use_tqdm=False)[0]
    got = llm.generate([prompt], sampling, configure("consensus", False, "auto", "tree"), use_tqdm=False)[0]
    assert llm.last_stats.accepted_tokens > 100
    for completion in plain.outputs:
        ids = completion.token_ids
        assert all(allows(ids[:i])[ids[i]] for i in range(len(ids)))
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in plain.outputs]


def test_the_walk_refuses_exactly_the_inexact_pairings():
    """What the walk above must see refused, written out from the schemes' assumptions: a rule that
    reads q cannot verify copied drafts; without replacement and single-draft rules do not fit
    consensus's i.i.d. forks; of the rules that read q only recursive rejection without
    replacement verifies the hybrid's drawn candidates with copied text beside them; greedy
    acceptance is for temperature 0; prompt lookup has nothing to sample from. Everything else
    runs."""
    refused = set()
    for drafter, sampled, scheme in COMBINATIONS:
        for shape in SHAPES:
            spec = configure(drafter, sampled, scheme, shape)
            if isinstance(spec, SpecConfig):
                try:
                    spec.check_temperature(TEMPERATURE)
                    continue
                except ValueError:
                    pass
            refused.add((drafter, sampled, scheme, shape))
    q_rules = {"single", "specinfer", "without_replacement", "spectr", "canonical_lp", "canonical_wis"}
    want = set()
    for drafter, sampled, scheme in COMBINATIONS:
        for shape in SHAPES:
            copied = drafter in ("consensus", "ngram", "hybrid") and not sampled
            wide = SHAPES[shape][1] // SHAPES[shape][0] > 1
            mixed = drafter == "hybrid" and sampled  # drawn head nodes beside copied sibling text
            if (scheme == "greedy" or (drafter == "ngram" and sampled) or (copied and scheme in q_rules)
                    or (mixed and scheme in q_rules - {"without_replacement"})
                    or (drafter == "consensus" and sampled and wide and scheme in ("single", "without_replacement"))
                    or (drafter == "model" and wide and scheme == "single")):
                want.add((drafter, sampled, scheme, shape))
    assert refused == want


@pytest.mark.parametrize("sampled", [False, True])
def test_greedy_scheme_at_temperature_zero_is_greedy_decoding(successor, sampled):
    llm, prompt, _ = successor
    greedy = SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    # The prompt, its greedy continuation and the prompt again: the continuation is there to draft.
    prompt = prompt + llm.generate([prompt], greedy, SpecConfig(), use_tqdm=False)[0].outputs[0].token_ids + prompt
    plain = llm.generate([prompt], greedy, SpecConfig(), use_tqdm=False)[0]
    spec = SpecConfig(drafter="consensus", sampled_drafts=sampled, scheme="greedy", max_draft_tokens=3,
                      max_draft_nodes=3, adaptive=False)
    out = llm.generate([prompt], greedy, spec, use_tqdm=False)[0]
    assert llm.last_stats.accepted_tokens > 0
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]
