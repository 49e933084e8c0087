"""bench/agent_gpu.py's CPU smoke mode: both attention variants behind the server, the agent's runs, the report."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_mode_writes_the_report_for_both_variants(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "agent_gpu.py"), "--smoke", "--runs", "2",
                        "--sessions", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads(next(tmp_path.glob("agent-*-smoke.json")).read_text())
    assert [(row["variant"], row["sessions"]) for row in meta["rows"]] == [("ua", 2), ("unified_masked", 2)]
    assert all(row["steps"] == 2 * 4 and row["ttft_p99_s"] >= row["ttft_p50_s"] > 0 for row in meta["rows"])
    assert [t["target"] for t in meta["targets"]] == ["2 sessions: p99 TTFT / unified_masked <= 0.4",
                                                      "2 sessions: total time / unified_masked <= 0.5"]
    assert (tmp_path / next(tmp_path.glob("agent-*-smoke.md")).name).read_text().startswith("# Story agent")
