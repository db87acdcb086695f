import torch

from multispec.engine.sampler import target_probs


def rows(n, value, dtype=torch.float32):
    return torch.full((n,), value, dtype=dtype)


def test_temperature_scales_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = target_probs(logits, rows(3, 0.5), rows(3, 0, torch.long), rows(3, 1.0))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1), atol=1e-6)


def test_greedy_rows_are_one_hot_and_others_untouched():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    p = target_probs(logits, torch.tensor([0.0, 1.0]), rows(2, 0, torch.long), rows(2, 1.0))
    assert p[0, logits[0].argmax()] == 1 and p[0].sum() == 1
    assert torch.allclose(p[1], torch.softmax(logits[1], -1), atol=1e-6)


def test_top_k_keeps_k_largest_renormalised():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    p = target_probs(logits, rows(2, 1.0), torch.tensor([5, 0]), rows(2, 1.0))
    top = logits[0].topk(5).indices
    assert set(p[0].nonzero().squeeze(1).tolist()) == set(top.tolist())
    assert torch.allclose(p[0, top], torch.softmax(logits[0, top], -1), atol=1e-6)
    assert (p[1] > 0).all()


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, rows(1, 1.0), rows(1, 0, torch.long), rows(1, 0.7))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    p = target_probs(logits, rows(1, 1.0), rows(1, 0, torch.long), rows(1, 0.81))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95, atol=1e-6)
