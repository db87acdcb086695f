"""From logits to the target distribution p that sampling and verification both use.

Temperature, min-p, top-k and top-p are applied per row (in that order, as vLLM does), so samples of different requests share one
forward. Greedy rows (temperature 0) become one-hot at the argmax: every verification scheme
then reduces to exact greedy decoding without a special case.
"""

from __future__ import annotations

import torch


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """p[T, V] from logits[T, V] and per-row temperature[T], top_k[T] (0 = off), top_p[T] and
    min_p[T] (0 = off; None: off for every row)."""
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if min_p is not None and bool((min_p > 0).any()):
        # p_i >= min_p * p_max, read on the scaled logits: s_i - s_max >= log(min_p).
        floor = torch.log(min_p.to(scaled.dtype))[:, None]
        scaled = scaled.masked_fill(scaled - scaled.amax(-1, keepdim=True) < floor, float("-inf"))
    use_k = top_k > 0
    if bool(use_k.any()):
        k = torch.where(use_k, top_k, torch.full_like(top_k, scaled.shape[-1])).clamp(max=scaled.shape[-1])
        kmax = int(k[use_k].max())
        top_values = scaled.topk(kmax, dim=-1).values
        threshold = top_values.gather(1, (k.clamp(max=kmax) - 1)[:, None])
        scaled = scaled.masked_fill(use_k[:, None] & (scaled < threshold), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    use_p = top_p < 1
    if bool(use_p.any()):
        rows = use_p.nonzero().squeeze(1)
        sub = probs[rows]
        sorted_p, order = sub.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = before >= top_p[rows, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        sub = sub.masked_fill(drop, 0.0)
        probs[rows] = sub / sub.sum(-1, keepdim=True)
    _one_hot_greedy(probs, logits, greedy)
    return probs


def target_probs_and_lse(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor, min_p: torch.Tensor | None = None, truncated: bool | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``target_probs`` and, where the compiled CPU softmax computes them alongside (rows without
    top-k, top-p or min-p, float32 or bf16 logits on a CPU), each row's logsumexp of its raw logits and
    the index of each greedy row's one (-1 for the other rows); None and None elsewhere. ``logits``
    may be in the model's dtype: the kernel reads bf16 directly. ``truncated`` (some row has top-k,
    top-p or min-p): where the caller knows it, the parameter tensors are not searched for it."""
    op = _compiled_softmax(logits)
    if truncated is None:
        truncated = (bool((top_k > 0).any()) or bool((top_p < 1).any())
                     or (min_p is not None and bool((min_p > 0).any())))
    if op is None or truncated:
        return target_probs(logits, temperature, top_k, top_p, min_p), None, None
    return op(logits.contiguous(), temperature.to(torch.float32).contiguous())


def _compiled_softmax(logits: torch.Tensor):
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    from multispec import kernels

    return kernels.softmax_rows()


def _one_hot_greedy(probs: torch.Tensor, logits: torch.Tensor, greedy: torch.Tensor) -> None:
    """Greedy rows (temperature 0) become one-hot at their argmax, in place."""
    if bool(greedy.any()):
        rows = greedy.nonzero().squeeze(1)
        top = logits[rows].argmax(-1, keepdim=True)
        probs[rows] = torch.zeros(rows.numel(), probs.shape[-1], dtype=probs.dtype, device=probs.device).scatter_(
            1, top, 1.0)
