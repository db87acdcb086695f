"""The weights a decode step streams, moved onto 2 MiB pages (``multispec.models.pages``).

The arena's copies must be the same tensors (shape, dtype, every byte) laid where asked: the first
on a 2 MiB boundary, each on a cache line, all in one mapping advised for huge pages. It must
refuse what it cannot copy as plain memory (oneDNN's opaque layouts, non-contiguous views) and
stand aside where huge pages are switched off or ``MULTISPEC_HUGE_PAGES=0``. On the default model
every streamed layout must live in the arena and still be exactly what packing the product's
weight gives.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from multispec.models import pages

needs_huge_pages = pytest.mark.skipif(not pages.huge_pages_available(), reason="no transparent huge pages here")


def _advised(address: int) -> bool:
    """Whether the mapping holding ``address`` is advised for huge pages (``hg`` in its VmFlags)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


@needs_huge_pages
def test_copies_are_the_same_tensors_laid_on_a_huge_page():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1000, 16, generator=gen), None, torch.randint(0, 256, (77,), dtype=torch.uint8),
               torch.randn(3, 5, 7, generator=gen).bfloat16(), torch.randn(1, generator=gen)]
    arena = pages.huge_page_arena(tensors)
    assert arena is not None
    copies = [arena.copy(t) for t in tensors]
    assert copies[1] is None
    for original, copy in zip(tensors, copies):
        if original is None:
            continue
        assert copy.shape == original.shape and copy.dtype == original.dtype
        assert torch.equal(copy.view(torch.uint8) if copy.dtype == torch.uint8 else copy, original)
        assert copy.data_ptr() != original.data_ptr() and copy.data_ptr() % pages.ALIGN == 0
    assert copies[0].data_ptr() % pages.HUGE_PAGE == 0
    assert _advised(copies[0].data_ptr())
    # Writing the copy leaves the original alone, and the copies do not overlap.
    copies[0].zero_()
    assert tensors[0].abs().sum() > 0 and torch.equal(copies[2], tensors[2])
    with pytest.raises(ValueError, match="do not fit"):
        arena.copy(torch.zeros(1 << 20))


def test_the_arena_stands_aside_where_it_cannot_copy(monkeypatch):
    plain = torch.zeros(64)
    assert pages.huge_page_arena([None, None]) is None
    assert pages.huge_page_arena([plain, torch.zeros(8, 8).t()]) is None  # a non-contiguous view
    if torch.backends.mkldnn.is_available():
        assert pages.huge_page_arena([plain, torch.zeros(8, 8).to_mkldnn()]) is None
    monkeypatch.setenv("MULTISPEC_HUGE_PAGES", "0")
    assert not pages.huge_pages_available() and pages.huge_page_arena([plain]) is None
    pages.release_free_heap()  # harmless anywhere (nothing where the C library has no malloc_trim)


@needs_huge_pages
def test_the_default_models_streamed_weights_live_in_the_arena(llm):
    model = llm.engine.model
    layers = model.model.layers
    products = [p for layer in layers for p in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up,
                                                layer.mlp.down)] + [model.head]
    if model.head is None or products[0].stream is None:
        pytest.skip("the model's products are not streamed on this CPU")
    streamed = [t for p in products for t in (p.stream, p.affine) if t is not None]
    first = min(t.data_ptr() for t in streamed)
    assert first % pages.HUGE_PAGE == 0 and _advised(first)
    assert all(_advised(t.data_ptr()) for t in streamed[::17])
    # Still exactly the packed weight (the copy moved it, nothing else).
    gate_up = layers[3].mlp.gate_up
    dense = gate_up.dense().float() if gate_up.packed else gate_up.weight
    assert torch.equal(gate_up.stream, torch.ops.multispec.stream_pack(dense.to(gate_up.stream.dtype)))
    if gate_up.affine is not None:
        assert torch.equal(gate_up.affine, torch.ops.multispec.affine_pack(dense))


def test_the_mode_read_decides_both_uses():
    from multispec.engine.cache import lazy_memory

    mode = pages.transparent_huge_pages()
    assert mode in ("always", "madvise", "never", None)
    assert pages.huge_pages_available() == (mode in ("always", "madvise"))
    if sys.platform.startswith("linux"):
        assert lazy_memory("cpu") == (mode != "always")
