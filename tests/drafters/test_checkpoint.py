"""Drafting with a causal LM checkpoint (``SpecConfig(drafter="model", draft_model=<checkpoint>)``):
its own KV cache, exact trees, commit along the accepted path, bad input.

The strongest check of the draft model's cache is a draft identical to the target: its q must
then equal the target's distribution at every drafted node, step after step, which holds only if
the prompt prefill, the catch-up of undrafted tokens, each depth's tree attention and the commit
of accepted nodes all put the right keys at the right places.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2

import multispec.engine.step as step_module
from multispec import LLM, SamplingParams, SpecConfig
from multispec.drafters.checkpoint import FIRST_CAPACITY, CheckpointDrafter
from multispec.engine.prefix import KeptPrompts
from multispec.verify.support import dense_rows
from tests.helpers import exact_cells, sampled_cells
from tests.tiny_models import chain, cycle_start, write_successor_model

ALPHA = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny successor model as target, and a second successor model with other logits (same
    tokenizer) whose drafts are often, not always, accepted."""
    target = tmp_path_factory.mktemp("target")
    successor = write_successor_model(target)
    other = tmp_path_factory.mktemp("other")
    write_successor_model(other, seed=0, logits=(9.0, 9.0))
    llm = LLM(str(target), device="cpu", dtype="float32")
    prompt = chain(successor, cycle_start(successor), 24)
    return llm, target, other, prompt


def spec(draft, **options) -> SpecConfig:
    return SpecConfig(drafter="model", draft_model=str(draft), adaptive=False, **options)


class _Spy:
    """Records, for every drafted node the verifier sees, how far its q is from the target's
    distribution at its parent's row."""

    def __init__(self, monkeypatch):
        self.worst, self.nodes = 0.0, 0
        verify_tree = step_module.verify_tree

        def spy(probs, tokens, parents, offsets, q=None, **options):
            bounds, row = offsets.tolist(), 0
            for b in range(len(bounds) - 1):
                count = bounds[b + 1] - bounds[b]
                for j in range(count):
                    parent = int(parents[bounds[b] + j])
                    own = probs[row + (0 if parent < 0 else 1 + parent)]
                    self.worst = max(self.worst, float((dense_rows(q, [bounds[b] + j])[0] - own).abs().max()))
                    self.nodes += 1
                row += count + 1
            return verify_tree(probs, tokens, parents, offsets, q=q, **options)

        monkeypatch.setattr(step_module, "verify_tree", spy)


@pytest.mark.parametrize("width, threshold", [(1, 0.0), (3, 0.0), (2, 0.6)])
def test_a_draft_identical_to_the_target_drafts_its_distributions(setup, monkeypatch, width, threshold):
    """The target as its own draft: every node's q equals the target's law at that node (float32
    rounding), through 190 tokens per sample (the draft's per-prompt cache outgrows its first
    capacity), samples that stop at different steps, candidates, chains cut by the confidence
    threshold, commits of accepted nodes that are not in place, and two prompts (each with its
    own cache) drafted in one forward a depth."""
    llm, target, _, prompt = setup
    spy = _Spy(monkeypatch)
    params = [SamplingParams(n=4, temperature=1.0, max_tokens=190, ignore_eos=True, seed=3),
              SamplingParams(n=3, temperature=1.0, max_tokens=40, ignore_eos=True, seed=4)]
    assert 190 > FIRST_CAPACITY
    outs = llm.generate([prompt, prompt[:10]], params,
                        spec(target, num_candidates=width, max_draft_tokens=3, decision_threshold=threshold),
                        use_tqdm=False)
    stats = llm.last_stats
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [190] * 4 + [40] * 3
    assert spy.nodes > 300 and spy.worst < 1e-5
    # q equal to p: (almost) every first candidate is accepted, so tau is near its ceiling.
    assert stats.accepted_tokens >= 0.9 * (stats.generated_tokens - stats.decode_forwards * 7)
    assert stats.draft_forwards > 0 and stats.time_draft_model > 0
    # Both prompts' samples share each forward: a catch-up and at most two depths a step.
    assert stats.draft_forwards <= 3 * stats.decode_forwards


def test_a_windowed_draft_identical_to_the_target_drafts_its_distributions(setup, tmp_path, monkeypatch):
    """The same, with a sliding window of 16 positions on every layer (the successor model as
    Mistral): past the window the draft's rows at each depth (its scratch positions) see the keys
    the target's tree rows see, or its q would part from the target's law."""
    _, target, _, prompt = setup
    windowed = tmp_path / "windowed"
    shutil.copytree(target, windowed)
    config = json.loads((windowed / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16)
    (windowed / "config.json").write_text(json.dumps(config))
    llm = LLM(str(windowed), device="cpu", dtype="float32")
    assert llm.config.layer_window(0) == 16 and len(prompt) > 16
    spy = _Spy(monkeypatch)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=60, ignore_eos=True, seed=3)
    outs = llm.generate([prompt], params, spec(windowed, num_candidates=2, max_draft_tokens=3), use_tqdm=False)
    assert [len(c.token_ids) for c in outs[0].outputs] == [60] * 4
    assert spy.nodes > 100 and spy.worst < 1e-5


def test_two_candidates_keep_the_two_token_law(setup):
    """Chi-square of 6,000 samples' first two tokens against their exact law, three candidates
    drawn without replacement from a draft model with other logits, two deep. Cells: every pair
    with probability >= 0.5%, plus the rest. Power: >= 0.9 at alpha 1e-3 against a sampler that
    moves 3% of the mass from the likeliest pair to the second."""
    llm, _, other, prompt = setup
    cells = exact_cells(llm, prompt, 1.0, 2, threshold=0.005)
    keys = sorted(cells, key=cells.get, reverse=True)
    expected = [cells[k] for k in keys] + [1.0 - sum(cells.values())]
    calls, per_call = 3, 2000
    total = calls * per_call
    moved = list(expected)
    moved[0] -= 0.03
    moved[1] += 0.03
    df = len(expected) - 1
    assert ncx2.sf(chi2.isf(ALPHA, df), df, total * sum((a - b) ** 2 / b for a, b in zip(moved, expected))) >= 0.9
    observed, accepted = sampled_cells(
        llm, prompt, keys, 2, [SamplingParams(n=per_call, temperature=1.0, max_tokens=4, ignore_eos=True, seed=seed)
                               for seed in range(calls)], spec(other, num_candidates=3, max_draft_tokens=2))
    assert accepted > 0.3 * total, "too few accepted drafts to exercise verification"
    assert chisquare(observed, [p * total for p in expected]).pvalue > ALPHA


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_greedy_with_a_checkpoint_draft_is_greedy_decoding(setup, drafter):
    llm, _, other, prompt = setup
    greedy = SamplingParams(n=3, temperature=0, max_tokens=60, ignore_eos=True)
    plain = llm.generate([prompt], greedy, SpecConfig(), use_tqdm=False)[0]
    config = SpecConfig(drafter=drafter, draft_model=str(other), num_candidates=2, max_draft_tokens=3, adaptive=False)
    out = llm.generate([prompt], greedy, config, use_tqdm=False)[0]
    assert llm.last_stats.accepted_tokens > 20
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]


def test_hybrid_with_a_checkpoint_draft_under_the_default_budget_is_greedy_decoding(setup):
    llm, _, other, prompt = setup
    greedy = SamplingParams(n=3, temperature=0, max_tokens=40, ignore_eos=True)
    plain = llm.generate([prompt], greedy, SpecConfig(), use_tqdm=False)[0]
    config = SpecConfig(drafter="hybrid", draft_model=str(other), num_candidates=2, max_draft_tokens=3)
    out = llm.generate([prompt], greedy, config, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]


def test_commit_moves_accepted_nodes_into_place(setup):
    """Drafter level: after an accepted second candidate (not in place) its keys move to the
    front of the sample's text, and only the bonus token is left to catch up."""
    llm, target, _, prompt = setup
    draft = llm.engine.draft_model(str(target))
    drafter = CheckpointDrafter(draft=draft, max_depth=2, max_nodes=4, num_candidates=2)
    drafter.add_group(0, prompt, [7])
    drafter.observe(7, [prompt[-1]])
    tree = drafter.propose([7], [4], [[0.5] * 4])[0]
    assert tree.parents[:2] == [-1, -1] and len(tree) == 4
    second, its_child = tree.tokens[1], tree.tokens[tree.parents.index(1)]
    state = drafter.samples[7]
    assert state.committed == 1 and state.paths[(second,)] == 1
    drafter.observe(7, [second, its_child, 5])
    assert state.committed == 2 and state.pending == [its_child, 5]  # the leaf was never forwarded
    assert state.group.moves == [(0, 2, 1)]
    drafter.propose([7], [4], [[0.5] * 4])
    assert state.committed == 4 and not state.group.moves
    # The cache now holds the same keys as a draft that saw the text token by token.
    fresh = CheckpointDrafter(draft=draft, max_depth=1, max_nodes=1)
    fresh.add_group(1, prompt, [8])
    fresh.observe(8, [prompt[-1], second, its_child, 5])
    fresh.propose([8], [1], [[0.5]])
    mine, theirs = state.group.cache.sample_k[:, 0, :, :4], fresh.samples[8].group.cache.sample_k[:, 0, :, :4]
    assert torch.allclose(mine, theirs, atol=1e-5)


def test_bad_draft_models_are_refused_naming_both_models(setup, tmp_path):
    llm, target, _, prompt = setup
    params = SamplingParams(n=2, max_tokens=8)
    # Same shapes, another tokenizer: two ids swapped.
    swapped = tmp_path / "swapped"
    shutil.copytree(target, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=rf"draft_model='{swapped}' does not share the tokenizer of {target}"):
        llm.generate([prompt], params, spec(swapped), use_tqdm=False)
    # A context window shorter than the request needs.
    short = tmp_path / "short"
    write_successor_model(short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="needs 124 tokens of context.*max_position_embeddings=64"):
        llm.generate([prompt], SamplingParams(n=2, max_tokens=100), spec(short), use_tqdm=False)
    llm.generate([prompt], SamplingParams(n=2, max_tokens=30), spec(short), use_tqdm=False)  # fits
    with pytest.raises(ValueError, match="draft_model='.*missing'"):
        llm.generate([prompt], params, spec(tmp_path / "missing"), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_cli_drafts_with_a_checkpoint(setup):
    from multispec.cli import main

    llm, target, other, _ = setup
    assert main(["generate", "--model", str(target), "--dtype", "float32", "--drafter", "model", "--draft-model",
                 str(other), "--num-candidates", "2", "--prompt", "hello", "--max-tokens", "6", "--n", "2"]) == 0


@pytest.mark.slow
def test_the_default_model_drafts_for_itself_by_name(llm, monkeypatch):
    """A registered name as the draft model: the default model drafting for itself in float32
    gives q equal to the target's law at every node."""
    spy = _Spy(monkeypatch)
    out = llm.generate(["Count to five:"], SamplingParams(n=2, temperature=0.8, max_tokens=12, seed=0),
                       spec("smollm2-135m-instruct", num_candidates=2, max_draft_tokens=2), use_tqdm=False)[0]
    assert all(len(c.token_ids) > 0 for c in out.outputs)
    assert spy.nodes > 0 and spy.worst < 1e-4


def test_prompts_that_begin_as_a_kept_one_copy_its_keys(setup, monkeypatch):
    """A draft model keeps its recent prompts' keys and values (``DraftLM.kept``, on with prefix
    caching): a prompt seen before is copied whole (no row computed), one that continues a kept
    prompt or shares its beginning computes only the rest, and the prompt slot then holds what a
    whole prefill computes (the copy bit for bit, the continued rows within float32 rounding)."""
    llm, target, _, prompt = setup
    draft = llm.engine.draft_model(str(target))
    assert draft.kept is not None
    draft.kept.reset()
    hits, rows = draft.kept.hits, []
    real = draft.model.hidden_states
    monkeypatch.setattr(draft.model, "hidden_states", lambda ids, *args: rows.append(len(ids)) or real(ids, *args))

    def prompt_keys(drafter, sample_id):
        group = drafter.samples[sample_id].group
        return group.cache.prompt_k[:, 0, :, :group.prompt_len], group.cache.prompt_v[:, 0, :, :group.prompt_len]

    def prefill(tokens, sample_id, kept=True):
        use = draft if kept else replace(draft, kept=None)
        drafter = CheckpointDrafter(draft=use, max_depth=1, max_nodes=1)
        drafter.add_group(0, tokens, [sample_id])
        return prompt_keys(drafter, sample_id)

    first = prefill(prompt, 1)
    again = prefill(prompt, 2)
    longer = prompt + [5, 6, 7, 8, 9, 10, 11, 12]
    continued = prefill(longer, 3)
    other = prompt[:5] + [13, 14, 15]
    shared = prefill(other, 4)
    assert rows == [len(prompt), 8, 3] and draft.kept.hits - hits == len(prompt) * 2 + 5
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    whole = prefill(longer, 5, kept=False), prefill(other, 6, kept=False)
    for got, want in zip((continued, shared), whole):
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5)
    # The longer prompt replaced the one it continues; the other is kept beside it.
    assert [len(kept.tokens) for kept in draft.kept.kept] == [len(longer), len(other)]
    llm.reset_prefix_cache()
    rows.clear()
    prefill(prompt, 7)
    assert rows == [len(prompt)]


def test_kept_prompts_stay_within_their_positions():
    """The oldest kept prompts go first once more positions than allowed are held; one that a
    later prompt begins with all of is refreshed, not copied again; a prompt longer than the
    bound is not kept."""
    kept = KeptPrompts(positions=10)
    keys = torch.zeros(1, 1, 10, 2)
    for tokens in ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10]):
        kept.keep(tokens, keys[:, :, :len(tokens)], keys[:, :, :len(tokens)])
    assert [k.tokens.tolist() for k in kept.kept] == [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10]]
    kept.keep([5, 6], keys[:, :, :2], keys[:, :, :2])  # held by [5, 6, 7]: now the most recent
    assert [k.tokens.tolist() for k in kept.kept] == [[1, 2, 3, 4], [8, 9, 10], [5, 6, 7]]
    kept.keep([11, 12], keys[:, :, :2], keys[:, :, :2])
    assert [k.tokens.tolist() for k in kept.kept] == [[8, 9, 10], [5, 6, 7], [11, 12]]
    assert kept.longest([5, 6, 9])[1] == 2 and kept.longest([0])[1] == 0
    kept.keep(list(range(11)), torch.zeros(1, 1, 11, 2), torch.zeros(1, 1, 11, 2))
    assert len(kept.kept) == 3


def test_without_prefix_caching_a_draft_model_keeps_no_prompt(setup):
    _, target, _, _ = setup
    off = LLM(str(target), device="cpu", dtype="float32", enable_prefix_caching=False)
    assert off.engine.draft_model(str(target)).kept is None
