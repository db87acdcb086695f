"""The step loop: draft, pack, one target forward, verify, commit, observe.

Plain decoding is this same loop with empty drafts. Requests wait until their n samples fit in
the cache, are prefilled once (one prompt slot shared by all n samples), then step together
with every other admitted sample in one packed forward. A sample leaves the batch as soon as it
finishes and its slot goes to the next request.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from multispec.drafters import DraftTree, make_drafter
from multispec.engine.budget import Calibration, DraftBudget
from multispec.engine.kv_cache import CacheShape, DecodeAttention, KVCache, PrefillAttention, StepLayout, kv_bytes_per_token
from multispec.engine.sampler import target_probs
from multispec.engine.sequence import Request, Sample
from multispec.models.llama import LlamaForCausalLM
from multispec.models.tokenizer import Tokenizer
from multispec.params import CompletionOutput, RequestOutput, RunStats, SamplingParams, SpecConfig
from multispec.verify import PositionKeys, verify_tree
from multispec.verify.sampling import sample_key, sample_rows
from multispec.verify.schemes import resolve

GIB = 1 << 30


@dataclass
class EngineConfig:
    """Limits fixed when the model is loaded."""

    max_model_len: int
    kv_cache_bytes: int = 4 * GIB


@dataclass
class _Step:
    """The packed inputs of one decode step, with what verification and commit need back."""

    samples: list[Sample]
    trees: list[DraftTree]
    token_ids: torch.Tensor
    positions: torch.Tensor
    layout: StepLayout
    row_offsets: list[int]


class Engine:
    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer, config: EngineConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.dtype = model.output_weight().dtype
        self.device = model.output_weight().device
        # Kernels on an accelerator run asynchronously; the step's time split (and the draft
        # budget's cost samples) must wait for them to finish.
        on_gpu = self.device.type == "cuda"
        self._sync = (lambda: torch.cuda.synchronize(self.device)) if on_gpu else (lambda: None)
        self.vocab_size = model.config.vocab_size
        # (tokens, attention work, seconds) of recent decode steps: the draft budget's cost model.
        self.forward_costs: deque[tuple[int, float, float]] = deque(maxlen=256)
        # What verification accepted of each drafter's drafts, per sampling setting (see Calibration).
        self.calibrations: dict[tuple, Calibration] = {}

    # ------------------------------------------------------------------ requests and memory
    def make_requests(self, prompt_ids: list[list[int]], params: list[SamplingParams],
                      prompts: list[str | None]) -> list[Request]:
        """Requests checked against the model (vocabulary, context window): one bad request
        refuses the whole call before any work. ``max_tokens`` past the context window is clipped
        to it, as vLLM's offline ``LLM`` does: such samples end with finish_reason "length"."""
        requests = []
        for i, (ids, sp, text) in enumerate(zip(prompt_ids, params, prompts)):
            if len(ids) == 0:
                raise ValueError(f"prompt {i} is empty: give at least one token")
            if len(ids) >= self.config.max_model_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens, more than the context window allows "
                                 f"(max_model_len={self.config.max_model_len}, leaving room for 1 new token)")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
            if sp.logprobs is not None and sp.logprobs > self.vocab_size:
                raise ValueError(f"logprobs={sp.logprobs!r}: must be at most the vocabulary size {self.vocab_size}")
            outside = [t for t in sp.stop_token_ids if t >= self.vocab_size]
            if outside:
                raise ValueError(f"stop_token_ids={sp.stop_token_ids!r}: ids must lie in [0, {self.vocab_size})")
            seed = sp.seed if sp.seed is not None else secrets.randbits(64)
            stop_ids = set(sp.stop_token_ids)
            if not sp.ignore_eos:
                stop_ids |= set(self.tokenizer.eos_token_ids)
            max_tokens = min(sp.max_tokens, self.config.max_model_len - len(ids))
            requests.append(Request(str(i), text, list(ids), sp, max_tokens, seed, frozenset(stop_ids)))
        return requests

    def plan_cache(self, requests: list[Request], spec: SpecConfig) -> CacheShape:
        """Choose slot counts that fit ``kv_cache_bytes``; refuse before allocating if one request cannot."""
        per_token = kv_bytes_per_token(self.model.config, self.dtype)
        draft = spec.max_draft_nodes if spec.speculates else 0
        longest = max(r.max_tokens for r in requests)
        sample_capacity = longest + draft + 1
        if spec.batching == "padded" and spec.speculates:
            # Filler entries: every step may advance a sample by the batch's longest acceptance.
            sample_capacity = longest * (1 + min(spec.max_draft_tokens, draft)) + draft + 1
        prompt_capacity = max(r.prompt_len for r in requests)
        largest_n = max(r.params.n for r in requests)
        smallest_n = min(r.params.n for r in requests)
        budget = self.config.kv_cache_bytes

        def size(shape: CacheShape) -> int:
            return shape.tokens() * per_token

        minimum = CacheShape(largest_n, sample_capacity, 1, prompt_capacity)
        if size(minimum) > budget:
            raise ValueError(
                f"request needs {size(minimum) / GIB:.2f} GiB of KV cache (n={largest_n} samples x "
                f"{sample_capacity} tokens + a {prompt_capacity}-token prompt) but the cap is "
                f"kv_cache_memory={budget / GIB:.2f} GiB; lower n or max_tokens, or raise the cap")
        slots = sum(r.params.n for r in requests)
        while True:
            prompts = min(len(requests), max(1, slots // smallest_n))
            shape = CacheShape(slots, sample_capacity, prompts, prompt_capacity)
            if size(shape) <= budget or slots <= largest_n:
                return shape if size(shape) <= budget else minimum
            slots = max(largest_n, slots * 3 // 4)

    def sequence_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, in one prefill forward through a scratch cache."""
        if not token_ids:
            raise ValueError("token_ids is empty")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens exceed max_model_len={self.config.max_model_len}")
        if not all(0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        cache = KVCache(self.model.config, CacheShape(0, 0, 1, len(token_ids)), self.dtype, self.device)
        with torch.inference_mode():
            ids = torch.tensor(token_ids, device=self.device)
            return self.model(ids, torch.arange(len(token_ids), device=self.device),
                              PrefillAttention(cache, [(0, len(token_ids))]))

    # ------------------------------------------------------------------ the loop
    @staticmethod
    def check_spec(requests: list[Request], spec: SpecConfig) -> None:
        """Refuse, before any work, a speculation config whose verification scheme is not exact for
        its drafts at some request's temperature (see ``multispec.verify.schemes``)."""
        spec.check()
        for request in requests:
            spec.check_temperature(request.params.temperature)

    def generate(self, requests: list[Request], spec: SpecConfig,
                 on_step: Callable[[int, int], None] | None = None) -> tuple[list[RequestOutput], RunStats]:
        self.check_spec(requests, spec)
        stats = RunStats()
        start = time.perf_counter()
        shape = self.plan_cache(requests, spec)
        padded = spec.batching == "padded" and spec.speculates
        cache = KVCache(self.model.config, shape, self.dtype, self.device, with_holes=padded)
        drafter = make_drafter(spec.drafter, vocab_size=self.vocab_size, max_depth=spec.max_draft_tokens,
                               max_nodes=spec.max_draft_nodes, sampled=spec.sampled_drafts,
                               aggregate=spec.aggregate, max_ngram=spec.max_ngram, min_ngram=spec.min_ngram)
        depth = spec.max_draft_tokens if spec.speculates and spec.adaptive else 0
        budget = DraftBudget(depth, self.forward_costs, max_evidence=spec.max_ngram,
                             calibration=self._calibration(spec, depth, requests))
        waiting = deque(requests)
        slots: list[Sample] = []
        next_sample_id = 0
        with torch.inference_mode():
            while waiting or slots:
                admitted = _admit(waiting, len(cache.free_prompt_slots), shape.sample_slots - len(slots))
                if admitted:
                    for request in admitted:
                        request.prompt_slot = cache.take_prompt_slot()
                        request.samples = [Sample(request, i, next_sample_id + i, sample_key(request.seed, i))
                                           for i in range(request.params.n)]
                        next_sample_id += request.params.n
                        drafter.add_group(request.prompt_slot, request.prompt_ids,
                                          [s.sample_id for s in request.samples])
                    new, seen = self._prefill(admitted, cache, stats, _wanted(drafter))
                    for sample, (token_probs, alternatives) in zip(new, seen):
                        added = len(sample.output_ids)
                        drafter.observe(sample.sample_id, sample.output_ids, token_probs[:added],
                                        None if alternatives is None else alternatives[:added])
                    slots.extend(new)
                    done = self._retire(slots, cache, drafter)
                    if on_step:
                        on_step(len(new), done)
                    continue
                step_tokens = self._decode_step(slots, cache, spec, drafter, budget, stats)
                done = self._retire(slots, cache, drafter)
                if on_step:
                    on_step(step_tokens, done)
        stats.time_total = time.perf_counter() - start
        stats.generated_tokens = sum(len(s.output_ids) for r in requests for s in r.samples)
        return [self._output(r) for r in requests], stats

    def _calibration(self, spec: SpecConfig, depth: int, requests: list[Request]) -> Calibration:
        """The engine's calibration for this drafter at these requests' sampling settings
        (acceptance depends on both), made from the prior the first time."""
        settings = tuple(sorted({(round(r.params.temperature, 2), r.params.top_k, round(r.params.top_p, 2))
                                 for r in requests}))
        key = (spec.drafter, spec.aggregate, spec.sampled_drafts, spec.scheme, spec.min_ngram, spec.max_ngram, depth,
               settings)
        if key not in self.calibrations:
            self.calibrations[key] = Calibration.prior(depth, spec.max_ngram)
        return self.calibrations[key]

    def _prefill(self, requests: list[Request], cache: KVCache, stats: RunStats,
                 alternatives: tuple[int, float] = (0, 0.0)):
        """One forward over the admitted prompts; each prompt's last row seeds its n samples.

        Returns the new samples and, for each, what the drafter is told about its first token: the
        target's probability of it and (see ``_top``) the target's most likely tokens."""
        t0 = time.perf_counter()
        token_ids = torch.tensor([t for r in requests for t in r.prompt_ids], device=self.device)
        positions = torch.cat([torch.arange(r.prompt_len) for r in requests]).to(self.device)
        last_rows = torch.tensor(list(_cumsum([r.prompt_len for r in requests])), device=self.device) - 1
        attention = PrefillAttention(cache, [(r.prompt_slot, r.prompt_len) for r in requests])
        logits = self.model(token_ids, positions, attention, logit_rows=last_rows)
        probs = target_probs(logits, *self._params_rows(requests))
        logprobs = torch.log_softmax(logits, -1)
        samples, seen = [], []
        for row, request in enumerate(requests):
            keys = PositionKeys([s.key for s in request.samples], [0] * request.params.n)
            first = sample_rows(probs[row:row + 1], keys.at(torch.arange(request.params.n), 0))
            tokens = first.tolist()
            token_probs = probs[row, first].tolist()
            tops = _top(probs, [row] * len(tokens), token_probs, *alternatives)
            for k, (sample, token) in enumerate(zip(request.samples, tokens)):
                self._append(sample, [token], [float(logprobs[row, token])], logprobs[row:row + 1])
                samples.append(sample)
                seen.append(([token_probs[k]], None if tops is None else [tops[k]]))
            request.unfinished = request.params.n
        stats.prefill_forwards += 1
        stats.prompt_tokens += int(token_ids.numel())
        stats.time_prefill += time.perf_counter() - t0
        return samples, seen

    def _params_rows(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        temperature = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32, device=self.device)
        top_k = torch.tensor([r.params.top_k for r in requests], dtype=torch.long, device=self.device)
        top_p = torch.tensor([r.params.top_p for r in requests], dtype=torch.float32, device=self.device)
        return temperature, top_k, top_p

    def _pack(self, slots: list[Sample], trees: list[DraftTree], padded: bool) -> _Step:
        """Concatenate every sample's root and draft nodes; no padding anywhere but the masks.

        ``padded`` is the ablation: every sample is filled up to the longest draft with filler
        nodes (children of the root that nothing verifies), as a padded batch would compute them.
        """
        counts = [1 + len(t.tokens) for t in trees]
        qmax = max(counts)
        if padded:
            counts = [qmax] * len(trees)
        tree_mask = torch.zeros(len(slots), qmax, qmax, dtype=torch.bool)
        tokens, positions, offsets = [], [], []
        offset = 0
        for b, (sample, tree) in enumerate(zip(slots, trees)):
            base = sample.request.prompt_len + sample.cached
            depth = [0]
            tree_mask[b, 0, 0] = True
            for j, parent in enumerate(tree.parents):
                depth.append(depth[parent + 1] + 1)
                tree_mask[b, j + 1] = tree_mask[b, parent + 1]
                tree_mask[b, j + 1, j + 1] = True
            for j in range(len(tree.tokens), counts[b] - 1):
                depth.append(1)
                tree_mask[b, j + 1, 0] = tree_mask[b, j + 1, j + 1] = True
            tokens.append(sample.root)
            tokens.extend(tree.tokens)
            tokens.extend([sample.root] * (counts[b] - 1 - len(tree.tokens)))
            positions.extend(base + d for d in depth)
            offsets.append(offset)
            offset += counts[b]
        layout = StepLayout(
            counts=torch.tensor(counts),
            written=torch.tensor([s.written for s in slots]),
            prompt_slot=torch.tensor([s.request.prompt_slot for s in slots]),
            prompt_len=torch.tensor([s.request.prompt_len for s in slots]),
            tree_mask=tree_mask,
        )
        return _Step(slots, trees, torch.tensor(tokens, device=self.device),
                     torch.tensor(positions, device=self.device), layout, offsets)

    def _draft(self, slots: list[Sample], spec: SpecConfig, drafter, budget: DraftBudget,
               context: int) -> list[DraftTree]:
        if not spec.speculates:
            return [DraftTree.EMPTY] * len(slots)
        nodes = spec.max_draft_nodes
        scored = spec.adaptive and not spec.sampled_drafts
        if spec.adaptive and not scored:
            length = budget.choose(len(slots), context)
            if length == 0:
                return [DraftTree.EMPTY] * len(slots)
            if length < spec.max_draft_tokens:
                nodes = min(nodes, length)
        if scored and not budget.wants_drafts():
            return [DraftTree.EMPTY] * len(slots)
        budgets = [max(0, min(nodes, s.remaining - 1)) for s in slots]
        if spec.max_batch_tokens is not None:
            spare = max(0, spec.max_batch_tokens - len(slots))
            if sum(budgets) > spare:
                share = spare // len(slots)
                budgets = [min(b, share) for b in budgets]
        uniforms = None
        if drafter.sampled:  # keyed to each sample's position, like its verification (see PositionKeys)
            uniforms = _position_keys(slots).draft_uniforms(max(budgets)).tolist()
        trees = drafter.propose([s.sample_id for s in slots], budgets, uniforms)
        return budget.select(trees, context) if scored else trees

    def _decode_step(self, slots: list[Sample], cache: KVCache, spec: SpecConfig, drafter,
                     budget: DraftBudget, stats: RunStats) -> int:
        t0 = time.perf_counter()
        context = _context(slots)
        trees = self._draft(slots, spec, drafter, budget, context)
        t1 = time.perf_counter()
        padded = cache.valid is not None
        step = self._pack(slots, trees, padded)
        logits = self.model(step.token_ids, step.positions, DecodeAttention(cache, step.layout))
        self._sync()
        t2 = time.perf_counter()
        results = self._verify(step, logits, spec, _wanted(drafter))
        t3 = time.perf_counter()
        gained = self._commit(step, logits, results, cache, drafter, stats, padded)
        self._sync()
        t4 = time.perf_counter()
        # The whole step is what a draft token costs: forward, verification and commit grow with it.
        qmax, drafting = int(step.layout.counts.max()), int((step.layout.counts > 1).sum())
        tokens = int(step.token_ids.numel())
        budget.record_forward(tokens, budget.work(len(slots), qmax, context, drafting, tokens), t4 - t0,
                              speculative=qmax > 1)
        if budget.max_depth:  # each mode learns only what its own choice uses
            if spec.sampled_drafts:
                budget.record_acceptance(*_acceptance_by_depth(trees, results, budget.max_depth))
            else:
                budget.record_nodes(trees, [result[0] for result in results])
        stats.decode_forwards += 1
        stats.sample_steps += len(slots)
        stats.forward_tokens += int(step.token_ids.numel())
        stats.drafted_tokens += sum(len(t.tokens) for t in trees)
        stats.time_draft += t1 - t0
        stats.time_forward += t2 - t1
        stats.time_verify += t3 - t2
        stats.time_commit += t4 - t3
        return gained

    def _verify(self, step: _Step, logits: torch.Tensor, spec: SpecConfig,
                alternatives: tuple[int, float] = (0, 0.0)):
        """One call for every sample of the step: per sample, the accepted path, the bonus token,
        the target's probabilities of the tokens it appends (path, then bonus) and the target's
        most likely tokens at each of those positions (see ``_top``).

        Each sample's random numbers are keyed by its own seed, index and output positions, so
        sharing the call with other requests changes nothing for any of them. Rows of greedy
        requests are one-hot, which every scheme follows exactly."""
        samples, trees = step.samples, step.trees
        counts = [1 + len(t.tokens) for t in trees]
        offsets = [0, *_cumsum(counts)]
        if logits.shape[0] != offsets[-1]:  # padded ablation: its filler rows verify nothing
            logits = logits[torch.tensor([step.row_offsets[b] + i for b, c in enumerate(counts) for i in range(c)],
                                         device=self.device)]
        rows = torch.tensor(counts, device=self.device)
        probs = target_probs(logits, *(x.repeat_interleave(rows) for x in self._params_rows(
            [s.request for s in samples])))
        node_tokens = torch.tensor([t for tree in trees for t in tree.tokens], dtype=torch.long, device=self.device)
        node_parents = torch.tensor([p for tree in trees for p in tree.parents], dtype=torch.long, device=self.device)
        node_offsets = torch.tensor([0] + list(_cumsum([len(tree.tokens) for tree in trees])), dtype=torch.long,
                                    device=self.device)
        drafted = [tree.q for tree in trees if tree.tokens]
        q = torch.cat(drafted).to(self.device) if drafted and drafted[0] is not None else None
        greedy = all(s.request.params.temperature == 0 for s in samples)
        scheme = resolve(spec.scheme, spec.draft_law, 0.0 if greedy else 1.0).name
        keys = _position_keys(samples)
        # The engine builds these tensors itself, so the input checks are skipped here.
        out = verify_tree(probs, node_tokens, node_parents, node_offsets, q=q, scheme=scheme, rng=keys,
                          validate=False)
        bonus = out.bonus_token.tolist()
        paths = out.accepted_nodes
        # The target's probability of every token each sample appends (accepted nodes, then the
        # bonus at the last of them), for the drafter: one gather for the step.
        flat_rows, flat_tokens = [], []
        for b, tree in enumerate(trees):
            tokens, local = _appended(tree, paths[b], bonus[b])
            flat_rows += [offsets[b] + r for r in local]
            flat_tokens += tokens
        appended = probs[torch.tensor(flat_rows, device=self.device),
                         torch.tensor(flat_tokens, device=self.device)].tolist()
        top = _top(probs, flat_rows, appended, *alternatives)
        results, start = [], 0
        for b in range(len(samples)):
            end = start + 1 + len(paths[b])
            results.append((paths[b], bonus[b], appended[start:end], None if top is None else top[start:end]))
            start = end
        return results

    def _commit(self, step: _Step, logits: torch.Tensor, results, cache: KVCache, drafter, stats: RunStats,
                padded: bool) -> int:
        """Append accepted tokens, move accepted tree nodes into place in the cache, observe.

        Padded ablation: every sample's slot advances by the batch's longest acceptance, the
        entries past its own acceptance stay behind as masked filler.
        """
        # Log-probabilities of every appended token in one gather: rows of the packed batch.
        appended = [_appended(tree, result[0], result[1]) for tree, result in zip(step.trees, results)]
        flat_rows = torch.tensor([step.row_offsets[b] + r for b, (_, rows) in enumerate(appended) for r in rows],
                                 device=self.device)
        flat_tokens = torch.tensor([t for tokens, _ in appended for t in tokens], device=self.device)
        logsumexp = torch.logsumexp(logits, -1)
        token_logprobs = (logits[flat_rows, flat_tokens] - logsumexp[flat_rows]).tolist()
        move_slots, move_src, move_dst = [], [], []
        gained = 0
        offset = 0
        advance = 1 + max(len(r[0]) for r in results)
        for b, sample in enumerate(step.samples):
            path, _, token_probs, alternatives = results[b]
            tokens, rows = appended[b]
            stats.accepted_tokens += len(path)
            for k, j in enumerate(path):
                if j != k:
                    move_slots.append(b)
                    move_src.append(sample.written + 1 + j)
                    move_dst.append(sample.written + 1 + k)
            sample.cached += 1 + len(path)
            if padded:
                cache.valid[b, sample.written: sample.written + 1 + len(path)] = True
                cache.valid[b, sample.written + 1 + len(path): sample.written + advance] = False
                sample.written += advance
            else:
                sample.written = sample.cached
            lps = token_logprobs[offset: offset + len(tokens)]
            top_rows = None
            if sample.request.params.logprobs:
                top_rows = logits[flat_rows[offset: offset + len(tokens)]]
                top_rows = top_rows - logsumexp[flat_rows[offset: offset + len(tokens)], None]
            offset += len(tokens)
            before = len(sample.output_ids)
            self._append(sample, tokens, lps, top_rows)
            added = len(sample.output_ids) - before
            gained += added
            drafter.observe(sample.sample_id, tokens[:added], token_probs[:added],
                            None if alternatives is None else alternatives[:added])
        cache.keep_paths(*(torch.tensor(index, dtype=torch.long, device=self.device)
                           for index in (move_slots, move_src, move_dst)))
        return gained

    def _append(self, sample: Sample, tokens: list[int], token_logprobs: list[float],
                logprob_rows: torch.Tensor | None) -> None:
        """Add tokens up to the first stop condition, with their log-probabilities.

        ``logprob_rows`` (log-softmax rows at the tokens' positions) is needed only when the
        request asks for top log-probabilities."""
        request = sample.request
        sp = request.params
        take = tokens[: sample.remaining]
        for i, token in enumerate(take):
            if token in request.stop_ids:
                take = take[: i + 1]
                sample.finish_reason = "stop"
                break
        lp = token_logprobs[: len(take)]
        sample.cumulative_logprob += sum(lp)
        if sp.logprobs is not None:
            sample.logprobs = sample.logprobs or []
            top = logprob_rows[: len(take)].topk(sp.logprobs, dim=-1) if sp.logprobs else None
            for i, token in enumerate(take):
                entry = {token: lp[i]}
                if top is not None:
                    entry.update(zip(top.indices[i].tolist(), top.values[i].tolist()))
                    entry[token] = lp[i]
                sample.logprobs.append(entry)
        sample.output_ids.extend(take)
        if sp.stop and sample.finish_reason is None:
            text = self.tokenizer.decode(sample.output_ids)
            hits = [text.find(s) for s in sp.stop if s in text]
            if hits:
                sample.finish_reason = "stop"
                sample.stop_text_end = min(hits)
        if sample.finish_reason is None and sample.remaining <= 0:
            sample.finish_reason = "length"

    def _retire(self, slots: list[Sample], cache: KVCache, drafter) -> int:
        """Drop finished samples, keeping the live ones in slots 0..B-1 (the attention reads them in place)."""
        finished = [b for b, s in enumerate(slots) if s.finish_reason is not None]
        for b in reversed(finished):
            sample = slots[b]
            last = len(slots) - 1
            if b != last:
                cache.move_sample(last, b, slots[last].written)
                slots[b] = slots[last]
            slots.pop()
            drafter.remove(sample.sample_id)
            request = sample.request
            request.unfinished -= 1
            if request.unfinished == 0:
                cache.release_prompt_slot(request.prompt_slot)
        return len(finished)

    def _output(self, request: Request) -> RequestOutput:
        outputs = []
        for sample in request.samples:
            text = self.tokenizer.decode(sample.output_ids)
            if sample.stop_text_end is not None:
                text = text[: sample.stop_text_end]
            outputs.append(CompletionOutput(sample.index, text, list(sample.output_ids), sample.cumulative_logprob,
                                            sample.finish_reason or "length", sample.logprobs))
        return RequestOutput(request.request_id, request.prompt, request.prompt_ids, outputs)


def _position_keys(samples: list[Sample]) -> PositionKeys:
    """Each sample's key and the output position its next token takes."""
    return PositionKeys(np.array([s.key for s in samples], dtype=np.uint64),
                        np.array([len(s.output_ids) for s in samples], dtype=np.int64))


def _acceptance_by_depth(trees: list[DraftTree], results, max_depth: int) -> tuple[list[int], list[int]]:
    """Per depth d: how many samples reached d - 1 with a draft child to try at d, and how many
    accepted it (the statistics the draft budget learns from)."""
    tried = [0] * (max_depth + 1)
    kept = [0] * (max_depth + 1)
    for tree, (path, *_) in zip(trees, results):
        if not tree.tokens:
            continue
        node = -1
        for depth in range(1, max_depth + 1):
            if node not in tree.parents:
                break
            tried[depth] += 1
            if depth > len(path):
                break
            kept[depth] += 1
            node = path[depth - 1]
    return tried, kept


def _appended(tree: DraftTree, path: list[int], bonus: int) -> tuple[list[int], list[int]]:
    """The tokens a sample appends (its accepted nodes, then the bonus) and, for each, the row of
    the sample's forward rows (0 = its last token, 1 + j = node j) whose distribution it follows."""
    return [tree.tokens[j] for j in path] + [bonus], [0] + [1 + j for j in path]


def _wanted(drafter) -> tuple[int, float]:
    """How many of the target's most likely tokens the drafter wants per position, and the least
    probability it keeps (see ``Drafter``)."""
    return drafter.alternatives, drafter.min_alternative


def _top(probs: torch.Tensor, rows: list[int], token_probs: list[float], k: int,
         floor: float) -> list[tuple[list[int], list[float]] | None] | None:
    """For each of ``rows`` (whose sampled token has probability ``token_probs[i]``), the ``k``
    most likely tokens and their probabilities; None for all if k is 0, and None for a row where
    the sampled token leaves less than ``floor`` to every other token (nothing the drafter keeps).

    A full-vocabulary top-k costs a few percent of a big compute-bound step on a CPU, so it runs
    only on the rows that can have an alternative, once per distinct row (a prefill's n samples
    share one), and on ``probs`` in place when that is all of them."""
    if k <= 0:
        return None
    out: list[tuple[list[int], list[float]] | None] = [None] * len(rows)
    wanted = [i for i, p in enumerate(token_probs) if 1.0 - p >= floor]
    if not wanted:
        return out
    distinct = sorted({rows[i] for i in wanted})
    if distinct == list(range(probs.shape[0])):
        values, tokens = probs.topk(min(k, probs.shape[-1]), dim=-1)
    else:
        chosen = torch.tensor(distinct, device=probs.device)
        values, tokens = probs.index_select(0, chosen).topk(min(k, probs.shape[-1]), dim=-1)
    where = {row: j for j, row in enumerate(distinct)}
    tokens, values = tokens.tolist(), values.tolist()
    for i in wanted:
        j = where[rows[i]]
        out[i] = (tokens[j], values[j])
    return out


def _admit(waiting: deque[Request], free_prompt_slots: int, free_sample_slots: int) -> list[Request]:
    """Take waiting requests in order while each has a prompt slot and room for all its samples."""
    admitted: list[Request] = []
    while waiting and len(admitted) < free_prompt_slots and waiting[0].params.n <= free_sample_slots:
        free_sample_slots -= waiting[0].params.n
        admitted.append(waiting.popleft())
    return admitted


def _context(slots: list[Sample]) -> int:
    """Keys a step's attention reads per query row: longest prompt plus longest sample cache."""
    return max(s.request.prompt_len for s in slots) + max(s.written for s in slots)


def _cumsum(values: list[int]):
    total = 0
    for v in values:
        total += v
        yield total
