"""Draft-model drafting (``drafter="model"``): exact multi-candidate trees, the decision model,
the features the engine hands the head, training, bad input.

Every verification scheme with these drafts is also walked in ``tests/engine/test_configurations.py``.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2

from multispec import LLM, SamplingParams, SpecConfig
from multispec.drafters import DRAFTERS, ModelDrafter
from multispec.models.draft_head import DraftHead, HeadConfig
from multispec.verify.support import dense_rows
from multispec.training import (Answer, Sequences, TrainConfig, _answers, agreement, file_agreement, joined, observed,
                               pick_threshold, teacher_forced, train_head, unroll_inputs, windows)
from tests.helpers import exact_cells, sampled_cells
from tests.tiny_models import chain, cycle_start, write_copy_head, write_successor_model

ALPHA = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny successor model, a copy head for it, and a prompt around its short cycle."""
    directory = tmp_path_factory.mktemp("successor-head")
    successor = write_successor_model(directory)
    llm = LLM(str(directory), device="cpu", dtype="float32")
    head = tmp_path_factory.mktemp("head") / "head.safetensors"  # not beside the checkpoint's own files
    write_copy_head(head, llm)
    prompt = chain(successor, cycle_start(successor), 24)
    return llm, head, prompt, successor


def spec(head, **options) -> SpecConfig:
    return SpecConfig(drafter="model", draft_model=str(head), adaptive=False, **options)


def _power(expected_p: list[float], total: int, moved: float) -> float:
    shifted = list(expected_p)
    shifted[0] -= moved
    shifted[1] += moved
    df = len(expected_p) - 1
    return ncx2.sf(chi2.isf(ALPHA, df), df, total * sum((a - b) ** 2 / b for a, b in zip(shifted, expected_p)))


def test_three_candidates_keep_the_two_token_law(setup):
    """Chi-square of 6,000 samples' first two tokens against their exact law, drafting three
    candidates without replacement, two deep, with the decision model cutting some chains. Cells:
    every pair with probability >= 0.5%, plus the rest. Power: >= 0.9 at alpha 1e-3 against a
    sampler that moves 3% of the mass from the likeliest pair to the second."""
    llm, head, prompt, _ = setup
    cells = exact_cells(llm, prompt, 1.0, 2, threshold=0.005)
    keys = sorted(cells, key=cells.get, reverse=True)
    expected_p = [cells[k] for k in keys] + [1.0 - sum(cells.values())]
    calls, per_call = 3, 2000
    total = calls * per_call
    assert _power(expected_p, total, 0.03) >= 0.9
    config = spec(head, num_candidates=3, max_draft_tokens=2, decision_threshold=0.5)
    observed, accepted = sampled_cells(
        llm, prompt, keys, 2, [SamplingParams(n=per_call, temperature=1.0, max_tokens=4, ignore_eos=True, seed=seed)
                               for seed in range(calls)], config)
    assert accepted > 0.3 * total, "too few accepted drafts to exercise verification"
    assert chisquare(observed, [p * total for p in expected_p]).pvalue > ALPHA


def _longest_continuation(p1: torch.Tensor, p2: torch.Tensor, q2: torch.Tensor, width: int, runs: int,
                          generator: torch.Generator) -> torch.Tensor:
    """The first two tokens as the public code of the dynamic-depth paper picks them: ``width``
    first tokens sampled from the target, each given a drafted second token (from q2), each draft
    checked by speculative sampling, and the candidate whose draft was accepted kept (the first one
    when none or several were); its second token is the accepted draft or a draw from the
    residual."""
    firsts = torch.multinomial(p1.expand(runs, -1), width, replacement=True, generator=generator)  # [R, W]
    drafts = torch.multinomial(q2[firsts.flatten()], 1, generator=generator).view(runs, width)
    p, q = p2[firsts, drafts], q2[firsts, drafts]
    accepted = torch.rand(runs, width, generator=generator) < (p / q).clamp(max=1)
    chosen = torch.where(accepted.any(1), accepted.float().argmax(1), torch.zeros(runs, dtype=torch.long))
    first = firsts.gather(1, chosen[:, None])[:, 0]
    residual = (p2[first] - q2[first]).clamp(min=0)
    residual = residual / residual.sum(1, keepdim=True)
    resampled = torch.multinomial(residual, 1, generator=generator)[:, 0]
    second = torch.where(accepted.gather(1, chosen[:, None])[:, 0], drafts.gather(1, chosen[:, None])[:, 0], resampled)
    return first * p2.shape[1] + second


def test_longest_continuation_choice_breaks_the_law():
    """The documented ablation: choosing among several target-sampled first tokens by whose
    continuation is accepted favours first tokens with easy continuations. A first token whose
    continuation the draft predicts well (token 0) wins the choice more often than its
    probability, so the joint law of the first two tokens moves; the same chi-square that
    speculation passes rejects it (20,000 runs, four first tokens, four second tokens)."""
    generator = torch.Generator().manual_seed(0)
    p1 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    p2 = torch.tensor([[0.9, 0.05, 0.03, 0.02], [0.3, 0.3, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]])
    q2 = torch.tensor([[0.85, 0.08, 0.05, 0.02], [0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4]])
    runs = 20000
    pairs = _longest_continuation(p1, p2, q2, width=3, runs=runs, generator=generator)
    observed = torch.bincount(pairs, minlength=16).double()
    expected = (p1[:, None] * p2).flatten().double() * runs
    assert chisquare(observed.tolist(), expected.tolist()).pvalue < 1e-12
    # The exact rule on the same distributions passes: one target sample as root, as multispec does.
    first = torch.multinomial(p1.expand(runs, -1), 1, generator=generator)[:, 0]
    draft = torch.multinomial(q2[first], 1, generator=generator)[:, 0]
    keep = torch.rand(runs, generator=generator) < (p2[first, draft] / q2[first, draft]).clamp(max=1)
    residual = (p2[first] - q2[first]).clamp(min=0)
    second = torch.where(keep, draft, torch.multinomial(residual / residual.sum(1, keepdim=True), 1,
                                                        generator=generator)[:, 0])
    exact = torch.bincount(first * 4 + second, minlength=16).double()
    assert chisquare(exact.tolist(), expected.tolist()).pvalue > ALPHA


def test_greedy_drafts_give_greedy_decoding(setup):
    llm, head, prompt, _ = setup
    greedy = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    plain = llm.generate([prompt], greedy, SpecConfig(), use_tqdm=False)[0]
    out = llm.generate([prompt], greedy, spec(head, num_candidates=2, max_draft_tokens=3), use_tqdm=False)[0]
    assert llm.last_stats.accepted_tokens > 0
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]


def test_trees_are_rooted_wide_then_chains_and_carry_their_q(setup, check_tree):
    """W candidates at depth 1 drawn without replacement (distinct tokens) from one q row, then
    one child a node; every node's q gives its token positive mass; the stats count the head's
    forwards and time."""
    llm, head, prompt, _ = setup
    trees = []
    llm.engine.step_observers.append(lambda report: trees.extend(report.trees))
    try:
        llm.generate([prompt], SamplingParams(n=8, temperature=1.0, max_tokens=12, ignore_eos=True, seed=3),
                     spec(head, num_candidates=3, max_draft_tokens=3), use_tqdm=False)
    finally:
        llm.engine.step_observers.clear()
    stats = llm.last_stats
    assert stats.draft_forwards > 0 and 0 < stats.time_draft_model <= stats.time_draft
    full = [t for t in trees if len(t.tokens) == 9]
    assert full, "no full-size tree was drafted"
    for tree in trees:
        if tree.tokens:
            check_tree(tree, 9, 3, llm.config.vocab_size)
    for tree in full:
        roots = [i for i, parent in enumerate(tree.parents) if parent < 0]
        assert len(roots) == 3 and len({tree.tokens[i] for i in roots}) == 3
        q = dense_rows(tree.q)
        assert all(torch.equal(q[roots[0]], q[i]) for i in roots)
        children = [tree.parents.count(i) for i in range(len(tree.tokens))]
        assert max(children) == 1


def test_decision_threshold_shortens_chains(setup):
    """Threshold 1 stops every chain after its first node; 0 drafts the full depth; a head's own
    threshold (from its file) is the default."""
    llm, head, prompt, _ = setup
    params = SamplingParams(n=8, temperature=1.0, max_tokens=16, ignore_eos=True, seed=1)
    drafted = {}
    for threshold in (0.0, 1.0):
        llm.generate([prompt], params, spec(head, num_candidates=2, max_draft_tokens=4, decision_threshold=threshold),
                     use_tqdm=False)
        drafted[threshold] = llm.last_stats.drafted_tokens / llm.last_stats.sample_steps
    assert drafted[1.0] <= 2.0 < drafted[0.0]
    assert ModelDrafter.create(head=DraftHead.load(head), max_depth=4, max_nodes=8).threshold == 0.0


def test_engine_hands_the_head_the_target_features_of_every_new_position(setup, monkeypatch):
    """After every step, the features a sample's drafter is handed are the target's final hidden
    states at the positions its new tokens were drawn from (the root's and every accepted node's),
    i.e. the rows of a plain forward over the prompt and all but the newest token."""
    llm, head, prompt, _ = setup
    seen = []

    class Recording(ModelDrafter):
        def observe(self, sample_id, new_tokens, token_probs=None, alternatives=None):
            super().observe(sample_id, new_tokens, token_probs, alternatives)
            self.__dict__.setdefault("written", {}).setdefault(sample_id, []).extend(new_tokens)

        def observe_features(self, sample_ids, features):
            super().observe_features(sample_ids, features)
            for sample_id, rows in zip(sample_ids, features):
                seen.append((list(self.written[sample_id]), torch.stack(list(rows))))  # [k, H] rows, whatever the container

    monkeypatch.setitem(DRAFTERS, "model", Recording)
    llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True, seed=5),
                 spec(head, num_candidates=2, max_draft_tokens=3), use_tqdm=False)
    assert llm.last_stats.accepted_tokens > 0 and len(seen) > 6
    assert any(rows.shape[0] > 1 for _, rows in seen)  # steps that accepted drafts hand several rows
    for written, rows in seen:
        states = llm.engine.sequence_states(prompt + written[:-1])
        first = len(prompt) - 1 + len(written) - rows.shape[0]  # the row the oldest new token was drawn from
        torch.testing.assert_close(rows, states[first:first + rows.shape[0]], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("drafting,temperature", [(False, 0.7), (True, 1.0), (True, 0.7)])
def test_position_observers_get_the_features_of_every_kept_token(setup, drafting, temperature):
    """``position_observers`` hear, for every token a sample keeps (the prompt's first, plain
    steps, accepted draft paths cut short by max_tokens), the target's final hidden state and raw
    log-normaliser at the position it was drawn from: what a teacher-forced forward over the
    finished text gives at positions prompt_len - 1 .. len - 2 (the log-normaliser of the raw
    logits whatever the temperature)."""
    llm, head, prompt, _ = setup
    heard: dict[tuple[str, int], list] = {}

    def keep(samples, features, lse):
        assert len(samples) == len(features) == len(lse)
        for sample, f, l in zip(samples, features, lse):
            assert f.shape[0] == l.shape[0] >= 1
            heard.setdefault((sample.request.request_id, sample.index), []).append((f.clone(), l.clone()))

    llm.engine.position_observers.append(keep)
    try:
        outputs = llm.generate([prompt, prompt[3:]], SamplingParams(n=3, temperature=temperature, max_tokens=11,
                                                                    ignore_eos=True, seed=2),
                               spec(head, num_candidates=2, max_draft_tokens=4) if drafting else None, use_tqdm=False)
    finally:
        llm.engine.position_observers.remove(keep)
    if drafting:
        assert llm.last_stats.accepted_tokens > 0
    assert len(heard) == 6
    for out in outputs:
        for completion in out.outputs:
            rows = heard[(out.request_id, completion.index)]
            features, lse = torch.cat([f for f, _ in rows]), torch.cat([l for _, l in rows])
            ids = list(out.prompt_token_ids) + completion.token_ids
            assert len(completion.token_ids) == 11 == features.shape[0]
            states = llm.engine.sequence_states(ids)[len(out.prompt_token_ids) - 1:-1]
            torch.testing.assert_close(features, states, atol=1e-4, rtol=1e-4)
            with torch.inference_mode():
                want = torch.logsumexp(llm.model.logits(states), -1)
            torch.testing.assert_close(lse, want, atol=1e-4, rtol=1e-4)


def test_sampled_answers_keep_the_teacher_forced_data(setup):
    """``train-draft``'s sampled answers carry the features the engine computed as it sampled
    them: the same data as a teacher-forced pass over them, but for the position after each
    answer's last token; joined with teacher-forced answers, every answer stays apart."""
    llm, _, prompt, successor = setup

    class Problem:
        def __init__(self, k):
            self.k = k

        def chat(self):
            return [{"role": "user", "content": f"question {self.k}"}]

    answers = _answers(llm, [Problem(k) for k in range(3)], TrainConfig(samples=2, max_tokens=9), log=lambda _: None)
    assert len(answers) == 6 and {a.problem for a in answers} == {0, 1, 2}
    assert all(a.features is not None for a in answers)
    kept = observed(answers)
    forced = teacher_forced(llm, [(a.ids, a.prompt_len) for a in answers])
    last = torch.tensor([i + 1 == len(forced.sequence) or forced.sequence[i + 1] != forced.sequence[i]
                         for i in range(len(forced.sequence))])
    assert kept.tokens.tolist() == forced.tokens[~last].tolist()
    assert kept.sequence.tolist() == forced.sequence[~last].tolist()
    torch.testing.assert_close(kept.features.float(), forced.features[~last].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kept.lse, forced.lse[~last], atol=1e-4, rtol=1e-4)
    both = joined(kept, None, forced)
    assert both.tokens.numel() == kept.tokens.numel() + forced.tokens.numel()
    assert both.sequence.unique().numel() == 12
    assert Answer(*[answers[0].ids, answers[0].prompt_len, answers[0].problem]).features is None


def test_a_windowed_head_drafts_from_the_windows_it_is_trained_on(setup, tmp_path, monkeypatch):
    """A head that reads four pairs before its root: the first draft distribution it gives each
    sample at every step (windows shorter than four in the first steps, longer later, rows handed
    after multi-token acceptances) equals what training computes for the same text from a plain
    forward's features, so the head drafts from exactly the inputs it learnt from."""
    llm, _, prompt, _ = setup
    torch.manual_seed(3)
    head = DraftHead(HeadConfig.for_target(llm.config, llm.config.vocab_size, intermediate_size=64, context=4))
    head.vocab_ids.copy_(torch.arange(llm.config.vocab_size))
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(8.0)  # a random head far from uniform, so a misaligned window changes q visibly
    path = tmp_path / "windowed.safetensors"
    head.save(path)
    seen = []

    class Recording(ModelDrafter):
        def observe(self, sample_id, new_tokens, token_probs=None, alternatives=None):
            super().observe(sample_id, new_tokens, token_probs, alternatives)
            self.__dict__.setdefault("written", {}).setdefault(sample_id, []).extend(new_tokens)

        def _root_probs(self, sample_ids):
            probs = super()._root_probs(sample_ids)
            seen.extend((list(self.written[s]), row.clone()) for s, row in zip(sample_ids, probs))
            return probs

    monkeypatch.setitem(DRAFTERS, "model", Recording)
    llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=14, ignore_eos=True, seed=7),
                 spec(path, num_candidates=2, max_draft_tokens=3, decision_threshold=0.0), use_tqdm=False)
    assert llm.last_stats.accepted_tokens > 0 and len(seen) > 6
    assert {min(len(w), 4) for w, _ in seen} >= {1, 4}
    trained = DraftHead.load(path).attach(llm.model)
    for written, q in seen:
        ids = prompt + written
        states = llm.engine.sequence_states(ids)[len(prompt) - 1:]
        # Two answers in one batch, as training lays them out: the window must not reach into the first.
        data = Sequences(torch.cat([states, states]), torch.tensor(ids[len(prompt) - 1:] * 2),
                         torch.zeros(2 * states.shape[0]), torch.tensor([0, 1]).repeat_interleave(states.shape[0]))
        start = torch.tensor([2 * states.shape[0] - 2])  # the root is the newest token of the second answer
        with torch.no_grad():
            features = trained.unrolled(*unroll_inputs(data, start, 4, 1))[:, 0]
            want = torch.softmax(trained.logits(features), -1)[0]
        torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-4)


def test_windows_stay_inside_their_answer():
    data = Sequences(torch.zeros(7, 2), torch.arange(7), torch.zeros(7), torch.tensor([0, 0, 0, 1, 1, 1, 1]))
    index, inside = windows(data, torch.tensor([1, 4, 6]), 3)
    assert index.tolist() == [[0, 0, 1], [2, 3, 4], [4, 5, 6]]
    assert inside.tolist() == [[False, True, True], [False, True, True], [True, True, True]]


def test_training_teaches_the_head_the_target(setup, tmp_path):
    """A head trained from scratch on the tiny model's own samples agrees with the target's top
    token on held-out samples far more often than before training (the target's top token is the
    successor of the last one for most positions; an untrained head picks it about 1 in 400).
    Saved and read back as the engine reads it (bf16 weights), it keeps that agreement, which is
    how ``train-draft`` compares a new head with the shipped one."""
    llm, _, prompt, successor = setup
    torch.manual_seed(0)
    answers = []
    for seed, start in enumerate(range(0, 400, 25)):
        ids = chain(successor, start, 6)
        out = llm.generate([ids], SamplingParams(n=8, temperature=1.0, max_tokens=40, ignore_eos=True, seed=seed),
                           use_tqdm=False)[0]
        answers += [(ids + c.token_ids, len(ids)) for c in out.outputs]
    train, held = teacher_forced(llm, answers[:112]), teacher_forced(llm, answers[112:])
    config = TrainConfig(epochs=6, batch=128, unroll=2, lr=3e-3)
    model = DraftHead(HeadConfig.for_target(llm.config, llm.config.vocab_size, intermediate_size=64))
    model.vocab_ids.copy_(torch.arange(llm.config.vocab_size))
    model.attach(llm.model)
    before = agreement(model, held, 2)
    train_head(model, train, config, log=lambda line: None)
    after = agreement(model, held, 2)
    assert before[0]["agree"] < 0.1
    assert after[0]["agree"] > 0.5 and after[1]["agree"] > 0.3
    assert after[0]["accept"] > before[0]["accept"] + 0.3
    model.save(tmp_path / "trained.safetensors")
    saved = file_agreement(llm, tmp_path / "trained.safetensors", held, 2)
    for depth in range(2):
        assert abs(saved[depth]["agree"] - after[depth]["agree"]) < 0.05


def test_threshold_keeps_the_accepted_children():
    scores = torch.tensor([0.9, 0.8, 0.7, 0.2, 0.1, 0.05])
    labels = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert pick_threshold(scores, labels) == 0.7
    assert pick_threshold(scores, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0])) == 0.05


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("options,field", [
    ({"num_candidates": 0}, "num_candidates"),
    ({"max_draft_tokens": 0}, "max_draft_tokens"),
    ({"decision_threshold": 1.5}, "decision_threshold"),
    ({"decision_threshold": -0.1}, "decision_threshold"),
    ({"max_draft_nodes": 0}, "max_draft_nodes"),
])
def test_bad_settings_name_their_field(options, field):
    with pytest.raises(ValueError, match=field):
        SpecConfig(drafter="model", **options)


def test_draft_model_needs_the_model_drafter():
    with pytest.raises(ValueError, match="draft_model"):
        SpecConfig(drafter="consensus", draft_model="head.safetensors")


def test_default_max_draft_nodes_is_depth_times_width():
    assert SpecConfig(drafter="model", num_candidates=3, max_draft_tokens=4).max_draft_nodes == 12
    assert SpecConfig(drafter="consensus").max_draft_nodes == 6


def test_heads_that_cannot_serve_the_target_are_refused(setup, tmp_path):
    llm, head, prompt, _ = setup
    params = SamplingParams(n=2, max_tokens=4)
    with pytest.raises(ValueError, match="no draft head is paired"):
        llm.generate([prompt], params, SpecConfig(drafter="model"), use_tqdm=False)
    with pytest.raises(ValueError, match="not found"):
        llm.generate([prompt], params, spec(tmp_path / "missing.safetensors"), use_tqdm=False)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        llm.generate([prompt], params, spec(junk), use_tqdm=False)
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match="not a multispec draft head"):
        llm.generate([prompt], params, spec(other), use_tqdm=False)
    wide = tmp_path / "wide.safetensors"
    config = HeadConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                        num_tokens=10, target_vocab_size=llm.config.vocab_size)
    DraftHead(config).save(wide)
    with pytest.raises(ValueError, match="hidden size 128 does not match the target's 64"):
        llm.generate([prompt], params, spec(wide), use_tqdm=False)
    vocab = tmp_path / "vocab.safetensors"
    DraftHead(HeadConfig.for_target(llm.config, 10)).save(vocab)  # fine
    other_vocab = HeadConfig(**{**HeadConfig.for_target(llm.config, 10).__dict__, "target_vocab_size": 500})
    DraftHead(other_vocab).save(vocab)
    with pytest.raises(ValueError, match="vocabulary of 500"):
        llm.generate([prompt], params, spec(vocab), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---------------------------------------------------------------------- command line, shipped head
def test_cli_generates_with_a_draft_head_and_refuses_bad_training_options(setup, capsys):
    from multispec.cli import main

    llm, head, _, _ = setup
    directory = str(llm.model_name)
    assert main(["generate", "--model", directory, "--dtype", "float32", "--drafter", "model", "--draft-model",
                 str(head), "--num-candidates", "2", "--prompt", "hello", "--max-tokens", "6", "--n", "2"]) == 0
    assert main(["generate", "--model", directory, "--drafter", "model", "--num-candidates", "0", "--prompt",
                 "hello"]) == 2
    assert "num_candidates" in capsys.readouterr().err
    assert main(["train-draft", "--model", directory, "--questions", "0"]) == 2
    assert "--questions" in capsys.readouterr().err
    assert main(["train-draft", "--model", directory, "--context", "0"]) == 2
    assert "--context" in capsys.readouterr().err


@pytest.mark.slow
def test_shipped_head_drafts_for_the_default_model(llm):
    """The registry pairs the default model with its trained head: drafter="model" needs no file,
    and on a GSM8K question the head's drafts are accepted often (tau well above 1; the benchmark
    has the figures)."""
    from multispec.models import DEFAULT_MODEL, paired_draft_head
    from multispec.reasoning import load_gsm8k

    assert paired_draft_head(DEFAULT_MODEL) is not None
    conversation = load_gsm8k(limit=1)[0].chat()
    llm.chat([conversation], SamplingParams(n=4, temperature=0.7, max_tokens=64, seed=0),
             SpecConfig(drafter="model", num_candidates=2, max_draft_tokens=4, adaptive=False), use_tqdm=False)
    stats = llm.last_stats
    assert stats.draft_forwards > 0
    assert stats.tau > 1.8, stats.summary()


def test_batched_teacher_forcing_equals_one_sequence_at_a_time(setup):
    llm, _, prompt, successor = setup
    sequences = [prompt, chain(successor, 3, 9), prompt[:5]]
    together = llm.engine.batch_states(sequences)
    for ids, got in zip(sequences, together):
        torch.testing.assert_close(got, llm.engine.sequence_states(ids), atol=1e-5, rtol=1e-5)
    data = teacher_forced(llm, [(ids, 2) for ids in sequences], per_forward=20)
    assert data.tokens.tolist() == [t for ids in sequences for t in ids[1:]]
    assert data.sequence.tolist() == [k for k, ids in enumerate(sequences) for _ in ids[1:]]


# ---------------------------------------------------------------------- hybrid
def test_hybrid_merges_shared_prefixes_and_keeps_the_likeliest_paths():
    from multispec.drafters import DraftTree
    from multispec.drafters.hybrid import merge

    sibling = DraftTree([5, 6, 7], [-1, 0, 1], None, [0.9, 0.8, 0.5], [3, 3, 2])
    head = DraftTree([5, 9, 6, 4], [-1, -1, 0, 2], None, [0.95, 0.3, 0.6, 0.7], [0, 0, 0, 0])
    merged = merge(sibling, head, budget=10)
    assert merged.tokens == [5, 6, 7, 9, 4] and merged.parents == [-1, 0, 1, -1, 1]
    assert merged.confidence == [0.95, 0.8, 0.5, 0.3, 0.7] and merged.evidence == [3, 3, 2, 0, 0]
    assert merged.q is None
    # Cut to 3 nodes by path confidence: 5 (0.95), 5-6 (0.76), 5-6-4 (0.53) beat 5-6-7 (0.38) and 9 (0.3).
    cut = merge(sibling, head, budget=3)
    assert cut.tokens == [5, 6, 4] and cut.parents == [-1, 0, 1]


def test_hybrid_with_drawn_candidates_keeps_them_first_and_whole():
    """``sampled_drafts=True``: the head's nodes (drawn, with q rows) come first among their
    siblings and are all kept, each with its own q row; sibling text that repeats a drawn node
    joins it, the rest is copied after them and cut by path confidence to the budget."""
    from multispec.drafters import DraftTree
    from multispec.drafters.hybrid import merge

    q = torch.eye(12)[[5, 9, 6]]  # any rows: one per drawn node
    sibling = DraftTree([5, 6, 7, 8], [-1, 0, 1, -1], None, [0.9, 0.8, 0.5, 0.99], [3, 3, 2, 4])
    head = DraftTree([5, 9, 6], [-1, -1, 0], q, [0.1, 0.05, 0.2], [0, 0, 0])
    merged = merge(sibling, head, budget=5)
    assert merged.tokens == [5, 9, 6, 7, 8] and merged.parents == [-1, -1, 0, 2, -1]
    assert merged.drawn == [True, True, True, False, False]
    assert torch.equal(merged.q, q) and merged.q_rows() == [0, 1, 2, -1, -1]
    assert merged.evidence == [3, 0, 3, 2, 4]
    # Four nodes: the drawn three stay, however unlikely; the likelier copied node wins the last place.
    cut = merge(sibling, head, budget=4)
    assert cut.tokens == [5, 9, 6, 8] and cut.drawn == [True, True, True, False]
    assert torch.equal(cut.q, q)
    # Subtrees keep each drawn node's own row.
    part = merged.subtree([0, 2, 4])
    assert part.drawn == [True, True, False] and torch.equal(part.q, q[[0, 2]])


def test_the_hybrid_sizes_its_drawn_head_against_the_sibling_text():
    """The head's depth comes from the sibling tree alone (before the head draws): a sibling node
    takes the budget of a head level it is likelier than (levels worth 0.5, 0.25, 0.125, ...)."""
    from multispec.drafters import DraftTree
    from multispec.drafters.hybrid import _head_depth

    nothing = DraftTree.EMPTY
    assert _head_depth(nothing, 10, 2, 5) == 5
    assert _head_depth(nothing, 7, 2, 5) == 3
    sure = DraftTree([1, 2, 3, 4], [-1, 0, 1, 2], None, [0.9, 0.9, 0.9, 0.9], [3, 3, 3, 3])  # 0.9 ... 0.66
    assert _head_depth(sure, 10, 2, 5) == 3  # the four sibling nodes beat every level: 4 + 2 x 3
    unsure = DraftTree([1, 2], [-1, -1], None, [0.2, 0.1], [1, 1])  # below level 2 (0.25) and level 3 (0.125)
    assert _head_depth(unsure, 10, 2, 5) == 4  # levels 1-2, the 0.2 node, level 3, the 0.1 node, level 4
    assert _head_depth(unsure, 10, 2, 3) == 3


def test_hybrid_with_drawn_candidates_refuses_the_rules_that_need_every_q():
    law = SpecConfig(drafter="hybrid", sampled_drafts=True).draft_law
    assert law.law == "mixed"
    for scheme in ("auto", "without_replacement", "deterministic"):
        SpecConfig(drafter="hybrid", sampled_drafts=True, scheme=scheme)
    for scheme in ("single", "specinfer", "spectr", "canonical_lp", "canonical_wis"):
        with pytest.raises(ValueError, match=f"scheme='{scheme}'"):
            SpecConfig(drafter="hybrid", sampled_drafts=True, scheme=scheme)


def test_hybrid_with_drawn_candidates_keeps_the_three_token_law_under_the_budget(setup, monkeypatch):
    """The adaptive budget cuts the hybrid's copied nodes by their calibrated chance but must keep
    the drawn ones whole: chi-square of 10,000 samples' first three tokens against their exact
    law, with the budget on (cells: sequences of probability >= 0.4%, plus the rest). Power >= 0.9
    at alpha 1e-3 against a sampler that moves 3% of the mass from the likeliest sequence to the
    second. The step is priced as on a machine where a forward's extra rows cost little (on this
    CPU a step of 2,500 samples is compute-bound and the budget would keep the head off), so that
    the head drafts and the budget cuts around its drawn nodes."""
    from multispec.engine.costs import Prices
    from tests.engine.test_costs import law_costs

    llm, head, prompt, _ = setup
    cheap = Prices(law_costs(lambda tokens: 1.0 + 1e-5 * tokens))
    monkeypatch.setattr(llm.engine, "prices", lambda: cheap)
    cells = exact_cells(llm, prompt, 1.0, 3, threshold=0.004)
    keys = sorted(cells, key=cells.get, reverse=True)
    expected_p = [cells[k] for k in keys] + [1.0 - sum(cells.values())]
    calls, per_call = 4, 2500
    total = calls * per_call
    assert _power(expected_p, total, 0.03) >= 0.9
    config = SpecConfig(drafter="hybrid", draft_model=str(head), sampled_drafts=True, num_candidates=2,
                        max_draft_tokens=3)
    observed, accepted = sampled_cells(
        llm, prompt, keys, 3, [SamplingParams(n=per_call, temperature=1.0, max_tokens=5, ignore_eos=True, seed=seed)
                               for seed in range(calls)], config)
    assert accepted > 0.2 * total, "too few accepted drafts to exercise verification"
    assert chisquare(observed, [p * total for p in expected_p]).pvalue > ALPHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loaded_head_drafts_the_same_packed_or_plain(llm, dtype, monkeypatch):
    """A head loaded for drafting runs its products on packed weights where the CPU can; its
    features and logits must equal those of the same head on plain weights (within rounding),
    and the packed head still saves the tensors it was loaded from."""
    import multispec.models.draft_head as draft_head
    from multispec.models import DEFAULT_MODEL, paired_draft_head
    from multispec.models.draft_head import PathAttention
    from multispec.models.llama import packing_available

    if not packing_available(dtype, "cpu"):
        pytest.skip(f"this CPU's matrix library cannot pack {dtype}")
    path = paired_draft_head(DEFAULT_MODEL)
    packed = DraftHead.load(path, dtype).attach(llm.model)
    monkeypatch.setattr(draft_head, "packing_available", lambda *_: False)
    plain = DraftHead.load(path, dtype).attach(llm.model)
    assert packed.packed and not plain.packed
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(5, llm.config.hidden_size, generator=gen)
    tokens = torch.randint(0, llm.config.vocab_size, (5,), generator=gen)
    outputs = []
    with torch.inference_mode():
        for head in (packed, plain):
            attention, x = PathAttention(), features
            for depth in range(3):
                x = head.step(x, tokens, depth, attention)
            outputs.append(head.logits(x))
    assert torch.allclose(outputs[0], outputs[1], atol=1e-3 if dtype == torch.float32 else 0.15)
    assert torch.equal(outputs[0].argmax(-1), outputs[1].argmax(-1))
    saved = packed.state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(saved[name], value), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_head_layer_is_the_python_layer(llm, dtype):
    """The head's layer as one compiled call a depth (the roots' windows, some padded on the left,
    then drafted depths whose nodes continue chosen parents, several children to one parent and
    parents out of order) gives the Python layer's features: equal within float32's rounding, within
    bf16's (the attention sums in another order) in bf16. It would fail if the kernel ignored the
    window mask (shown: the mask moves the features far more than the tolerance) or read a node's
    own row instead of its parent's path."""
    from multispec import kernels
    from multispec.models import DEFAULT_MODEL, paired_draft_head
    from multispec.models.draft_head import CompiledPath, PathAttention

    if kernels.head_layer() is None:
        pytest.skip("the compiled kernels cannot be built here")
    head = DraftHead.load(paired_draft_head(DEFAULT_MODEL), dtype).attach(llm.model)
    head.embedding = head.embedding.to(dtype)  # the compiled layer reads the target's embedding in the head's dtype
    gen = torch.Generator().manual_seed(3)
    n, c = 6, head.config.context - 2
    features = torch.randn(n, c, llm.config.hidden_size, generator=gen).to(dtype) * 4
    tokens = torch.randint(0, llm.config.vocab_size, (n, c), generator=gen)
    mask = torch.ones(n, c, dtype=torch.bool)
    mask[1, :3] = False
    mask[4, :c - 1] = False
    parents = [torch.tensor([0, 0, 1, 2, 3, 4, 5, 5, 5]), torch.tensor([8, 0, 3, 2, 4])]

    def run(compiled: bool, mask):
        head._layer_call = None if compiled else False
        with torch.inference_mode():
            state, path = head.start(features, tokens, mask)
            assert isinstance(path, CompiledPath if compiled else PathAttention)
            out = [state]
            for depth, rows in enumerate(parents, 1):
                path = path.children(rows)
                state = head.step(state[rows], head.vocab_ids[rows * 7 + depth], depth, path)
                out.append(state)
        head._layer_call = None
        return [x.float() for x in out]

    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    error = 0.0
    for m in (None, mask):
        for fast, slow in zip(run(True, m), run(False, m)):
            assert fast.shape == slow.shape
            assert torch.allclose(fast, slow, **tolerance), (fast - slow).abs().max()
            error = max(error, float((fast - slow).norm() / slow.norm()))
    masked, whole = run(False, mask), run(False, None)
    for root in (1, 4):
        moved = float((masked[0][root] - whole[0][root]).norm() / whole[0][root].norm())
        assert moved > 10 * max(error, 1e-4), (moved, error)
    # A dtype the kernel does not run (float16) keeps the Python layer.
    half = DraftHead.load(paired_draft_head(DEFAULT_MODEL), torch.float16).attach(llm.model)
    half.embedding = half.embedding.to(torch.float16)
    with torch.inference_mode():
        assert half._compiled() is None
        assert isinstance(half.start(features[:1].half(), tokens[:1])[1], PathAttention)


def test_the_live_step_prices_leave_the_draft_models_seconds_to_its_own_price(setup, monkeypatch):
    """The budget prices a draft model's forwards apart (its measured seconds a depth), so the
    live correction of what drafting adds to a step must not see them again: every drafting step
    the engine records is its wall time less the seconds the head spent. A head slowed by 30 ms a
    step shows it (recorded at least 30 ms below the step's wall time)."""
    import time as clock

    from multispec.engine.costs import Prices

    llm, head, prompt, _ = setup
    slow = ModelDrafter._draft

    def slowed(self, *args):
        clock.sleep(0.03)
        return slow(self, *args)

    recorded, walls = [], []
    record = Prices.record

    def spy(self, seconds, tokens, batch, qmax, context, drafting):
        recorded.append((seconds, qmax))
        return record(self, seconds, tokens, batch, qmax, context, drafting)

    monkeypatch.setattr(ModelDrafter, "_draft", slowed)
    monkeypatch.setattr(Prices, "record", spy)
    llm.engine.step_observers.append(lambda report: walls.append(
        report.time_draft + report.time_forward + report.time_verify + report.time_commit))
    try:
        llm.generate([prompt], SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True, seed=1),
                     SpecConfig(drafter="model", draft_model=str(head), max_draft_tokens=2), use_tqdm=False)
    finally:
        llm.engine.step_observers.clear()
    drafted = [(seconds, wall) for (seconds, qmax), wall in zip(recorded, walls) if qmax > 1]
    assert drafted, "no drafting step to check"
    for seconds, wall in drafted:
        assert seconds <= wall - 0.03 + 1e-6


def test_the_head_drafts_for_every_request_of_a_lane_in_one_forward_a_depth(setup):
    """Two requests in flight share their lane's head calls: one forward per depth per step, not
    one per request."""
    llm, head, prompt, _ = setup
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, ignore_eos=True, seed=2)
    llm.generate([prompt, prompt[:12]], params, spec(head, num_candidates=2, max_draft_tokens=3,
                                                      decision_threshold=0.0), use_tqdm=False)
    stats = llm.last_stats
    assert stats.drafted_tokens > 0
    assert stats.draft_forwards <= 3 * stats.decode_forwards


def test_hybrid_head_stops_chains_below_the_budgets_cut(setup):
    """Copied head drafts (the hybrid's) stop a chain where the product of the budget's measured
    acceptance over its confidences falls below the floor the lane sets from the last step's cut;
    with no floor they run the full depth. Drawn drafts stop the same way (whether a node gets a
    child depends on the node and its ancestors only, so the child is still drawn from its q)."""
    llm, head, prompt, _ = setup
    loaded = DraftHead.load(head).attach(llm.model)
    hidden = llm.config.hidden_size

    def depths(copied: bool, chances: list[float] | None, floor: float) -> list[int]:
        drafter = ModelDrafter.create(head=loaded, max_depth=4, max_nodes=8, num_candidates=2, temperature=1.0)
        drafter.copied = copied
        if chances is not None:
            drafter.limit(chances, floor)
        gen = torch.Generator().manual_seed(0)
        for sample in range(3):
            drafter.observe(sample, prompt[-4:])
            drafter.observe_features([sample], [torch.randn(4, hidden, generator=gen)])
        uniforms = None if copied else [[0.5] * 8] * 3
        trees = drafter.propose([0, 1, 2], [8, 8, 8], uniforms)
        return [max(t.depths()) if t.tokens else 0 for t in trees]

    bins = 9  # one more than CONFIDENCE_EDGES
    assert depths(True, None, 0.0) == [4, 4, 4]
    assert depths(True, [1.0] * bins, 0.5) == [4, 4, 4]
    # Every node calibrated at 0.4: paths 0.4, 0.16, 0.064, so nodes at depth 3 are not extended.
    assert depths(True, [0.4] * bins, 0.1) == [3, 3, 3]
    assert depths(True, [0.4] * bins, 0.5) == [1, 1, 1]
    assert depths(False, [0.4] * bins, 0.5) == [1, 1, 1]
    assert depths(False, None, 0.0) == [4, 4, 4]
