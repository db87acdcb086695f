"""Float32 weights read from their integer blocks (``affine_pack`` in stream_gemm.cpp).

A GGUF file's quantised weight, dequantised to float32, is per block of 32 inputs of an output
column ``scale * q + offset`` for small integers q (Q4_1: q in 0..15 and a float16 scale and
minimum; Q8_0: q in -127..127, a float16 scale, no offset). ``affine_pack`` finds those blocks and
checks that one fused multiply-add of them gives back every weight bit for bit, else it returns
None; the product from the blocks must then be the float32 streaming product's, bit for bit (the
same weights in the same FMA order), for every row count and with a bias. A weight that is not
such blocks (random floats; one weight moved by one unit in the last place; a column count that is
not a multiple of 16) must be refused: a pack that let any of these through would change the
model. On the default model every product has its blocks, and greedy generation and its
log-probabilities are the same with them and without (``MULTISPEC_AFFINE=0``).
"""

from __future__ import annotations

import pytest
import torch

from multispec import kernels
from multispec.models import llama

pytestmark = pytest.mark.skipif(kernels.stream_kind() != 3, reason="the float32 streaming product (AVX2) is not here")

ROWS = [1, 2, 5, 6, 7, 13, 16, 48, 100]


def q4_1(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """As llama.cpp quantises a block: its minimum becomes q 0, its maximum q 15 (shuffled in)."""
    scale = (torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 1e-3).half().float()
    offset = (-torch.rand(n, k // 32, 1, generator=gen) * 0.15).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    q = q.gather(2, torch.rand(n, k // 32, 32, generator=gen).argsort(dim=2)).float()
    return (scale * q + offset).reshape(n, k)  # the product exact, the sum rounded once


def q8_0(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Its largest magnitude becomes q 127 or -127."""
    scale = (torch.rand(n, k // 32, 1, generator=gen) * 0.001 + 1e-5).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen)
    q[..., 0] = torch.where(torch.rand(n, k // 32, generator=gen) < 0.5, -127, 127)
    q = q.gather(2, torch.rand(n, k // 32, 32, generator=gen).argsort(dim=2)).float()
    return (scale * q).reshape(n, k)


@pytest.mark.parametrize("kind", [q4_1, q8_0], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("shape", [(64, 32), (960, 576), (96, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocks_give_the_float32_product_bit_for_bit(kind, shape, with_bias):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    weight = kind(n, k, gen)
    bias = torch.randn(n, generator=gen) * 0.1 if with_bias else None
    blocks = torch.ops.multispec.affine_pack(weight)
    assert blocks is not None and blocks.dtype == torch.uint8
    assert blocks.numel() * 3 < weight.numel() * weight.element_size()  # a third of the bytes or less
    stream = torch.ops.multispec.stream_pack(weight)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        got = torch.ops.multispec.stream_linear(x, blocks, bias)
        want = torch.ops.multispec.stream_linear(x, stream, bias)
        assert torch.equal(got, want), (shape, rows)
    # and both are the product of these weights (a wrong scale or column would not be)
    want = (x.double() @ weight.double().T + (0 if bias is None else bias.double()))
    assert ((got.double() - want).abs() <= want.abs().amax(1, keepdim=True) * 2 ** -16).all()


def test_weights_that_are_not_such_blocks_are_refused():
    gen = torch.Generator().manual_seed(3)
    assert torch.ops.multispec.affine_pack(torch.randn(64, 64, generator=gen)) is None
    weight = q4_1(64, 64, gen)
    assert torch.ops.multispec.affine_pack(weight) is not None
    moved = weight.clone()
    moved[17, 40] = torch.nextafter(moved[17, 40], torch.tensor(1.0))  # one unit in the last place
    assert torch.ops.multispec.affine_pack(moved) is None
    assert torch.ops.multispec.affine_pack(q4_1(40, 64, gen)) is None  # 40 columns: no whole panels
    assert torch.ops.multispec.affine_pack(q4_1(64, 64, gen)[:, :40].contiguous()) is None  # k % 32
    broken = weight.clone()
    broken[0, 0] = float("nan")
    assert torch.ops.multispec.affine_pack(broken) is None


def test_projection_uses_the_blocks_up_to_their_row_limit(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    weight = q4_1(192, 64, gen)
    product = llama.Projection(weight, None, pack=True)
    assert product.affine is not None and llama.affine_rows() == llama.AFFINE_ROWS
    seen = []
    original = torch.ops.multispec.stream_linear

    def spy(x, packed, bias):
        seen.append((x.shape[0], packed.dtype))
        return original(x, packed, bias)

    monkeypatch.setattr(torch.ops.multispec, "stream_linear", spy)
    limit = llama.AFFINE_ROWS
    for rows in (1, limit, limit + 1):
        product(torch.randn(rows, 64, generator=gen))
    assert seen[:2] == [(1, torch.uint8), (limit, torch.uint8)] and all(d != torch.uint8 for _, d in seen[2:])
    monkeypatch.setenv("MULTISPEC_AFFINE", "0")
    assert llama.affine_rows() == 0
    seen.clear()
    product(torch.randn(4, 64, generator=gen))
    assert seen == [(4, torch.float32)]


def test_the_default_model_reads_its_blocks_and_generates_the_same(llm, monkeypatch):
    from multispec import SamplingParams

    model = llm.engine.model
    products = [p for layer in model.model.layers for p in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up,
                                                             layer.mlp.down)]
    if not products[0].packed:
        pytest.skip("the model's products are not packed on this device")
    assert all(p.affine is not None for p in products) and model.head.affine is not None
    stream_bytes = sum(p.stream.numel() * 4 for p in products + [model.head])
    affine_bytes = sum(p.affine.numel() for p in products + [model.head])
    assert affine_bytes * 3 < stream_bytes
    prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
               "Write a haiku about the sea."]
    params = SamplingParams(n=3, temperature=0.0, max_tokens=24, logprobs=2, seed=0)

    def run():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(c.token_ids, c.logprobs) for out in outs for c in out.outputs]

    with_blocks = run()
    monkeypatch.setenv("MULTISPEC_AFFINE", "0")
    without = run()
    assert with_blocks == without
