"""The benchmark scripts run only on the device, so a broken import would first show there, costing
device time: import each one here (no GPU needed to import) and parse its command line."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_script_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module(name)
    assert callable(getattr(module, "main", None)), f"bench/{name}.py has no main()"


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_script_help(name):
    out = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
