"""The weights a decode step streams, on 2 MiB pages.

A decode step of a few to a few dozen samples reads every product's weight from memory once.
With ordinary 4 KiB pages that stream crosses a page every 64 cache lines, and each crossing needs
a new translation (the second-level TLB of a Zen 2 core covers 8 MiB of a 500 MiB stream); a
2 MiB page needs one per 32,768 lines. Under Linux, transparent huge pages are usually granted
only where asked for (``madvise``), so ``huge_page_arena`` puts the streamed layouts into one
anonymous mapping asked for huge pages before it is touched. On a 2-core AMD EPYC (Zen 2,
float32), both layouts in one process, alternating: decode steps of 1, 4 and 16 samples 0.97x,
0.98x and 0.97x the time (medians of three runs), 64 samples unchanged (docs/results.md, "The
streamed weights on 2 MiB pages"). ``MULTISPEC_HUGE_PAGES=0`` leaves them where they are.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each copy starts on a cache line


def transparent_huge_pages() -> str | None:
    """Linux's transparent huge page mode ("always", "madvise" or "never"), or None where there is
    none to read (another system, or a kernel without them)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    chosen = text[text.find("[") + 1:text.find("]")] if "[" in text else ""
    return chosen or None


def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages: Linux, with them not switched off
    (``never``); ``always`` grants them to large mappings anyway, ``madvise`` where asked.
    ``MULTISPEC_HUGE_PAGES=0`` keeps the weights on ordinary pages (to compare)."""
    if os.environ.get("MULTISPEC_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    return transparent_huge_pages() in ("always", "madvise")


class HugePageArena:
    """Room for tensors of the given byte sizes, one after the other in one anonymous mapping asked
    for 2 MiB pages before anything is written to it; ``copy`` moves a tensor in. Copies are
    ordinary CPU tensors (same shape, dtype and values) that keep the mapping alive."""

    def __init__(self, sizes: list[int]):
        total = sum(-(-size // ALIGN) * ALIGN for size in sizes)
        self.region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.region.madvise(mmap.MADV_HUGEPAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self.region))
        self.offset = -address % HUGE_PAGE  # the first copy on a huge page boundary
        self.arena = torch.frombuffer(self.region, dtype=torch.uint8)

    def copy(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        size = tensor.numel() * tensor.element_size()
        if self.offset + size > len(self.region):
            raise ValueError(f"{size} bytes do not fit the arena's {len(self.region) - self.offset} left")
        out = self.arena[self.offset:self.offset + size].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        self.offset += -(-size // ALIGN) * ALIGN
        return out


def streamable(tensors: list[torch.Tensor | None]) -> bool:
    """Whether ``huge_page_arena`` can take these: plain contiguous CPU tensors, at least one."""
    present = [t for t in tensors if t is not None]
    return bool(present) and all(t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn
                                 and t.is_contiguous() for t in present)


def huge_page_arena(tensors: list[torch.Tensor | None]) -> HugePageArena | None:
    """An arena with room for ``tensors`` (None entries take none) where the system grants huge
    pages and the tensors are plain contiguous CPU tensors; else None (keep them where they are)."""
    if not huge_pages_available() or not streamable(tensors):
        return None
    try:
        return HugePageArena([t.numel() * t.element_size() for t in tensors if t is not None])
    except OSError:
        return None


def release_free_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). The layouts the arena replaces are freed into that heap, and there they would stay
    resident: loading the default model in float32 peaked at 3.05 GB instead of 2.29 without the
    arena; trimmed after each product, 2.38 GB."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
