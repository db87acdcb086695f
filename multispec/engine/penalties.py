"""Repetition, frequency and presence penalties, as vLLM applies them, on each row of a step.

A row's logits are penalised by the text before its position: the prompt and the sample's
generated tokens, and for a draft node's row the draft tokens on its path from the root. With the
generated tokens (path included) counted per row:

- repetition: a token seen in the prompt or the generated text has its logit divided by the
  penalty where positive, multiplied by it where not;
- frequency: the logit less the penalty times the token's count in the generated text;
- presence: the logit less the penalty where the token was generated at all.

The penalised logits then go through temperature, min-p, top-k and top-p as usual. Because every
row carries exactly the text its position follows, a draft node's row gets the law that plain
decoding would give that position had the path been sampled, so verification stays exact; the
log-probabilities reported stay those of the raw logits, as in vLLM.
``multispec.engine.rules`` applies them with the other rules on the logits.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch


def penalizes(params) -> bool:
    """Whether a request's law depends on its text through a penalty."""
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def penalized(logits: torch.Tensor, requests: Sequence, prompts: Sequence[Sequence[int]],
              generated: Sequence[Sequence[int]]) -> torch.Tensor:
    """float32 logits [R, V] with each row's penalties: row r belongs to ``requests[r]`` (its
    sampling parameters), follows the prompt ``prompts[r]`` and the generated tokens
    ``generated[r]`` (path tokens included). Rows of requests without penalties come back as
    their raw values."""
    scored = logits.float()
    return penalize_(scored.clone() if scored is logits else scored, requests, prompts, generated)


def penalize_(scored: torch.Tensor, requests: Sequence, prompts: Sequence[Sequence[int]],
              generated: Sequence[Sequence[int]]) -> torch.Tensor:
    """``penalized`` in place on float32 logits ``scored``, which it returns. Only the (row, token)
    entries the texts name are read and written, one key per occurrence and nothing sorted: a
    key repeated in an assignment writes the same value each time, and frequency adds up its
    repeats (an accumulating write)."""
    vocab = scored.shape[-1]
    device = scored.device
    flat = scored.view(-1)

    def keys(lists: Sequence[Sequence[int]]) -> torch.Tensor:
        lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        token = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
        return torch.from_numpy(np.repeat(np.arange(len(lists), dtype=np.int64) * vocab, lengths) + token).to(device)

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r.params, name) for r in requests], dtype=torch.float32, device=device)

    output = keys(generated)  # every generated token of every row, repeats included
    repetition = per_row("repetition_penalty")
    if bool((repetition != 1.0).any()):
        seen = torch.cat([output, keys([p if r.params.repetition_penalty != 1.0 else ()
                                        for r, p in zip(requests, prompts)])])
        factor = repetition[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / factor, values * factor)
    frequency, presence = per_row("frequency_penalty"), per_row("presence_penalty")
    if bool((frequency != 0).any()):
        flat.index_put_((output,), -frequency[output // vocab], accumulate=True)  # times the token's count
    if bool((presence != 0).any()):
        flat[output] = flat[output] - presence[output // vocab]  # read first: once per token however repeated
    return scored

