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


@pytest.fixture(autouse=True)
def _no_user_tuning_database(tmp_path_factory, monkeypatch):
    """Tests never read the user's tuning database (a `uacompile tune` run on the machine would change which
    configs the planner and the runtime pick): the default database is an empty path of the test's own."""
    from uacompile import tunedb

    path = tmp_path_factory.mktemp("tuning") / "tuning.json"
    monkeypatch.setattr(tunedb, "default_db_path", lambda: path)
    tunedb.default_tuned.cache_clear()
    yield
    tunedb.default_tuned.cache_clear()
