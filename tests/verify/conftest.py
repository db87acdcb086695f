"""Run the verification tests single-threaded.

Their tensors are small (200,000 x 16 at most); with two intra-op threads on a shared 2-core machine
each op pays thread wake-ups that cost more than the arithmetic, and one thread is both faster and
steadier. The previous setting is restored for tests outside this folder.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
