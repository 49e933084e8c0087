"""Decode timeline probe: where a split-KV decode launch's fixed cost goes (docs/attention-rationale.md,
"What bounds 1x32768").

    python3 bench/decode_timeline.py [--shapes 1x32768,1x4096,8x16384] [--samples 20] [--json PATH]

Builds the production op of each shape (auto split, fused merge) twice: as is, and with the template's
probe switch -DUA_DECODE_TIMELINE, whose decode groups stamp %globaltimer (ns, one clock for all SMs)
and %clock (the SM's cycles) at the points of the template's TimelinePoint (POINTS below) into a buffer
of the library. Checks both builds' output against torch SDPA (poisoned first), times them interleaved
(bench/timing.time_graphs: the probe's own cost), then replays a graph of [clear the stamps, a marker
kernel that stamps when the stream reaches it, the probe launch] and reads the stamps after each of
--samples replays. Per shape it prints a table of spans (p0 / p50 / p100 over the groups or items of a
replay, each the median over the replays): launch (the marker) -> block entry and group start, the
prologue (start -> token chosen -> first K/V stage landed), the stream (first stage -> last tile), the
spread of the groups' finishes, store and arrival, the merge tail, and the whole launch against the
graph time per call. Spans within a group are taken from the SM clock (converted with the cycles per
ns the replay's own stamps give), spans across groups from the global timer, whose step is printed
(it can be ~1 us). The raw records go to the JSON (default $OUT/decode_timeline.json when OUT is set).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

PROBE_FLAG = "-DUA_DECODE_TIMELINE"
# the template's TimelinePoint, in its order (the library reports how many there are: checked on load)
POINTS = ("entry", "start", "token", "first_stage", "last_tile", "stored", "arrived", "merge_start", "merge_end")
SHAPES = [(1, 32768), (1, 4096), (8, 16384)]
LAST_FLAG = 1 << 63  # in a record's token word: the group that merged its item
TIMELINE_CDEF = """
int {sym}_timeline_layout(int64_t* out);
int {sym}_timeline_clear(int64_t words, void* stream);
int {sym}_timeline_mark(void* stream);
int {sym}_timeline_read(void* dst, int64_t words);
"""


# ---------------------------------------------------------------- the probe library's buffer
LAYOUT_WORDS = 8  # what the template's timeline_layout writes (either probe)


class Timeline:
    """The stamp buffer of a library built with PROBE_FLAG (the template's timeline_* accessors of op).
    bench/prefill_timeline.py reads the prefill probe's through a subclass: its POINTS and layout FIELDS."""

    POINTS = POINTS
    FIELDS = ("header", "record", "groups", "points", "clock_word", "info_word", "token_word")  # + one unused word
    RECORDS = "groups"

    def __init__(self, library, op):
        import cffi

        self.ffi = cffi.FFI()
        sym = op.symbol()
        self.ffi.cdef(TIMELINE_CDEF.format(sym=sym))
        lib = self.ffi.dlopen(str(library.path))
        self._layout, self._clear, self._mark, self._read = (getattr(lib, f"{sym}_timeline_{n}")
                                                             for n in ("layout", "clear", "mark", "read"))
        out = self.ffi.new(f"int64_t[{LAYOUT_WORDS}]")
        self._check(self._layout(out), "layout")
        self.layout = dict(zip(self.FIELDS, (int(x) for x in out)))
        if self.layout["points"] != len(self.POINTS):
            raise RuntimeError(f"the library stamps {self.layout['points']} points, this script knows {len(self.POINTS)}"
                               " (a build of the other timeline probe?)")
        self.words = self.layout["header"] + self.layout[self.RECORDS] * self.layout["record"]

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"timeline_{what}: CUDA error {rc}")

    def _stream(self):
        import torch

        return self.ffi.cast("void*", torch.cuda.current_stream().cuda_stream)

    def clear(self) -> None:
        """Zero the buffer on the current stream (graph-capturable)."""
        self._check(self._clear(self.words, self._stream()), "clear")

    def mark(self) -> None:
        """The marker kernel on the current stream: header word 0 = its %globaltimer."""
        self._check(self._mark(self._stream()), "mark")

    def read(self) -> np.ndarray:
        """The whole buffer (uint64), after the device's work so far."""
        import torch

        torch.cuda.synchronize()
        words = np.zeros(self.words, dtype=np.uint64)
        self._check(self._read(self.ffi.cast("void*", words.ctypes.data), self.words), "read")
        return words


# ---------------------------------------------------------------- records -> spans (numpy only)
def parse(words: np.ndarray, layout: dict) -> dict:
    """The used records of a buffer: ns [n, POINTS] (0: not reached), clock [n, POINTS] (uint32),
    smid, split, head, token, last [n], and the marker's ns (0: no marker)."""
    words = np.asarray(words, dtype=np.uint64)
    hdr, rec, npts = layout["header"], layout["record"], layout["points"]
    recs = words[hdr:hdr + layout["groups"] * rec].reshape(-1, rec)
    used = recs[recs[:, POINTS.index("start")] != 0]
    clocks = used[:, layout["clock_word"]:layout["clock_word"] + (npts + 1) // 2].copy().view(np.uint32)[:, :npts]
    info, token = used[:, layout["info_word"]], used[:, layout["token_word"]]
    return dict(ns=used[:, :npts].astype(np.int64), clock=clocks.astype(np.int64),
                smid=(info & 0xFFFF).astype(np.int64), split=((info >> 16) & 0xFFFF).astype(np.int64),
                head=((info >> 32) & 0xFFFF).astype(np.int64), token=(token & ~np.uint64(LAST_FLAG)).astype(np.int64),
                last=(token >> 63).astype(bool), mark_ns=int(words[0]))


def ordered(rec: dict) -> np.ndarray:
    """Per group: its reached points in POINTS order never go back in time (global ns and SM clock)."""
    ok = np.ones(len(rec["ns"]), dtype=bool)
    for g, (ns, clk) in enumerate(zip(rec["ns"], rec["clock"])):
        reached = ns > 0
        ok[g] = bool(np.all(np.diff(ns[reached]) >= 0) and np.all(np.diff(clk[reached]) % 2**32 < 2**31))
    return ok


def _pcts(x) -> dict:
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return dict(p0=None, p50=None, p100=None, n=0)
    return dict(p0=float(x.min()), p50=float(np.median(x)), p100=float(x.max()), n=int(x.size))


def global_step_ns(rec: dict) -> float:
    """The global timer's step: the smallest gap between distinct stamp values of the replay."""
    v = np.unique(rec["ns"][rec["ns"] > 0])
    return float(np.diff(v).min()) if v.size > 1 else 0.0


# (name, description, kind, a, b): "group" = b - a within each group (SM clock), "global" = b - the first
# a over the groups (global timer), "mark" = b - the marker's stamp, "item" = per (token, head) item
SPANS = [
    ("launch_entry", "launch (marker) -> block entry", "mark", None, "entry"),
    ("launch_start", "launch (marker) -> group start", "mark", None, "start"),
    ("start_spread", "group start, after the first group's", "global", "start", "start"),
    ("pdl_wait", "block entry -> group start (PDL wait)", "group", "entry", "start"),
    ("scan", "group start -> token chosen (scan)", "group", "start", "token"),
    ("ramp", "group start -> first K/V stage landed", "group", "start", "first_stage"),
    ("first_bytes", "token chosen -> first K/V stage landed", "group", "token", "first_stage"),
    ("stream", "first stage -> last tile (stream)", "group", "first_stage", "last_tile"),
    ("finish_spread", "last tile, after the first group's", "global", "last_tile", "last_tile"),
    ("store", "last tile -> partials stored", "group", "last_tile", "stored"),
    ("arrive", "stored -> counter arrival", "group", "stored", "arrived"),
    ("arrival_spread", "item: first -> last arrival", "item", "arrived", "arrived"),
    ("merge_tail", "last arrival -> merge end", "group", "arrived", "merge_end"),
    ("merge", "merge start -> merge end", "group", "merge_start", "merge_end"),
    ("total", "first group start -> last end", "global", "start", "end"),
    ("launch_total", "launch (marker) -> last end", "mark", None, "end"),
]


def clock_rate(rec: dict, i: int, j: int) -> float:
    """SM cycles per ns over every record's points i -> j, stamped on both clocks (0: not measurable)."""
    ok = (rec["ns"][:, i] > 0) & (rec["ns"][:, j] > 0)
    dns = (rec["ns"][ok, j] - rec["ns"][ok, i]).sum()
    dclk = ((rec["clock"][ok, j] - rec["clock"][ok, i]) % 2**32).sum()
    return float(dclk / dns) if dns > 0 else 0.0


def cycles_per_ns(rec: dict) -> float:
    """SM cycles per ns, from every group's start -> last tile."""
    return clock_rate(rec, POINTS.index("start"), POINTS.index("last_tile"))


def summarize(rec: dict, bytes_per_unit: float | None = None) -> dict:
    """The spans of one replay in us ({name: {p0, p50, p100, n}}), plus groups, SMs, the clocks."""
    ns, clk = rec["ns"], rec["clock"]
    cpn = cycles_per_ns(rec)
    col = {p: k for k, p in enumerate(POINTS)}
    # a group's end: its merge end when it merged, else its arrival, else its store
    end = np.where(ns[:, col["merge_end"]] > 0, ns[:, col["merge_end"]],
                   np.where(ns[:, col["arrived"]] > 0, ns[:, col["arrived"]], ns[:, col["stored"]]))
    out = dict(groups=int(len(ns)), sms=int(len(np.unique(rec["smid"]))), cycles_per_ns=cpn,
               global_step_ns=global_step_ns(rec), spans={})

    def at(p):
        return end if p == "end" else ns[:, col[p]]

    for name, _, kind, a, b in SPANS:
        vb = at(b)
        if kind == "mark":
            x = (vb[vb > 0] - rec["mark_ns"]) if rec["mark_ns"] else []
        elif kind == "global":
            va = at(a)
            x = vb[vb > 0] - (va[va > 0].min() if (va > 0).any() else 0)
            if name == "total":
                x = [x.max()] if len(x) else []
        elif kind == "item":
            x = []
            for key in set(zip(rec["token"].tolist(), rec["head"].tolist())):
                sel = (rec["token"] == key[0]) & (rec["head"] == key[1]) & (vb > 0)
                if sel.any():
                    x.append(vb[sel].max() - vb[sel].min())
        else:
            ok = (ns[:, col[a]] > 0) & (ns[:, col[b]] > 0)
            if cpn > 0:
                x = ((clk[ok, col[b]] - clk[ok, col[a]]) % 2**32) / cpn
            else:
                x = ns[ok, col[b]] - ns[ok, col[a]]
        out["spans"][name] = {k: (v / 1e3 if isinstance(v, float) else v) for k, v in _pcts(x).items()}
    if bytes_per_unit and out["spans"]["stream"]["n"]:
        out["unit_gbps_p50"] = bytes_per_unit / (out["spans"]["stream"]["p50"] * 1e3)
    return out


def median_summary(summaries: list) -> dict:
    """Each figure's median over replays (a span's p0 / p50 / p100 each on its own)."""
    first = summaries[0]
    out = {k: float(np.median([s[k] for s in summaries if k in s])) for k in first if k != "spans"}
    out["spans"] = {}
    for name in first["spans"]:
        cell = {}
        for k in ("p0", "p50", "p100"):
            vals = [s["spans"][name][k] for s in summaries if s["spans"][name][k] is not None]
            cell[k] = float(np.median(vals)) if vals else None
        cell["n"] = int(np.median([s["spans"][name]["n"] for s in summaries]))
        out["spans"][name] = cell
    return out


def table(summary: dict, graph_us: dict | None = None) -> str:
    """The compact per-shape table (us)."""
    fmt = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["| span | p0 | p50 | p100 | n |", "|---|---:|---:|---:|---:|"]
    for name, text, *_ in SPANS:
        c = summary["spans"][name]
        lines.append(f"| {text} | {fmt(c['p0'])} | {fmt(c['p50'])} | {fmt(c['p100'])} | {c['n']} |")
    for name, us in (graph_us or {}).items():
        lines.append(f"| graph time per call, {name} | | {us:.2f} | | |")
    return "\n".join(lines)


def headline(r: dict, samples: int) -> str:
    """A shape's line above its table: the checks, the probe's cost, the clocks, the stream's rate."""
    s = r["summary"]
    checks = ", ".join(f"{n} {'ok' if c['ok'] else 'BAD'} ({c['max_diff']:.3g})" for n, c in r["checks"].items())
    cost = r["graph_us"]["probe"] - r["graph_us"]["production"]
    gbps = s.get("unit_gbps_p50", 0.0)
    return (f"{r['shape']}: {r['splits']} splits, {r['units']} groups on {s['sms']:.0f} SMs; vs SDPA: {checks}; "
            f"probe cost {cost:+.2f} us; stamps ordered: {r['stamps_ordered']}; global timer step "
            f"{s['global_step_ns']:.0f} ns, {s['cycles_per_ns']:.3f} SM cycles/ns; stream p50 {gbps:.1f} GB/s a unit, "
            f"{gbps * r['units'] / 1e3:.2f} TB/s over the {r['units']}; median of {samples} replays (us)")


# ---------------------------------------------------------------- the device run
def production_op(B: int, L: int):
    """(op, splits): what paged_attention() launches for B decode tokens at context L on this GPU."""
    import attention_bench as ab

    from uacompile.targets.cuda import attention

    return attention.launch_plan(ab.op_of(), B, B, L, num_sms=attention._num_sms(0), arch=attention._arch(0))


def launch(kern, op, splits: int, b) -> None:
    """One launch of a build's kernel on batch b, with paged_attention()'s per-stream workspaces."""
    import attention_bench as ab
    import torch

    from uacompile.targets.cuda import attention

    stream = torch.cuda.current_stream(b.q.device).cuda_stream
    extra = {}
    if splits > 1:
        o_part, lse_part = attention._workspace(b.q.device, stream, splits, b.q.shape[0], ab.HQ, ab.D)
        extra.update(o_partial=o_part, lse_partial=lse_part,
                     split_counters=attention._split_counters(b.q.device, stream, b.q.shape[0], ab.HKV))
    if op.item_queue:
        extra["item_queue"] = attention._item_queue(b.q.device, stream)
    kern(**b.args(), **extra, out=b.out)


def run_shape(B: int, L: int, libs: dict, samples: int, gen) -> dict:
    import attention_bench as ab
    import decode_sweep as ds
    import torch

    from uacompile.targets.cuda import api

    op, splits = production_op(B, L)
    batches = ab.decode_batches(B, L, gen)
    b0 = batches[0]
    k, v = b0.contiguous_kv()
    want = ab.sdpa(b0.q_bhld(), k, v, False).transpose(1, 2).reshape(b0.q.shape).float()
    del k, v
    calls, checks, fns = {}, {}, {}
    for name, lib in libs.items():
        kern = api.CudaKernel(op, library=lib)
        calls[name] = lambda b, kern=kern: launch(kern, op, splits, b)
        b0.out.fill_(float("nan"))
        calls[name](b0)
        diff = (b0.out.float() - want).abs().max().item()  # NaN (an unwritten element) compares False
        checks[name] = dict(max_diff=diff, ok=diff <= ds.TOLERANCE)
        fns[name] = [lambda b=b, c=calls[name]: c(b) for b in batches]
    timings = ab.time_graphs(fns, ds.replay_calls(b0.kv_bytes), rounds=ab.ROUNDS)
    graph_us = {n: t.ms * 1e3 for n, t in timings.items()}
    tl = Timeline(libs["probe"], op)
    # [clear, mark, probe] per batch copy: the last launch of a replay reads its K/V from DRAM like the timed ones
    graph = api.capture_graph([lambda b=b: (tl.clear(), tl.mark(), calls["probe"](b)) for b in batches])
    units = B * ab.HKV * splits
    bytes_per_unit = b0.kv_bytes / units
    raw, sums, order_ok = [], [], True
    for _ in range(samples):
        graph.replay()
        rec = parse(tl.read(), tl.layout)
        order_ok &= bool(ordered(rec).all()) and len(rec["ns"]) == units
        sums.append(summarize(rec, bytes_per_unit))
        raw.append(dict(mark_ns=rec["mark_ns"], ns=rec["ns"].tolist(), clock=rec["clock"].tolist(),
                        smid=rec["smid"].tolist(), split=rec["split"].tolist(), head=rec["head"].tolist(),
                        token=rec["token"].tolist(), last=rec["last"].tolist()))
    kv_bytes = b0.kv_bytes
    del graph, batches, b0
    torch.cuda.empty_cache()
    return dict(shape=f"{B}x{L}", splits=splits, units=units, kv_bytes=kv_bytes, checks=checks, graph_us=graph_us,
                stamps_ordered=order_ok, summary=median_summary(sums), samples=raw)


def timeline_main(argv, *, doc: str, script: str, probe_flag: str, points, rows: str, shapes: list, samples: int,
                  ops_of, run_shape, headline, table, passed, label: str) -> int:
    """The command line of a timeline script (this one, bench/prefill_timeline.py): build production and the
    probe of ops_of(shapes), then per shape run_shape, print headline and table(result), write the results
    (default $OUT/<script>.json) and exit 0 if every result passed(result)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{B}x{L}" for B, L in shapes), help=rows)
    ap.add_argument("--samples", type=int, default=samples, help="graph replays whose stamps are read")
    ap.add_argument("--json", default=None, help=f"write results and {label} here (default $OUT/{script}.json)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    import torch

    if not torch.cuda.is_available():
        print(f"bench/{script}.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import attention_bench as ab

    from uacompile.targets.cuda import attention

    t0 = time.perf_counter()
    libs = attention.load_designs({"production": "", "probe": "|" + probe_flag}, ops_of(shapes))
    bad = {n: v for n, v in libs.items() if isinstance(v, Exception)}
    if bad:
        for n, v in bad.items():
            print(f"! {n}: {v}", file=sys.stderr)
        return 1
    print(f"# built production and probe in {time.perf_counter() - t0:.1f} s", flush=True)
    ab.spin_up_clocks()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for B, L in shapes:
        r = run_shape(B, L, libs, args.samples, gen)
        results.append(r)
        print(f"\n## {headline(r, args.samples)}\n")
        print(table(r), flush=True)
    path = args.json or (os.path.join(os.environ["OUT"], f"{script}.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                                              points=points, results=results)))
        print(f"\n# {label}: {path}")
    return 0 if all(passed(r) for r in results) else 1


def main(argv=None) -> int:
    return timeline_main(
        argv, doc=__doc__, script="decode_timeline", probe_flag=PROBE_FLAG, points=POINTS, rows="BxL decode rows (comma list)", shapes=SHAPES, samples=20,
        ops_of=lambda shapes: list(dict.fromkeys(production_op(B, L)[0] for B, L in shapes)),
        run_shape=run_shape, headline=headline, table=lambda r: table(r["summary"], r["graph_us"]),
        passed=lambda r: all(c["ok"] for c in r["checks"].values()) and r["stamps_ordered"], label="raw stamps")


if __name__ == "__main__":
    sys.exit(main())
