"""The one GPU timer of the bench scripts: interleaved CUDA-graph replays.

Each function is captured `calls` times back to back into one CUDA graph (api.capture_graph:
warmed up on the capture stream first), so launch gaps and Python do not count. Every round
replays each graph once, in an order rotated by one per round, with no synchronisation inside a
round: clock, power and DRAM drift hit every implementation of a row alike and none always runs
first. This is why ratios against peers are taken from one time_graphs call: timed one after
the other, the same kernel read up to 10% apart (docs/attention-rationale.md, "How it was measured").
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    """Samples of ms per call; median and the interquartile spread in % of the median."""

    samples: list

    @property
    def ms(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread_pct(self) -> float:
        if len(self.samples) < 4:
            return 100 * (max(self.samples) - min(self.samples)) / self.ms
        q1, _, q3 = statistics.quantiles(self.samples, n=4)
        return 100 * (q3 - q1) / self.ms


def _warm_graphs(fns: dict, calls: int) -> tuple[dict, dict]:
    """({name: list of fns}, {name: CUDA graph of `calls` rounds of them}), each replayed once untimed:
    first-replay costs (graph upload) stay out."""
    from uacompile.targets.cuda import api

    lists = {name: (fn if isinstance(fn, (list, tuple)) else [fn]) for name, fn in fns.items()}
    graphs = {name: api.capture_graph(fl, calls) for name, fl in lists.items()}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    return lists, graphs


def time_graphs(fns: dict, calls: int = 20, rounds: int = 25) -> dict:
    """{name: Timing} for {name: fn or list of fns}; a list's fns (e.g. the same call on rotating
    input copies, so that L2 does not hold them) run in turn, and a sample is ms per fn call."""
    lists, graphs = _warm_graphs(fns, calls)
    names = list(graphs)
    samples = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        events = []
        for n in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[n].replay()
            b.record()
            events.append((n, a, b))
        events[-1][2].synchronize()
        for n, a, b in events:
            samples[n].append(a.elapsed_time(b) / (calls * len(lists[n])))
    del graphs
    return {n: Timing(samples[n]) for n in names}


@dataclass
class Power:
    """Board power and SM clock while one implementation runs alone, from NVML's energy counter."""

    watts: float
    joules_per_call: float
    sm_mhz: int  # NVML's SM clock, read while the replays run


def power_per_call(fns: dict, seconds: float = 1.0, passes: int = 2, calls: int = 10) -> dict:
    """{name: Power} for time_graphs' {name: fn or list of fns}, or {} without NVML (nvidia-ml-py, carried
    in .whl). Under a power cap the same kernel runs at whatever clock its draw leaves it (prefill on the H200 draws
    up to its 700 W cap and its SM clock moves with it), so a variant that is slower beside the same SDPA may be
    drawing more power rather than doing more work; time_graphs' interleaved rounds cannot tell which
    implementation drew it. Here each one runs alone for `seconds`, `passes` times in rotated order (drift hits
    all alike), and the board's energy counter is read around it."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library or no driver: the caller prints without power
        return {}
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    lists, graphs = _warm_graphs(fns, calls)
    names, totals = list(graphs), {n: [0.0, 0.0, 0, []] for n in graphs}  # joules, seconds, calls, clocks
    for p in range(passes):
        for n in names[p % len(names):] + names[:p % len(names)]:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[n].replay()
            b.record()
            b.synchronize()
            reps = max(1, int(seconds * 1e3 / max(a.elapsed_time(b), 1e-3)))
            e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # mJ
            a.record()
            for _ in range(reps):
                graphs[n].replay()
            b.record()
            totals[n][3].append(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))  # mid-run: enqueued, running
            b.synchronize()
            e1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            t = totals[n]
            t[0] += (e1 - e0) / 1e3
            t[1] += a.elapsed_time(b) / 1e3
            t[2] += reps * calls * len(lists[n])
    del graphs
    return {n: Power(j / s, j / c, int(statistics.median(clk))) for n, (j, s, c, clk) in totals.items()}


def time_ms(fns, calls_per_fn: int = 1, reps: int = 7) -> float:
    """Median ms per call of one implementation (a fn or a list of fns) on its own."""
    return time_graphs({"": fns}, calls=calls_per_fn, rounds=reps)[""].ms


def time_eager(fn, iters: int = 20, repeats: int = 5, warmup: int = 3) -> float:
    """Median over `repeats` of the mean ms of `iters` back-to-back eager calls (CUDA events), for
    what a graph cannot hold or would change (host copies, the copy ceiling). The first call of each
    sample waits for Python after the start event: use it only where one call is long against a launch."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / iters)
    return statistics.median(samples)


def copy_ceiling_gbps(nbytes: int = 1 << 30, iters: int = 10, repeats: int = 5) -> tuple[float, float]:
    """(GB/s, ms) of one device-to-device torch copy_ of nbytes (read + written): the ceiling the
    bandwidth rows are read against. The source is random (no compressible zeros). Timed eagerly,
    not in a graph: captured, the copy becomes a memcpy node that runs well below the eager copy on the H200
    (docs/attention-rationale.md)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_eager(lambda: dst.copy_(src), iters, repeats)
    return 2 * nbytes / ms / 1e6, ms
