"""The benchmark scripts run only on the device, so a broken import would first show there, costing
device time: import each one here (no GPU needed to import) and parse its command line."""
from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import torch  # noqa: F401
BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if "__main__" in p.read_text())  # timing.py is a module


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


def _kernels(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("kernels")


def test_targets_are_checked_from_the_committed_table(monkeypatch):
    """bench/kernels.py's target table, from the rows of the committed H200 run."""
    import json

    kernels = _kernels(monkeypatch)
    rows = json.loads((BENCH / "results" / "kernels-2026-11-30.json").read_text())["rows"]
    checks = {(c["target"], c["shape"]): c for c in kernels.target_checks(rows)}
    by = {(r["op"], r["shape"], r["impl"]): r for r in rows}
    autos = [r for r in rows if r["op"] == "decode" and r["impl"].startswith("ua") and r["impl"].endswith("(auto)")]
    assert len(autos) == 4 and all(checks[("decode GB/s >= 3800", r["shape"])]["measured"] == round(r["gbps"], 2)
                                   for r in autos)
    for shape in ("8x4096 causal", "2x16384 causal"):
        c = checks[("prefill TFLOP/s >= torch SDPA", shape)]
        want = by[("prefill", shape, "ua")]["tflops"] / by[("prefill", shape, "torch SDPA contiguous")]["tflops"]
        assert c["ratio"] == round(want, 3) and c["met"] == (want >= 1) and "FlashInfer paged" in c["peers"]
    builds = [r["ms"] for r in rows if r["op"] == "build" and r["impl"] == "nvcc cold build"]
    assert checks[("cold build ms <= 10000", f"slowest of {len(builds)} variants")]["measured"] == round(max(builds), 2)
    assert not any(c["shape"].startswith("T=256 ") for c in checks.values()), "launch-bound rows are no target rows"


def test_a_target_row_is_met_at_its_goal_and_missed_below(monkeypatch):
    kernels = _kernels(monkeypatch)
    row = dict(op="decode", shape="1x1", impl="ua splits=1 (auto)", gbps=kernels.DECODE_TARGET_GBPS, ms=1.0)
    assert kernels.target_checks([row])[0]["met"]
    assert not kernels.target_checks([dict(row, gbps=kernels.DECODE_TARGET_GBPS - 1)])[0]["met"]
    slow = dict(op="build", shape="x", impl="cached load (key+render+dlopen)", ms=kernels.CACHED_LOAD_TARGET_MS * 2)
    assert not kernels.target_checks([slow])[0]["met"]
    assert "0 of 1 target rows met" in kernels.targets_table(kernels.target_checks([slow]))


def test_rerender_rebuilds_the_report_from_a_json(tmp_path):
    import json

    src = BENCH / "results" / "kernels-2026-11-30.json"
    out = subprocess.run([sys.executable, str(BENCH / "kernels.py"), "--rerender", str(src), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    meta = json.loads((tmp_path / "kernels-2026-11-30.json").read_text())
    assert meta["rows"] == json.loads(src.read_text())["rows"] and meta["targets"]
    md = (tmp_path / "kernels-2026-11-30.md").read_text()
    assert "## Targets" in md and "| decode GB/s >= 3800 | 1x32768 |" in md
    if importlib.util.find_spec("matplotlib"):  # a dev dependency: the chart comes with the table
        assert (tmp_path / "kernels-2026-11-30.png").stat().st_size > 20_000 and "(kernels-2026-11-30.png)" in md


def test_chart_draws_every_panel_from_a_run(tmp_path, monkeypatch):
    """bench/chart.py: the decode, prefill and cache-op panels of the committed run, its bars the JSON's numbers."""
    import matplotlib  # noqa: F401
    import json

    monkeypatch.syspath_prepend(str(BENCH))
    chart = importlib.import_module("chart")
    meta = json.loads((BENCH / "results" / "kernels-2026-11-30.json").read_text())
    png = chart.draw(meta, tmp_path / "k.png")
    assert png.stat().st_size > 20_000
    assert chart._label("reshape_and_cache % of copy ceiling >= 85", "T=32768 Hkv=8 D=128 P=16 bf16->bf16 +rope") \
        == "reshape\nbf16 to\nbf16\n+rope"
    assert chart._label("swap % of pinned memcpy >= 80", "d2h L=32 pairs=128") == "swap\nd2h"
    out = subprocess.run([sys.executable, str(BENCH / "chart.py"), str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no such file" in out.stderr


@pytest.mark.gpu
def test_interleaved_timer_times_each_implementation(monkeypatch):
    """timing.time_graphs: a sample a round for each name; a list of fns counts per fn call; the
    longer work reads longer (a 4x bigger copy takes more time per call)."""

    monkeypatch.syspath_prepend(str(BENCH))
    timing = importlib.import_module("timing")
    small, big = torch.randn(1 << 22, device="cuda"), torch.randn(1 << 24, device="cuda")
    out_s, out_b = torch.empty_like(small), torch.empty_like(big)
    t = timing.time_graphs({"small": [lambda: out_s.copy_(small)] * 2, "big": lambda: out_b.copy_(big)},
                           calls=3, rounds=5)
    assert set(t) == {"small", "big"} and all(len(x.samples) == 5 for x in t.values())
    assert 0 < t["small"].ms < t["big"].ms and t["small"].spread_pct >= 0
    assert torch.equal(out_b, big)


def test_power_reader_needs_nvml_and_says_so_by_an_empty_result(monkeypatch):
    """timing.power_per_call returns {} where NVML cannot start (no nvidia-ml-py, or no driver: this CPU
    machine), before touching CUDA; prefill_sweep --power then prints its rows without power."""
    monkeypatch.syspath_prepend(str(BENCH))
    timing = importlib.import_module("timing")
    assert timing.power_per_call({"x": lambda: None}) == {}


@pytest.mark.gpu
def test_power_reader_reads_watts_joules_and_clock(monkeypatch):
    """timing.power_per_call on the device (nvidia-ml-py carried in .whl): each implementation alone, a
    positive draw and clock, and the 4x bigger copy costs more energy a call."""

    pytest.importorskip("pynvml")
    monkeypatch.syspath_prepend(str(BENCH))
    timing = importlib.import_module("timing")
    small, big = torch.randn(1 << 22, device="cuda"), torch.randn(1 << 24, device="cuda")
    out_s, out_b = torch.empty_like(small), torch.empty_like(big)
    p = timing.power_per_call({"small": lambda: out_s.copy_(small), "big": lambda: out_b.copy_(big)}, seconds=0.3)
    assert set(p) == {"small", "big"}
    assert all(x.watts > 0 and x.sm_mhz > 0 for x in p.values())
    assert 0 < p["small"].joules_per_call < p["big"].joules_per_call


def test_decode_candidates_time_the_ops_production_launches(monkeypatch):
    """decode_sweep --candidates must time what paged_attention() launches (launched_op: on Hopper the
    item-queue op). Until session 8 it timed the op without item_queue, another kernel whose decode path
    ptxas allocates differently: a layout change read +3% there and -13% in bench/kernels.py."""
    monkeypatch.syspath_prepend(str(BENCH))
    sweep = importlib.import_module("decode_sweep")
    from uacompile.targets.cuda import attention

    monkeypatch.setattr(attention, "_num_sms", lambda device: 132)  # the H200 the sweep runs on
    monkeypatch.setattr(attention, "_arch", lambda device: "sm_90")
    ops = sweep.candidate_ops(sweep.CANDIDATE_SHAPES, sweep.CANDIDATE_QUANT_SHAPES)
    production = attention.design_of("")
    for (kv, B, L), (op, splits) in ops.items():  # decode steps: the decode-only op
        base = op.replace(num_splits=1, fused_merge=False, decode_only=False)
        assert op == attention.launched_op(base, splits, arch="sm_90", design=production, decode_only=True), (kv, B, L)
        assert op.decode_only and not op.item_queue, (kv, B, L)
        assert splits == attention.choose_splits(op, B, B, L), (kv, B, L)
    assert {s for _, s in ops.values()} >= {1, 4, 32}  # one-split and split rows both
    # the "mixed" candidate: the one kernel, on Hopper with the item queue (the wgmma path; 8-bit KV runs mma.sync)
    mixed = sweep.candidate_ops(sweep.CANDIDATE_SHAPES, sweep.CANDIDATE_QUANT_SHAPES, sweep.candidate_design("mixed"))
    for (kv, B, L), (op, splits) in mixed.items():
        assert not op.decode_only and op.item_queue == (kv == "bf16"), (kv, B, L)


def test_variant_sweep_rerenders_a_run_and_times_the_launched_ops(tmp_path, monkeypatch):
    """bench/variant_sweep.py: --rerender rebuilds the table (and chart) from a committed H200 run; its ops are
    the ones paged_attention() launches for each geometry (decode-only at the auto split, the prefill op)."""
    import json

    from uacompile.targets.cuda import attention

    monkeypatch.syspath_prepend(str(BENCH))
    sweep = importlib.import_module("variant_sweep")
    src = BENCH / "results" / "variants-2026-12-01-s13.json"
    before = BENCH / "results" / "variants-2026-12-01-s12.json"
    out = subprocess.run([sys.executable, str(BENCH / "variant_sweep.py"), "--rerender", str(src), "--out", str(tmp_path),
                          "--before", str(before)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(src.read_text())["rows"]
    md = (tmp_path / "variants-2026-12-01-s13.md").read_text()
    names = [v.name for v in sweep.VARIANTS]  # that run's variants: all but those added since (d64page1)
    assert len(rows) == 2 * (len(names) - 1) and {r["variant"] for r in rows} < set(names)
    assert md.count("\n| ") == len(rows) + 1
    assert "| d256 | Gemma-2-9B | 16/8 | 256 | 16 | bf16 | prefill |" in md
    assert "| page1 | page 1 | 32/8 | 128 | 1 | bf16 | prefill |" in md
    assert "Dotted lines: the ratio in variants-2026-12-01-s12.json" in md  # the before run's label
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "variants-2026-12-01-s13.png").stat().st_size > 20_000
    for v in sweep.VARIANTS:
        decode, splits, prefill = sweep.launched_ops(v)
        assert decode.decode_only and decode.num_splits == splits and not prefill.decode_only
        assert splits == attention.launch_splits(v.op(), sweep.DECODE_B, sweep.DECODE_B, v.decode_len())
        assert v.decode_len() % v.p == 0 and prefill.item_queue == attention.uses_wgmma(prefill)
    assert all(attention.uses_wgmma(sweep.launched_ops(v)[2]) for v in sweep.VARIANTS)  # page 1 included


def test_variant_sweep_takes_another_wgmma_tile(monkeypatch, tmp_path):
    """--wg-tile W=BNxST overrides attention.WG_TILE for a run (a next tile to measure, e.g. D 64 at 192 positions),
    refuses a malformed or impossible one, and the report says which tiles ran."""
    import json

    monkeypatch.syspath_prepend(str(BENCH))
    sweep = importlib.import_module("variant_sweep")
    assert sweep.parse_wg_tiles(["64=192x4", "128=128x2"]) == {64: (192, 4), 128: (128, 2)}
    for bad in ("64=192", "96=128x2", "64=200x2", "64=272x2", "64=128x0"):
        with pytest.raises(SystemExit):
            sweep.parse_wg_tiles([bad])
    meta = json.loads((BENCH / "results" / "variants-2026-12-01-s13.json").read_text())
    meta["wg_tile"] = {"64": "192x4"}
    assert "Hopper prefill tiles changed for this run (row width: positions x stages): 64: 192x4." in \
        sweep.report(meta, tmp_path, "v")
