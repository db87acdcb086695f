"""Small drivers of the packed forward for tests: prefill a prompt, then step trees through the cache.

They run on the model's device and hand logits back on the CPU, where the tests compare them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from multispec.engine.attention import DecodeAttention, PrefillAttention, StepLayout
from multispec.engine.cache import CacheShape, KVCache
from multispec.engine.penalties import penalized
from multispec.engine.sampler import target_probs
from multispec.params import SamplingParams
from multispec.verify.sampling import TOKEN, PositionKeys, sample_key


def new_cache(model, samples: int = 4, capacity: int = 64, prompts: int = 2, prompt_capacity: int = 128) -> KVCache:
    """A cache laid out with every slot ready; the tests address slots by number."""
    weight = model.output_weight()
    shape = CacheShape(samples, capacity, prompts, prompt_capacity)
    cache = KVCache(model.config, shape.tokens(), weight.dtype, weight.device)
    cache.layout(shape)
    cache.ready(samples, capacity, [cache.take_prompt_slot() for _ in range(prompts)], prompt_capacity)
    return cache


def prefill(model, cache: KVCache, prompt: list[int], slot: int = 0) -> torch.Tensor:
    """Logits of every prompt position, the prompt's keys stored in prompt slot ``slot``."""
    device = model.output_weight().device
    ids = torch.tensor(prompt, device=device)
    return model(ids, torch.arange(len(prompt), device=device), PrefillAttention(cache, [(slot, len(prompt))])).cpu()


def tree_mask_of(parents_per_sample: list[list[int]]) -> torch.Tensor:
    qmax = 1 + max(len(p) for p in parents_per_sample)
    mask = torch.zeros(len(parents_per_sample), qmax, qmax, dtype=torch.bool)
    for b, parents in enumerate(parents_per_sample):
        mask[b, 0, 0] = True
        for j, parent in enumerate(parents):
            mask[b, j + 1] = mask[b, parent + 1]
            mask[b, j + 1, j + 1] = True
    return mask


def step(model, cache: KVCache, roots: list[int], trees: list[tuple[list[int], list[int]]], cached: list[int],
         prompt_slots: list[int], prompt_lens: list[int], split: bool | None = None) -> list[torch.Tensor]:
    """One packed decode step; sample b sits in cache slot b. Returns each sample's logits rows.
    ``split``: the attention layout (see ``DecodeAttention``)."""
    tokens, positions, counts = [], [], []
    for root, (toks, parents), c, plen in zip(roots, trees, cached, prompt_lens):
        depth = [0]
        for p in parents:
            depth.append(depth[p + 1] + 1)
        tokens += [root] + toks
        positions += [plen + c + d for d in depth]
        counts.append(1 + len(toks))
    layout = StepLayout(torch.tensor(counts), torch.tensor(cached), torch.tensor(prompt_slots),
                        torch.tensor(prompt_lens), tree_mask_of([p for _, p in trees]))
    device = model.output_weight().device
    logits = model(torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                   DecodeAttention(cache, layout, split))
    return list(logits.cpu().split(counts))


def last_logits(llm, ids: list[int]) -> torch.Tensor:
    """The model's next-token logits after ``ids``, from a plain prefill (no speculation involved)."""
    with torch.inference_mode():
        return prefill(llm.model, new_cache(llm.model, prompt_capacity=len(ids)), ids)[-1]


def exact_cells(llm, prompt_ids: list[int], temperature: float, length: int, threshold: float, *, top_k: int = 0,
                top_p: float = 1.0, min_p: float = 0.0, stop_token_ids: tuple = (), min_tokens: int = 0,
                logit_bias: dict | None = None, allowed_token_ids: list | None = None, allows=None,
                **penalties) -> dict:
    """Every token sequence of ``length`` whose exact probability under the sampling law (the
    temperature, top-k, top-p and min-p where given, and the penalties ``penalties`` names, applied
    to each prefix's text) is at least ``threshold``, found by expanding prefixes with plain prefill
    forwards. ``stop_token_ids`` end a sequence (it keeps its mass, shorter), except before
    ``min_tokens`` tokens, where they get no probability; ``allowed_token_ids`` leaves only those
    tokens any; ``logit_bias`` is added before the penalties. ``allows(prefix)``, where given, is a
    bool tensor of the tokens a grammar allows after ``prefix`` (applied first, as in the engine)."""
    request = SimpleNamespace(params=SamplingParams(**penalties))
    cells = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in cells.items():
            if prefix and prefix[-1] in stop_token_ids:
                grown[prefix] = mass
                continue
            logits = last_logits(llm, prompt_ids + list(prefix))[None].clone()
            if allows is not None:
                logits[0, ~allows(prefix)] = float("-inf")
            if allowed_token_ids is not None:
                banned = torch.ones(logits.shape[-1], dtype=torch.bool)
                banned[allowed_token_ids] = False
                logits[0, banned] = float("-inf")
            for token, bias in (logit_bias or {}).items():
                logits[0, token] += bias
            if penalties:
                logits = penalized(logits, [request], [prompt_ids], [list(prefix)])
            if len(prefix) < min_tokens:
                logits[0, list(stop_token_ids)] = float("-inf")
            probs = target_probs(logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]),
                                 torch.tensor([min_p]))[0]
            top = probs.topk(64)
            for p, token in zip(top.values.tolist(), top.indices.tolist()):
                if mass * p >= threshold:
                    grown[prefix + (token,)] = mass * p
        cells = grown
    return cells


def sampled_cells(llm, prompt_ids, keys, length: int, calls, spec) -> tuple[list[int], int]:
    """Counts of the samples' first ``length`` tokens over ``keys`` (each a token tuple), then one
    count for every other sequence, from one ``generate`` call per SamplingParams in ``calls``; and
    the calls' accepted draft tokens, which a test checks to know its drafts were verified at all."""
    counts, other, accepted = dict.fromkeys(keys, 0), 0, 0
    for params in calls:
        for completion in llm.generate([prompt_ids], params, spec, use_tqdm=False)[0].outputs:
            key = tuple(completion.token_ids[:length])
            if key in counts:
                counts[key] += 1
            else:
                other += 1
        accepted += llm.last_stats.accepted_tokens
    return [counts[k] for k in keys] + [other], accepted


NEAR_TIE = 1e-4
"""How close to a boundary of the cumulative distribution a draw may fall and still be decided
differently by two batch shapes: a batch's shape changes the rounding of the logits (about 1e-6),
and a float32 cumulative sum over 49k tokens adds its own; a real bug moves far more mass."""


def assert_same_sampled_tokens(llm, prompt_ids: list[int], got: list[int], want: list[int], seed: int, index: int,
                               temperature: float):
    """Identical ids, except where the random number that decides a position falls within
    ``NEAR_TIE`` of the boundary between the two tokens in the cumulative distribution (or, at
    temperature 0, where the top two logits tie within it); past such a position the texts may
    part. ``seed`` and ``index`` name the sample whose keyed draws decide its tokens."""
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if k is None:
        assert len(got) == len(want), f"sample {index}: {len(got)} tokens vs {len(want)}"
        return
    logits = last_logits(llm, prompt_ids + want[:k])
    if temperature == 0:
        top = logits.topk(2).values
        assert float(top[0] - top[1]) < NEAR_TIE, f"sample {index}, token {k}: {got[k]} vs {want[k]} without a tie"
        return
    probs = torch.softmax(logits.double() / temperature, -1)
    cdf = probs.cumsum(0)
    u = float(PositionKeys([sample_key(seed, index)], [k]).at(torch.tensor([0]), 0).draw(TOKEN, 0, cdf))
    edges = [float(cdf[t] - probs[t]) for t in (got[k], want[k])] + [float(cdf[t]) for t in (got[k], want[k])]
    gap = min(abs(u - edge) for edge in edges)
    assert gap < NEAR_TIE, f"sample {index}, token {k}: {got[k]} vs {want[k]}, draw {u:.6f} is {gap:.2g} from a boundary"
