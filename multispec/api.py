"""The vLLM-shaped entry point: ``LLM(model).generate(prompts, SamplingParams(n=16))``."""

from __future__ import annotations

import gc
import itertools
import logging
import math
import os
import time
from pathlib import Path
from numbers import Integral, Real
from typing import Mapping, Sequence

import torch

from multispec.devices import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from multispec.engine.cache import GIB
from multispec.engine.engine import EngineConfig, LLMEngine
from multispec.engine.request import Request
from multispec.models import DEFAULT_MODEL, load_checkpoint, paired_draft_head, resolve_model
from multispec.models.loading import generation_defaults, load_tokenizer, weights_key
from multispec.models.llama import LlamaForCausalLM
from multispec.params import (SEED_RANGE, CompletionOutput, RequestOutput, RequestOutputKind, RunStats,
                              SamplingParams, SpecConfig, check_bool, check_int)

__all__ = ["LLM", "SamplingParams", "SpecConfig", "RequestOutput", "CompletionOutput", "RunStats"]

log = logging.getLogger("multispec")

_heap_frozen = False


def _freeze_heap() -> None:
    """Once per process, when the first model is loaded: collect, then move every object the
    cyclic garbage collector tracks out of its way (``gc.freeze``).

    That heap is mostly what the imports left (torch alone: some 160,000 tracked objects, 320,000
    once a model is loaded), and none of it becomes garbage. Drafting allocates containers every
    step, so collections run during generation, and each full one walked the whole heap: 120-170
    ms, seven decode steps of 16 samples, at a random step. Frozen, a collection walks only what
    was allocated since. Objects alive now are still freed when their last reference goes (an
    ``LLM`` among them); only cycles among them are no longer collected. ``gc.unfreeze()`` undoes
    it."""
    global _heap_frozen
    if _heap_frozen:
        return
    _heap_frozen = True
    gc.collect()
    gc.freeze()


class LLM:
    """A loaded model that draws n samples per prompt.

    ``model`` is a registered name (default ``smollm2-135m-instruct``), a Hugging Face checkpoint
    directory, a Hub repository id in the local cache or a ``.gguf`` file. ``spec`` is the default
    speculation setting of every ``generate`` call (plain decoding when omitted).
    ``kv_cache_memory`` (GiB) is the KV cache, reserved once here and touched only as slots are
    used; a request that cannot fit even alone is refused before it runs, and requests that fit
    only one after another wait for their turn.
    ``device``: where the weights, the KV cache and verification live ("auto": the first CUDA GPU
    if there is one, else the CPU); drafting always runs on the CPU. ``dtype`` of the weights, the
    activations and the KV cache ("auto": bfloat16 where the hardware computes it natively, see
    ``multispec.devices``; logits, sampling and verification are float32 whatever it is); the one
    chosen is ``self.dtype``. ``kv_cache_dtype``: "auto" (the model's dtype) or "bfloat16" under float32
    weights: keys and values stored rounded to bfloat16, half the bytes (twice the tokens in
    ``kv_cache_memory``, less to read a step), attention still computed in float32; plain and
    speculative decoding see the same rounded cache, so the output law is unchanged between them
    (``self.kv_cache_dtype``). ``generation_config``: where the default sampling settings come from,
    as in vLLM: "auto" the checkpoint's ``generation_config.json`` (temperature, top-p, top-k,
    min-p, repetition penalty, max_new_tokens; ``get_default_sampling_params``), "vllm"
    ``SamplingParams``' own defaults, or another directory's file. ``enable_prefix_caching`` (vLLM's
    name, on by default): a prompt that begins with tokens an earlier prompt had computes only the
    rest, from the keys and values that prompt left in the cache (``multispec.engine.prefix``).
    ``seed`` (vLLM's): requests whose ``SamplingParams`` give no seed take theirs, in the order
    they are added, from a stream begun from it, so that rerunning a script draws the same samples
    (None: fresh randomness each time). ``tokenizer`` (vLLM's): another tokenizer than the
    checkpoint's own, a directory holding ``tokenizer.json`` or a Hub repository id in the local
    cache, with its chat template and end-of-sequence tokens (for a GGUF file, its original
    model's, as vLLM advises); its ids must fit the model's vocabulary. ``revision``: the snapshot of
    a Hub repository id to load (a branch, tag or commit the cache holds; default ``main``).
    ``engine`` is the ``LLMEngine``
    every call steps. The first ``LLM`` of a process freezes the interpreter's heap out of the
    garbage collector's way (``gc.freeze``, see ``_freeze_heap``; ``gc.unfreeze()`` undoes it).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "auto", kv_cache_memory: float = 4.0,
                 max_model_len: int | None = None, spec: SpecConfig | None = None, cache_dir: str | None = None,
                 device: str = "auto", kv_cache_dtype: str = "auto", generation_config: str = "auto",
                 enable_prefix_caching: bool = True, seed: int | None = None, tokenizer: str | None = None,
                 revision: str | None = None):
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model={model!r}: must be a registered name, a checkpoint directory, a "
                             f"Hub repository id or a .gguf path")
        if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, Real) or not (
                math.isfinite(kv_cache_memory) and kv_cache_memory > 0):
            raise ValueError(f"kv_cache_memory={kv_cache_memory!r}: must be a finite number of GiB > 0")
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, Integral)):
            raise ValueError(f"max_model_len={max_model_len!r}: must be an integer or None")
        _check_spec(spec)
        seed = check_int("seed", seed, SEED_RANGE[0], SEED_RANGE[1] - 1, none=True)
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
            raise ValueError(f"tokenizer={tokenizer!r}: must be a directory holding tokenizer.json, a Hub "
                             f"repository id or None")
        if revision is not None and not isinstance(revision, str):
            raise ValueError(f"revision={revision!r}: must be a branch, tag or commit of a Hub repository, or None")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={enable_prefix_caching!r}: must be True or False")
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise ValueError(f"cache_dir={cache_dir!r}: must be a directory path or None")
        if not isinstance(generation_config, (str, os.PathLike)) or (
                generation_config not in ("auto", "vllm") and not Path(generation_config).expanduser().is_dir()):
            raise ValueError(f"generation_config={generation_config!r}: must be 'auto' (the model's "
                             f"generation_config.json), 'vllm' (SamplingParams' own defaults) or a directory")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        path = resolve_model(model, revision)
        checkpoint = load_checkpoint(path, cache_dir=cache_dir)
        self.model_name = model
        self.generation_defaults = {} if generation_config == "vllm" else generation_defaults(
            checkpoint.path if generation_config == "auto" else generation_config)
        """The sampling defaults taken from a generation config (``get_default_sampling_params``)."""
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer if tokenizer is None else load_tokenizer(tokenizer, checkpoint.config)
        self.model = LlamaForCausalLM.from_tensors(checkpoint.config, checkpoint.tensors, self.dtype, self.device)
        limit = checkpoint.config.context_window
        if max_model_len is not None and not 1 < max_model_len <= limit:
            why = checkpoint.config.context_window_reason()
            raise ValueError(f"max_model_len={max_model_len!r}: must be in [2, {limit}] for this model"
                             + (f" ({why})" if why else ""))
        self.spec = spec or SpecConfig()
        engine_config = EngineConfig(max_model_len=max_model_len or limit, kv_cache_bytes=int(kv_cache_memory * GIB),
                                     model_key=weights_key(path), cache_dir=cache_dir,
                                     draft_head=paired_draft_head(model), model_name=str(model),
                                     kv_cache_dtype=self.kv_cache_dtype, prefix_caching=enable_prefix_caching,
                                     seed=seed)
        self.engine = LLMEngine(self.model, self.tokenizer, engine_config, self.spec)
        self.last_stats: RunStats | None = None
        self._ids = itertools.count()
        _freeze_heap()

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every prompt the cache holds (vLLM's method): later prompts compute all their
        tokens until the cache fills again. True once done."""
        if self.engine.driver is not None:  # its thread may be choosing slots from what is held
            raise RuntimeError(f"this LLM's engine is stepped by {self.engine.driver}; use that, or shut it down")
        self.engine.reset_prefix_cache()
        return True

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no ``SamplingParams``: the model's
        generation config (its temperature, top-p, top-k, min-p, repetition penalty and
        max_new_tokens, as vLLM takes them) over ``SamplingParams``' own defaults."""
        return SamplingParams(**self.generation_defaults)

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Mapping
                 | Sequence[Mapping],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 spec: SpecConfig | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate ``n`` completions per prompt; prompts are text or token ids, or vLLM's dict
        prompts (``{"prompt": text}``, ``{"prompt_token_ids": ids}``). Every request is checked
        before any is queued; the engine then steps until all are finished.

        Run counters and timings (forwards, tau, acceptance, time split) land in ``last_stats``. A
        request that failed on its own (``RequestOutput.error``) is returned as it ended, with a
        warning; the others are complete.
        """
        texts, token_ids = self._prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(token_ids)
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
            if len(params) != len(token_ids):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(token_ids)} prompts")
        else:
            raise ValueError(f"sampling_params={sampling_params!r}: must be a SamplingParams, a list of them (one per "
                             f"prompt) or None")
        _check_spec(spec)
        check_bool("use_tqdm", use_tqdm)
        spec = spec or self.spec
        if self.engine.driver is not None:
            raise RuntimeError(f"this LLM's engine is stepped by {self.engine.driver}; use that, or shut it down")
        requests = [self.engine.make_request(f"generate-{next(self._ids)}", ids, sp, spec, prompt=text,
                                             output_kind=RequestOutputKind.FINAL_ONLY, name=f"prompt {i}")
                    for i, (ids, sp, text) in enumerate(zip(token_ids, params, texts))]
        for request in requests:
            self.engine.enqueue(request)
        return self._run(requests, use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every one of ``requests`` is finished; their outputs in order."""
        engine = self.engine
        position = {r.request_id: i for i, r in enumerate(requests)}
        outputs: list[RequestOutput | None] = [None] * len(requests)
        left = len(requests)
        progress = _Progress(sum(r.n for r in requests), enabled=use_tqdm)
        before = engine.stats.copy()
        start = time.perf_counter()
        try:
            while left:
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the engine has no work left but requests are unanswered")
                tokens, finished = engine.stats.generated_tokens, engine.stats.finished_samples
                for out in engine.step():
                    i = position.get(out.request_id)
                    if i is not None and outputs[i] is None:
                        outputs[i] = out
                        left -= 1
                progress.update(engine.stats.generated_tokens - tokens, engine.stats.finished_samples - finished)
        finally:
            progress.close()
            for request, out in zip(requests, outputs):
                if out is None:
                    engine.abort(request.request_id)
        self.last_stats = engine.stats.since(before)
        self.last_stats.time_total = time.perf_counter() - start
        for i, out in enumerate(outputs):
            if out.error:
                log.warning("request %d failed: %s", i, out.error)
        return outputs

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Raw next-token logits [len(token_ids), V] at every position of one sequence (teacher forcing)."""
        return self.engine.sequence_logits(list(token_ids))

    def chat(self, messages: list[dict] | Sequence[list[dict]], sampling_params=None, spec=None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them, then generate.

        A conversation is a list of ``{"role": ..., "content": ...}`` dicts. As in vLLM:
        ``chat_template`` replaces the checkpoint's template, ``add_generation_prompt`` opens the
        assistant's turn, ``continue_final_message`` (with ``add_generation_prompt=False``) lets
        the model go on writing the last message, and ``chat_template_kwargs`` are more variables
        for the template (``{"enable_thinking": False}`` where a template reads it), and ``tools``
        (OpenAI's function definitions) are rendered by templates that render them."""
        conversations = _conversations(messages)
        options = chat_options(chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs,
                               tools)
        prompts = [self.tokenizer.apply_chat_template(c, **options) for c in conversations]
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(token_ids, sampling_params, spec, use_tqdm)
        for output, prompt in zip(outputs, prompts):
            output.prompt = prompt
        return outputs

    def _prompts(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts={prompts!r}: must be a string, a list of strings, a list of token ids, a dict "
                             f"with 'prompt' or 'prompt_token_ids', or a list of these")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        if all(_is_token(t) for t in prompts):
            prompts = [prompts]
        texts, ids = [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError(f"prompt {i} is empty")
                texts.append(prompt)
                ids.append(self.tokenizer.encode(prompt))
            elif isinstance(prompt, (list, tuple)) and all(_is_token(t) for t in prompt):
                texts.append(None)
                ids.append([int(t) for t in prompt])
            elif isinstance(prompt, Mapping):
                text, prompt_ids = self._prompt_dict(i, prompt)
                texts.append(text)
                ids.append(prompt_ids)
            else:
                raise ValueError(f"prompt {i} must be a string, a list of token ids or a dict with 'prompt' or "
                                 f"'prompt_token_ids', got {type(prompt).__name__}")
        return texts, ids

    def _prompt_dict(self, i: int, prompt: Mapping) -> tuple[str | None, list[int]]:
        """vLLM's dict prompts: ``{"prompt": text}`` (TextPrompt) or ``{"prompt_token_ids": ids}``
        (TokensPrompt)."""
        unknown = sorted(str(key) for key in prompt if key not in ("prompt", "prompt_token_ids"))
        if unknown:
            raise ValueError(f"prompt {i}: unsupported key(s) {', '.join(map(repr, unknown))}; a dict prompt takes "
                             f"'prompt' (text) or 'prompt_token_ids'")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"prompt {i}: a dict prompt takes exactly one of 'prompt' and 'prompt_token_ids'")
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str) or not text:
                raise ValueError(f"prompt {i}: 'prompt' must be a non-empty string, got {text!r}")
            return text, self.tokenizer.encode(text)
        token_ids = prompt["prompt_token_ids"]
        if not isinstance(token_ids, (list, tuple)) or not token_ids or not all(_is_token(t) for t in token_ids):
            raise ValueError(f"prompt {i}: 'prompt_token_ids' must be a non-empty list of token ids")
        return None, [int(t) for t in token_ids]


def _is_token(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_spec(spec) -> None:
    if spec is not None and not isinstance(spec, SpecConfig):
        raise ValueError(f"spec={spec!r}: must be a SpecConfig (for example SpecConfig(drafter='consensus')) or None")


def chat_options(chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs,
                 tools=None) -> dict:
    """The chat call's template options, checked, as ``Tokenizer.apply_chat_template`` takes them."""
    if tools is not None and (not isinstance(tools, Sequence) or isinstance(tools, str)
                              or not all(isinstance(tool, Mapping) for tool in tools)):
        raise ValueError(f"tools={tools!r:.80}: must be a list of function definitions (dicts) or None")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise ValueError(f"chat_template={chat_template!r:.80}: must be a non-empty Jinja template or None")
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: must be True or False")
    if chat_template_kwargs is not None and (not isinstance(chat_template_kwargs, Mapping) or not all(
            isinstance(key, str) for key in chat_template_kwargs)):
        raise ValueError(f"chat_template_kwargs={chat_template_kwargs!r:.80}: must be a dict with string keys or None")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True needs add_generation_prompt=False: the first continues the "
                         "last message, the second starts a new one")
    return {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
            "chat_template": chat_template, "template_kwargs": dict(chat_template_kwargs or {}),
            "tools": [dict(tool) for tool in tools] if tools else None}


def _conversations(messages) -> list[list[dict]]:
    """One conversation or a list of them, each checked to be a non-empty list of role/content dicts."""
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
        conversations = [list(messages)]
    elif isinstance(messages, (list, tuple)) and messages and all(isinstance(c, (list, tuple)) for c in messages):
        conversations = [list(c) for c in messages]
    else:
        raise ValueError(f"messages={messages!r:.80}: must be a conversation (a list of {{'role': ..., 'content': ...}} "
                         f"dicts) or a list of conversations")
    for i, conversation in enumerate(conversations):
        if not conversation:
            raise ValueError(f"messages: conversation {i} is empty")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
                    message.get("content"), str):
                raise ValueError(f"messages: conversation {i}, message {j} must be a dict with string 'role' and "
                                 f"'content', got {message!r:.80}")
    return conversations


class _Progress:
    """Finished samples on stderr, with live generated tokens/s."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled and os.environ.get("MULTISPEC_NO_PROGRESS") is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="sample", desc="generating", dynamic_ncols=True)
        self.tokens = 0
        self.start = time.perf_counter()

    def update(self, tokens: int, finished: int) -> None:
        if self.bar is None:
            return
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens} tok, {self.tokens / elapsed:.1f} tok/s", refresh=False)
        self.bar.update(finished)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
