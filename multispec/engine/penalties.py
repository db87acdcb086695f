"""The rules that make a row's law depend on the text before it, as vLLM applies them, on each row
of a step: repetition, frequency and presence penalties, and ``min_tokens``.

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

``min_tokens`` holds back the stops: a row whose position comes before the request's
``min_tokens``-th generated token (the sample's output and the draft path counted) gets no
probability on the request's stop tokens, so a draft that ends a sample early is simply rejected.
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
    their raw values. Only the (row, token) entries the texts name are read and written."""
    rows, vocab = logits.shape
    device = logits.device
    scored = logits.float()
    if scored is logits:
        scored = scored.clone()
    flat = scored.view(-1)

    def keys(lists: Sequence[Sequence[int]]) -> torch.Tensor:
        lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        token = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
        return torch.from_numpy(np.repeat(np.arange(len(lists), dtype=np.int64) * vocab, lengths) + token).to(device)

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r.params, name) for r in requests], dtype=torch.float32, device=device)

    output, counts = torch.unique(keys(generated), return_counts=True)
    repetition = per_row("repetition_penalty")
    if bool((repetition != 1.0).any()):
        seen = torch.unique(torch.cat([output, keys([p if r.params.repetition_penalty != 1.0 else ()
                                                     for r, p in zip(requests, prompts)])]))
        factor = repetition[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / factor, values * factor)
    frequency, presence = per_row("frequency_penalty"), per_row("presence_penalty")
    if bool((frequency != 0).any()):
        flat[output] -= frequency[output // vocab] * counts.float()
    if bool((presence != 0).any()):
        flat[output] -= presence[output // vocab]
    return scored


def step_histories(samples: Sequence, trees: Sequence) -> tuple[list, list, list]:
    """Per row of a step (each sample's root, then its draft nodes): the request, the prompt and
    the generated tokens the row follows (the sample's output, then the path to the node); empty
    for rows of requests without penalties, which nothing reads."""
    requests, prompts, generated = [], [], []
    for sample, tree in zip(samples, trees):
        request, out = sample.request, list(sample.output_ids)
        paths: list[list[int]] = []
        for token, parent in zip(tree.tokens, tree.parents):
            paths.append((paths[parent] if parent >= 0 else []) + [token])
        own = penalizes(request.params)
        for path in [[]] + paths:
            requests.append(request)
            prompts.append(request.prompt_ids if own else ())
            generated.append(out + path if own else ())
    return requests, prompts, generated


def holds_stops(request, generated: int) -> bool:
    """Whether the next token of a sample of ``request`` with ``generated`` tokens may not end it
    yet (fewer than ``min_tokens``): only then do its rows need ``held_stops``."""
    return generated < request.params.min_tokens and bool(request.stop_ids)


def held_stops(requests: Sequence, generated: Sequence[int], parents: Sequence[Sequence[int]],
               row_offsets: Sequence[int], vocab: int) -> torch.Tensor | None:
    """Flat indices (row x vocab + token) of a step's logits that ``min_tokens`` holds back. Sample
    b belongs to ``requests[b]``, has ``generated[b]`` tokens and its draft tree's ``parents[b]``
    (-1: the root), its rows starting at ``row_offsets[b]``. Held: each stop token of a row whose
    tokens so far (the sample's, then the draft path to the row's node) number fewer than the
    request's ``min_tokens``. None where nothing is held."""
    keys: list[int] = []
    for request, count, tree, offset in zip(requests, generated, parents, row_offsets):
        left = request.params.min_tokens - count  # rows less deep than this hold the stops back
        if left <= 0 or not request.stop_ids:
            continue
        depths = [0]
        for parent in tree:
            depths.append(depths[parent + 1] + 1)
        stops = sorted(t for t in request.stop_ids if t < vocab)
        keys += [(offset + row) * vocab + token for row, depth in enumerate(depths) if depth < left for token in stops]
    return torch.tensor(keys, dtype=torch.long) if keys else None


def without(logits: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
    """float32 logits with the flat entries ``keys`` set to -inf (a copy where that writes)."""
    if keys is None:
        return logits
    scored = logits.float()
    if scored is logits:
        scored = scored.clone()
    scored.view(-1)[keys.to(scored.device)] = float("-inf")
    return scored
