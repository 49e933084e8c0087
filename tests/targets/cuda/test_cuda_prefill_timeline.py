"""The prefill timeline probe (-DUA_PREFILL_TIMELINE, bench/prefill_timeline.py).

CPU: the switch builds (sm_90: the persistent Hopper blocks stamp; sm_80: nothing to stamp) and leaves
production alone; the library reports the layout the script parses; the template's points are the script's;
the script's spans on a synthetic buffer. GPU: the probe build matches the float64 reference on a causal case
whose blocks take several items, every item taken has one record with its stamps ordered, and a graph replay
refreshes the records.
"""
from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_cuda_decode_timeline import probe_build, probe_library
from uacompile import ir, testing
from uacompile.targets.cuda import attention

BENCH = Path(__file__).resolve().parents[3] / "bench"
PROBE = "-DUA_PREFILL_TIMELINE"
PA = ir.PagedAttention
# the benchmarks' launch (one split, the item queue), with lse to check it too
OP = attention.launched_op(PA(32, 8, 128, 16, "bf16", "bf16", return_lse=True), 1, design=attention.design_of(""))
# causal prompts (and one chunk of a longer sequence) of ~1900 tokens: 60 tiles x 8 KV heads = 480 items, 3-4 a
# block of an H200; sequences meeting inside a tile make items of two runs
KV_LENS = [700, 300, 450, 90, 33, 100, 1500]
Q_LENS = [700, 300, 450, 90, 33, 100, 200]


@pytest.fixture(scope="module")
def timeline():
    """bench/prefill_timeline.py as a module."""
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("prefill_timeline")
    finally:
        sys.path.remove(str(BENCH))


# ---------------------------------------------------------------- CPU
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_probe_switch_compiles_and_reports_its_layout(arch, monkeypatch, timeline):
    """The switch builds on the persistent Hopper prefill blocks and on the mma.sync path (no stamps there);
    the library (a host function, no GPU needed) reports the layout and points the script expects; production
    has no probe; the decode probe's switch with it is refused (they share the buffer)."""
    import cffi

    from uacompile.nvcc import NvccError
    from uacompile.targets.cuda.build import build
    from uacompile.targets.cuda.loader import load_library

    op = attention.launched_op(OP, 1, arch=arch, design=attention.design_of(""))
    assert op.item_queue == (arch == "sm_90")
    plain = build([op], arch).path
    res = probe_build([op], arch, monkeypatch, PROBE)
    assert res.path.exists() and res.path != plain
    tl = timeline.PrefillTimeline(load_library(res.path, [op]), op)
    lay = tl.layout
    assert lay["points"] == len(timeline.POINTS) and lay["items"] >= 64 and lay["records"] >= 132 * lay["items"]
    assert lay["clock_word"] == lay["points"] and lay["wait_word"] + 2 <= lay["record"]
    assert tl.words == lay["header"] + lay["records"] * lay["record"]
    ffi = cffi.FFI()
    ffi.cdef(timeline.TIMELINE_CDEF.format(sym=op.symbol()))
    with pytest.raises(AttributeError):  # the accessors exist only in a probe build
        getattr(ffi.dlopen(str(plain)), f"{op.symbol()}_timeline_layout")
    if arch == "sm_90":
        with pytest.raises(NvccError, match="one probe a build"):
            probe_build([op], arch, monkeypatch, f"{PROBE} -DUA_DECODE_TIMELINE")


def test_template_points_match_the_script(timeline):
    import re

    text = (Path(attention.__file__).parents[2] / "templates" / "cuda" / "paged_attention.cu.j2").read_text()
    body = re.search(r"enum PrefillTimelinePoint \{(.*?)\};", text, re.S).group(1)
    names = [n.lower() for n in re.findall(r"TLP_(\w+)", body)]
    assert names == [*timeline.PRODUCER_POINTS, *timeline.WG_POINTS, "wg_end"]
    assert len(timeline.POINTS) == len(timeline.PRODUCER_POINTS) + 2 * len(timeline.WG_POINTS)


LAYOUT = dict(header=16, record=32, records=4 * 8, points=18, clock_word=18, info_word=27, wait_word=28, items=8)


def synthetic_buffer(timeline, items: list, layout=LAYOUT) -> np.ndarray:
    """A buffer as the probe writes it: items = [(block, ordinal, cycles by point name, smid, tiles, item,
    (wait_k0, wait_v0, wait_k1, wait_v1))]; a point's ns = cycles / 2 (2 cycles a ns) + 1000, its clock the
    cycles mod 2**32."""
    words = np.zeros(layout["header"] + layout["records"] * layout["record"], dtype=np.uint64)
    for block, ordinal, pts, smid, tiles, item, waits in items:
        rec = words[layout["header"] + (block * layout["items"] + ordinal) * layout["record"]:][:layout["record"]]
        clocks = rec[layout["clock_word"]:layout["clock_word"] + (layout["points"] + 1) // 2].view(np.uint32)
        for name, cyc in pts.items():
            k = timeline.POINTS.index(name)
            rec[k] = cyc // 2 + 1000
            clocks[k] = cyc % 2**32
        rec[layout["info_word"]] = smid | tiles << 16 | item << 32
        rec[layout["wait_word"]:layout["wait_word"] + 2].view(np.uint32)[:] = waits
    return words


def item_points(start: int, tiles: int, wg_skew: int = 100) -> dict:
    """An item's points in cycles: taken at start, K issued over the tiles (200 a tile), the consumers receive
    at start + 1000, prologue 600, S(0) 400 later, softmax(0) 700 later, 1000 cycles a tile, last softmax 500
    after the last S issue (a 1-tile item: 500 after softmax(0), whose S issue is S(0)'s), stored 800 after that;
    warpgroup 1 wg_skew behind warpgroup 0."""
    pts = dict(taken=start, k_first=start + 300, k_last=start + 300 + 200 * (tiles - 1), v_first=start + 400)
    for w in (0, 1):
        r = start + 1000 + w * wg_skew
        s0 = r + 600 + 400
        last = s0 + 1000 * (tiles - 1)
        pts.update({f"wg{w}_received": r, f"wg{w}_prologue": r + 600, f"wg{w}_s0": s0, f"wg{w}_softmax0": s0 + 700,
                    f"wg{w}_last_issued": last})
        pts[f"wg{w}_run_end"] = last + 500 if tiles > 1 else s0 + 1200
        pts[f"wg{w}_stored"] = pts[f"wg{w}_run_end"] + 800
    return pts


def test_summary_of_a_synthetic_timeline(timeline):
    """Two blocks of three items (tiles 2, 8, 20 and 3, 4, 1), each item's consumers 1000 cycles a tile: known
    spans come out of parse + summarize; a block's clock may wrap past 2**32."""
    items = []
    for block, (tiles_list, base) in enumerate((((2, 8, 20), 10_000), ((3, 4, 1), 2**32 - 9_000))):
        start = base
        for k, tiles in enumerate(tiles_list):
            waits = (50 * tiles, 20, 60, 30)
            items.append((block, k, item_points(start, tiles), 7 + block, tiles, 3 * block + k, waits))
            # the next item's consumers receive 700 cycles after this one's last softmax: its taken 1000 before that
            start += 1000 + 1000 + (tiles - 1) * 1000 + 500 + 700 - 1000
    words = synthetic_buffer(timeline, items)
    rec = timeline.parse(words, LAYOUT)
    assert len(rec["ns"]) == 6 and rec["block"].tolist() == [0, 0, 0, 1, 1, 1]
    assert rec["ordinal"].tolist() == [0, 1, 2] * 2 and rec["item"].tolist() == list(range(6))
    assert rec["tiles"].tolist() == [2, 8, 20, 3, 4, 1] and rec["smid"].tolist() == [7, 7, 7, 8, 8, 8]
    assert rec["wait_k"][:, 0].tolist() == [100, 400, 1000, 150, 200, 50] and rec["wait_v"][:, 1].tolist() == [30] * 6
    assert timeline.ordered(rec).all()
    assert timeline.cycles_per_ns(rec) == pytest.approx(2.0, rel=1e-3)
    sp = timeline.item_spans(rec)["values"]
    # gap: last issue (k) -> S(0) (k + 1) = 500 (last softmax) + 700 (ring) + 600 (prologue) + 400 (to S(0))
    assert np.allclose(sp["gap"], 2200) and len(sp["gap"]) == 8  # 4 pairs x 2 warpgroups
    assert np.allclose(sp["gap_tail"], 500) and np.allclose(sp["gap_ring"], 700)
    assert np.allclose(sp["prologue"], 600) and np.allclose(sp["to_s0"], 400) and np.allclose(sp["first_tile"], 700)
    per = sp["per_tile"][np.isfinite(sp["per_tile"])]
    assert len(per) == 10 and np.allclose(per, 1000)  # the 1-tile item has no time a tile
    assert np.allclose(sp["stored"], 800)
    assert np.allclose(sp["epilogue"], -900)  # stored before the next S(0) here: 1300 vs 2200 after the last issue
    assert np.allclose(sp["k_lead"], 1000 + 600 - 300)  # K(0) issued at +300, the consumers' prologue done at +1600
    assert np.allclose(sp["v_lead"], 1000 + 1000 + 700 - 400)
    assert np.allclose(sp["take_to_k"], 300)
    s = timeline.summarize([rec, rec])
    assert s["items"] == 6 and s["blocks"] == 2 and s["sms"] == 2
    assert s["spans"]["gap"]["p50"] == pytest.approx(2200) and s["spans"]["gap"]["n"] == 16
    # a block's gaps over its first S(0) -> last S issue: block 0 2 x 2200 over 1000 + 7000 + 2200 x 2 + 19000
    share0 = 100 * 4400 / (1000 + 7000 + 4400 + 19000)
    share1 = 100 * 4400 / (2000 + 3000 + 4400 + 0)
    assert sorted(set(np.round(timeline.block_gap_share(rec), 6))) == pytest.approx(sorted({share0, share1}))
    by = s["by_length"]
    assert by["1-4"]["tiles"]["n"] == 8 and by["5-16"]["tiles"]["n"] == 2 and by["17+"]["tiles"]["n"] == 2
    assert by["17+"]["per_tile"]["p50"] == pytest.approx(1000) and by["1-4"]["wait_k"]["p50"] == pytest.approx(60)
    text = timeline.table(s)
    assert "| item gap: last S=QK^T issue (k) -> S(0) issue (k+1) | 2200 | 2200 | 2200 | 1.10 | 16 |" in text
    assert "| 17+ | 2 |" in text
    # a record whose stamps go back in time is flagged
    bad = list(items)
    bad[1] = (*bad[1][:2], dict(bad[1][2], wg1_softmax0=bad[1][2]["wg1_s0"] - 1), *bad[1][3:])
    assert timeline.ordered(timeline.parse(synthetic_buffer(timeline, bad), LAYOUT)).tolist() == [
        True, False, True, True, True, True]


# ---------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def probe():
    """(kernel, PrefillTimeline) of the probe build, for this GPU's arch."""
    from uacompile.targets.cuda import api

    pt, lib = probe_library("prefill_timeline", PROBE, [OP])
    return api.CudaKernel(OP, library=lib), pt.PrefillTimeline(lib, OP)


@pytest.fixture(scope="module")
def case():
    """The causal case's inputs and float64 reference (out, lse), drawn once."""
    from test_cuda_attention_gpu import reference_of

    rng = np.random.default_rng(31)
    inputs = testing.attention_inputs(OP, rng, KV_LENS, Q_LENS)
    return inputs, reference_of(OP.replace(item_queue=False), inputs)


def launch_args(inputs) -> dict:
    import torch
    from test_cuda_attention_gpu import device_inputs

    dev = device_inputs(OP, inputs)
    T = inputs["num_tokens"]
    return {**dev, "out": torch.full_like(dev["q"], float("nan")),
            "lse": torch.full((T, OP.num_q_heads), float("nan"), device="cuda"),
            "item_queue": torch.zeros(2, dtype=torch.int32, device="cuda")}


def check_records(timeline, rec, items: int, sms: int) -> None:
    """One record an item taken (every item of the launch: none is all lone tokens), all of its points reached,
    stamps ordered, a block's items in the order it took them."""
    assert sorted(rec["item"].tolist()) == list(range(items)), "one record an item"
    assert (rec["ns"] > 0).all(), "every point of every item reached"
    assert timeline.ordered(rec).all(), "a record's stamps go back in time"
    assert (rec["tiles"] >= 1).all() and (rec["smid"] < sms).all()
    col = {p: k for k, p in enumerate(timeline.POINTS)}
    for b in np.unique(rec["block"]):
        rows = np.flatnonzero(rec["block"] == b)
        assert sorted(rec["ordinal"][rows].tolist()) == list(range(len(rows)))
        taken = rec["ns"][rows[np.argsort(rec["ordinal"][rows])], col["taken"]]
        assert (np.diff(taken) >= 0).all() and len(np.unique(rec["smid"][rows])) == 1
    assert rec["block"].max() < sms and rec["wait_k"].min() >= 0


@gpu
def test_probe_matches_reference_and_records_every_item(probe, case, timeline):
    import torch
    from test_cuda_attention_gpu import check_close, tol_of

    kern, tl = probe
    inputs, (ref_out, ref_lse) = case
    args = launch_args(inputs)
    tl.clear()
    kern(**args)
    torch.cuda.synchronize()
    check_close("out", args["out"], ref_out, tol_of(OP))
    check_close("lse", args["lse"], ref_lse, 2 * tol_of(OP))
    assert not args["item_queue"].any(), "the item queue must be zero after the launch"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    items = attention.prefill_items(OP, inputs["num_tokens"])
    assert items >= 3 * sms or sms > 150, "blocks take several items"
    rec = timeline.parse(tl.read(), tl.layout)
    check_records(timeline, rec, items, sms)
    s = timeline.summarize([rec])
    assert s["cycles_per_ns"] > 0.5 and s["spans"]["gap"]["n"] > 0 and s["spans"]["per_tile"]["p50"] > 0


@gpu
def test_probe_records_refresh_in_graph_replays(probe, case, timeline):
    """What the script replays: [clear, launch] captured in a graph; each replay leaves its own records."""
    import torch

    from uacompile.targets.cuda import api

    kern, tl = probe
    inputs, _ = case
    args = launch_args(inputs)
    graph = api.capture_graph([lambda: (tl.clear(), kern(**args))])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    items = attention.prefill_items(OP, inputs["num_tokens"])
    spans = []
    for _ in range(2):
        graph.replay()
        rec = timeline.parse(tl.read(), tl.layout)
        check_records(timeline, rec, items, sms)
        spans.append((rec["ns"].min(), rec["ns"].max()))
    assert spans[0][1] < spans[1][0], "the second replay's records are its own"
