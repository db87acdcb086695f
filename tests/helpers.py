"""Small drivers of the packed forward for tests: prefill a prompt, then step trees through the cache."""

from __future__ import annotations

import torch

from multispec.engine.kv_cache import CacheShape, DecodeAttention, KVCache, PrefillAttention, StepLayout


def new_cache(model, samples: int = 4, capacity: int = 64, prompts: int = 2, prompt_capacity: int = 128) -> KVCache:
    dtype = model.output_weight().dtype
    return KVCache(model.config, CacheShape(samples, capacity, prompts, prompt_capacity), dtype)


def prefill(model, cache: KVCache, prompt: list[int], slot: int = 0) -> torch.Tensor:
    """Logits of every prompt position, the prompt's keys stored in prompt slot ``slot``."""
    ids = torch.tensor(prompt)
    return model(ids, torch.arange(len(prompt)), PrefillAttention(cache, [(slot, len(prompt))]))


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
         prompt_slots: list[int], prompt_lens: list[int]) -> list[torch.Tensor]:
    """One packed decode step; sample b sits in cache slot b. Returns each sample's logits rows."""
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
    logits = model(torch.tensor(tokens), torch.tensor(positions), DecodeAttention(cache, layout))
    return list(logits.split(counts))
