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
"""

from __future__ import annotations

import pytest
import torch

from multispec import kernels
from multispec.models import llama

pytestmark = pytest.mark.skipif(not kernels.stream_available(), reason="no AMX or AVX512-BF16 (or kernels) here")

SHAPES = [(64, 32), (960, 576), (96, 1536), (49152 // 16, 576)]
ROWS = [1, 4, 11, 12, 13, 15, 16, 17, 24, 25, 32, 47, 48, 49, 100]  # the tiles' blocks of 16 and 48, the vectors' of 12


def exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_exact_arithmetic(shape, with_bias):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = (torch.randn(n, generator=gen) * 0.1).bfloat16() if with_bias else None
    packed = torch.ops.multispec.stream_pack(weight)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        got = torch.ops.multispec.stream_linear(x, packed, bias)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        want = exact(x, weight, bias)
        scale = want.abs().amax(dim=1, keepdim=True)
        assert ((got.double() - want).abs() <= scale * 2 ** -7).all(), (shape, rows)


def test_each_row_is_independent_of_the_others():
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16()
    packed = torch.ops.multispec.stream_pack(weight)
    x = torch.randn(100, 576, generator=gen).bfloat16()
    whole = torch.ops.multispec.stream_linear(x, packed, None)
    for start, rows in [(0, 1), (3, 4), (17, 16), (40, 33), (52, 48)]:
        part = torch.ops.multispec.stream_linear(x[start:start + rows], packed, None)
        assert torch.equal(part, whole[start:start + rows]), (start, rows)


def test_bad_shapes_are_refused_or_left_to_the_library():
    with pytest.raises(RuntimeError, match="multiples? of 32|% 32"):
        torch.ops.multispec.stream_pack(torch.zeros(101, 64, dtype=torch.bfloat16))
    assert llama._stream_layout(torch.zeros(101, 64, dtype=torch.bfloat16)) is None  # the library's product
    assert llama._stream_layout(torch.zeros(64, 64)) is None  # float32: not on tiles
    packed = torch.ops.multispec.stream_pack(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.multispec.stream_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, None)


def test_projection_routes_the_rows_it_streams(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(192, 64, generator=gen) * 0.05).bfloat16()
    product = llama.Projection(weight, None, pack=True)
    assert product.stream is not None
    limit = llama.stream_rows()
    assert limit == {2: llama.STREAM_ROWS, 1: llama.VECTOR_STREAM_ROWS}[kernels.stream_kind()]
    calls = []
    original = torch.ops.multispec.stream_linear

    class Spy:
        def __call__(self, *args):
            calls.append(args[0].shape[0])
            return original(*args)

    monkeypatch.setattr(torch.ops.multispec, "stream_linear", Spy())
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        got = product(x)
        want = exact(x, weight, None)
        assert ((got.double() - want).abs() <= want.abs().amax(1, keepdim=True) * 2 ** -7).all()
    assert calls == [1, limit]
    monkeypatch.setenv("MULTISPEC_STREAM", "0")
    assert kernels.stream_kind() == 0 and llama.stream_rows() == 0
    product(torch.randn(4, 64, generator=gen).bfloat16())
    assert calls == [1, limit]


@pytest.mark.skipif(kernels.stream_kind() != 2, reason="no AMX tiles here")
def test_vector_path_under_amx_off_agrees_with_exact_arithmetic(monkeypatch):
    """With the tiles switched off, an AVX512-BF16 CPU streams on vectors (same packed layout);
    a CPU without AVX512-BF16 but with AMX does not exist, so the kind is 1 here."""
    monkeypatch.setenv("MULTISPEC_AMX", "0")
    assert kernels.stream_kind() == 1
    test_matches_exact_arithmetic((960, 576), True)
    test_each_row_is_independent_of_the_others()
