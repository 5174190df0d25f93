import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# The heavy optional imports most test ranks make (tiertrain.launch.HEAVY_IMPORTS), made here
# first: the ranks' forkserver starts at the session's first launch and preloads what this
# process holds then, so no rank imports them again (about a second each, per rank).
from tiertrain.launch import HEAVY_IMPORTS  # noqa: E402

for _name in HEAVY_IMPORTS:
    try:
        __import__(_name)
    except ImportError:
        pass


@pytest.fixture(scope="module")
def one_torch_thread():
    """Test-data preparation only: on 2 oversubscribed cores, torch's 2-thread OpenMP regions
    make small tensor ops ~10x slower than one thread (measured), which would dominate the
    test time. The library's own copies do not use OpenMP (see tiertrain.io.swap._copy_bytes)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def aio():
    """An AsyncIO with 4 threads and 1 MiB blocks, closed (with a bounded wait) afterwards."""
    from tiertrain.io import AsyncIO

    io = AsyncIO(num_threads=4, block_bytes=1 << 20)
    yield io
    io.close(timeout=20)
