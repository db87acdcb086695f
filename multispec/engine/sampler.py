"""From logits to the target distribution p that sampling and verification both use.

Temperature, min-p, top-k and top-p are applied per row (in that order, as vLLM does), so
samples of different requests share one forward. Greedy rows (temperature 0) become one-hot at the argmax: every verification scheme
then reduces to exact greedy decoding without a special case.
"""

from __future__ import annotations

import torch


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """p[T, V] from logits[T, V] and per-row temperature[T], top_k[T] (0 = off), top_p[T] and
    min_p[T] (0 = off; None: off for every row).

    The rules, which the compiled CPU softmax (``sampling.cpp``, ``softmax_truncated``) follows too:
    min-p keeps a token whose scaled logit, (logit - the row's largest) * (1 / temperature), is at
    least log(min_p); top-k keeps a token whose raw logit is at least the k-th largest; top-p, on the
    law those leave, keeps a token when the tokens strictly more likely than it hold less than top_p
    of the mass, so tokens of equal probability are kept or dropped together."""
    logits = logits.float()
    greedy = temperature <= 0
    temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temperature[:, None]
    drop = None
    if min_p is not None and bool((min_p > 0).any()):
        shifted = (logits - logits.amax(-1, keepdim=True)) * temperature.reciprocal()[:, None]
        drop = shifted < torch.log(min_p.float())[:, None]
    use_k = (top_k > 0) & (top_k < logits.shape[-1])
    if bool(use_k.any()):
        kmax = int(top_k[use_k].max())
        least = logits.topk(kmax, dim=-1).values.gather(1, (top_k.clamp(1, kmax) - 1)[:, None])
        below = use_k[:, None] & (logits < least)
        drop = below if drop is None else drop | below
    if drop is not None:
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    use_p = top_p < 1
    if bool(use_p.any()):
        rows = use_p.nonzero().squeeze(1)
        sub = probs[rows]
        ranked = sub.sort(dim=-1, descending=True).values
        before = torch.cat([torch.zeros_like(ranked[:, :1]), ranked.cumsum(-1)[:, :-1]], 1)
        kept = (before < top_p[rows, None]).sum(-1).clamp_min(1)
        floor = ranked.gather(1, (kept - 1)[:, None])
        sub = sub.masked_fill(sub < floor, 0.0)
        probs[rows] = sub / sub.sum(-1, keepdim=True)
    _one_hot_greedy(probs, logits, greedy)
    return probs


def target_probs_and_lse(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor, min_p: torch.Tensor | None = None, truncated: bool | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``target_probs`` and, where the compiled CPU softmax computes them alongside (float32 or
    bf16 logits on a CPU; rows with top-k, top-p or min-p through ``softmax_truncated``), each row's
    logsumexp of its raw logits and the index of each greedy row's one (-1 for the other rows);
    None and None elsewhere. ``logits`` may be in the model's dtype: the kernel reads bf16
    directly. ``truncated`` (some row has top-k, top-p or min-p): where the caller knows it, the
    parameter tensors are not searched for it."""
    if truncated is None:
        truncated = (bool((top_k > 0).any()) or bool((top_p < 1).any())
                     or (min_p is not None and bool((min_p > 0).any())))
    op = _compiled_softmax(logits, truncated)
    if op is None:
        return target_probs(logits, temperature, top_k, top_p, min_p), None, None
    temperature = temperature.to(torch.float32).contiguous()
    if not truncated:
        return op(logits.contiguous(), temperature)
    log_min_p = (torch.full_like(top_p, float("-inf"), dtype=torch.float32) if min_p is None
                 else torch.log(min_p.float()))
    return op(logits.contiguous(), temperature, top_k.to(torch.long).contiguous(),
              top_p.to(torch.float32).contiguous(), log_min_p.contiguous())


def _compiled_softmax(logits: torch.Tensor, truncated: bool):
    """The compiled CPU softmax for these logits (``softmax_truncated`` where some row truncates),
    or None where it does not run."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    from multispec import kernels

    return kernels.softmax_truncated() if truncated else kernels.softmax_rows()


def _one_hot_greedy(probs: torch.Tensor, logits: torch.Tensor, greedy: torch.Tensor) -> None:
    """Greedy rows (temperature 0) become one-hot at their argmax, in place."""
    if bool(greedy.any()):
        rows = greedy.nonzero().squeeze(1)
        top = logits[rows].argmax(-1, keepdim=True)
        probs[rows] = torch.zeros(rows.numel(), probs.shape[-1], dtype=probs.dtype, device=probs.device).scatter_(
            1, top, 1.0)
