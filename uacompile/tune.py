"""`uacompile tune`: search a target's config space per (op, shape) and record the winner in the tuning database.

    db = TuningDB.open(path)
    results = tune(op, tune_space.space("cpu"), [Shape.parse("decode:4x2048")], db, trials=16)
    print(report_table(results))

Per shape: a record of this (target, op, bucket) on this device and toolchain is a cache hit (nothing is built
or timed again). Otherwise the candidates (the built-in rule's default first, then the space's others, at most
`trials`, or as many as half the `budget` seconds builds) are built in a process pool through the kernel cache,
each is checked against the float64 reference (a wrong or failing one is discarded, never recorded), then all
are timed round-robin, `rounds` rounds in an order rotated each round (machine drift hits all alike), and the
lowest median wins. Each round's samples are saved in the database, so an interrupted run resumes where it
stopped. The report gives default against tuned per shape with the speedup (table, JSON, plot).
"""
from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import json
import logging
import math
import multiprocessing
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import ir
from .errors import IRError
from .tunedb import Record, Shape, TuningDB, config_to_dict, environment, record_key

log = logging.getLogger(__name__)

DEFAULT_SHAPES = {
    "cpu": "decode:4x2048,prefill:1x512",
    "cuda": "decode:8x16384,decode:64x4096,prefill:4x4096,prefill:1x16384",
    "tvm-cuda": "decode:8x16384,decode:64x4096,prefill:4x4096,prefill:1x16384",
    "ascend": "decode:4x1024,prefill:1x256",  # checked at check_shape's size only
}
DEFAULT_TRIALS = 24
MIN_SAMPLE_S = {"cpu": 2e-3, "cuda": 1e-3}  # calls a sample takes are raised until one sample lasts this long


@dataclass
class Result:
    """One (op, shape) of a tuning run."""

    target: str
    op: dict
    shape: str
    bucket: str
    default_config: dict
    config: dict
    default_ms: float
    tuned_ms: float
    candidates: int = 0
    timed: int = 0
    discarded: list = field(default_factory=list)  # [(config, reason)]
    cached: bool = False  # the database already held the record: nothing built or timed
    error: str | None = None
    checked_only: bool = False  # a space without a timer (the AscendC emulator): candidates checked, none timed
    spread_pct: tuple = (0.0, 0.0)  # interquartile spread of the default's and the winner's samples, % of median

    @property
    def speedup(self) -> float:
        return self.default_ms / self.tuned_ms if self.tuned_ms else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": round(self.speedup, 4)}


def trial_configs(space, op: ir.OpSpec, shape: Shape, trials: int | None = None, budget: float | None = None) -> list:
    """The configs tune() tries for op at shape, the default first: the space's candidates, at most `trials` (all
    of them with a budget, which tune() cuts by time; DEFAULT_TRIALS without either). Deterministic (the spaces'
    order is seeded), so the kernels of a run can be built ahead of it (build_all)."""
    configs = space.candidates(op, shape)
    return configs[:trials if trials is not None else (None if budget is not None else DEFAULT_TRIALS)]


def build_all(space, kernels: list, jobs: int, progress: bool = True) -> dict:
    """Build kernels through space.build (a process pool of `jobs` workers): {index: error string} of those whose
    build failed; the others are in the kernel cache. tune() builds a shape's candidates so; a run of many shapes
    may build all of theirs first in one pool (trial_configs), which tune() then finds in the cache."""
    from tqdm import tqdm

    errors = {}
    bar = tqdm(total=len(kernels), desc=f"build {space.target}", unit="kernel", disable=not progress,
               dynamic_ncols=True, leave=False)
    if jobs <= 1 or len(kernels) <= 1:
        for i, k in enumerate(kernels):
            try:
                space.build(k)
            except Exception as e:  # noqa: BLE001 - a candidate that does not build is discarded
                errors[i] = f"build: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            bar.update()
    else:
        ctx = multiprocessing.get_context("spawn")  # TVM's and CUDA's threads do not survive a fork
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(space.build, k): i for i, k in enumerate(kernels)}
            for f in cf.as_completed(futures):
                e = f.exception()
                if e is not None:
                    errors[futures[f]] = f"build: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                bar.update()
    bar.close()
    return errors


def tune(op: ir.OpSpec, space, shapes: list[Shape], db: TuningDB, *, trials: int | None = None,
         budget: float | None = None, rounds: int = 15, warmup: int = 2, jobs: int | None = None,
         env: dict | None = None, force: bool = False, progress: bool = True, seed: int = 0) -> list[Result]:
    """Tune op on space (tune_space.space(target)) at each shape; records winners in db (saved)."""
    from tqdm import tqdm

    if trials is not None and trials < 1:
        raise ValueError(f"--trials must be >= 1, got {trials}")
    if budget is not None and budget <= 0:
        raise ValueError(f"--budget must be > 0 seconds, got {budget}")
    if op.kind not in space.ops():
        raise ValueError(f"target {space.target} tunes {list(space.ops())}, not {op.kind}")
    if space.timer is None:
        env = env or {"device": f"{space.target} emulator", "toolchain": {}}
    env = env or environment("cpu" if space.timer == "cpu" else "cuda", getattr(space, "device", 0))
    jobs = jobs if jobs is not None else max(1, min(8, os.cpu_count() or 1))
    results = []
    for shape in shapes:
        t_start = time.perf_counter()
        bucket = shape.bucket()
        rec = db.get(space.target, op, bucket, env)
        if rec is not None and not force:
            log.info("%s %s %s: in the tuning database (%s), not re-timed", space.target, op.kind, shape, db.path)
            results.append(Result(space.target, op.to_dict(), str(shape), bucket, rec.default_config, rec.config,
                                  rec.default_ms, rec.tuned_ms, rec.candidates, 0, [], cached=True))
            continue
        configs = trial_configs(space, op, shape, trials, budget)
        default = configs[0]
        kernels, discarded, ok = [], [], []
        for c in configs:
            try:
                kernels.append(space.kernel(op, c))
            except IRError as e:
                discarded.append((config_to_dict(c), f"invalid: {e}"))
                kernels.append(None)
        # build (in budget mode, in chunks until half the budget is spent)
        chunk = len(kernels) if budget is None else max(1, jobs)
        benches = {}
        for lo in range(0, len(kernels), chunk):
            if budget is not None and lo and time.perf_counter() - t_start > budget / 2:
                break
            part = [(i, k) for i, k in enumerate(kernels[lo:lo + chunk], lo) if k is not None]
            errors = build_all(space, [k for _, k in part], jobs, progress)
            for j, (i, k) in enumerate(part):
                if j in errors:
                    discarded.append((config_to_dict(configs[i]), errors[j]))
                    continue
                try:
                    bench = space.bench(k, shape, seed)
                    bench.check()
                except Exception as e:  # noqa: BLE001 - wrong or failing: discarded, never recorded
                    reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    log.info("%s %s %s: discarded %s: %s", space.target, op.kind, shape, configs[i], reason)
                    discarded.append((config_to_dict(configs[i]), reason))
                    continue
                benches[i] = bench
                ok.append(i)
        if 0 not in benches:
            reason = next((r for c, r in discarded if c == config_to_dict(default)), "not built")
            log.error("%s %s %s: the default config fails (%s): nothing recorded", space.target, op.kind, shape,
                      reason)
            results.append(Result(space.target, op.to_dict(), str(shape), bucket, config_to_dict(default),
                                  config_to_dict(default), 0.0, 0.0, len(configs), 0, discarded,
                                  error=f"default config fails: {reason}"))
            continue
        if space.timer is None:  # correctness only: nothing timed, nothing recorded
            results.append(Result(space.target, op.to_dict(), str(shape), bucket, config_to_dict(default),
                                  config_to_dict(default), 0.0, 0.0, len(configs), 0, discarded, checked_only=True))
            continue
        # time: round-robin, rotated, resumable
        key = record_key(space.target, op.key(), bucket, env["device"], env["toolchain"])
        saved = db.partial.get(key, {})
        names = {i: json.dumps(config_to_dict(configs[i]), sort_keys=True) for i in ok}
        samples = {i: list(saved.get(names[i], [])) for i in ok}
        todo = [i for i in ok if len(samples[i]) < rounds]
        min_s = MIN_SAMPLE_S[space.timer]
        calls = {}
        for i in todo:
            for _ in range(max(1, warmup)):
                t = benches[i].sample(1)
            calls[i] = max(1, min(1000, math.ceil(min_s / max(t, 1e-9))))
        bar = tqdm(total=rounds * len(todo), desc=f"time {space.target} {shape}", unit="sample",
                   disable=not progress, dynamic_ncols=True, leave=False)
        for r in range(rounds):
            active = [i for i in todo if len(samples[i]) < rounds]
            if not active:
                break
            if budget is not None and r >= 3 and time.perf_counter() - t_start > budget:
                break
            k = r % len(active)
            for i in active[k:] + active[:k]:
                samples[i].append(benches[i].sample(calls[i]))
                bar.update()
            db.partial[key] = {names[i]: samples[i] for i in ok}
            db.save()
        bar.close()
        medians = {i: statistics.median(samples[i]) for i in ok if samples[i]}
        best = min(medians, key=lambda i: (medians[i], i))
        spread = tuple(round(_spread_pct(samples[i]), 2) for i in (0, best))
        rec = Record(space.target, op.to_dict(), op.key(), bucket, str(shape), env["device"], env["toolchain"],
                     config_to_dict(configs[best]), config_to_dict(default), medians[0] * 1e3, medians[best] * 1e3,
                     len(configs), len(discarded))
        db.put(rec)
        db.save()
        results.append(Result(space.target, op.to_dict(), str(shape), bucket, rec.default_config, rec.config,
                              rec.default_ms, rec.tuned_ms, len(configs), len(medians), discarded, spread_pct=spread))
    return results


def _spread_pct(xs: list) -> float:
    if len(xs) < 4:
        return 100 * (max(xs) - min(xs)) / statistics.median(xs)
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return 100 * (q3 - q1) / statistics.median(xs)


# ------------------------------------------------------------------ report
def _changed(r: Result) -> str:
    diff = {k: v for k, v in r.config.items() if k != "config" and r.default_config.get(k) != v}
    return json.dumps(diff) if diff else "(default)"


def report_table(results: list[Result]) -> str:
    """Default against tuned per (op, shape), with the speedup and what the winner changes."""
    lines = ["| target | op | shape | default ms | tuned ms | speedup | spread % (default, tuned) | timed / candidates "
             "| discarded | tuned config |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        geometry = "/".join(str(r.op[k]) for k in ("num_q_heads", "num_kv_heads", "head_dim", "page_size") if k in r.op)
        name = f"{r.op.get('op')} {geometry} {r.op.get('q_dtype', r.op.get('dtype', ''))}"
        if r.error:
            lines.append(f"| {r.target} | {name} | {r.shape} | | | | | | {len(r.discarded)} | {r.error} |")
            continue
        if r.checked_only:
            lines.append(f"| {r.target} | {name} | {r.shape} | | | | | {r.candidates - len(r.discarded)} / "
                         f"{r.candidates} passed the reference | {len(r.discarded)} | not timed (emulator) |")
            continue
        timed = "cached" if r.cached else f"{r.timed} / {r.candidates}"
        spread = "" if r.cached else f"{r.spread_pct[0]:.1f}, {r.spread_pct[1]:.1f}"
        lines.append(f"| {r.target} | {name} | {r.shape} | {r.default_ms:.4f} | {r.tuned_ms:.4f} | "
                     f"{r.speedup:.2f}x | {spread} | {timed} | {len(r.discarded)} | {_changed(r)} |")
    return "\n".join(lines)


def report_json(results: list[Result], env: dict | None = None) -> dict:
    return {"created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "environment": env,
            "results": [r.to_dict() for r in results]}


def plot(results: list[Result], png: Path) -> Path | None:
    """A bar per shape: tuned speedup over the default (1.0 = the default won)."""
    rows = [r for r in results if not r.error and not r.checked_only and r.tuned_ms]
    if not rows:
        return None
    try:
        import matplotlib
    except ImportError:  # the device has none: rerender the JSON elsewhere (uacompile tune --rerender)
        log.warning("no matplotlib: %s not drawn", png)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, 0.9 * len(rows) + 2), 3.5))
    labels = [f"{r.target}\n{r.op.get('op')}\n{r.shape}" for r in rows]
    ax.bar(range(len(rows)), [r.speedup for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("speedup (default ms / tuned ms)")
    ax.set_title("uacompile tune: tuned config against the built-in rule")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def write_report(results: list[Result], out: Path, env: dict | None = None, stem: str | None = None) -> list[Path]:
    """out/<stem>.json, .md and .png (stem: tune-<UTC date>)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = stem or f"tune-{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}"
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(report_json(results, env), indent=1))
    paths[1].write_text(f"# {stem}\n\n{env['device'] if env else ''}\n\n{report_table(results)}\n")
    png = plot(results, out / f"{stem}.png")
    return paths + ([png] if png else [])


def read_report(path: Path) -> tuple[list[Result], dict | None]:
    """(results, environment) of a report's JSON (report_json), to rewrite its table and plot elsewhere."""
    data = json.loads(Path(path).read_text())
    fields = Result.__dataclass_fields__
    results = [Result(**{k: v for k, v in r.items() if k in fields}) for r in data["results"]]
    for r in results:
        r.spread_pct = tuple(r.spread_pct)
    return results, data.get("environment")


# ------------------------------------------------------------------ what to tune
def ops_to_tune(target: str, preset: str | None = None, op_name: str | None = None, sets: dict | None = None):
    """The ops of a preset that the target's space tunes, or one op: the default preset's first model's op of
    that kind with `sets` (op fields) applied."""
    from .build import MODELS, PRESETS
    from .tune_space import space as make_space

    kinds = make_space(target).ops()
    if op_name is not None:
        if op_name not in kinds:
            raise ValueError(f"--op: target {target} tunes {list(kinds)}, not {op_name!r}")
        base = next(op for m in PRESETS["default"] for op in MODELS[m].ops() if op.kind == op_name)
        return [base.replace(**(sets or {}))]
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    ops = []
    for m in PRESETS[preset]:
        ops += [op for op in MODELS[m].ops() if op.kind in kinds and op not in ops]
    return ops


__all__ = ["DEFAULT_SHAPES", "Result", "trial_configs", "build_all", "tune", "report_table", "report_json", "plot",
           "write_report", "read_report", "ops_to_tune"]
