"""Penalties and min_tokens on a step's rows: each row ruled by its own text (prompt, output, draft
path)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from multispec import SamplingParams
from multispec.engine.penalties import held_stops, holds_stops, penalized, step_histories, without


def request(prompt, **params):
    return SimpleNamespace(params=SamplingParams(**params), prompt_ids=prompt)


def test_rows_follow_their_own_path():
    """A root and three draft nodes (node 1 under node 0, node 2 beside node 0): each row's text
    is the sample's output, then its path."""
    req = request([1, 2], frequency_penalty=1.0)
    sample = SimpleNamespace(request=req, output_ids=[5, 6])
    tree = SimpleNamespace(tokens=[7, 8, 9], parents=[-1, 0, -1])
    requests, prompts, generated = step_histories([sample], [tree])
    assert requests == [req] * 4 and prompts == [[1, 2]] * 4
    assert generated == [[5, 6], [5, 6, 7], [5, 6, 7, 8], [5, 6, 9]]
    plain = SimpleNamespace(request=request([3]), output_ids=[4])
    assert step_histories([plain], [SimpleNamespace(tokens=[], parents=[])])[2] == [()]  # nothing to penalise


def test_penalties_as_vllm_applies_them():
    """Repetition divides positive logits and multiplies the others of tokens in the prompt or the
    output; frequency subtracts penalty x count and presence penalty x seen, over the output only."""
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0, 1.0]]).repeat(3, 1)
    requests = [request([0, 1], repetition_penalty=2.0), request([0, 1], frequency_penalty=0.5, presence_penalty=0.25),
                request([0, 1])]
    generated = [[2, 2], [2, 2, 3], [2, 3]]
    out = penalized(logits, requests, [r.prompt_ids for r in requests], generated)
    assert torch.equal(out[0], torch.tensor([1.0, -2.0, 1.5, 0.5, -2.0, 1.0]))
    assert torch.equal(out[1], torch.tensor([2.0, -1.0, 3.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, -2.0, 1.0]))
    assert torch.equal(out[2], logits[2])  # no penalty: the raw row


def test_min_tokens_holds_the_stops_of_rows_before_it():
    """A sample with 1 token and min_tokens 3: its root (depth 0) and first-level nodes (depth 1)
    hold the stops, deeper nodes do not; a stop id past the vocabulary is skipped; a sample past
    its min_tokens holds nothing."""
    vocab = 6
    held = SimpleNamespace(params=SamplingParams(min_tokens=3), stop_ids=frozenset({2, 4, 9}))
    free = SimpleNamespace(params=SamplingParams(min_tokens=1), stop_ids=frozenset({2}))
    assert holds_stops(held, 1) and not holds_stops(free, 1)
    assert not holds_stops(SimpleNamespace(params=SamplingParams(min_tokens=3), stop_ids=frozenset()), 0)
    # sample 0: root, node 0 (depth 1), node 1 under node 0 (depth 2), node 2 (depth 1); sample 1 after it
    keys = held_stops([held, free], [1, 1], [[-1, 0, -1], [-1]], [0, 4], vocab)
    assert sorted(keys.tolist()) == [0 * vocab + 2, 0 * vocab + 4, 1 * vocab + 2, 1 * vocab + 4, 3 * vocab + 2,
                                     3 * vocab + 4]
    assert held_stops([free], [1], [[-1]], [0], vocab) is None
    logits = torch.zeros(6, vocab, dtype=torch.bfloat16)
    out = without(logits, keys)
    assert out.dtype == torch.float32 and torch.isinf(out).sum() == 6 and out[0, 2] == float("-inf")
    assert not torch.isinf(logits.float()).any()  # the step's logits themselves untouched
