"""Small drivers of the packed forward for tests: prefill a prompt, then step trees through the cache.

They run on the model's device and hand logits back on the CPU, where the tests compare them."""

from __future__ import annotations

import torch

from multispec.engine.kv_cache import CacheShape, DecodeAttention, KVCache, PrefillAttention, StepLayout


def new_cache(model, samples: int = 4, capacity: int = 64, prompts: int = 2, prompt_capacity: int = 128) -> KVCache:
    weight = model.output_weight()
    return KVCache(model.config, CacheShape(samples, capacity, prompts, prompt_capacity), weight.dtype, weight.device)


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
    device = model.output_weight().device
    logits = model(torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                   DecodeAttention(cache, layout))
    return list(logits.cpu().split(counts))
