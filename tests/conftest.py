import os

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (run on the device; CI deselects)")
    config.addinivalue_line("markers", "browser: drives Debian's Chromium through Playwright (.ci/run installs both)")
    config.addinivalue_line("markers", "slow: long CPU test covered in part by fast ones; deselected unless the "
                                       "-m expression names slow (CI's second step: -m \"slow and not gpu\")")


# Slow on the 2-core CPU machine, each a compile check that the fast set covers in part: nvcc builds of
# whole variant sets and of PTX checks; g++ -Wall -Werror over every AscendC source;
# the CLI's Ascend build (tests/targets/ascend covers build_and_verify). Marked here by node id so the
# files keep their own history; tests in other files carry @pytest.mark.slow themselves.
SLOW_TESTS = (
    "targets/cuda/test_cuda_compile.py::test_variants_compile_and_export_launchers[paged_attention",
    "targets/cuda/test_cuda_compile.py::test_small_pages_take_the_cp_async_producer_unserialised",
    "targets/cuda/test_cuda_compile.py::test_reshape_sweep_candidates_compile",
    "targets/cuda/test_cuda_compile.py::test_decode_only_kernels_fit_their_register_budget",
    "targets/cuda/test_cuda_compile.py::test_q_l2_prefetch_only_for_rows_of_a_kilobyte",
    "targets/cuda/test_cuda_compile.py::test_smaller_gpus_take_fewer_stages_and_fit",
    "lower/test_tvm_cuda.py::test_cuda_library_builds[attn",
    "lower/test_tvm_cuda.py::test_cuda_library_builds[merge",
    "targets/ascend/test_ascend_generate.py::test_every_generated_source_passes_gxx_wall_werror",
    "test_cli.py::test_build_ascend_records_emulator_verification",
)


def pytest_collection_modifyitems(config, items):
    """Tests marked slow (or listed in SLOW_TESTS) run only when -m names slow, so the README's test
    command stays fast; CI runs them in a step of their own (.ci/run)."""
    for item in items:
        if any(s in item.nodeid for s in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
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
