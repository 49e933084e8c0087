"""Prefill timeline probe: where a Hopper prefill item's time goes (docs/attention-rationale.md,
"At the power cap").

    python3 bench/prefill_timeline.py [--shapes 8x4096,2x16384] [--samples 5] [--heads 32/8] [--json PATH]

Builds the benchmarks' causal prefill launch (bf16 Hq32/Hkv8 D128 P16, one split, the item queue:
attention.launched_op; --heads HQ/HKV takes other head counts, e.g. 32/32 for MHA) twice: as is, and with the template's probe switch -DUA_PREFILL_TIMELINE, whose
persistent prefill blocks stamp per item they take (%globaltimer ns and the SM's %clock) when the K
producer took it, issued its first and last K tile, the V producer its first V tile, and when each
consumer warpgroup received it, finished its prologue, issued S(0), finished tile 0's softmax, issued
its last tile's S = Q K^T, finished its last softmax and stored its rows, plus the cycles its warp 0
waited on full_k / full_v during the item (POINTS below; the record layout comes from the library).
Checks both builds against torch SDPA (outputs poisoned first), times them interleaved beside SDPA
(bench/timing.time_graphs: the probe's own cost), then replays a graph of [clear the stamps, the probe
launch] --samples times and reads the stamps after each. Per shape it prints p10 / p50 / p90 (SM cycles,
and the p50 in us) over the items of every replay, pooled: the consumers' item gap (last S = Q K^T issue
of item k -> S(0) issue of item k + 1, same block and warpgroup), its parts, the prologue, tile 0's
latency, the time a tile, the K / V wait cycles an item, the producers' lead, and over the blocks the
share of a block's time that is item gap; then the same p50s by item length (tiles 1-4, 5-16, 17+).
Spans within a block use the SM clock (one SM's counter); the cycles per ns come from the stamps.
The last replay's raw records go to the JSON (default $OUT/prefill_timeline.json when OUT is set; ns as
offsets from ns_base).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

# the shared buffer's reader and accessors, a launch with paged_attention()'s workspaces
from decode_timeline import TIMELINE_CDEF, Timeline, clock_rate, launch, timeline_main  # noqa: E402,F401

PROBE_FLAG = "-DUA_PREFILL_TIMELINE"
# the template's PrefillTimelinePoint, in its order: the producers', then each consumer warpgroup's
PRODUCER_POINTS = ("taken", "k_first", "k_last", "v_first")
WG_POINTS = ("received", "prologue", "s0", "softmax0", "last_issued", "run_end", "stored")
POINTS = PRODUCER_POINTS + tuple(f"wg{w}_{p}" for w in (0, 1) for p in WG_POINTS)
SHAPES = [(8, 4096), (2, 16384)]
HEADS = [32, 8]  # query and KV heads of the probed op (--heads)
TOLERANCE = 2e-2  # bf16 output vs SDPA (as bench/decode_sweep.py)
LENGTHS = [("1-4", 1, 4), ("5-16", 5, 16), ("17+", 17, 1 << 30)]  # an item's K/V tiles


class PrefillTimeline(Timeline):
    """The prefill probe's records: one an item a persistent block takes (the first `items` of each block)."""

    POINTS = POINTS
    FIELDS = ("header", "record", "records", "points", "clock_word", "info_word", "wait_word", "items")
    RECORDS = "records"


# ---------------------------------------------------------------- records -> spans (numpy only)
def parse(words: np.ndarray, layout: dict) -> dict:
    """The used records of a buffer (an item some block took): ns [n, POINTS] (0: not reached), clock [n, POINTS]
    (uint32 as int64), smid, tiles, item, block, ordinal (the block's k-th item), wait_k / wait_v [n, 2] (cycles of
    consumer warpgroup 0 / 1), and the marker's ns (0: none)."""
    words = np.asarray(words, dtype=np.uint64)
    hdr, rec, npts = layout["header"], layout["record"], layout["points"]
    recs = words[hdr:hdr + layout["records"] * rec].reshape(-1, rec)
    col = {p: k for k, p in enumerate(POINTS)}
    idx = np.flatnonzero((recs[:, col["taken"]] != 0) | (recs[:, col["wg0_received"]] != 0))
    used = recs[idx]
    clocks = used[:, layout["clock_word"]:layout["clock_word"] + (npts + 1) // 2].copy().view(np.uint32)[:, :npts]
    info = used[:, layout["info_word"]]
    waits = used[:, layout["wait_word"]:layout["wait_word"] + 2].copy().view(np.uint32).reshape(-1, 2, 2)
    return dict(ns=used[:, :npts].astype(np.int64), clock=clocks.astype(np.int64),
                smid=(info & 0xFFFF).astype(np.int64), tiles=((info >> 16) & 0xFFFF).astype(np.int64),
                item=(info >> 32).astype(np.int64), block=idx // layout["items"], ordinal=idx % layout["items"],
                wait_k=waits[:, :, 0].astype(np.int64), wait_v=waits[:, :, 1].astype(np.int64), mark_ns=int(words[0]))


# the points each role passes in this order (an item's "first" points from its first run, the others its last;
# the last S issue of a 1-tile item is S(0)'s, before softmax(0))
CHAINS = [("taken", "k_first", "k_last"), ("taken", "v_first"),
          *[tuple(f"wg{w}_{p}" for p in chain) for w in (0, 1)
            for chain in (("received", "prologue", "s0", "softmax0", "run_end", "stored"),
                          ("s0", "last_issued", "run_end"))],
          *[("taken", f"wg{w}_received") for w in (0, 1)]]


def ordered(rec: dict) -> np.ndarray:
    """Per record: along each role's chain its reached points never go back in time (global ns and SM clock)."""
    col = {p: k for k, p in enumerate(POINTS)}
    n = len(rec["ns"])
    ok = np.ones(n, dtype=bool)
    for chain in CHAINS:
        c = [col[p] for p in chain]
        ns, clk = rec["ns"][:, c], rec["clock"][:, c]
        reached = ns > 0
        first = clk[np.arange(n), np.argmax(reached, axis=1)]
        rel = (clk - first[:, None]) % 2**32  # cycles since the chain's first reached point: < 2**31 unless it went back
        ok &= np.all(~reached | (rel < 2**31), axis=1)
        for v in (ns, rel):
            v = np.where(reached, v, -1)
            before = np.concatenate([np.full((n, 1), -1), np.maximum.accumulate(v, axis=1)[:, :-1]], axis=1)
            ok &= np.all(~reached | (v >= before), axis=1)
    return ok


def cycles_per_ns(rec: dict) -> float:
    """SM cycles per ns over every record's wg0 received -> stored."""
    return clock_rate(rec, POINTS.index("wg0_received"), POINTS.index("wg0_stored"))


def _span(rec: dict, a: str, b: str, rows=None) -> np.ndarray:
    """b - a in SM cycles (same record), NaN where either was not reached."""
    col = {p: k for k, p in enumerate(POINTS)}
    rows = slice(None) if rows is None else rows
    ns, clk = rec["ns"][rows], rec["clock"][rows]
    d = ((clk[:, col[b]] - clk[:, col[a]] + 2**31) % 2**32 - 2**31).astype(np.float64)  # signed: a lead may be < 0
    d[(ns[:, col[a]] == 0) | (ns[:, col[b]] == 0)] = np.nan
    return d


def _next_of(rec: dict) -> tuple[np.ndarray, np.ndarray]:
    """(i, j): record j is the next item of record i's block (ordinal + 1)."""
    key = {(int(b), int(o)): r for r, (b, o) in enumerate(zip(rec["block"], rec["ordinal"]))}
    pairs = [(r, key[(int(b), int(o) + 1)]) for r, (b, o) in enumerate(zip(rec["block"], rec["ordinal"]))
             if (int(b), int(o) + 1) in key]
    i, j = (np.asarray(x, dtype=np.int64) for x in zip(*pairs)) if pairs else (np.zeros(0, np.int64),) * 2
    return i, j


def _across(rec: dict, i: np.ndarray, j: np.ndarray, a: str, b: str) -> np.ndarray:
    """Point b of record j - point a of record i (same block: one SM clock), cycles; NaN where not reached."""
    col = {p: k for k, p in enumerate(POINTS)}
    d = ((rec["clock"][j, col[b]] - rec["clock"][i, col[a]] + 2**31) % 2**32 - 2**31).astype(np.float64)
    d[(rec["ns"][i, col[a]] == 0) | (rec["ns"][j, col[b]] == 0)] = np.nan
    return d


# (name, description): per item (both warpgroups pooled where the span is a consumer's), in SM cycles
SPANS = [
    ("gap", "item gap: last S=QK^T issue (k) -> S(0) issue (k+1)"),
    ("gap_tail", "  last S=QK^T issue -> last softmax done (k)"),
    ("gap_ring", "  last softmax done (k) -> next item received"),
    ("prologue", "  received -> prologue done (Q staged, ranges read)"),
    ("to_s0", "  prologue done -> S(0) issued (K(0) wait, first turn)"),
    ("first_tile", "first-tile latency: S(0) issued -> softmax(0) done"),
    ("epilogue", "  S(0) issued (k+1) -> item k's rows stored (OVERLAP: inside it)"),
    ("per_tile", "time a tile: S(0) -> last S issue / (tiles - 1)"),
    ("item", "item period: S(0) issue (k) -> S(0) issue (k+1)"),
    ("stored", "last softmax done -> rows stored"),
    ("wait_k", "consumer wait on full_k an item (warp 0)"),
    ("wait_v", "consumer wait on full_v an item (warp 0)"),
    ("wait_share", "K+V wait, % of the item period"),
    ("take_to_k", "K producer: taken -> first K issued"),
    ("k_issue", "K producer: first -> last K issued"),
    ("k_lead", "K lead: first K issued -> consumers' prologue done"),
    ("v_lead", "V lead: first V issued -> softmax(0) done (V(0) needed)"),
    ("tiles", "K/V tiles an item"),
]


def item_spans(rec: dict) -> dict:
    """{name: values} per item (consumer spans of both warpgroups concatenated), and 'tiles_of' for each value:
    the tiles of the item it belongs to (a gap or period: the item it leads into)."""
    n = len(rec["ns"])
    i, j = _next_of(rec)
    tiles = rec["tiles"].astype(np.float64)
    out, tiles_of = {}, {}

    def put(name, values, t):
        out[name] = np.concatenate([out.get(name, np.zeros(0)), values])
        tiles_of[name] = np.concatenate([tiles_of.get(name, np.zeros(0)), t])

    for w in (0, 1):
        p = lambda name: f"wg{w}_{name}"  # noqa: E731
        put("gap", _across(rec, i, j, p("last_issued"), p("s0")), tiles[j])
        put("gap_tail", _span(rec, p("last_issued"), p("run_end"))[i], tiles[j])
        put("gap_ring", _across(rec, i, j, p("run_end"), p("received")), tiles[j])
        put("prologue", _span(rec, p("received"), p("prologue")), tiles)
        put("to_s0", _span(rec, p("prologue"), p("s0")), tiles)
        put("first_tile", _span(rec, p("s0"), p("softmax0")), tiles)
        put("epilogue", -_across(rec, i, j, p("stored"), p("s0")), tiles[j])
        per = _span(rec, p("s0"), p("last_issued")) / np.maximum(tiles - 1, 1)
        per[tiles < 2] = np.nan
        put("per_tile", per, tiles)
        period = _across(rec, i, j, p("s0"), p("s0"))
        put("item", period, tiles[i])
        put("stored", _span(rec, p("run_end"), p("stored")), tiles)
        wk, wv = rec["wait_k"][:, w].astype(np.float64), rec["wait_v"][:, w].astype(np.float64)
        put("wait_k", wk, tiles)
        put("wait_v", wv, tiles)
        put("wait_share", 100 * (wk + wv)[i] / period, tiles[i])
    put("take_to_k", _span(rec, "taken", "k_first"), tiles)
    put("k_issue", _span(rec, "k_first", "k_last"), tiles)
    need = np.fmin(_span(rec, "k_first", "wg0_prologue"), _span(rec, "k_first", "wg1_prologue"))
    put("k_lead", need, tiles)
    put("v_lead", np.fmin(_span(rec, "v_first", "wg0_softmax0"), _span(rec, "v_first", "wg1_softmax0")), tiles)
    put("tiles", tiles, tiles)
    assert all(len(v) == len(tiles_of[k]) for k, v in out.items()) and n >= 0
    return dict(values=out, tiles_of=tiles_of)


def block_gap_share(rec: dict) -> np.ndarray:
    """Per (block, warpgroup): the summed item gaps in % of its time from the first item's S(0) to the last
    item's last S = Q K^T issue (its recorded items only)."""
    i, j = _next_of(rec)
    shares = []
    for w in (0, 1):
        gap = _across(rec, i, j, f"wg{w}_last_issued", f"wg{w}_s0")
        for b in np.unique(rec["block"]):
            rows = np.flatnonzero(rec["block"] == b)
            if len(rows) < 2:
                continue
            first, last = rows[np.argmin(rec["ordinal"][rows])], rows[np.argmax(rec["ordinal"][rows])]
            total = _across(rec, np.array([first]), np.array([last]), f"wg{w}_s0", f"wg{w}_last_issued")[0]
            g = gap[rec["block"][i] == b]
            if np.isfinite(total) and total > 0 and np.isfinite(g).all():
                shares.append(100 * g.sum() / total)
    return np.asarray(shares, dtype=np.float64)


def _pcts(x) -> dict:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return dict(p10=None, p50=None, p90=None, n=0)
    p10, p50, p90 = np.percentile(x, [10, 50, 90])
    return dict(p10=float(p10), p50=float(p50), p90=float(p90), n=int(x.size))


def summarize(recs: list) -> dict:
    """Pooled over the replays' records: each span's p10 / p50 / p90 (cycles) and n, by item length too, the
    blocks' gap share, the clock rate, blocks, items and SMs."""
    spans = [item_spans(r) for r in recs]
    values = {k: np.concatenate([s["values"][k] for s in spans]) for k, _ in SPANS}
    tiles_of = {k: np.concatenate([s["tiles_of"][k] for s in spans]) for k, _ in SPANS}
    cpn = [cycles_per_ns(r) for r in recs]
    out = dict(cycles_per_ns=float(np.median(cpn)) if cpn else 0.0,
               items=int(np.median([len(r["ns"]) for r in recs])) if recs else 0,
               blocks=int(np.median([len(np.unique(r["block"])) for r in recs])) if recs else 0,
               sms=int(np.median([len(np.unique(r["smid"])) for r in recs])) if recs else 0,
               spans={k: _pcts(values[k]) for k, _ in SPANS},
               gap_share=_pcts(np.concatenate([block_gap_share(r) for r in recs]) if recs else []),
               by_length={})
    for label, lo, hi in LENGTHS:
        out["by_length"][label] = {k: _pcts(values[k][(tiles_of[k] >= lo) & (tiles_of[k] <= hi)]) for k, _ in SPANS}
    return out


def table(summary: dict) -> str:
    """The per-shape tables: spans (cycles, us at p50), then p50 by item length."""
    cpn = summary["cycles_per_ns"]
    fmt = lambda v: "" if v is None else f"{v:.0f}"  # noqa: E731
    us = lambda v: "" if v is None or not cpn else f"{v / cpn / 1e3:.2f}"  # noqa: E731
    lines = ["| span (SM cycles) | p10 | p50 | p90 | p50 us | n |", "|---|---:|---:|---:|---:|---:|"]
    for name, text in SPANS:
        c = summary["spans"][name]
        unitless = name in ("wait_share", "tiles")
        lines.append(f"| {text} | {fmt(c['p10'])} | {fmt(c['p50'])} | {fmt(c['p90'])} | "
                     f"{'' if unitless else us(c['p50'])} | {c['n']} |")
    g = summary["gap_share"]
    lines.append(f"| block time in item gaps, % (per block and warpgroup) | {fmt(g['p10'])} | {fmt(g['p50'])} | "
                 f"{fmt(g['p90'])} | | {g['n']} |")
    cols = ["gap", "prologue", "to_s0", "first_tile", "per_tile", "wait_k", "wait_v", "item"]
    lines += ["", "| tiles an item | items | " + " | ".join(f"{c} p50" for c in cols) + " |",
              "|---|---:|" + "---:|" * len(cols)]
    for label, cells in summary["by_length"].items():
        lines.append(f"| {label} | {cells['tiles']['n']} | " + " | ".join(fmt(cells[c]["p50"]) for c in cols) + " |")
    return "\n".join(lines)


def headline(r: dict, samples: int) -> str:
    s = r["summary"]
    checks = ", ".join(f"{n} {'ok' if c['ok'] else 'BAD'} ({c['max_diff']:.3g})" for n, c in r["checks"].items())
    g = r["graph_us"]
    cost = 100 * (g["probe"] / g["production"] - 1)
    return (f"{r['shape']} causal, Hq/Hkv {r['heads']}: {r['items']} items on {r['ctas']} blocks ({s['blocks']} recorded, {s['sms']} SMs), "
            f"{s['items']} records a replay; vs SDPA: {checks}; graph us production {g['production']:.1f}, probe "
            f"{g['probe']:.1f} ({cost:+.1f}%), SDPA {g['sdpa']:.1f} (production {g['sdpa'] / g['production']:.3f}x SDPA); "
            f"stamps ordered: {r['stamps_ordered']}, one record an item: {r['one_record_an_item']}; "
            f"{s['cycles_per_ns']:.3f} SM cycles/ns; pooled over {samples} replays")


# ---------------------------------------------------------------- the device run
def production_op():
    """What paged_attention() launches for the benchmarks' causal prefill (one split, the item queue)."""
    import attention_bench as ab

    from uacompile.targets.cuda import attention

    from uacompile import ir

    return attention.launched_op(ir.PagedAttention(*HEADS, ab.D, ab.P, "bf16", "bf16"), 1, arch=attention._arch(0))


def run_shape(B: int, L: int, libs: dict, samples: int, gen) -> dict:
    import attention_bench as ab
    import torch

    from uacompile.targets.cuda import api, attention

    op = production_op()
    b = ab.PagedBatch(B, L, L, gen, (*HEADS, ab.D, ab.P))
    k, v = b.contiguous_kv()
    want = ab.sdpa(b.q_bhld(), k, v, True)
    calls, checks = {}, {}
    for name, lib in libs.items():
        kern = api.CudaKernel(op, library=lib)
        calls[name] = lambda kern=kern: launch(kern, op, 1, b)
        b.out.fill_(float("nan"))
        calls[name]()
        torch.cuda.synchronize()
        diff = (b.out.view(B, L, HEADS[0], ab.D).transpose(1, 2).float() - want.float()).abs().max().item()
        checks[name] = dict(max_diff=diff, ok=diff <= TOLERANCE)  # NaN (an unwritten element) compares False
    fns = dict(calls, sdpa=lambda: ab.sdpa(b.q_bhld(), k, v, True))
    timings = ab.time_graphs(fns, calls=2, rounds=ab.ROUNDS)
    graph_us = {n: t.ms * 1e3 for n, t in timings.items()}
    tl = PrefillTimeline(libs["probe"], op)
    graph = api.capture_graph([lambda: (tl.clear(), calls["probe"]())])
    items = attention.prefill_items(op, B * L)
    ctas = min(items, torch.cuda.get_device_properties(0).multi_processor_count)
    recs, order_ok, one_each = [], True, True
    for _ in range(samples):
        graph.replay()
        rec = parse(tl.read(), tl.layout)
        order_ok &= bool(ordered(rec).all())
        # every item taken once; records past a block's first `items` are not kept
        per_block = np.bincount(rec["block"], minlength=ctas)
        taken = np.sort(rec["item"])
        one_each &= bool(np.all(np.diff(taken) > 0)) and (len(taken) == items or per_block.max() >= tl.layout["items"])
        recs.append(rec)
    # the last replay's records; ns as offsets from its first stamp (ns_base), -1 where not reached
    last = recs[-1]
    base = int(last["ns"][last["ns"] > 0].min()) if (last["ns"] > 0).any() else 0
    raw = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in last.items() if k != "ns"}
    raw.update(ns_base=base, ns=np.where(last["ns"] > 0, last["ns"] - base, -1).tolist())
    del graph, b, k, v, want
    torch.cuda.empty_cache()
    return dict(shape=f"{B}x{L}", heads="/".join(map(str, HEADS)), items=items, ctas=ctas, checks=checks, graph_us=graph_us, stamps_ordered=order_ok,
                one_record_an_item=one_each, summary=summarize(recs), records=raw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(add_help=False)  # --heads; the rest is timeline_main's command line
    ap.add_argument("--heads", default="/".join(map(str, HEADS)))
    known, argv = ap.parse_known_args(argv)
    HEADS[:] = [int(x) for x in known.heads.split("/")]
    return timeline_main(
        argv, doc=__doc__, script="prefill_timeline", probe_flag=PROBE_FLAG, points=POINTS,
        rows="BxL causal prefill rows", shapes=SHAPES, samples=5, ops_of=lambda shapes: [production_op()],
        run_shape=run_shape, headline=headline, table=lambda r: table(r["summary"]), label="raw records",
        passed=lambda r: (all(c["ok"] for c in r["checks"].values()) and r["stamps_ordered"]
                          and r["one_record_an_item"]))


if __name__ == "__main__":
    sys.exit(main())
