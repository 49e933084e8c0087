import os

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (run on the device; CI deselects)")
    config.addinivalue_line("markers", "slow: long-running CPU test")


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test name (reproducible, differs per test)."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("UA_SEED", "0")))


# Kernel builds go through the content-hash cache (UACOMPILE_CACHE_DIR, default the user
# cache dir), so tests and test runs share them: a kernel is compiled once per content.
