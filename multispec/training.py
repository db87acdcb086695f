"""Training a draft head (and its decision model) from the target alone, offline.

1. **Text.** The target answers GSM8K train questions (chat template), half at temperature 0.7
   and half at 1.0, several samples each: the text the head will draft for. More questions come
   with the dataset's own reference solutions (calculator annotations removed) as the answer:
   text the target did not write, but on which its features and distributions are just as much
   what the head must learn, at the cost of one prefill instead of a generation.
2. **Features.** The target's final hidden state at every answer position and the log-normaliser
   of its distribution there: for the target's own answers, as the engine computed them while
   sampling (``LLMEngine.position_observers``); for the reference solutions (and answers read back
   from a file), from one teacher-forced prefill over each prompt + answer.
3. **Head.** The head's output is restricted to the tokens the target wrote most often. Each
   training row starts at a true feature ``h_t`` and unrolls ``unroll`` steps on the true tokens,
   feeding back its own predicted features (as it runs when drafting), with two losses per step:
   cross-entropy towards the target's own probabilities of the kept tokens (distillation) and a
   smooth-L1 pull of the predicted feature towards the true one.
4. **Held-out agreement.** On questions the head never saw: per depth, how often the head's most
   likely token is the target's, and the acceptance rate sum(min(p, q)) a single draft would get
   at temperature 1.
5. **Decision model.** The engine drafts held-out questions at full depth with the new head; for
   every drafted node that was accepted and had a child, what the head knew before drawing the
   child and whether the child was accepted. A small MLP fits that by binary cross-entropy; the
   shipped threshold is the highest that keeps 97% of the accepted tokens on those logs.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from multispec.models.draft_head import DraftHead, HeadConfig, decision_stats
from multispec.models.registry import paired_draft_head
from multispec.verify.support import dense_rows, entries


@dataclass
class TrainConfig:
    questions: int = 640
    """GSM8K train questions the target answers for the head's data."""
    samples: int = 2
    """Samples per question (half the questions at temperature 0.7, half at 1.0)."""
    max_tokens: int = 256
    references: int = 0
    """Further train questions whose reference solution is teacher-forced as the answer."""
    held_out: int = 32
    """Further train questions kept out of training, for the agreement figures and the decision model."""
    num_tokens: int = 4096
    """The head's vocabulary: the tokens the target wrote most often."""
    intermediate_size: int = 768
    context: int = 1
    """Pairs of the text before the root the head reads (see ``HeadConfig.context``)."""
    unroll: int = 3
    epochs: int = 4
    batch: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.0
    feature_weight: float = 0.5
    decision_depth: int = 5
    seed: int = 0


@dataclass
class Sequences:
    """Teacher-forced data of many answers, concatenated: per position its feature, the token at
    that position, the log-normaliser of the target's distribution after it, and which answer
    it belongs to."""

    features: torch.Tensor  # [P, H] bfloat16
    tokens: torch.Tensor  # [P]
    lse: torch.Tensor  # [P] float32
    sequence: torch.Tensor  # [P]

    def starts(self, unroll: int) -> torch.Tensor:
        """Positions whose next ``unroll`` positions lie in the same answer."""
        p = self.tokens.numel()
        index = torch.arange(max(0, p - unroll))
        return index[self.sequence[index] == self.sequence[index + unroll]]


def teacher_forced(llm, sequences: list[tuple[list[int], int]], per_forward: int = 4096) -> Sequences | None:
    """Features of each (ids, prompt_len) at positions prompt_len - 1 .. end, from prefills of
    about ``per_forward`` tokens (several sequences each); None for no sequences."""
    if not sequences:
        return None
    features, tokens, lse, which = [], [], [], []
    batches, batch, size = [], [], 0
    for k, (ids, prompt_len) in enumerate(sequences):
        if batch and size + len(ids) > per_forward:
            batches.append(batch)
            batch, size = [], 0
        batch.append(k)
        size += len(ids)
    if batch:
        batches.append(batch)
    for batch in batches:
        states = llm.engine.batch_states([sequences[k][0] for k in batch])
        for k, hidden in zip(batch, states):
            ids, prompt_len = sequences[k]
            with torch.inference_mode():
                hidden = hidden[prompt_len - 1:]
                logits = llm.model.logits(hidden)
            features.append(hidden.to(torch.bfloat16))
            lse.append(torch.logsumexp(logits, -1))
            tokens.append(torch.tensor(ids[prompt_len - 1:]))
            which.append(torch.full((hidden.shape[0],), k))
    return Sequences(torch.cat(features), torch.cat(tokens), torch.cat(lse), torch.cat(which))


@dataclass
class Answer:
    """A sampled answer: prompt + answer ids, the prompt's length, which question; and, where the
    engine handed them over as it sampled (``LLMEngine.position_observers``), the target's
    features ``[k, H]`` and log-normalisers ``[k]`` at the positions prompt_len - 1 .. len(ids) - 2
    (k = len(ids) - prompt_len, one per answer token)."""

    ids: list[int]
    prompt_len: int
    problem: int
    features: torch.Tensor | None = None
    lse: torch.Tensor | None = None


def observed(answers: list[Answer]) -> Sequences | None:
    """``Sequences`` of answers whose features were kept as they were sampled. A teacher-forced
    pass gives one position more per answer (what follows its last token: after an end token,
    nothing drafting ever asks for); the rest is the same data. None for no answers."""
    if not answers:
        return None
    features, tokens, lse, which = [], [], [], []
    for k, a in enumerate(answers):
        features.append(a.features.to(torch.bfloat16))
        lse.append(a.lse.float())
        tokens.append(torch.tensor(a.ids[a.prompt_len - 1:len(a.ids) - 1]))
        which.append(torch.full((a.features.shape[0],), k))
    return Sequences(torch.cat(features), torch.cat(tokens), torch.cat(lse), torch.cat(which))


def joined(*parts: Sequences | None) -> Sequences:
    """One ``Sequences`` of several (None: none), their answers kept apart."""
    parts = [p for p in parts if p is not None and p.tokens.numel()]
    offsets, total = [], 0
    for part in parts:
        offsets.append(total)
        total += int(part.sequence.max()) + 1
    return Sequences(torch.cat([p.features for p in parts]), torch.cat([p.tokens for p in parts]),
                     torch.cat([p.lse for p in parts]), torch.cat([p.sequence + o for p, o in zip(parts, offsets)]))


def frequent_tokens(data: Sequences, k: int, vocab_size: int) -> torch.Tensor:
    counts = torch.bincount(data.tokens, minlength=vocab_size)
    return counts.topk(min(k, vocab_size)).indices.sort().values


def windows(data: Sequences, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each start's window of ``context`` positions ending at it ``[R, C]`` (clamped into range)
    and which of them lie in the start's own answer (the head sees no earlier text when drafting
    either: the first feature it gets is the prompt's last)."""
    index = starts[:, None] - torch.arange(context - 1, -1, -1)
    inside = index >= 0
    index = index.clamp_min(0)
    inside &= data.sequence[index] == data.sequence[starts][:, None]
    return index, inside


def unroll_inputs(data: Sequences, starts: torch.Tensor, context: int,
                  unroll: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DraftHead.unrolled``'s inputs for chains rooted after each start: the window's features
    ``[R, C, H]``, the token after each window position (that after the start is the first one
    drafted) followed by the ``unroll - 1`` tokens the chain feeds back ``[R, C + unroll - 1]``,
    and which window positions exist ``[R, C]``."""
    window, inside = windows(data, starts, context)
    after = data.tokens[(window + 1).clamp_max(data.tokens.numel() - 1)]
    fed = data.tokens[starts[:, None] + torch.arange(2, unroll + 1)]
    return data.features[window].float(), torch.cat([after, fed], 1), inside


def head_loss(head: DraftHead, data: Sequences, starts: torch.Tensor, unroll: int, feature_weight: float,
              output: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
    """Mean loss over ``starts`` and per-step statistics (top-1 agreement, acceptance)."""
    offsets = starts[:, None] + torch.arange(1, unroll + 1)
    predicted = head.unrolled(*unroll_inputs(data, starts, head.config.context, unroll))  # [R, S, H]
    total = 0.0
    stats = []
    for s in range(unroll):
        true = data.features[offsets[:, s]].float()
        p = torch.exp(F.linear(true, output) - data.lse[offsets[:, s], None])  # target's probs of the kept tokens
        logq = torch.log_softmax(head.logits(predicted[:, s]), -1)
        ce = -(p * logq).sum(-1).mean()
        reg = F.smooth_l1_loss(predicted[:, s], true)
        total = total + ce + feature_weight * reg
        with torch.no_grad():
            q = logq.exp()
            stats.append({"agree": float((q.argmax(-1) == p.argmax(-1)).float().mean()),
                          "accept": float(torch.minimum(p, q).sum(-1).mean())})
    return total / unroll, stats


def train_head(head: DraftHead, data: Sequences, config: TrainConfig, log=print) -> None:
    starts = data.starts(config.unroll)
    output = head.output.float()
    params = [p for n, p in head.named_parameters() if not n.startswith("decision")]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    steps = config.epochs * math.ceil(starts.numel() / config.batch)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=steps, pct_start=0.05)
    generator = torch.Generator().manual_seed(config.seed)
    head.train()
    for epoch in range(config.epochs):
        order = starts[torch.randperm(starts.numel(), generator=generator)]
        start, running = time.perf_counter(), []
        for i in range(0, order.numel(), config.batch):
            loss, stats = head_loss(head, data, order[i:i + config.batch], config.unroll, config.feature_weight, output)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            running.append(stats[0]["agree"])
        log(f"  epoch {epoch + 1}/{config.epochs}: loss {loss.item():.3f}, train top-1 agreement at depth 1 "
            f"{sum(running[-50:]) / len(running[-50:]):.3f}, {time.perf_counter() - start:.0f}s")
    head.eval()


@torch.no_grad()
def agreement(head: DraftHead, data: Sequences, unroll: int) -> list[dict]:
    """Held-out top-1 agreement and single-draft acceptance per depth (1 .. unroll)."""
    starts = data.starts(unroll)
    output = head.output.float()
    totals = [{"agree": 0.0, "accept": 0.0} for _ in range(unroll)]
    rows = 0
    for i in range(0, starts.numel(), 1024):
        chunk = starts[i:i + 1024]
        _, stats = head_loss(head, data, chunk, unroll, 0.0, output)
        for total, s in zip(totals, stats):
            for key in total:
                total[key] += s[key] * chunk.numel()
        rows += chunk.numel()
    return [{key: value / max(1, rows) for key, value in total.items()} for total in totals]


def file_agreement(llm, path: Path, data: Sequences, unroll: int) -> list[dict]:
    """``agreement`` of the head stored at ``path``, loaded as the engine loads it (its weights
    as stored, computed in float32), on ``data``: how a retrained head is compared with another,
    the shipped one say, on the same held-out answers."""
    return agreement(DraftHead.load(path).attach(llm.model), data, unroll)


def _depths(figures: list[dict]) -> str:
    return ", ".join(f"{f['agree']:.3f}" for f in figures)


def decision_logs(llm, head_path: Path, problems, depth: int, max_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stats, label) of every drafted node that was accepted and had a child, drafting held-out
    questions at full depth (decision model off) at T 0.7 and 1.0."""
    from multispec.params import SamplingParams, SpecConfig

    xs, ys = [], []
    head = llm.engine.draft_head(str(head_path))
    vocab = head.vocab_ids

    def observe(report):
        for tree, result in zip(report.trees, report.results):
            if not tree.tokens or tree.q is None:
                continue
            accepted = set(result.path)
            children: dict[int, int] = {}
            for i, parent in enumerate(tree.parents):
                if parent >= 0:
                    children[parent] = i
            depths = tree.depths()
            for node, child in children.items():
                if node not in accepted:
                    continue
                child_q = dense_rows(tree.q, [child])[0][vocab]
                node_prob = entries(tree.q, torch.tensor([node]), torch.tensor([tree.tokens[node]]))[0]
                xs.append(decision_stats(torch.tensor([depths[node]]), node_prob[None], child_q[None].float())[0])
                ys.append(float(child in accepted))

    spec = SpecConfig(drafter="model", draft_model=str(head_path), max_draft_tokens=depth, adaptive=False,
                      decision_threshold=0.0)
    llm.engine.step_observers.append(observe)
    try:
        for temperature, part in ((0.7, problems[0::2]), (1.0, problems[1::2])):
            llm.chat([p.chat() for p in part], SamplingParams(n=4, temperature=temperature, max_tokens=max_tokens,
                                                             seed=seed), spec)
    finally:
        llm.engine.step_observers.remove(observe)
    return torch.stack(xs), torch.tensor(ys)


def train_decision(head: DraftHead, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
    torch.manual_seed(seed)
    model = head.decision.float()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(600):
        loss = F.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def pick_threshold(scores: torch.Tensor, labels: torch.Tensor, keep: float = 0.97) -> float:
    """The highest threshold at which the children the decision model lets through still hold
    ``keep`` of the accepted ones (a node below it stops its chain, so this bounds what is lost
    at the first cut; deeper nodes only lose less)."""
    accepted = float(labels.sum())
    best = 0.0
    for t in [i / 100 for i in range(1, 96)]:
        if float(labels[scores >= t].sum()) >= keep * accepted:
            best = t
    return best


def train_draft(llm, output: Path, config: TrainConfig, log=print, answers_file: Path | None = None) -> dict:
    """Build, train and save a draft head (with its decision model) for ``llm``'s model; returns
    the figures it printed. ``answers_file``: where the sampled answers are kept (JSON), so a
    second run with the same settings trains without sampling again."""
    import json

    from multispec.reasoning import load_gsm8k

    torch.manual_seed(config.seed)
    started = time.perf_counter()
    count = config.questions + 2 * config.held_out + config.references
    problems = load_gsm8k(limit=count, split="train")
    train_q, held_q = problems[:config.questions], problems[config.questions:config.questions + config.held_out]
    decision_q = problems[config.questions + config.held_out:config.questions + 2 * config.held_out]
    reference_q = problems[config.questions + 2 * config.held_out:]
    key = {"model": str(llm.model_name), "questions": config.questions, "held_out": config.held_out,
           "samples": config.samples, "max_tokens": config.max_tokens, "seed": config.seed}
    cached = json.loads(answers_file.read_text()) if answers_file is not None and answers_file.is_file() else {}
    if cached.get("key") == key:
        answers = [Answer(*a) for a in cached["answers"]]
        log(f"{len(answers)} sampled answers from {answers_file}")
    else:
        log(f"sampling answers to {len(train_q) + len(held_q)} GSM8K train questions")
        answers = _answers(llm, train_q + held_q, config, log)
        if answers_file is not None:
            answers_file.parent.mkdir(parents=True, exist_ok=True)
            answers_file.write_text(json.dumps({"key": key, "answers": [[a.ids, a.prompt_len, a.problem]
                                                                        for a in answers]}))
    # Answers sampled in this run kept their features as they were sampled; those read back from
    # ``answers_file`` (and the reference solutions) are teacher-forced.
    sampled = [a for a in answers if a.features is not None]
    forced = [a for a in answers if a.features is None]
    references = _reference_answers(llm, reference_q)
    log(f"teacher-forced features of {len(forced) + len(references)} answers ({len(references)} of them reference "
        f"solutions); {len(sampled)} sampled answers' features kept as they were sampled")
    start = time.perf_counter()
    train = joined(observed([a for a in sampled if a.problem < len(train_q)]),
                   teacher_forced(llm, [(a.ids, a.prompt_len) for a in forced if a.problem < len(train_q)] + references))
    held = joined(observed([a for a in sampled if a.problem >= len(train_q)]),
                  teacher_forced(llm, [(a.ids, a.prompt_len) for a in forced if a.problem >= len(train_q)]))
    log(f"  {time.perf_counter() - start:.0f}s")
    vocab = frequent_tokens(train, config.num_tokens, llm.config.vocab_size)
    coverage = float(torch.isin(held.tokens, vocab).float().mean())
    log(f"  {train.tokens.numel()} training positions, {held.tokens.numel()} held out; the {vocab.numel()} most "
        f"frequent tokens cover {coverage:.1%} of held-out answer tokens")

    head = DraftHead(HeadConfig.for_target(llm.config, vocab.numel(), config.intermediate_size,
                                           name=str(llm.model_name), context=config.context))
    head.vocab_ids.copy_(vocab)
    head.attach(llm.model)
    head.output = head.output.float()
    head.embedding = head.embedding.float()
    log(f"training the head ({sum(p.numel() for n, p in head.named_parameters() if not n.startswith('decision')) / 1e6:.1f}M "
        f"parameters, window {config.context}, unroll {config.unroll}, {config.epochs} epochs)")
    train_head(head, train, config, log)
    figures = agreement(head, held, config.unroll)
    log("held-out agreement with the target (per draft depth):")
    for depth, f in enumerate(figures, 1):
        log(f"  depth {depth}: top-1 {f['agree']:.3f}, single-draft acceptance at T 1 {f['accept']:.3f}")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    head.save(output)
    shipped = paired_draft_head(llm.model_name)
    shipped_figures = None
    if shipped is not None and shipped.resolve() != output.resolve():
        shipped_figures = file_agreement(llm, shipped, held, config.unroll)
        log(f"  top-1 per depth on the same held-out answers: this head (as saved) "
            f"{_depths(file_agreement(llm, output, held, config.unroll))}, the shipped head {_depths(shipped_figures)}")

    log(f"decision model: drafting {len(decision_q)} held-out questions at depth {config.decision_depth}")
    llm.engine._heads.pop(output.resolve(), None)
    x, y = decision_logs(llm, output, decision_q, config.decision_depth, config.max_tokens, config.seed)
    train_decision(head, x, y, config.seed)
    with torch.no_grad():
        scores = torch.sigmoid(head.decision(x).squeeze(-1))
    threshold = pick_threshold(scores, y)
    base_rate = float(y.mean())
    log(f"  {len(y)} logged children, {base_rate:.1%} accepted; threshold {threshold:.2f} keeps "
        f"{float(y[scores >= threshold].sum()) / max(1.0, float(y.sum())):.1%} of accepted children and drafts "
        f"{float((scores >= threshold).float().mean()):.1%} of them")
    head.config = HeadConfig(**{**head.config.__dict__, "threshold": threshold})
    head.save(output)
    llm.engine._heads.pop(output.resolve(), None)
    elapsed = time.perf_counter() - started
    log(f"saved {output} ({output.stat().st_size / 1e6:.1f} MB) in {elapsed / 60:.1f} min")
    return {"agreement": figures, "shipped_agreement": shipped_figures, "coverage": coverage, "threshold": threshold,
            "decision_rows": len(y), "minutes": elapsed / 60}


_CALCULATOR = re.compile(r"<<[^>]*>>")


def _reference_answers(llm, problems) -> list[tuple[list[int], int]]:
    """(prompt + reference solution ids, prompt length) of each problem, its solution as the
    assistant's turn: the worked steps without the dataset's calculator annotations, then
    '#### <answer>' as the prompt asks."""
    out = []
    tokenizer = llm.tokenizer
    end = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    for problem in problems:
        prompt = tokenizer.encode(tokenizer.apply_chat_template(problem.chat(), add_generation_prompt=True),
                                  add_special_tokens=False)
        answer = tokenizer.encode(_CALCULATOR.sub("", problem.data["solution"]), add_special_tokens=False)
        out.append((prompt + answer + ([end] if end is not None else []), len(prompt)))
    return out


def _answers(llm, problems, config: TrainConfig, log) -> list[Answer]:
    """``samples`` answers per problem, each with the target's features and log-normalisers at
    its positions as the engine computed them while sampling (no second forward over them)."""
    from multispec.params import SamplingParams

    kept: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def keep(samples, features, lse) -> None:
        for sample, f, l in zip(samples, features, lse):
            kept.setdefault((sample.request.request_id, sample.index), []).append((f.to(torch.bfloat16), l))

    out = []
    llm.engine.position_observers.append(keep)
    try:
        for temperature, offset in ((0.7, 0), (1.0, 1)):
            indexes = list(range(offset, len(problems), 2))
            start = time.perf_counter()
            results = llm.chat([problems[i].chat() for i in indexes],
                               SamplingParams(n=config.samples, temperature=temperature, max_tokens=config.max_tokens,
                                              seed=config.seed))
            count = 0
            for i, result in zip(indexes, results):
                for completion in result.outputs:
                    rows = kept.pop((result.request_id, completion.index), [])
                    answer = Answer(list(result.prompt_token_ids) + list(completion.token_ids),
                                    len(result.prompt_token_ids), i)
                    if sum(f.shape[0] for f, _ in rows) == len(completion.token_ids) > 0:
                        answer.features = torch.cat([f for f, _ in rows])
                        answer.lse = torch.cat([l for _, l in rows])
                    out.append(answer)
                    count += len(completion.token_ids)
            kept.clear()
            log(f"  {len(indexes)} questions x {config.samples} at T {temperature}: {count} tokens in "
                f"{time.perf_counter() - start:.0f}s")
    finally:
        llm.engine.position_observers.remove(keep)
    return out
