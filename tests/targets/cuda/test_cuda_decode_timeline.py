"""The decode timeline probe (-DUA_DECODE_TIMELINE, bench/decode_timeline.py, bench/NOTES-attention.md v26).

CPU: the switch builds on both decode paths and leaves production alone; the library reports the
buffer layout the script parses; the script's summary on a synthetic stamp buffer. GPU: the probe
build still matches the float64 reference, and every decode group's stamps are ordered and name its
(token, KV head, split).
"""
from __future__ import annotations

import importlib
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from uacompile import ir, testing
from uacompile.targets.cuda import attention

BENCH = Path(__file__).resolve().parents[3] / "bench"
PROBE = "-DUA_DECODE_TIMELINE"
PA = ir.PagedAttention
G4 = PA(32, 8, 128, 16, "bf16", "bf16", return_lse=True)
D256 = PA(8, 2, 256, 16, "bf16", "bf16", return_lse=True)  # the mma.sync path on Hopper too
DECODE_LENS = [5000, 1, 700, 64, 2900, 33]  # with 32 splits the short ones leave most splits empty
PRODUCTION = attention.design_of("")
# (op as paged_attention() launches it, splits): the mixed kernel's Hopper decode groups with and without the
# fused merge, the mma.sync path's (one group a block), and the decode-only kernel a decode step launches
CASES = {"wgmma-s32": (attention.launched_op(G4, 32, design=PRODUCTION), 32),
         "wgmma-s1": (attention.launched_op(G4, 1, design=PRODUCTION), 1),
         "mma-sync-s3": (attention.launched_op(D256, 3, design=PRODUCTION), 3),
         "decode-only-s32": (attention.launched_op(G4, 32, design=PRODUCTION, decode_only=True), 32)}


@pytest.fixture(scope="module")
def timeline(request):
    """bench/decode_timeline.py as a module."""
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("decode_timeline")
    finally:
        sys.path.remove(str(BENCH))


def probe_build(ops, arch, monkeypatch, flags=PROBE):
    """build(ops, arch) with the probe switch (flags) set; the prefill probe's tests use it too."""
    from uacompile.targets.cuda.build import build

    monkeypatch.setenv("UACOMPILE_NVCC_FLAGS", flags)
    try:
        return build(ops, arch)
    finally:
        monkeypatch.delenv("UACOMPILE_NVCC_FLAGS")


# ---------------------------------------------------------------- CPU
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_probe_switch_compiles_and_reports_its_layout(arch, monkeypatch, timeline):
    """The switch builds on the Hopper decode groups and the mma.sync path; the library (without a GPU:
    a host function) reports the layout and point count the script expects; production has no probe."""
    import cffi

    from uacompile.targets.cuda.build import build
    from uacompile.targets.cuda.loader import load_library

    ops = [op for op, _ in CASES.values()]
    plain = build(ops, arch).path
    res = probe_build(ops, arch, monkeypatch)
    assert res.path.exists() and res.path != plain
    lib = load_library(res.path, ops)
    for op in ops:
        tl = timeline.Timeline(lib, op)
        assert tl.layout["points"] == len(timeline.POINTS) and tl.layout["groups"] >= 264  # an H200 wave of groups
        assert tl.layout["token_word"] < tl.layout["record"]
    ffi = cffi.FFI()
    ffi.cdef(timeline.TIMELINE_CDEF.format(sym=ops[0].symbol()))
    with pytest.raises(AttributeError):  # the accessors exist only in the probe build
        getattr(ffi.dlopen(str(plain)), f"{ops[0].symbol()}_timeline_layout")


def test_template_points_match_the_script(timeline):
    import re

    text = (Path(attention.__file__).parents[2] / "templates" / "cuda" / "paged_attention.cu.j2").read_text()
    body = re.search(r"enum TimelinePoint \{(.*?)\};", text, re.S).group(1)
    names = [n.lower() for n in re.findall(r"TL_(\w+)", body)]
    assert names == [*timeline.POINTS, "points"]


LAYOUT = dict(header=16, record=16, groups=4096, points=9, clock_word=9, info_word=14, token_word=15)


def synthetic_buffer(timeline, groups: list, mark_ns: int, layout=LAYOUT) -> np.ndarray:
    """A buffer as the probe writes it: groups = [(ns by point name, clock offset, smid, split, head, token, last)];
    a point's clock = (ns * 2 + offset) mod 2**32 (2 cycles a ns, a per-SM counter)."""
    words = np.zeros(layout["header"] + layout["groups"] * layout["record"], dtype=np.uint64)
    words[0] = mark_ns
    for g, (pts, offset, smid, split, head, token, last) in enumerate(groups):
        rec = words[layout["header"] + g * layout["record"]:][:layout["record"]]
        clocks = rec[layout["clock_word"]:layout["clock_word"] + (layout["points"] + 1) // 2].view(np.uint32)
        for name, ns in pts.items():
            k = timeline.POINTS.index(name)
            rec[k] = ns
            clocks[k] = (2 * ns + offset) % 2**32
        rec[layout["info_word"]] = smid | split << 16 | head << 32
        rec[layout["token_word"]] = token | (timeline.LAST_FLAG if last else 0)
    return words


def test_summary_of_a_synthetic_timeline(timeline):
    """Two items (token 0, heads 0 and 1) of 4 splits each: known spans come out of parse + summarize,
    in-group spans from the SM clocks (one wraps past 2**32), cross-group ones from the global timer."""
    mark = 1_000_000
    groups = []
    for head in (0, 1):
        for split in range(4):
            k = head * 4 + split
            start = mark + 3000 + 100 * k  # launch -> start 3.0 .. 3.7 us
            pts = dict(entry=start - 50, start=start, token=start + 400, first_stage=start + 1400,
                       last_tile=start + 1400 + 20000 + 200 * split, stored=0, arrived=0)
            pts["stored"] = pts["last_tile"] + 300
            pts["arrived"] = pts["stored"] + 600 + 10 * split
            last = split == 3 - head  # the merger need not be the last split
            if last:
                pts["merge_start"] = pts["arrived"] + 100
                pts["merge_end"] = pts["merge_start"] + 1000
            offset = 2**32 - 2 * start - 500 if k == 5 else 12345 * k  # group 5's clock wraps
            groups.append((pts, offset, 10 + k, split, head, 0, last))
    rec = timeline.parse(synthetic_buffer(timeline, groups, mark), LAYOUT)
    assert len(rec["ns"]) == 8 and rec["mark_ns"] == mark and rec["last"].sum() == 2
    assert rec["split"].tolist() == [0, 1, 2, 3] * 2 and rec["head"].tolist() == [0] * 4 + [1] * 4
    assert timeline.ordered(rec).all()
    s = timeline.summarize(rec, bytes_per_unit=80_000)
    assert s["groups"] == 8 and s["sms"] == 8 and s["cycles_per_ns"] == pytest.approx(2.0)
    assert s["global_step_ns"] == 10  # the closest distinct stamps: a store and an arrival 10 ns apart
    sp = s["spans"]

    def close(name, p0, p50, p100):
        assert (sp[name]["p0"], sp[name]["p50"], sp[name]["p100"]) == pytest.approx((p0, p50, p100)), name

    close("launch_start", 3.0, 3.35, 3.7)
    close("launch_entry", 2.95, 3.3, 3.65)
    close("start_spread", 0.0, 0.35, 0.7)
    close("pdl_wait", 0.05, 0.05, 0.05)
    close("scan", 0.4, 0.4, 0.4)
    close("ramp", 1.4, 1.4, 1.4)
    close("first_bytes", 1.0, 1.0, 1.0)
    close("stream", 20.0, 20.3, 20.6)
    # last tiles at start + 21400 + 200 split: the first at mark + 24400, the last (head 1, split 3) 1.3 us later
    close("finish_spread", 0.0, 0.65, 1.3)
    close("store", 0.3, 0.3, 0.3)
    close("arrive", 0.6, 0.615, 0.63)
    close("arrival_spread", 0.93, 0.93, 0.93)  # per item: split 3's arrival - split 0's (3 x 310 ns)
    close("merge_tail", 1.1, 1.1, 1.1)
    close("merge", 1.0, 1.0, 1.0)
    # a group ends at its arrival, 25300 + 100 k + 210 split ns after the mark, or a merger 1100 ns later:
    # head 0: 25300, 25610, 25920, 26230 + 1100; head 1: 25700, 26010, 26320 + 1100, 26630
    close("total", 24.42, 24.42, 24.42)  # the last end (27420) - the first start (3000)
    close("launch_total", 25.3, (25920 + 26010) / 2e3, 27.42)
    assert s["unit_gbps_p50"] == pytest.approx(80_000 / 20_300)
    text = timeline.table(timeline.median_summary([s, s]), {"production": 42.8, "probe": 43.0})
    assert "| group start -> first K/V stage landed | 1.40 | 1.40 | 1.40 | 8 |" in text
    assert "graph time per call, probe | | 43.00" in text
    result = dict(shape="1x4096", splits=4, units=8, summary=timeline.median_summary([s]),
                  graph_us={"production": 42.8, "probe": 43.0}, stamps_ordered=True,
                  checks={n: dict(ok=True, max_diff=0.004) for n in ("production", "probe")})
    line = timeline.headline(result, 2)
    assert "probe cost +0.20 us" in line and "10 ns" in line and "2.000 SM cycles/ns" in line
    assert "3.9 GB/s a unit, 0.03 TB/s over the 8" in line  # 80 KB in 20.3 us
    # a group whose stamps go back in time is flagged
    bad = groups[:1] + [(dict(groups[1][0], last_tile=groups[1][0]["first_stage"] - 1), *groups[1][1:])]
    assert timeline.ordered(timeline.parse(synthetic_buffer(timeline, bad, mark), LAYOUT)).tolist() == [True, False]


# ---------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


def probe_library(script: str, flag: str, ops: list):
    """(bench/<script>.py as a module, the library of ops built with the probe switch flag) for this GPU's arch;
    skips without CUDA (the prefill probe's tests use it too)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import sys

    sys.path.insert(0, str(BENCH))
    lib = attention.load_designs({"probe": "|" + flag}, ops)["probe"]
    if isinstance(lib, Exception):
        raise lib
    return importlib.import_module(script), lib


@pytest.fixture(scope="module")
def probe():
    """{case: (kernel, Timeline)} of the probe build, for this GPU's arch."""
    from uacompile.targets.cuda import api

    dt, lib = probe_library("decode_timeline", PROBE, [op for op, _ in CASES.values()])
    return {name: (api.CudaKernel(op, library=lib), dt.Timeline(lib, op)) for name, (op, _) in CASES.items()}


def launch_args(op, splits, inputs) -> dict:
    """A launch's device inputs, poisoned outputs and fresh workspaces (the counters stay zero after it)."""
    import torch
    from test_cuda_attention_gpu import device_inputs

    dev = device_inputs(op, inputs)
    T = inputs["num_tokens"]
    outs = {"out": torch.full_like(dev["q"], float("nan")),
            "lse": torch.full((T, op.num_q_heads), float("nan"), device="cuda")}
    if splits > 1:
        outs["o_partial"] = torch.full((splits, T, op.num_q_heads, op.head_dim), float("nan"), device="cuda")
        outs["lse_partial"] = torch.full((splits, T, op.num_q_heads), float("nan"), device="cuda")
        outs["split_counters"] = torch.zeros((T, op.num_kv_heads), dtype=torch.int32, device="cuda")
    if op.item_queue:
        outs["item_queue"] = torch.zeros(2, dtype=torch.int32, device="cuda")
    return {**dev, **outs}


@gpu
@pytest.mark.parametrize("case", list(CASES))
def test_probe_matches_reference_and_its_stamps_are_ordered(probe, rng, case, timeline):
    import torch
    from test_cuda_decode_gpu import check_outputs

    op, splits = CASES[case]
    kern, tl = probe[case]
    inputs = testing.attention_inputs(op, rng, DECODE_LENS)
    outs = launch_args(op, splits, inputs)
    tl.clear()
    tl.mark()
    kern(**outs)
    torch.cuda.synchronize()
    check_outputs(case, op, inputs, outs["out"], outs["lse"])
    rec = timeline.parse(tl.read(), tl.layout)
    col = {p: k for k, p in enumerate(timeline.POINTS)}
    ns = rec["ns"]
    # one record a (token, KV head, split) unit: every group of a pure decode launch runs one token
    units = sorted(zip(rec["token"].tolist(), rec["head"].tolist(), rec["split"].tolist()))
    assert units == [(t, h, s) for t in range(len(DECODE_LENS)) for h in range(op.num_kv_heads) for s in range(splits)]
    assert timeline.ordered(rec).all(), "a group's stamps go back in time"
    for p in ("entry", "start", "token", "last_tile", "stored"):
        assert (ns[:, col[p]] > 0).all(), p
    assert (rec["mark_ns"] <= ns[:, col["entry"]]).all() and (ns[:, col["entry"]] <= ns[:, col["start"]]).all()
    # a split sees K/V (and stamps its first stage) exactly when its range is not empty
    kv_len = np.asarray(DECODE_LENS)[rec["token"]]
    chunk = -(-kv_len // splits)
    assert ((ns[:, col["first_stage"]] > 0) == (rec["split"] * chunk < kv_len)).all()
    seen = ns[:, col["first_stage"]] > 0
    assert (ns[seen, col["start"]] <= ns[seen, col["first_stage"]]).all()
    assert (ns[seen, col["first_stage"]] <= ns[seen, col["last_tile"]]).all()
    if splits == 1:
        assert not ns[:, col["arrived"]:].any() and not rec["last"].any()
        return
    assert (ns[:, col["last_tile"]] <= ns[:, col["arrived"]]).all()
    # the fused merge: one merging group an item, whose merge follows its arrival
    items = {(t, h) for t, h, _ in units}
    mergers = list(zip(rec["token"][rec["last"]].tolist(), rec["head"][rec["last"]].tolist()))
    assert sorted(mergers) == sorted(items)
    assert (ns[rec["last"], col["arrived"]] <= ns[rec["last"], col["merge_start"]]).all()
    assert not ns[~rec["last"], col["merge_start"]:].any()
    s = timeline.summarize(rec)
    assert s["cycles_per_ns"] > 0.5 and math.isfinite(s["spans"]["total"]["p50"])


@gpu
def test_probe_stamps_refresh_in_graph_replays(probe, rng, timeline):
    """What the script replays: [clear, mark, launch] captured in a graph; each replay leaves its own stamps."""
    import torch

    from uacompile.targets.cuda import api

    op, splits = CASES["wgmma-s32"]
    kern, tl = probe["wgmma-s32"]
    inputs = testing.attention_inputs(op, rng, DECODE_LENS)
    args = launch_args(op, splits, inputs)
    graph = api.capture_graph([lambda: (tl.clear(), tl.mark(), kern(**args))])
    marks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        rec = timeline.parse(tl.read(), tl.layout)
        assert len(rec["ns"]) == len(DECODE_LENS) * op.num_kv_heads * splits and timeline.ordered(rec).all()
        assert rec["last"].sum() == len(DECODE_LENS) * op.num_kv_heads
        marks.append(rec["mark_ns"])
    assert 0 < marks[0] < marks[1]
