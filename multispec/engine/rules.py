"""A request's rules on the logits, applied to each row before the sampling law, in vLLM's order:
the grammar of ``structured_outputs`` (its mask, ``multispec.engine.grammar``),
``allowed_token_ids`` (every other token gets no probability), ``bad_words`` (a word's last token
gets none where the text ends with the rest of it), ``min_tokens`` (the stop tokens get none on
rows before it), ``logit_bias`` (added to the logits), then the repetition, frequency and presence
penalties (``multispec.engine.penalties``). Temperature, min-p, top-k and top-p follow.

The rows are a step's (each sample's root, then its draft nodes) or a prefill's (each prompt's
last). A row's rules read only its request and the text before its position: the sample's output
and, for a draft node's row, the draft path to the node. So every row gets the law plain decoding
would give its position had the path been sampled, and verification stays exact: a draft token a
rule forbids is simply rejected. Log-probabilities stay those of the raw logits, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from multispec.engine.grammar import advance, apply_masks, masks
from multispec.engine.penalties import penalize_, penalizes


@dataclass
class Rows:
    """What the rules read, per row of the logits."""

    requests: list
    prompts: list
    """The request's prompt where it has penalties, else ()."""
    generated: list
    """The tokens before the row (the sample's output, then the draft path) where the request has
    penalties or bad words, else () (nothing reads them)."""
    lengths: list[int]
    """How many tokens come before the row (output and path), for ``min_tokens``."""
    grammars: list = field(default_factory=list)
    """``(row, matcher, path)`` for each row the grammar of ``structured_outputs`` rules: the
    matcher at the sample's output (a prefill's: the request's fresh one) and the draft path after
    it (none after an end of sequence: see ``multispec.engine.grammar``)."""
    dead: list[int] = field(default_factory=list)
    """Filled by ``ruled``: the rows its rules left no token (see ``may_leave_nothing``)."""


def rules_every_row(params) -> bool:
    """Whether a request's rules touch every row of it (all but ``min_tokens``, which ends)."""
    return (params.allowed_token_ids is not None or bool(params.logit_bias) or bool(params.bad_words)
            or penalizes(params) or params.structured_outputs is not None)


def may_leave_nothing(request) -> bool:
    """Whether the rules of ``request`` can leave a row no token: two or more of the rules that take
    tokens away (the grammar, allowed tokens, bad words, the stops held before ``min_tokens``)
    together. One alone never does (a grammar always allows a token or the end, allowed tokens
    are a non-empty list, the others take a few tokens), and the pairing that always would,
    allowed tokens that are all stops under ``min_tokens``, is refused when the request is made."""
    params = request.params
    return sum((request.grammar is not None, params.allowed_token_ids is not None, bool(request.bad_words_ids),
                params.min_tokens > 0)) >= 2


def holds_stops(request, generated: int) -> bool:
    """Whether a sample of ``request`` with ``generated`` tokens may not end yet (``min_tokens``)."""
    return generated < request.params.min_tokens and bool(request.stop_ids)


def ruled_now(request, generated: int) -> bool:
    """Whether the next rows of a sample of ``request`` with ``generated`` tokens need ``ruled``;
    where no row of a step does, the step keeps its fused draws."""
    return rules_every_row(request.params) or holds_stops(request, generated)


def step_rows(samples: Sequence, trees: Sequence) -> Rows:
    """The rows of a step: each sample's root, then its draft nodes in order."""
    rows = Rows([], [], [], [])
    for sample, tree in zip(samples, trees):
        request, out = sample.request, sample.output_ids
        penalized = penalizes(request.params)
        paths: list[list[int]] = [[]]  # the root's, then each node's
        for token, parent in zip(tree.tokens, tree.parents):
            paths.append(paths[parent + 1] + [token])
        if sample.grammar is not None and advance(sample):
            rows.grammars += [(len(rows.requests) + k, sample.grammar, path) for k, path in enumerate(paths)
                              if request.eos_ids.isdisjoint(path)]
        rows.requests += [request] * len(paths)
        rows.prompts += [request.prompt_ids if penalized else ()] * len(paths)
        texts = penalized or bool(request.bad_words_ids)
        rows.generated += [list(out) + path for path in paths] if texts else [()] * len(paths)
        rows.lengths += [len(out) + len(path) for path in paths]
    return rows


def prompt_rows(requests: Sequence) -> Rows:
    """The rows of a prefill: each prompt's last, before any generated token."""
    return Rows(list(requests), [r.prompt_ids if penalizes(r.params) else () for r in requests],
                [() for _ in requests], [0] * len(requests),
                [(row, r.grammar, []) for row, r in enumerate(requests) if r.grammar is not None])


def ruled(logits: torch.Tensor, rows: Rows) -> torch.Tensor:
    """float32 logits [R, V] with each row's rules (a copy), or ``logits`` itself where no row has
    any."""
    vocab = logits.shape[-1]
    device = logits.device
    scored: torch.Tensor | None = None

    def writable() -> torch.Tensor:
        nonlocal scored
        if scored is None:
            scored = logits.float()
            if scored is logits:
                scored = scored.clone()
        return scored

    if rows.grammars:
        masked, bits = masks(rows.grammars, vocab)
        if masked:
            apply_masks(writable(), masked, bits)
    members: dict[int, tuple] = {}  # the rows of each request
    for row, request in enumerate(rows.requests):
        members.setdefault(id(request), (request, []))[1].append(row)
    for request, own in members.values():
        params = request.params
        index = None
        if params.allowed_token_ids is not None:
            index = torch.tensor(own, device=device)
            keep = torch.zeros(vocab, dtype=torch.bool, device=device)
            keep[torch.tensor(params.allowed_token_ids, device=device)] = True
            out = writable()
            out[index] = out[index].masked_fill(~keep, float("-inf"))
        if request.bad_words_ids:
            banned = [(row, word[-1]) for row in own for word in request.bad_words_ids
                      if _ends_with(rows.generated[row], word[:-1])]
            if banned:
                at = torch.tensor(banned, device=device)
                writable()[at[:, 0], at[:, 1]] = float("-inf")
        if params.min_tokens:
            held = [row for row in own if rows.lengths[row] < params.min_tokens]
            stops = sorted(t for t in request.stop_ids if t < vocab)
            if held and stops:
                held_rows = torch.tensor(held, device=device)[:, None]
                writable()[held_rows, torch.tensor(stops, device=device)] = float("-inf")
        if params.logit_bias:
            index = torch.tensor(own, device=device) if index is None else index
            tokens = torch.tensor(list(params.logit_bias), device=device)
            writable()[index[:, None], tokens] += torch.tensor(list(params.logit_bias.values()), device=device)
    if any(penalizes(r.params) for r, _ in members.values()):
        penalize_(writable(), rows.requests, rows.prompts, rows.generated)
    exposed = [row for request, own in members.values() if may_leave_nothing(request) for row in own]
    if exposed and scored is not None:
        index = torch.tensor(exposed, device=device)
        dead = index[scored[index].amax(-1) == float("-inf")]
        if len(dead):
            # Nothing may be drawn there; the rows get finite logits so that no NaN reaches the
            # draws, and whoever reaches such a row fails (``rows.dead``).
            scored[dead] = 0.0
            rows.dead = dead.tolist()
    return logits if scored is None else scored


def _ends_with(text: Sequence[int], prefix: Sequence[int]) -> bool:
    """Whether the generated tokens ``text`` end with ``prefix`` (an empty prefix always)."""
    return not prefix or (len(text) >= len(prefix) and list(text[len(text) - len(prefix):]) == list(prefix))
