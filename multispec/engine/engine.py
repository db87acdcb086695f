"""The engine: requests in, one step at a time, outputs out (vLLM's ``add_request`` / ``step`` /
``abort`` shape), with continuous batching.

Each ``step`` admits the waiting requests that fit and prefills their prompts (one forward; the
first token of each of the n samples is sampled from the prompt's last row), then runs one decode
step for every live sample of every request: draft, pack, one target forward, verify, commit,
observe. Plain decoding is the same step with empty drafts. Samples leave the batch as soon as
they finish and their slots go to whoever waits. Nothing else drives the loop: ``LLM.generate``
and ``AsyncLLM`` are loops over ``step``.

A request whose own bookkeeping fails (its drafter raises, a stop rule fails on its text) is
finished with an error; the others in the batch go on.
"""

from __future__ import annotations

import itertools
import random
import secrets
import time
import warnings
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Callable

import torch

from multispec.drafters import DraftTree
from multispec.engine.attention import DecodeAttention, PrefillAttention
from multispec.engine.costs import Prices, StepCosts, load_or_measure
from multispec.engine.cache import GIB, OVERCOMMIT, CacheShape, KVCache, kv_bytes_per_token
from multispec.engine.grammar import AfterToken, Grammars
from multispec.engine.lane import Lane, lane_key
from multispec.engine.prefix import KeptPrompts, PromptScores
from multispec.engine.rules import prompt_rows, ruled, ruled_now
from multispec.engine.request import Request, Sample
from multispec.engine.scheduler import Scheduler
from multispec.engine.step import (Step, Verified, appended, commit, most_likely, pack, position_keys, sampling_rows,
                                   stuck, verify)
from multispec.engine.sampler import target_probs
from multispec.models.draft_head import DraftHead
from multispec.models.draft_lm import DraftLM, check_window, is_checkpoint, load_draft_lm
from multispec.models.llama import LlamaForCausalLM
from multispec.models.loading import default_cache_dir
from multispec.models.registry import known_models, resolve_model
from multispec.models.tokenizer import Tokenizer
from multispec.params import (HEAD_DRAFTERS, RequestOutput, RequestOutputKind, RunStats, SamplingParams, SpecConfig,
                              prompt_tail)
from multispec.verify.sampling import sample_key, sample_rows
from multispec.verify.schemes import resolve

PROMPT_LOGPROB_ROWS = 256
"""Prompt rows whose logits ``prompt_logprobs`` computes at once (256 x the vocabulary in float32:
50 MB for the default model)."""


@dataclass
class EngineConfig:
    """Limits fixed when the engine is built."""

    max_model_len: int
    kv_cache_bytes: int = 4 * GIB
    model_key: str | None = None
    """Identifies the model's weights (e.g. their file and its size and time), for the step costs
    cached per machine and model (see ``multispec.engine.costs``); None: measured, not cached."""
    cache_dir: str | None = None
    """Where the step costs are cached (default: ``multispec.models.loading.default_cache_dir``)."""
    draft_head: Path | None = None
    """The draft head paired with the model (``drafter="model"`` without ``draft_model``)."""
    model_name: str = "the target"
    """How error messages name the model."""
    kv_cache_dtype: torch.dtype | None = None
    """What the KV cache stores (None: the model's dtype; bfloat16 under float32 weights)."""
    prefix_caching: bool = True
    """Whether prompts reuse the keys and values of earlier prompts they begin with."""
    seed: int | None = None
    """Seeds the requests that give no seed of their own: each takes the next number of a stream
    begun from it, in the order the requests are added, so that a rerun adding the same requests
    draws the same samples (vLLM's ``LLM(seed=)``). None: each such request draws fresh randomness."""


@dataclass
class StepReport:
    """What a decode step did, for step observers (benchmarks, diagnostics): the samples in slot
    order, their draft trees and verification outcomes, the step's token count and its time split
    (seconds)."""

    samples: list[Sample]
    trees: list[DraftTree]
    results: list[Verified]
    tokens: int
    time_draft: float
    time_forward: float
    time_verify: float
    time_commit: float


def nothing_allowed(position: int) -> str:
    """Why a request fails where its rules leave a row no token."""
    return (f"no token is allowed at output position {position}: the request's rules (structured_outputs, "
            f"allowed_token_ids, bad_words, min_tokens) exclude every one there")


class LLMEngine:
    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer, config: EngineConfig,
                 spec: SpecConfig | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self._seeds = random.Random(config.seed) if config.seed is not None else None
        self.default_spec = spec or SpecConfig()
        self.dtype = model.output_weight().dtype
        self.device = model.output_weight().device
        # Kernels on an accelerator run asynchronously; the step's time split (and the draft
        # budget's cost samples) must wait for them to finish.
        on_gpu = self.device.type == "cuda"
        self._sync = (lambda: torch.cuda.synchronize(self.device)) if on_gpu else (lambda: None)
        self.vocab_size = model.config.vocab_size
        self.grammars = Grammars(tokenizer, self.vocab_size)
        self.kv_dtype = config.kv_cache_dtype or self.dtype
        per_token = kv_bytes_per_token(model.config, self.kv_dtype)
        self.cache = KVCache(model.config, config.kv_cache_bytes // per_token, self.kv_dtype, self.device,
                             overcommit=OVERCOMMIT, compute_dtype=self.dtype)
        self.scheduler = Scheduler(self.cache, config.max_model_len, config.prefix_caching)
        self.requests: dict[str, Request] = {}
        self.lanes: dict[tuple, Lane] = {}
        self._step_costs: StepCosts | None = None
        self._model_seconds = 0.0
        """Seconds the lanes' draft models spent in the current step's drafting (see ``_draft``)."""
        self._prices: Prices | None = None
        self.stats = RunStats()
        """Running totals since the engine was built."""
        self.step_observers: list[Callable[[StepReport], None]] = []
        self.position_observers: list[Callable[[list[Sample], list[torch.Tensor], list[torch.Tensor]], None]] = []
        """Called after every forward that gave samples tokens, with those samples and, for each,
        the final hidden states ``[k, H]`` and the logsumexp of the raw logits ``[k]`` of the k
        rows its new tokens were drawn from, in order: the target's features and log-normalisers
        at the sample's positions, as a second forward over the finished text would give them
        (``multispec train-draft`` keeps its samples' this way)."""
        self.driver: str | None = None
        """Who steps the engine from another thread (an ``AsyncLLM``), if anyone."""
        self._changed: dict[str, Request] = {}
        self._next_sample_id = 0
        self._heads: dict[Path, DraftHead] = {}
        self._draft_lms: dict[Path, DraftLM] = {}
        self._scratch: KVCache | None = None

    # ------------------------------------------------------------------ requests
    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     spec: SpecConfig | None = None, *, prompt: str | None = None,
                     output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, name: str | None = None,
                     grammar_after: int | None = None, grammar_open: bool | None = None) -> Request:
        """A request checked against the model and the cache, not yet queued (``enqueue``); the
        check is the whole of ``add_request``'s, so a caller can check several before queuing any.
        ``name``: how error messages call its prompt (default: "the prompt of request <id>").
        ``grammar_after``: a token after which ``structured_outputs`` starts to rule each sample
        (a reasoning model's end of thinking), as vLLM starts it under a reasoning parser; None:
        from the first token. ``grammar_open``: whether the prompt has already passed that token
        (the thinking ended in it); None: wherever the prompt holds the token, as vLLM decides.

        ``max_tokens`` past the context window is clipped to it, as vLLM's offline ``LLM`` does:
        such samples end with finish_reason "length"."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r}: must be a non-empty string")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r}: must be a SamplingParams")
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ValueError(f"spec={spec!r}: must be a SpecConfig or None")
        if not isinstance(output_kind, RequestOutputKind):
            raise ValueError(f"output_kind={output_kind!r}: must be a RequestOutputKind")
        subject = name or f"the prompt of request {request_id!r}"
        ids = list(prompt_ids) if isinstance(prompt_ids, (list, tuple)) else None
        if ids is None or not all(isinstance(t, Integral) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{subject} must be a list of token ids")
        if not ids:
            raise ValueError(f"{subject} is empty: give at least one token")
        ids = prompt_tail(ids, params.truncate_prompt_tokens, self.config.max_model_len)
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"{subject} has {len(ids)} tokens, more than the context window allows "
                             f"(max_model_len={self.config.max_model_len}, leaving room for 1 new token)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{subject} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
        for field in ("logprobs", "prompt_logprobs"):
            if (getattr(params, field) or 0) > self.vocab_size:
                raise ValueError(f"{field}={getattr(params, field)!r}: must be at most the vocabulary size "
                                 f"{self.vocab_size}")
        for field in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            given = getattr(params, field) or ()
            outside = [t for t in given if t >= self.vocab_size]
            if outside:
                raise ValueError(f"{field}={given!r:.80}: token ids must lie in [0, {self.vocab_size}), "
                                 f"not {outside[:5]}")
        spec = spec or self.default_spec
        spec.check()
        spec.check_temperature(params.temperature)
        eos = frozenset(self.tokenizer.eos_token_ids)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos)
        if params.min_tokens and params.allowed_token_ids is not None and stop_ids >= set(params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids={params.allowed_token_ids!r}: with min_tokens={params.min_tokens} "
                             f"a sample needs a token besides its stop tokens")
        max_tokens = min(params.max_tokens, self.config.max_model_len - len(ids))
        if spec.speculates and spec.drafter in HEAD_DRAFTERS:
            draft = self.draft_model(spec.draft_model)
            if isinstance(draft, DraftLM):
                check_window(draft, len(ids) + max_tokens, subject)
        draft = spec.max_draft_nodes if spec.speculates else 0
        request = Request(request_id, prompt, [int(t) for t in ids], params, spec, max_tokens,
                          params.seed if params.seed is not None else self._unseeded(), stop_ids, eos, output_kind,
                          resolve(spec.scheme, spec.draft_law, params.temperature).name, lane_key(spec, params),
                          max_tokens + draft + 1)
        request.bad_words_ids = self._bad_words_ids(params.bad_words or ())
        if params.structured_outputs is not None:
            request.grammar = self.grammars.matcher(params.structured_outputs)
            if grammar_after is not None:
                if isinstance(grammar_after, bool) or not isinstance(grammar_after, Integral) or \
                        not 0 <= grammar_after < self.vocab_size:
                    raise ValueError(f"grammar_after={grammar_after!r}: must be a token id below {self.vocab_size}")
                opened = grammar_after in ids if grammar_open is None else bool(grammar_open)
                request.grammar = AfterToken(request.grammar, int(grammar_after), opened)
        self.scheduler.check_fits(request)
        return request

    def _bad_words_ids(self, words) -> list[list[int]]:
        """Each bad word as token ids, as vLLM tokenizes them: the word as written (leading space
        stripped), and with a leading space where that starts with another token and is as long."""
        out: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            out.append(bare)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return [ids for ids in out if ids and max(ids) < self.vocab_size]

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    spec: SpecConfig | None = None, *, prompt: str | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """Queue a request (``spec``: its speculation settings, the engine's default when None).
        It is admitted at a coming step, when its prompt and samples fit; one that can never fit
        is refused here with a ValueError, as is an id already in use."""
        self.enqueue(self.make_request(request_id, prompt_ids, params, spec, prompt=prompt, output_kind=output_kind))

    def enqueue(self, request: Request) -> None:
        """Queue a request made by ``make_request``. The first with an adaptive draft budget
        has the step costs measured here (once per machine and model, about 20 seconds for the
        default model on a small CPU), between steps, so that no step's time includes it."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        if request.spec.speculates and request.spec.adaptive:
            self.step_costs()
        self.requests[request.request_id] = request
        self.scheduler.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its slots; its outputs end here. An unknown or finished id is
        ignored (a request may finish while its abort is on the way), as in vLLM."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self._changed.pop(request_id, None)
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
            return
        for sample in request.samples:
            if not sample.finished:
                sample.finish("abort")
        self._retire()

    def abort_sample(self, request_id: str, index: int) -> None:
        """Stop one sample of a request (finish_reason "abort") and free its slot; the others go
        on. An unknown or finished request is ignored; an index outside [0, n) is a ValueError."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if isinstance(index, bool) or not isinstance(index, Integral) or not 0 <= index < request.n:
            raise ValueError(f"index={index!r}: request {request_id!r} has samples 0 to {request.n - 1}")
        if not request.samples:  # still waiting: the sample starts finished
            request.aborted.add(int(index))
            return
        sample = request.samples[index]
        if not sample.finished:
            sample.finish("abort")
            self._changed[request_id] = request
            self._retire()

    def reset_prefix_cache(self) -> None:
        """Forget what every prompt slot holds (``multispec.engine.prefix``), and the prompts the
        draft models keep."""
        self.cache.prefixes.reset(len(self.cache.prefixes.tokens))
        for draft in self._draft_lms.values():
            if draft.kept is not None:
                draft.kept.reset()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit and prefill what fits, run one decode step for every live sample, and report the
        requests that changed (by each one's output kind). Nothing to do: an empty list."""
        start = time.perf_counter()
        changed, self._changed = self._changed, {}
        admitted = self.scheduler.admit()
        if admitted:
            self._prefill(admitted, changed)
            self._retire()
        if self.scheduler.slots:
            self._decode(changed)
            self._retire()
        outputs = []
        now = time.monotonic()
        for request in changed.values():
            if request.request_id not in self.requests:
                continue
            out = request.output(self.tokenizer)
            if request.finished:
                request.metrics.finished_time = now
                del self.requests[request.request_id]
            if out is not None:
                outputs.append(out)
        if admitted or changed:
            self.stats.time_total += time.perf_counter() - start
        return outputs

    def _lane(self, request: Request) -> Lane:
        lane = self.lanes.get(request.lane)
        if lane is None:
            spec = request.spec
            draft = self.draft_model(spec.draft_model) if spec.speculates and spec.drafter in HEAD_DRAFTERS else None
            lane = self.lanes[request.lane] = Lane(spec, self.vocab_size, self.prices,
                                                   temperature=request.params.temperature, draft=draft)
        return lane

    def _unseeded(self) -> int:
        """The seed of a request that gives none (see ``EngineConfig.seed``)."""
        return self._seeds.getrandbits(64) if self._seeds is not None else secrets.randbits(64)

    def draft_model(self, name: str | None = None) -> DraftHead | DraftLM:
        """What ``SpecConfig.draft_model`` names, loaded once: a causal LM checkpoint (a registered
        name, a checkpoint directory, a GGUF file or a cached Hub repository) that shares the
        target's tokenizer, or else a
        draft head file (None: the head paired with the model); a ValueError says why it cannot
        draft for this model."""
        if name is not None and not Path(name).expanduser().exists() and not is_checkpoint(name):
            raise ValueError(f"draft_model={name!r} not found: give a draft head file, a checkpoint directory, a "
                             f".gguf file, a known model name ({', '.join(known_models())}) or the id of a "
                             f"Hugging Face repository in the local cache")
        if name is None or not is_checkpoint(name):
            return self.draft_head(name)
        key = Path(resolve_model(name)).expanduser().resolve()
        draft = self._draft_lms.get(key)
        if draft is None:
            draft = load_draft_lm(name, self.model, self.tokenizer, self.config.model_name, self.config.cache_dir)
            draft.kept = KeptPrompts() if self.config.prefix_caching else None
            self._draft_lms[key] = draft
        return draft

    def draft_head(self, path: str | None = None) -> DraftHead:
        """The draft head at ``path`` (None: the one paired with the model), loaded once, in the
        model's dtype and on its device, sharing its embedding and output rows; a ValueError
        says why a head cannot serve this model."""
        if path is None:
            if self.config.draft_head is None:
                raise ValueError(f"drafter='model': no draft head is paired with {self.config.model_name}; give "
                                 f"SpecConfig(draft_model=<head.safetensors>) (train one with multispec train-draft)")
            path = self.config.draft_head
        key = Path(path).expanduser().resolve()
        head = self._heads.get(key)
        if head is None:
            head = DraftHead.load(key, self.dtype, self.device)
            try:
                head.attach(self.model)
            except ValueError as error:
                raise ValueError(f"draft_model={str(path)!r} does not fit {self.config.model_name}: {error}") from None
            self._heads[key] = head
        return head

    def step_costs(self, refresh: bool = False, even_if_busy: bool = False) -> StepCosts:
        """What a decode step of each shape costs here (the draft budget's prices): from the cache
        when this machine and model were measured before, else measured now, once. ``refresh``
        measures again and replaces the cached prices (lanes built before keep the old ones);
        ``even_if_busy`` caches them even where other work kept the machine busy meanwhile."""
        if self._step_costs is None or refresh:
            root = Path(self.config.cache_dir).expanduser() if self.config.cache_dir else default_cache_dir()
            self._step_costs = load_or_measure(self, self.config.model_key, root, refresh, even_if_busy)
            self._prices = None
        return self._step_costs

    def prices(self) -> Prices:
        """The step costs with the live correction of drafting steps (see ``Prices``), which every
        decode step updates once they exist."""
        if self._prices is None:
            self._prices = Prices(self.step_costs())
        return self._prices

    def _fail(self, request: Request, error: BaseException, changed: dict[str, Request]) -> None:
        """Finish a request whose own bookkeeping raised; the rest of the batch goes on."""
        request.error = f"{type(error).__name__}: {error}"
        for sample in request.samples:
            if not sample.finished:
                sample.finish("abort")
        changed[request.request_id] = request

    def _prefill(self, requests: list[Request], changed: dict[str, Request]) -> None:
        """One forward over the admitted prompts (two where some continue a prompt admitted with
        them: see ``multispec.engine.prefix``); each prompt's last row gives its n samples their
        first token, drawn with each sample's own keyed random number for output position 0."""
        t0 = time.perf_counter()
        rows: dict[int, torch.Tensor] = {}
        forwards = 0
        for wave in ([r for r in requests if r.source is None], [r for r in requests if r.source is not None]):
            if wave:
                rows.update(self._prefill_forward(wave))
                forwards += 1
        hidden = torch.cat([rows[id(r)] for r in requests])
        logits = self.model.logits(hidden)
        ruled_rows = prompt_rows(requests) if any(ruled_now(r, 0) for r in requests) else None
        scored = logits if ruled_rows is None else ruled(logits, ruled_rows)
        dead = set() if ruled_rows is None else set(ruled_rows.dead)
        probs = target_probs(scored, *sampling_rows(requests, self.device))
        logprobs = torch.log_softmax(logits, -1)
        now = time.monotonic()
        for row, request in enumerate(requests):
            n = request.n
            request.samples = [Sample(request, i, self._next_sample_id + i, sample_key(request.seed, i),
                                      logprobs=[] if request.params.logprobs is not None else None,
                                      stream=self.tokenizer.stream(request.params.skip_special_tokens)
                                      if request.tracks_text else None,
                                      grammar=None if request.grammar is None else request.grammar.deep_copy())
                               for i in range(n)]
            self._next_sample_id += n
            request.unfinished = n
            request.metrics.first_token_time = now
            self.scheduler.place(request.samples)
            changed[request.request_id] = request
            try:
                if row in dead:
                    raise ValueError(nothing_allowed(0))
                lane = self._lane(request)
                first = sample_rows(probs[row:row + 1], position_keys(request.samples).at(torch.arange(n), 0))
                tokens = first.tolist()
                token_probs = probs[row, first].tolist()
                wanted = lane.drafter.alternatives, lane.drafter.min_alternative
                tops = most_likely(probs, [row] * n, token_probs, *wanted)
                lane.add(request)
                for k, (sample, token) in enumerate(zip(request.samples, tokens)):
                    if k in request.aborted:
                        sample.finish("abort")
                        continue
                    sample.append([token], [float(logprobs[row, token])], logprobs[row:row + 1])
                    lane.drafter.observe(sample.sample_id, sample.output_ids, [token_probs[k]],
                                         None if tops is None else [tops[k]])
                if getattr(lane.drafter, "wants_features", False):
                    live = [s.sample_id for s in request.samples if not s.finished]
                    lane.drafter.observe_features(live, [hidden[row:row + 1]] * len(live))
                if self.position_observers:
                    given = [s for s in request.samples if s.output_ids]
                    h, lse = hidden[row:row + 1], torch.logsumexp(logits[row:row + 1].float(), -1)
                    for observer in self.position_observers:
                        observer(given, [h] * len(given), [lse] * len(given))
                self.stats.generated_tokens += n
            except Exception as error:  # noqa: BLE001 - one request's failure must not stop the others
                self._fail(request, error, changed)
        self.stats.prefill_forwards += forwards
        self.stats.prompt_tokens += sum(r.prompt_len for r in requests)
        self.stats.cached_prompt_tokens += sum(r.cached for r in requests)
        self.stats.time_prefill += time.perf_counter() - t0

    def _prefill_forward(self, requests: list[Request]) -> dict[int, torch.Tensor]:
        """One forward over the part of each prompt its slot does not hold yet (after copying in
        what it continues); keeps what each slot then holds, with its prompt's log-probabilities
        where asked. Returns each request's last row (final hidden state), by ``id``."""
        for request in requests:
            if request.copy_from is not None:
                self.cache.copy_prompt(request.copy_from, request.prompt_slot, request.cached)
            if request.source is not None and request.params.prompt_logprobs is not None:
                request.prompt_scores = request.source.prompt_scores.prefix(request.cached + 1)
        token_ids = torch.tensor([t for r in requests for t in r.prompt_ids[r.cached:]], device=self.device)
        positions = torch.cat([torch.arange(r.cached, r.prompt_len) for r in requests]).to(self.device)
        attention = PrefillAttention(self.cache, [(r.prompt_slot, r.prompt_len - r.cached) for r in requests],
                                     [r.cached for r in requests])
        every = self.model.hidden_states(token_ids, positions, attention)
        last: dict[int, torch.Tensor] = {}
        start = 0
        for request in requests:
            end = start + request.prompt_len - request.cached
            top = request.params.prompt_logprobs
            if top is not None:
                held = request.prompt_scores if request.cached else PromptScores(top, [None], [None], [None])
                request.prompt_scores = held.extend(
                    self._prompt_scores(every[start:end - 1], request.prompt_ids[request.cached + 1:], top))
                request.prompt_logprobs, request.prompt_ranks = request.prompt_scores.entries(request.prompt_ids, top)
            if self.scheduler.prefix_caching:
                self.cache.prefixes.hold(request.prompt_slot, request.prompt_ids, request.prompt_scores)
            last[id(request)] = every[end - 1:end]
            start = end
        return last

    def _prompt_scores(self, hidden: torch.Tensor, following: list[int], top: int) -> PromptScores:
        """The log-probability of each of the ``following`` tokens given the ones before it (raw
        logits, as vLLM reports them), with the ``top`` likeliest, and its rank in the vocabulary
        (1: the likeliest; ties share the better rank). ``hidden``: the rows before each (one per
        token). The head runs on 256 rows at a time."""
        scores = PromptScores(top, [], [], [])
        from multispec import kernels

        kernel = kernels.token_logprobs() if self.device.type == "cpu" else None
        for begin in range(0, len(following), PROMPT_LOGPROB_ROWS):
            rows = hidden[begin:begin + PROMPT_LOGPROB_ROWS]
            tokens = following[begin:begin + len(rows)]
            if kernel is not None:  # one pass a row, no log-softmax written out
                chosen_rows, rank, best_values, best_indices = kernel(
                    self.model.logits(rows, float32=False).contiguous(), torch.tensor(tokens), top)
                chosen, best_values, best_indices = chosen_rows.tolist(), best_values.tolist(), best_indices.tolist()
                scores.ranks.extend(rank.tolist())
            else:
                logprobs = torch.log_softmax(self.model.logits(rows), -1)
                chosen_rows = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])
                scores.ranks.extend(((logprobs > chosen_rows).sum(-1) + 1).tolist())
                chosen = chosen_rows[:, 0].tolist()
                best = logprobs.topk(top, -1) if top else None
                best_indices, best_values = (best.indices.tolist(), best.values.tolist()) if top else ([], [])
            scores.chosen.extend(chosen)
            scores.best.extend(zip(best_indices, best_values) if top else [((), ())] * len(tokens))
        return scores

    def _decode(self, changed: dict[str, Request]) -> None:
        slots = self.scheduler.slots
        t0 = time.perf_counter()
        context = max(s.request.prompt_len for s in slots) + max(s.cached for s in slots)
        trees = self._draft(slots, context, changed)
        t1 = time.perf_counter()
        step = pack(slots, trees, self.device)
        hidden = self.model.hidden_states(step.token_ids, step.positions, DecodeAttention(self.cache, step.layout))
        logits = self.model.logits(hidden, float32=False)  # verification converts as it reads
        self._sync()
        t2 = time.perf_counter()
        lanes = self._lanes_of(slots)
        asking = [lane.drafter for lane in lanes if lane.wants_alternatives()]
        wanted = (max(d.alternatives for d in asking), min(d.min_alternative for d in asking)) if asking else (0, 0.0)
        results = verify(step, logits, wanted)
        for b, position in stuck(step, results):
            if slots[b].request.error is None:  # its samples keep the tokens they had before this step
                self._fail(slots[b].request, ValueError(nothing_allowed(position)), changed)
        t3 = time.perf_counter()
        kept = commit(step, logits, results, self.cache)
        self._observe(step, results, kept, changed)
        self._features(step, results, hidden, lanes, changed)
        if self.position_observers:
            self._positions(step, results, kept, hidden, logits)
        self._sync()
        t4 = time.perf_counter()
        tokens = int(step.token_ids.numel())
        if self._prices is not None:
            # The draft models' own seconds are priced apart (each lane's cost per depth, or the
            # seconds a scored tree's model spent), so the live correction of what drafting adds to
            # a step leaves them out: counted in both, a draft model was charged twice.
            drafting = sum(1 for tree in trees if tree.tokens)
            self._prices.record(t4 - t0 - self._model_seconds, tokens, len(slots),
                                1 + max(len(tree.tokens) for tree in trees), context, drafting)
        for lane, members in lanes.items():
            lane.record([trees[b] for b in members], [results[b].path for b in members])
        stats = self.stats
        stats.decode_forwards += 1
        stats.sample_steps += len(slots)
        stats.forward_tokens += tokens
        stats.drafted_tokens += tokens - len(slots)
        stats.accepted_tokens += sum(len(r.path) for r in results)
        stats.generated_tokens += sum(kept)
        stats.time_draft += t1 - t0
        stats.time_forward += t2 - t1
        stats.time_verify += t3 - t2
        stats.time_commit += t4 - t3
        if self.step_observers:
            report = StepReport(list(slots), trees, results, tokens, t1 - t0, t2 - t1, t3 - t2, t4 - t3)
            for observer in self.step_observers:
                observer(report)

    def _lanes_of(self, slots: list[Sample]) -> dict[Lane, list[int]]:
        """The lanes of the step's samples, each with its samples' slot indices."""
        lanes: dict[Lane, list[int]] = {}
        for b, sample in enumerate(slots):
            lanes.setdefault(self.lanes[sample.request.lane], []).append(b)
        return lanes

    def _draft(self, slots: list[Sample], context: int, changed: dict[str, Request]) -> list[DraftTree]:
        """Every sample's draft tree, lane by lane; a request whose drafter raises gets no draft
        and fails (see ``_fail``)."""
        trees = [DraftTree.EMPTY] * len(slots)
        self._model_seconds = 0.0
        for lane, members in self._lanes_of(slots).items():
            samples = [slots[b] for b in members]
            budgets = lane.budgets(samples, len(slots), context)
            if not any(budgets):
                continue
            uniforms = None
            if lane.drafter.sampled:  # keyed to each sample's position, like its verification
                uniforms = position_keys(samples).draft_uniforms(max(budgets)).tolist()
            model_time = getattr(lane.drafter, "model_time", None)
            model_forwards = getattr(lane.drafter, "model_forwards", 0)
            asked = time.perf_counter()
            proposed = self._propose(lane, samples, budgets, uniforms, changed)
            proposing = time.perf_counter() - asked
            spent = 0.0
            if model_time is not None:
                spent = lane.drafter.model_time - model_time
                self.stats.time_draft_model += spent
                self._model_seconds += spent
                self.stats.draft_forwards += lane.drafter.model_forwards - model_forwards
                lane.observe_drafting(spent, lane.drafter.model_forwards - model_forwards)
            for b, tree in zip(members, lane.select(proposed, len(slots), context, spent, proposing - spent)):
                trees[b] = tree
        return trees

    def _propose(self, lane: Lane, samples: list[Sample], budgets: list[int], uniforms,
                 changed: dict[str, Request]) -> list[DraftTree]:
        """The lane's trees for ``samples``: one call for all of them (a draft model then runs one
        forward a depth for every request of the lane, not one per request); if that raises, one
        call per request, so that only the request whose drafting fails fails."""
        drafter = lane.drafter
        try:
            return drafter.propose([s.sample_id for s in samples], budgets, uniforms)
        except Exception as error:  # noqa: BLE001 - found again below, request by request
            first = error
        failed = False
        proposed = [DraftTree.EMPTY] * len(samples)
        by_request: dict[Request, list[int]] = {}
        for k, sample in enumerate(samples):
            by_request.setdefault(sample.request, []).append(k)
        for request, ks in by_request.items():
            try:
                got = drafter.propose([samples[k].sample_id for k in ks], [budgets[k] for k in ks],
                                      None if uniforms is None else [uniforms[k] for k in ks])
            except Exception as error:  # noqa: BLE001 - one request's failure must not stop the others
                self._fail(request, error, changed)
                failed = True
                continue
            for k, tree in zip(ks, got):
                proposed[k] = tree
        if not failed and not lane.warned:
            # No request fails alone (the error depends on the batch, or the failed call changed
            # the drafter's state): the requests go on, but the error must not pass unseen.
            lane.warned = True
            warnings.warn(f"multispec: drafter {lane.spec.drafter!r} raised {type(first).__name__}: {first} for a "
                          f"step's samples together but for no request alone; the requests go on, drafting "
                          f"request by request (shown once)", RuntimeWarning, stacklevel=2)
        return proposed

    def _observe(self, step: Step, results: list[Verified], kept: list[int], changed: dict[str, Request]) -> None:
        """Tell each lane's drafter what its samples appended, and count them for their requests.
        A drafter with ``observe_many`` hears each request's samples in one call, not one a sample."""
        added: dict[Request, tuple[list[int], list[list[int]], list[list[float]], list]] = {}
        for b, sample in enumerate(step.samples):
            request = sample.request
            metrics = request.metrics
            calls = added.get(request)
            if calls is None:
                calls = added[request] = ([], [], [], [])
                changed[request.request_id] = request
                metrics.decode_steps += 1
            metrics.sample_steps += 1
            metrics.drafted_tokens += len(step.trees[b].tokens)
            metrics.accepted_tokens += len(results[b].path)
            if request.error is not None:
                continue
            count = kept[b]
            result = results[b]
            output = sample.output_ids
            calls[0].append(sample.sample_id)
            calls[1].append(output[len(output) - count:])
            calls[2].append(result.token_probs[:count])
            calls[3].append(None if result.alternatives is None else result.alternatives[:count])
        for request, (sample_ids, tokens, probs, alternatives) in added.items():
            if not sample_ids:
                continue
            drafter = self.lanes[request.lane].drafter
            try:
                many = getattr(drafter, "observe_many", None)
                if many is not None:
                    many(sample_ids, tokens, probs, alternatives)
                else:
                    for each in zip(sample_ids, tokens, probs, alternatives):
                        drafter.observe(*each)
            except Exception as error:  # noqa: BLE001 - one request's failure must not stop the others
                self._fail(request, error, changed)

    def _features(self, step: Step, results: list[Verified], hidden: torch.Tensor, lanes: dict[Lane, list[int]],
                  changed: dict[str, Request]) -> None:
        """Give drafters that draft from the target's features (a draft head) each sample's final
        hidden states at the positions its new tokens were drawn from: the root's row, then each
        accepted node's (the last: the row its bonus token was drawn from)."""
        for lane, members in lanes.items():
            if not getattr(lane.drafter, "wants_features", False):
                continue
            live = [b for b in members if not step.samples[b].finished and step.samples[b].request.error is None]
            if not live:
                continue
            rows = [[step.row_offsets[b]] + [step.row_offsets[b] + 1 + node for node in results[b].path] for b in live]
            try:
                # One gather and one unbind for the whole lane: every sample's rows as a tuple of
                # [H] views (a split and a per-sample unbind cost two tensor operations a sample).
                picked = hidden[torch.tensor([r for each in rows for r in each], device=hidden.device)].unbind(0)
                ends = list(itertools.accumulate(len(each) for each in rows))
                lane.drafter.observe_features([step.samples[b].sample_id for b in live],
                                              [picked[end - len(each):end] for each, end in zip(rows, ends)])
            except Exception as error:  # noqa: BLE001 - the lane's requests fail, the others go on
                for request in {step.samples[b].request for b in live}:
                    self._fail(request, error, changed)

    def _positions(self, step: Step, results: list[Verified], kept: list[int], hidden: torch.Tensor,
                   logits: torch.Tensor) -> None:
        """Hand ``position_observers`` the rows each sample's kept tokens were drawn from."""
        samples, rows, counts = [], [], []
        for b, sample in enumerate(step.samples):
            if kept[b] <= 0 or sample.request.error is not None:
                continue
            _, local = appended(step.trees[b], results[b].path, results[b].bonus)
            samples.append(sample)
            rows.extend(step.row_offsets[b] + r for r in local[:kept[b]])
            counts.append(min(kept[b], len(local)))
        if not samples:
            return
        index = torch.tensor(rows, device=hidden.device)
        lse = (step.logsumexp[index] if step.logsumexp is not None
               else torch.logsumexp(logits.index_select(0, index).float(), -1))
        features, lse = hidden.index_select(0, index).split(counts), lse.float().split(counts)
        for observer in self.position_observers:
            observer(samples, list(features), list(lse))

    def _retire(self) -> None:
        for sample in self.scheduler.retire():
            self.stats.finished_samples += 1
            lane = self.lanes.get(sample.request.lane)
            if lane is not None:  # None only where building the lane failed the request
                lane.drafter.remove(sample.sample_id)

    # ------------------------------------------------------------------ teacher forcing
    def sequence_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, in one prefill forward through a scratch cache."""
        states = self.sequence_states(token_ids)
        with torch.inference_mode():
            return self.model.logits(states)

    def sequence_states(self, token_ids: list[int]) -> torch.Tensor:
        """The final (normed) hidden state at every position of one sequence (the features a
        draft head reads), in one prefill forward through a scratch cache."""
        return self.batch_states([token_ids])[0]

    def batch_states(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """``sequence_states`` of several sequences in one prefill forward (each attends only to
        itself), one ``[length, hidden]`` tensor each."""
        lengths = [len(ids) for ids in sequences]
        for ids in sequences:
            if not ids:
                raise ValueError("token_ids is empty")
            if len(ids) > self.config.max_model_len:
                raise ValueError(f"{len(ids)} tokens exceed max_model_len={self.config.max_model_len}")
            if not all(0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        longest = max(lengths)
        # One scratch cache kept between calls: a fresh one per call spends much of a big
        # prefill's time faulting in its new pages.
        need = len(sequences) * longest
        if self._scratch is None or self._scratch.capacity < need:
            self._scratch = KVCache(self.model.config, need, self.dtype, self.device)
        cache = self._scratch
        cache.layout(CacheShape(0, 0, len(sequences), longest))
        slots = [cache.take_prompt_slot() for _ in sequences]  # prefill reads only what it writes
        with torch.inference_mode():
            ids = torch.tensor([t for seq in sequences for t in seq], device=self.device)
            positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
            hidden = self.model.hidden_states(ids, positions, PrefillAttention(cache, list(zip(slots, lengths))))
        return list(hidden.split(lengths))

