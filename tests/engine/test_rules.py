"""The rules on a step's logits (allowed tokens, min_tokens, logit bias, penalties): each row ruled
by its request and its own text (prompt, output, draft path), in vLLM's order."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from multispec import SamplingParams
from multispec.engine.penalties import penalized
from multispec.engine.rules import holds_stops, prompt_rows, ruled, ruled_now, step_rows


def request(prompt, stops=(), **params):
    return SimpleNamespace(params=SamplingParams(**params), prompt_ids=prompt, stop_ids=frozenset(stops),
                           bad_words_ids=[], grammar=None)


def test_rows_follow_their_own_path():
    """A root and three draft nodes (node 1 under node 0, node 2 beside node 0): each row's text
    is the sample's output, then its path; a request without penalties needs only the lengths."""
    req = request([1, 2], frequency_penalty=1.0)
    sample = SimpleNamespace(request=req, output_ids=[5, 6], grammar=None)
    tree = SimpleNamespace(tokens=[7, 8, 9], parents=[-1, 0, -1])
    rows = step_rows([sample], [tree])
    assert rows.requests == [req] * 4 and rows.prompts == [[1, 2]] * 4
    assert rows.generated == [[5, 6], [5, 6, 7], [5, 6, 7, 8], [5, 6, 9]] and rows.lengths == [2, 3, 4, 3]
    plain = SimpleNamespace(request=request([3]), output_ids=[4], grammar=None)
    rows = step_rows([plain], [tree])
    assert rows.generated == [()] * 4 and rows.prompts == [()] * 4 and rows.lengths == [1, 2, 3, 2]
    assert prompt_rows([req]).lengths == [0] and prompt_rows([req]).prompts == [[1, 2]]


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
    its min_tokens holds nothing, and a step of such samples is left as it is."""
    vocab = 6
    held = request([0], stops={2, 4, 9}, min_tokens=3)
    free = request([0], stops={2}, min_tokens=1)
    assert holds_stops(held, 1) and ruled_now(held, 2) and not holds_stops(held, 3) and not ruled_now(free, 1)
    assert not holds_stops(request([0], min_tokens=3), 0)  # nothing to hold
    tree = SimpleNamespace(tokens=[7, 8, 9], parents=[-1, 0, -1])
    rows = step_rows([SimpleNamespace(request=held, output_ids=[5], grammar=None),
                      SimpleNamespace(request=free, output_ids=[5], grammar=None)],
                     [tree, SimpleNamespace(tokens=[], parents=[])])
    logits = torch.zeros(5, vocab, dtype=torch.bfloat16)
    out = ruled(logits, rows)
    assert out.dtype == torch.float32 and not torch.isinf(logits.float()).any()  # a copy
    assert torch.isinf(out).nonzero().tolist() == [[0, 2], [0, 4], [1, 2], [1, 4], [3, 2], [3, 4]]
    assert ruled(logits, step_rows([SimpleNamespace(request=free, output_ids=[5], grammar=None)], [tree])) is logits


def test_bad_words_follow_each_rows_path():
    """A two-token word (5, 7) bans 7 on the rows whose text ends with 5: the root (the output ends
    with 5) and the node under a 5, not the node under a 6; a one-token word (3) is banned on every
    row; the prompt does not count."""
    req = request([5], bad_words=["x"])
    req.bad_words_ids = [[5, 7], [3]]
    tree = SimpleNamespace(tokens=[6, 5, 1], parents=[-1, -1, 1])  # node 2 (token 1) under node 1 (token 5)
    rows = step_rows([SimpleNamespace(request=req, output_ids=[2, 5], grammar=None)], [tree])
    out = ruled(torch.zeros(4, 8), rows)
    assert [torch.isinf(row).nonzero().flatten().tolist() for row in out] == [[3, 7], [3], [3, 7], [3]]
    first = ruled(torch.zeros(1, 8), prompt_rows([req]))
    assert ruled_now(req, 0) and torch.isinf(first).nonzero().tolist() == [[0, 3]]


def test_rules_in_vllms_order():
    """Allowed tokens, then the held stops, then the bias, then the penalties: a repetition
    penalty divides the biased logit; rows of other requests stay raw."""
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]]).repeat(3, 1)
    ruled_request = request([1], stops={4}, allowed_token_ids=[0, 1, 4], min_tokens=2, logit_bias={"1": 2.0, 0: -0.5},
                            repetition_penalty=2.0)
    biased = request([3], logit_bias={2: 100})
    rows = prompt_rows([ruled_request, biased, request([1])])
    out = ruled(logits, rows)
    inf = float("-inf")
    assert out[0].tolist() == [0.5, (2.0 + 2.0) / 2, inf, inf, inf]  # not 2.0 / 2 + 2.0
    assert out[1].tolist() == [1.0, 2.0, 99.0, 0.5, 3.0] and torch.equal(out[2], logits[2])
