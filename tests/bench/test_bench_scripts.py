"""The benchmark scripts run only on the device, so a broken import would first show there, costing
device time: import each one here (no GPU needed to import) and parse its command line."""
from __future__ import annotations

import json
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


def _kernels_run() -> dict:
    """A bench/kernels.py run's meta with a row of every kind its targets and chart read (made-up numbers)."""
    rows = [dict(op="copy", shape="1 GiB", impl="torch copy_ (ceiling)", gbps=4250.0, ms=0.505)]
    for k, (shape, splits) in enumerate((("8x16384", 4), ("32x4096", 1), ("128x1024", 1), ("1x32768", 32))):
        for impl, gbps in ((f"ua splits={splits} (auto)", 4150.0 - 200 * k), ("ua splits=2", 2000.0),
                           ("FlashInfer tensor-core", 4000.0), ("FlashInfer CUDA-core", 2700.0),
                           ("torch SDPA contiguous", 4200.0 - 150 * k)):
            rows.append(dict(op="decode", shape=shape, impl=impl, gbps=gbps, ms=round(537e3 / gbps / 1e3, 4)))
    for shape, ours, sdpa, fi in (("8x4096 causal", 523.0, 531.0, 472.0), ("2x16384 causal", 592.0, 579.0, 524.0)):
        for impl, tf in (("ua", ours), ("torch SDPA contiguous", sdpa), ("FlashInfer paged", fi)):
            rows.append(dict(op="prefill", shape=shape, impl=impl, tflops=tf, ms=round(1.1e3 / tf, 4)))
    for shape, pct, ms in (("T=32768 Hkv=8 D=128 P=16 fp16->fp16", 89.3, 0.0708),
                           ("T=32768 Hkv=8 D=128 P=16 bf16->int8", 86.2, 0.0555),
                           ("T=32768 Hkv=8 D=128 P=16 bf16->bf16 +rope", 86.8, 0.0728),
                           ("T=256 Hkv=8 D=128 P=16 bf16->bf16", 28.4, 0.0017)):  # launch-bound: no target row
        rows.append(dict(op="reshape_and_cache", shape=shape, impl="uacompile", gbps=42.5 * pct, ms=ms,
                         pct_ceiling=pct))
    rows.append(dict(op="copy_blocks", shape="L=32 pairs=256 P=16 Hkv=8 D=128 bf16", impl="uacompile (1 launch)",
                     gbps=3808.0, ms=0.282, pct_ceiling=89.5))
    for way, pct in (("d2h", 94.3), ("h2d", 91.9)):
        rows.append(dict(op="swap_blocks", shape=f"{way} L=32 pairs=128 P=16 Hkv=8 D=128 bf16 (256 MiB)",
                         impl="uacompile (1 launch, zero-copy)", gbps=52.0, ms=5.2, pct_memcpy=pct))
    for k, op in enumerate(("reshape_and_cache", "paged_attention", "merge_state")):
        rows.append(dict(op="build", shape=f"{op} {k:012x}", impl="nvcc cold build", ms=2000.0 + 1500 * k))
        rows.append(dict(op="build", shape=f"{op} {k:012x}", impl="cached load (key+render+dlopen)", ms=2.5 + k))
    return dict(gpu="NVIDIA H200", date="2026-12-01", torch="2.11.0+cu130", copy_ceiling_gbps=4250.0, notes=[],
                rows=rows)


def test_targets_are_checked_from_a_run(monkeypatch):
    """bench/kernels.py's target table, from the rows of a run."""
    kernels = _kernels(monkeypatch)
    rows = _kernels_run()["rows"]
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
    run = dict(op="plan overhead", shape="decode 8x256", impl="attention.run(plan, ...)", us=kernels.RUN_TARGET_US)
    convenience = dict(run, impl="paged_attention(), kept Workspace", us=40.0)
    checks = kernels.target_checks([run, convenience])
    assert len(checks) == 1 and checks[0]["met"] and "paged_attention(), kept Workspace 40" in checks[0]["peers"]
    assert not kernels.target_checks([dict(run, us=kernels.RUN_TARGET_US + 1)])[0]["met"]


def test_rerender_rebuilds_the_report_from_a_json(tmp_path):
    import json

    src = tmp_path / "run.json"
    src.write_text(json.dumps(_kernels_run()))
    out = subprocess.run([sys.executable, str(BENCH / "kernels.py"), "--rerender", str(src), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    meta = json.loads((tmp_path / "out" / "kernels-2026-12-01.json").read_text())
    assert meta["rows"] == json.loads(src.read_text())["rows"] and meta["targets"]
    md = (tmp_path / "out" / "kernels-2026-12-01.md").read_text()
    assert "## Targets" in md and "| decode GB/s >= 3800 | 1x32768 |" in md
    if importlib.util.find_spec("matplotlib"):  # a dev dependency: the chart comes with the table
        png = tmp_path / "out" / "kernels-2026-12-01.png"
        assert png.stat().st_size > 20_000 and "(kernels-2026-12-01.png)" in md


def test_chart_draws_every_panel_from_a_run(tmp_path, monkeypatch):
    """bench/chart.py: the decode, prefill and cache-op panels of a run, its bars the JSON's numbers."""
    import matplotlib  # noqa: F401

    monkeypatch.syspath_prepend(str(BENCH))
    chart = importlib.import_module("chart")
    run = _kernels_run()
    run["targets"] = importlib.import_module("kernels").target_checks(run["rows"])
    png = chart.draw(run, tmp_path / "k.png")
    assert png.stat().st_size > 20_000
    assert chart.label("reshape_and_cache % of copy ceiling >= 85", "T=32768 Hkv=8 D=128 P=16 bf16->bf16 +rope") \
        == "reshape\nbf16 to\nbf16\n+rope"
    assert chart.label("swap % of pinned memcpy >= 80", "d2h L=32 pairs=128") == "swap\nd2h"
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


def test_decode_sweep_builds_and_times_what_plan_launches(monkeypatch):
    """decode_sweep and attention_bench build (launched_kernel) and time what attention.plan() launches on the
    device: the decode-only kernel at the built-in split count, fused, and with fused_merge=False the partials
    kernel plus merge_state. Timing another kernel than production's once read +3% there and -13% in
    bench/kernels.py."""
    from uacompile import ir
    from uacompile.targets.cuda.config import AttentionConfig
    from uacompile.targets.cuda.layout import layout
    from uacompile.targets.cuda.plan import choose_config

    monkeypatch.syspath_prepend(str(BENCH))
    ab = importlib.import_module("attention_bench")
    sweep = importlib.import_module("decode_sweep")
    for module in (ab, sweep):  # the H200 the sweep runs on
        monkeypatch.setattr(module, "device_sms", lambda device: 132)
        monkeypatch.setattr(module, "device_arch", lambda device: "sm_90")
    op = ab.op_of()
    autos = set()
    for B, L in ab.DECODE_SHAPES + sweep.EXTRA_SHAPES:
        auto = sweep.auto_splits(op, B, L)
        kernel = ab.launched_kernel(op, B, B, L)
        assert kernel == ir.Kernel(op, choose_config(op, B, B, L, 132, "sm_90")), (B, L)
        assert kernel.config.decode_only and not kernel.config.item_queue and kernel.config.num_splits == auto
        assert kernel.config.fused_merge == (auto > 1)
        two = ab.launched_kernel(op, B, B, L, num_splits=4, fused_merge=False)
        assert two.config == AttentionConfig(num_splits=4, decode_only=True)
        autos.add(auto)
    assert autos >= {1, 4, 32}  # one-split and split rows both
    lay = layout(op, AttentionConfig(decode_only=True), "sm_90")
    assert sweep.unit_slots(op) == 132 * lay.blocks_per_sm * lay.decode_groups
    prefill = ab.launched_kernel(op, 4 * 4096, 4, 4096, num_splits=1)
    assert prefill.config == AttentionConfig(item_queue=True)  # the Hopper path takes the item queue


def test_prefill_sweep_puts_each_tile_on_the_kernel_configs(monkeypatch):
    """prefill_sweep times each wgmma tile through the kernels' configs (AttentionConfig.wg_tile), never the built-in
    table (layout.WG_TILE): the planned prefill kernel and the --static one carry the tile, the decode-only kernel
    (no Hopper prefill path) stays the built-in rule's, and a tile the config refuses stops the run at once."""
    from uacompile.targets.cuda import layout as cuda_layout
    from uacompile.targets.cuda.config import AttentionConfig
    from uacompile.targets.cuda.layout import layout

    monkeypatch.syspath_prepend(str(BENCH))
    ab = importlib.import_module("attention_bench")
    sweep = importlib.import_module("prefill_sweep")
    monkeypatch.setattr(ab, "device_sms", lambda device: 132)
    monkeypatch.setattr(ab, "device_arch", lambda device: "sm_90")
    table = dict(cuda_layout.WG_TILE)
    op = ab.op_of()
    for tile in ((64, 6), (128, 3), (64, 4)):
        prefill = ab.launched_kernel(op, 4 * 4096, 4, 4096, num_splits=1, wg_tile=tile)
        assert prefill.config == AttentionConfig(item_queue=True, wg_tile=tile)
        assert (layout(op, prefill.config, "sm_90").bn_wg, layout(op, prefill.config, "sm_90").stages_wg) == tile
        assert ab.launched_kernel(op, 8, 8, 16384, wg_tile=tile) == ab.launched_kernel(op, 8, 8, 16384)
        assert sweep.tile_configs(sweep.CONFIGS, tile) == {"": None, "static": AttentionConfig(wg_tile=tile)}
    assert dict(cuda_layout.WG_TILE) == table
    out = subprocess.run([sys.executable, str(BENCH / "prefill_sweep.py"), "--tiles", "64x6,100x3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--tiles: AttentionConfig.wg_tile" in out.stderr, out.stderr[-2000:]


def _variants_run(sweep, names, date="2026-12-01") -> dict:
    """A variant_sweep run's meta for the named geometries (its fields; made-up timings)."""
    rows = []
    for k, v in enumerate(x for x in sweep.VARIANTS if x.name in names):
        geo = dict(variant=v.name, model=v.model, hq=v.hq, hkv=v.hkv, d=v.d, p=v.p, dtype=v.dtype)
        ratio = round(0.8 + 0.02 * k, 4)
        rows.append(dict(geo, op="decode", shape=f"{sweep.DECODE_B}x{v.decode_len()}", splits=2, ms=0.13,
                         sdpa_ms=round(0.13 * ratio, 4), gbps=4100.0, sdpa_gbps=round(4100 / ratio, 4), ratio=ratio,
                         diff=0.0005))
        rows.append(dict(geo, op="prefill", shape=f"{sweep.PREFILL_B}x{sweep.PREFILL_L} causal", ms=1.0, sdpa_ms=ratio,
                         tflops=500.0, sdpa_tflops=round(500 / ratio, 4), ratio=ratio, diff=0.0039))
    return dict(gpu="NVIDIA H200", date=date, copy_gbps=4249.0, rows=rows)


def test_variant_sweep_rerenders_a_run_and_times_the_launched_ops(tmp_path, monkeypatch):
    """bench/variant_sweep.py: --rerender rebuilds the table (and chart) from a run, an earlier one drawn behind
    it; its kernels are the ones attention.plan() launches for each geometry (decode-only at the auto split, the
    prefill kernel)."""
    import json

    from uacompile.targets.cuda.config import AttentionConfig
    from uacompile.targets.cuda.layout import uses_wgmma
    from uacompile.targets.cuda.plan import choose_splits

    monkeypatch.syspath_prepend(str(BENCH))
    sweep = importlib.import_module("variant_sweep")
    names = [v.name for v in sweep.VARIANTS]
    src, before = tmp_path / "variants-2026-12-01.json", tmp_path / "variants-2026-11-30.json"
    src.write_text(json.dumps(_variants_run(sweep, names)))
    before.write_text(json.dumps(_variants_run(sweep, names[:-1], date="2026-11-30")))  # a run without the last one
    out = subprocess.run([sys.executable, str(BENCH / "variant_sweep.py"), "--rerender", str(src), "--out",
                          str(tmp_path / "out"), "--before", str(before)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(src.read_text())["rows"]
    md = (tmp_path / "out" / "variants-2026-12-01.md").read_text()
    assert len(rows) == 2 * len(names) and md.count("\n| ") == len(rows) + 1
    assert "| d256 | Gemma-2-9B | 16/8 | 256 | 16 | bf16 | prefill |" in md
    assert "| page1 | page 1 | 32/8 | 128 | 1 | bf16 | prefill |" in md
    assert "Dotted lines: the ratio in variants-2026-11-30.json (2026-11-30)" in md  # the before run's label
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "out" / "variants-2026-12-01.png").stat().st_size > 20_000
    for v in sweep.VARIANTS:
        decode, splits, prefill = sweep.launched_ops(v)
        assert decode.op == prefill.op == v.op()
        assert decode.config.decode_only and decode.config.num_splits == splits and not prefill.config.decode_only
        assert prefill.config.num_splits == 1
        assert splits == choose_splits(v.op(), AttentionConfig(decode_only=True), sweep.DECODE_B, sweep.DECODE_B,
                                       v.decode_len())
        assert v.decode_len() % v.p == 0 and prefill.config.item_queue == uses_wgmma(prefill.op, prefill.config)
    assert all(uses_wgmma(k.op, k.config) for k in (sweep.launched_ops(v)[2] for v in sweep.VARIANTS))  # page 1 too


def test_variant_sweep_takes_another_wgmma_tile(monkeypatch, tmp_path):
    """--wg-tile W=BNxST puts another tile on the prefill kernels' configs of that row width for a run
    (AttentionConfig.wg_tile: a next tile to measure, e.g. D 64 at 192 positions), leaves the decode kernels, the
    other widths and the built-in table (layout.WG_TILE, read-only) as they are, refuses a malformed or impossible
    tile, and the report says which tiles ran."""
    from uacompile.targets.cuda import layout as cuda_layout
    from uacompile.targets.cuda.layout import layout

    monkeypatch.syspath_prepend(str(BENCH))
    sweep = importlib.import_module("variant_sweep")
    table = dict(cuda_layout.WG_TILE)
    tiles = sweep.parse_wg_tiles(["64=192x4", "128=128x2"])
    assert tiles == {64: (192, 4), 128: (128, 2)}
    for bad in ("64=192", "96=128x2", "64=200x2", "64=272x2", "64=128x0"):
        with pytest.raises(SystemExit):
            sweep.parse_wg_tiles([bad])
    by_name = {v.name: v for v in sweep.VARIANTS}
    for name, want in (("d64", (192, 4)), ("d96", (128, 2)), ("base", (128, 2)), ("d256", None)):
        decode, _, prefill = sweep.launched_ops(by_name[name], wg_tiles=tiles)
        assert prefill.config.wg_tile == want and decode.config.wg_tile is None, name
        assert sweep.wg_tile_of(by_name[name], tiles) == want
        lay = layout(prefill.op, prefill.config, "sm_90")
        assert (lay.bn_wg, lay.stages_wg) == (want or table[256])
        assert prefill.config == sweep.launched_ops(by_name[name])[2].config.replace(wg_tile=want)  # only the tile
    assert dict(cuda_layout.WG_TILE) == table
    with pytest.raises(TypeError):
        cuda_layout.WG_TILE[64] = (64, 2)  # the built-in rule's table is read-only
    meta = dict(_variants_run(sweep, ["d64", "base"]), wg_tile={"64": "192x4"})
    assert "Hopper prefill tiles changed for this run (row width: positions x stages): 64: 192x4." in \
        sweep.report(meta, tmp_path, "v")


def test_serving_benchmark_runs_end_to_end_on_a_toy_model(tmp_path):
    """bench/serving_gpu.py on the CPU with --tiny: the runtime and HF rows of a workload, the floors, the JSON's
    fields the issue names, the table and the plot."""
    pytest.importorskip("transformers")
    res = subprocess.run([sys.executable, str(BENCH / "serving_gpu.py"), "--tiny", "--device", "cpu", "--out",
                          str(tmp_path), "--impls", "uacompile-ua,hf-sdpa", "--workloads", "conc-2"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads(next(tmp_path.glob("serving-*.json")).read_text())
    assert {"gpu", "date", "model", "rows"} <= set(meta)
    assert [(r["workload"], r["impl"]) for r in meta["rows"]] == [("conc-2", "uacompile-ua"), ("conc-2", "hf-sdpa")]
    for r in meta["rows"]:
        for k in ("ttft_mean_s", "ttft_p99_s", "tpot_ms", "output_tok_s", "ttft_floor_s", "tpot_floor_ms"):
            assert r[k] > 0, (k, r)
    assert next(tmp_path.glob("serving-*.md")).read_text().count("| conc-2 |") == 2
    if importlib.util.find_spec("matplotlib"):
        assert next(tmp_path.glob("serving-*.png")).stat().st_size > 10_000


def test_serving_benchmark_runs_the_runtime_on_an_8_bit_kv_cache(tmp_path, monkeypatch):
    """--kv-cache-dtype int8: the runtime's rows name their cache, their decode floor counts 8-bit KV (elements and
    float32 scales), and the files are written beside the model-dtype run's (serving-<date>-kv-int8.*)."""
    res = subprocess.run([sys.executable, str(BENCH / "serving_gpu.py"), "--tiny", "--device", "cpu", "--out",
                          str(tmp_path), "--impls", "uacompile-ua", "--workloads", "conc-1",
                          "--kv-cache-dtype", "int8"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads(next(tmp_path.glob("serving-*-kv-int8.json")).read_text())
    assert meta["kv_cache_dtype"] == "int8" and [r["kv_cache_dtype"] for r in meta["rows"]] == ["int8"]
    assert "--kv-cache-dtype int8" in meta["command"]
    monkeypatch.syspath_prepend(str(BENCH))
    sg = importlib.import_module("serving_gpu")
    cfg = sg.ModelConfig(**sg.TINY)
    assert sg.model_numbers(cfg, "int8")[2] == 2 * 2 * 2 * (16 + 4)  # layers, K/V, KV heads, (head_dim + scale)
    assert sg.model_numbers(cfg, "fp32")[2] == 2 * 2 * 2 * 16 * 4


LLAMA_BATCHED_BENCH = """main: n_kv_max = 8448, n_batch = 2048, n_ubatch = 512, flash_attn = 1
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    64 |      8 |    1 |     72 |    0.050 |  1280.00 |    0.080 |   100.00 |    0.130 |   553.85 |
|    64 |      8 |    2 |    144 |    0.090 |  1422.22 |    0.100 |   160.00 |    0.190 |   757.89 |
"""


def test_serving_benchmark_reads_llama_batched_bench(tmp_path, monkeypatch):
    """serving_gpu.llama_cpp_runs over a stand-in llama-batched-bench: the decode step is T_TG / TG, TTFT all the
    prompts' prefill (T_PP), output tok/s B * TG / T; the command asks -no-kvu and a context for every sequence."""
    monkeypatch.syspath_prepend(str(BENCH))
    sg = importlib.import_module("serving_gpu")
    fake = tmp_path / "llama-batched-bench"
    fake.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\ncat <<'EOF'\n" + LLAMA_BATCHED_BENCH + "EOF\n")
    fake.chmod(0o755)
    wls = [sg.Workload(f"conc-{n}", [[1] * 64 for _ in range(n)], 8) for n in (1, 2)]
    runs = sg.llama_cpp_runs(tmp_path, tmp_path / "m.gguf", wls, tmp_path)
    assert set(runs) == {"conc-1", "conc-2"}
    assert runs["conc-2"]["decode_step_ms"] == pytest.approx(12.5) and runs["conc-2"]["prefilled_s"] == 0.09
    assert runs["conc-2"]["output_tok_s"] == pytest.approx(2 * 8 / 0.19)
    args = (tmp_path / "args").read_text().split()
    assert "-no-kvu" in args and args[args.index("-npl") + 1] == "1,2" and int(args[args.index("-c") + 1]) >= 2 * 72
    row = sg.row(wls[1], "llama.cpp", "q8_0", runs["conc-2"], (0.1, 0.1, 1.0), "fp16")
    assert row["impl"].startswith("llama.cpp") and row["weights"] == "q8_0" and row["decode_step_ms"] == 12.5
    assert row["kv_cache_dtype"] == "fp16"

def test_cpu_single_stream_runs_on_stories260k(tmp_path):
    """bench/cpu_single_stream.py end to end on the small model (one run, one thread), beside llama.cpp's speed as
    recorded in tests/data/llama_cpp_reference.json (this interpreter has no llama_cpp): the table and both files."""
    out = tmp_path / "cpu"
    r = subprocess.run([sys.executable, str(BENCH / "cpu_single_stream.py"), "--models", "stories260K", "--threads", "1",
                        "--repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    (row,) = res["ours"]["stories260K"]
    assert row["threads"] == 1 and row["decode_tok_s"] > 0 and row["decode_tokens"] == 256
    assert res["llama_cpp"]["source"].startswith("recorded") and "| stories260K | 1 |" in r.stdout
    assert "| stories260K | 1 |" in out.with_suffix(".md").read_text()


def test_kv_memory_benchmark_runs_end_to_end_on_a_toy_model(tmp_path):
    """bench/kv_memory.py on the CPU with --tiny: the capacity rows of each KV dtype and the preemption rows, with the
    JSON fields the issue names, the table, the targets and the plot; --append merges a second run's rows."""
    res = subprocess.run([sys.executable, str(BENCH / "kv_memory.py"), "--tiny", "--device", "cpu", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads(next(tmp_path.glob("kv-memory-*.json")).read_text())
    assert {"gpu", "date", "model", "rows"} <= set(meta) and "--tiny --device cpu' bash" in meta["command"]
    rows = meta["rows"]
    assert [(r["kv_cache_dtype"], r["preemption"]) for r in rows] == [
        ("fp32", "recompute"), ("fp8_e4m3", "recompute"), ("int8", "recompute"), ("fp32", "swap"), ("fp32", "offload")]
    for r in rows:
        for k in ("workload", "kv_cache_dtype", "preemption", "kv_gb", "max_seqs_no_preemption", "output_tok_s",
                  "ttft_p99_s", "preemptions", "recomputed_tokens"):
            assert r[k] is not None, (k, r)
        assert r["output_tok_s"] > 0 and r["ttft_p99_s"] > 0 and r["workload"] == "32x64"
    by = {(r["kv_cache_dtype"], r["preemption"]): r for r in rows}
    assert by[("fp32", "recompute")]["pool_share"] == pytest.approx(1 / 3, abs=0.01)
    assert by[("fp32", "recompute")]["preemptions"] > 0 and by[("fp32", "swap")]["swap_outs"] > 0
    assert by[("int8", "recompute")]["max_seqs_no_preemption"] > 2 * by[("fp32", "recompute")]["max_seqs_no_preemption"]
    assert by[("fp32", "offload")]["pages_offloaded"] > 0
    names = {c["target"] for c in meta["targets"]}
    assert "bf16: int8 sequences held / bf16's >= 1.9" in names
    assert any(n.endswith("output tok/s / recompute's >= 1.2") for n in names)
    md = next(tmp_path.glob("kv-memory-*.md")).read_text()
    assert md.count("| 32x64 |") == 5 and "## Targets" in md
    if importlib.util.find_spec("matplotlib"):
        assert next(tmp_path.glob("kv-memory-*.png")).stat().st_size > 10_000
    res = subprocess.run([sys.executable, str(BENCH / "kv_memory.py"), "--tiny", "--device", "cpu", "--out",
                          str(tmp_path), "--kv", "int8", "--preemptions", "offload", "--offload-pages-per-step", "512",
                          "--append"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    merged = json.loads(next(tmp_path.glob("kv-memory-*.json")).read_text())["rows"]
    assert len(merged) == 6 and merged[-1]["offload_pages_per_step"] == 32  # int8 recompute replaced, one added


def test_kv_memory_targets_come_from_the_rows(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    km = importlib.import_module("kv_memory")
    base = dict(weights="bf16", max_seqs_no_preemption=10, output_tok_s=100.0, recomputed_tokens=1000,
                offload_pages_per_step=None)
    rows = [dict(base, kv_cache_dtype="bf16", preemption="recompute"),
            dict(base, kv_cache_dtype="int8", preemption="recompute", max_seqs_no_preemption=19, output_tok_s=160.0),
            dict(base, kv_cache_dtype="bf16", preemption="offload", recomputed_tokens=50, output_tok_s=110.0,
                 offload_pages_per_step=256)]
    got = {c["target"]: (c["value"], c["met"]) for c in km.target_checks(rows)}
    assert got == {"bf16: int8 sequences held / bf16's >= 1.9": (1.9, True),
                   "bf16: int8 output tok/s under pressure / bf16's >= 1.5": (1.6, True),
                   "bf16 bf16 offload (256 pages/step): recomputed tokens cut vs recompute >= 90%": (0.95, True),
                   "bf16 bf16 offload (256 pages/step): output tok/s / recompute's >= 1.2": (1.1, False)}
