"""Penalties on a step's rows: each row penalised by its own text (prompt, output, draft path)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from multispec import SamplingParams
from multispec.engine.penalties import penalized, step_histories


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
