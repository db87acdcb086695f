"""The work split of the compiled kernels' parallel loops (``multispec_kernels::balanced_for`` in
``multispec/kernels/common.h``): every item runs exactly once whatever the item count, and a thread
that finishes its own share takes the rest of a slow thread's share. A split that lost an item,
ran one twice or never took over from a slow core fails these (the products, the attention and the
softmax rest on it; their own tests check what each item computes)."""

from __future__ import annotations

import pytest
import torch

from multispec import kernels

pytestmark = pytest.mark.skipif(kernels.decode_attention() is None, reason="compiled kernels unavailable here")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 100, 1001, 49152])
def test_every_item_runs_once(two_threads, n):
    taken, part = torch.ops.multispec.balanced_parts(n, 0)
    assert taken.shape == (n,)
    assert bool((taken == 1).all())
    assert bool(((part == 0) | (part == 1)).all())


def test_a_slow_part_is_relieved(two_threads):
    # Part 0 spends 500 us on each item it takes; part 1 is done with its own half at once and
    # then takes part 0's items from the back. With fixed halves part 0 would take all 100 of
    # its items (50 ms); here it takes a few while part 1 takes the rest.
    n = 200
    taken, part = torch.ops.multispec.balanced_parts(n, 500)
    assert bool((taken == 1).all())
    assert bool((part[n // 2:] == 1).all()), "part 1's own share is its own"
    relieved = int((part[: n // 2] == 1).sum())
    assert relieved >= 50, f"part 1 took only {relieved} of the slow part's 100 items"
