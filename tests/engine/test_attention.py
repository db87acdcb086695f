"""The fused attention kernel against the reference built from elementary operations."""

import pytest
import torch

from multispec.engine.attention import _FLASH_CPU, _fused_kernel, _reference_kernel, kernel_for


@pytest.mark.skipif(_FLASH_CPU is None, reason="this torch has no fused CPU attention kernel")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("mask_shape", [None, "per row", "per prompt"])
@pytest.mark.parametrize("kernel", [_fused_kernel, _reference_kernel], ids=["fused", "batched"])
def test_kernels_match_a_float64_reference(dtype, tol, mask_shape, kernel):
    """Output and log-sum-exp, on strided cache views (room past the keys read) and with the
    masks the decode step builds: one per query row (own half), one broadcast over rows (prompt
    half), none. The log-sum-exp is compared to a float64 reference: it carries the merge."""
    gen = torch.Generator().manual_seed(0)
    batch, heads, rows, keys, dim = 5, 3, 6, 37, 64
    q = torch.randn(batch, heads, rows, dim, generator=gen).to(dtype)
    room = torch.randn(2, batch, heads, keys + 11, dim, generator=gen).to(dtype)
    k, v = room[0, :, :, :keys], room[1, :, :, :keys]
    mask = None
    if mask_shape == "per row":
        visible = torch.rand(batch, 1, rows, keys, generator=gen) < 0.7
        visible[..., 0] = True
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    elif mask_shape == "per prompt":
        lengths = torch.tensor([37, 20, 5, 36, 1])
        pad = torch.arange(keys)[None, :] >= lengths[:, None]
        mask = torch.zeros(batch, 1, 1, keys, dtype=dtype).masked_fill_(pad[:, None, None], float("-inf"))
    out, lse = kernel(q, k, v, mask)
    ref_out, ref_lse = _reference_kernel(q.double(), k.double(), v.double(), None if mask is None else mask.double())
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.allclose(out.double(), ref_out, atol=tol, rtol=tol)
    # The batched kernel's bf16 products round each score to bf16 (8 bits) before its float32
    # softmax: scores here reach about 4, so 4 * 2**-9 bounds that rounding.
    lse_tol = 1e-2 if kernel is _reference_kernel and dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(lse.double(), ref_lse.double(), atol=lse_tol, rtol=1e-5)


def test_devices_without_the_fused_kernel_get_the_reference():
    assert kernel_for(torch.device("meta")) is _reference_kernel
    if _FLASH_CPU is not None:
        assert kernel_for(torch.device("cpu")) is _fused_kernel

