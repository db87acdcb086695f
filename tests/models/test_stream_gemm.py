"""The streaming product (``multispec/kernels/stream_gemm.cpp``, on AMX tiles or AVX512-BF16
vectors, whichever this CPU has) against float64 arithmetic.

The product rounds each output once, from a float32 sum over bf16 inputs, so it must agree with
the exact product of the same bf16 inputs to bf16 rounding plus the float32 sum's own error
(bounded here by 2**-7 relative to the row's largest output, far below what a misplaced column,
a wrong k pair or a lost row block would do: those move outputs by their whole size). Each row
must not depend on the other rows of the call, bit for bit, whatever their count (the kernel
accumulates each row in one fixed order); and ``Projection`` must route up to ``stream_rows()`` rows
through it and more rows, or ``MULTISPEC_STREAM=0``, through the CPU library's product. Where the
CPU has AMX, ``MULTISPEC_AMX=0`` runs the same tests on the vector path, if it has AVX512-BF16.

Where the CPU has AVX2 but no AVX-512 the product streams float32 weights instead (its inputs and
outputs float32, each output one FMA per k in order plus the bias): the same tests run in float32,
against float64 to 2**-16 of the row's largest output (a float32 sum over up to 1536 products of
this size is off by far less; a wrong column or k moves an output by its whole size).
"""

from __future__ import annotations

import pytest
import torch

from multispec import kernels
from multispec.models import llama

pytestmark = pytest.mark.skipif(not kernels.stream_available(), reason="no AMX, AVX512-BF16 or AVX2 (or kernels) here")
DTYPE = kernels.stream_dtype() or torch.bfloat16
"""What the product streams here: bf16 (AMX tiles, AVX512-BF16 vectors) or float32 (AVX2)."""
TOL = 2 ** -7 if DTYPE == torch.bfloat16 else 2 ** -16

SHAPES = [(64, 32), (960, 576), (96, 1536), (49152 // 16, 576)]
ROWS = [1, 4, 5, 6, 7, 8, 11, 12, 13, 15, 16, 17, 24, 25, 32, 47, 48, 49, 100]  # blocks: tiles 16, 48; vectors 12; AVX2 6


def exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_exact_arithmetic(shape, with_bias):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(DTYPE)
    bias = (torch.randn(n, generator=gen) * 0.1).to(DTYPE) if with_bias else None
    packed = torch.ops.multispec.stream_pack(weight)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).to(DTYPE)
        got = torch.ops.multispec.stream_linear(x, packed, bias)
        assert got.shape == (rows, n) and got.dtype == DTYPE
        want = exact(x, weight, bias)
        scale = want.abs().amax(dim=1, keepdim=True)
        assert ((got.double() - want).abs() <= scale * TOL).all(), (shape, rows)


def test_each_row_is_independent_of_the_others():
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(960, 576, generator=gen) * 0.05).to(DTYPE)
    packed = torch.ops.multispec.stream_pack(weight)
    x = torch.randn(100, 576, generator=gen).to(DTYPE)
    whole = torch.ops.multispec.stream_linear(x, packed, None)
    for start, rows in [(0, 1), (3, 4), (5, 7), (17, 16), (40, 33), (52, 48)]:
        part = torch.ops.multispec.stream_linear(x[start:start + rows], packed, None)
        assert torch.equal(part, whole[start:start + rows]), (start, rows)


def test_bad_shapes_are_refused_or_left_to_the_library():
    with pytest.raises(RuntimeError, match="multiples? of 32|% 32|% 16"):
        torch.ops.multispec.stream_pack(torch.zeros(101, 64, dtype=DTYPE))
    assert llama._stream_layout(torch.zeros(101, 64, dtype=DTYPE)) is None  # the library's product
    other = torch.float32 if DTYPE == torch.bfloat16 else torch.bfloat16
    assert llama._stream_layout(torch.zeros(64, 64, dtype=other)) is None  # the dtype this CPU does not stream
    packed = torch.ops.multispec.stream_pack(torch.zeros(64, 64, dtype=DTYPE))
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.multispec.stream_linear(torch.zeros(2, 32, dtype=DTYPE), packed, None)
    with pytest.raises(RuntimeError, match="needs"):  # the other dtype's product is not built for this CPU
        torch.ops.multispec.stream_linear(torch.zeros(2, 64, dtype=other),
                                          torch.ops.multispec.stream_pack(torch.zeros(64, 64, dtype=other)), None)


def test_projection_routes_the_rows_it_streams(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(192, 64, generator=gen) * 0.05).to(DTYPE)
    product = llama.Projection(weight, None, pack=True)
    assert product.stream is not None
    limit = llama.stream_rows()
    assert limit == {2: llama.STREAM_ROWS, 1: llama.VECTOR_STREAM_ROWS, 3: llama.F32_STREAM_ROWS}[kernels.stream_kind()]
    calls = []
    original = torch.ops.multispec.stream_linear

    class Spy:
        def __call__(self, *args):
            calls.append(args[0].shape[0])
            return original(*args)

    monkeypatch.setattr(torch.ops.multispec, "stream_linear", Spy())
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 64, generator=gen).to(DTYPE)
        got = product(x)
        want = exact(x, weight, None)
        # the library's product (limit + 1 rows) may round a float32 sum in another order
        assert ((got.double() - want).abs() <= want.abs().amax(1, keepdim=True) * max(TOL, 2 ** -12)).all()
    assert calls == [1, limit]
    monkeypatch.setenv("MULTISPEC_STREAM", "0")
    assert kernels.stream_kind() == 0 and llama.stream_rows() == 0
    product(torch.randn(4, 64, generator=gen).to(DTYPE))
    assert calls == [1, limit]


@pytest.mark.skipif(kernels.stream_kind() != 2, reason="no AMX tiles here")
def test_vector_path_under_amx_off_agrees_with_exact_arithmetic(monkeypatch):
    """With the tiles switched off, an AVX512-BF16 CPU streams on vectors (same packed layout);
    a CPU without AVX512-BF16 but with AMX does not exist, so the kind is 1 here."""
    monkeypatch.setenv("MULTISPEC_AMX", "0")
    assert kernels.stream_kind() == 1
    test_matches_exact_arithmetic((960, 576), True)
    test_each_row_is_independent_of_the_others()


@pytest.mark.skipif(kernels.stream_kind() != 2, reason="the fused gate/up product runs on AMX tiles only")
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_gate_up_equals_the_product_then_the_activation(with_bias):
    """``stream_gate_up`` takes each gate panel with its up panel and activates them in cache; it
    must give exactly what ``stream_linear`` followed by the layer stack's ``silu_mul`` gives, bit
    for bit, at every row count (one to three tile row blocks, and more than one pass of 48 rows;
    from 8 rows on each panel is activated a row at a time during the next panel's product).
    Gate values span -40 .. 40, so the activation's vanishing, negative and linear ranges all
    occur; pairing gate panel p with any up panel but p + I / 32, or skipping a bias, changes
    nearly every output."""
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(2 * 1536, 576, generator=gen) * 0.05).to(DTYPE)
    bias = (torch.randn(2 * 1536, generator=gen) * 0.5).to(DTYPE) if with_bias else None
    packed = torch.ops.multispec.stream_pack(weight)
    for rows in (1, 3, 7, 8, 16, 17, 32, 33, 48, 49, 100):
        x = (torch.randn(rows, 576, generator=gen) * torch.linspace(0.1, 30, rows)[:, None]).to(DTYPE)
        want = torch.ops.multispec.silu_mul(torch.ops.multispec.stream_linear(x, packed, bias))
        got = torch.ops.multispec.stream_gate_up(x, packed, bias)
        assert got.shape == (rows, 1536) and torch.equal(got, want), rows
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.multispec.stream_gate_up(torch.zeros(2, 64, dtype=DTYPE), packed, None)
