import os

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (run on the device; CI deselects)")
    config.addinivalue_line("markers", "slow: long CPU test covered in part by fast ones; deselected unless the "
                                       "-m expression names slow (CI's second step: -m \"slow and not gpu\")")


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run only when asked for by name in -m, so the README's test command stays fast."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test name (reproducible, differs per test)."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("UA_SEED", "0")))


# Kernel builds go through the content-hash cache (UACOMPILE_CACHE_DIR, default the user
# cache dir), so tests and test runs share them: a kernel is compiled once per content.
