"""`uacompile tune` on the device: the production shapes, the variant sweep's geometries and TVM's CUDA kernels.

    python3 bench/tune_device.py --out bench/results [--trials 12 | --budget S] [--only production,variants,tvm-cuda]
                                 [--tvm-cuda-dir DIR] [--jobs N]
    python3 bench/tune_device.py --prebuild-tvm-cuda DIR --trials N   # where TVM and nvcc are; no GPU needed

Tunes the CUDA (Jinja) attention config of Llama-3-8B / Qwen3-8B (one attention shape) at the production table's
shapes (bench/attention_bench.py) ("production"), and of each bench/variant_sweep.py geometry at its decode batch
and 4 x 4096 prefill ("variants"); "tvm-cuda" tunes TVM's CUDA schedule of the production op at
bench/tvm_cuda_bench.py's shapes (its decode shapes and one short prefill: TVM's prefill reads K/V once a token, so
the production prefill shapes take seconds a call), so that its "tvm-cuda tuned" rows find their records
(--tvm-cuda: the same as adding tvm-cuda to --only). With --trials, every shape's candidates (tune.trial_configs)
are built first in one pool of --jobs processes, then tuned shape by shape from the kernel cache.

A GPU machine without TVM times TVM's kernels from a folder of prebuilt libraries: `--prebuild-tvm-cuda DIR --trials
N` (bench/prebuild_tvm_cuda.sh --tune N runs it) writes, where TVM and nvcc are, every kernel a tvm-cuda run with
the same --trials times, and those bench/tvm_cuda_bench.py runs, as DIR/<symbol>_sm_90.so; on the device
`--tvm-cuda-dir DIR` finds them there by symbol (a kernel missing there: a one-line error naming it).

Winners go to the tuning database (--db, default the user cache's), and the report, default against tuned per shape
with the speedup, to OUT/tune-<date>.json and .md (.png where matplotlib is; else `uacompile tune --rerender
OUT/tune-<date>.json`). The database keeps what is done: a rerun skips it, so --only splits a run across calls.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from uacompile.tune import build_all, report_table, trial_configs, tune, write_report  # noqa: E402
from uacompile.tunedb import Shape, TuningDB, environment  # noqa: E402

PARTS = ("production", "variants", "tvm-cuda")
PREBUILT_ARCH = "sm_90"  # the H200's: the device's TVM-CUDA libraries are built for it


def production_shapes() -> list[Shape]:
    import attention_bench as ab

    return ([Shape("decode", B, L) for B, L in ab.DECODE_SHAPES]
            + [Shape("prefill", B, L) for B, L in ab.PREFILL_SHAPES])


def tvm_cuda_shapes() -> list[Shape]:
    """bench/tvm_cuda_bench.py's shapes: the production decode shapes and one short prefill."""
    import tvm_cuda_bench as tb

    return [Shape("decode", B, L) for B, L in tb.DECODE_SHAPES] + [Shape("prefill", B, L) for B, L in tb.PREFILL_SHAPES]


def variant_jobs():
    """(op, shapes) of each variant-sweep geometry."""
    import variant_sweep as vs

    return [(v.op(), [Shape("decode", vs.DECODE_B, v.decode_len()), Shape("prefill", vs.PREFILL_B, vs.PREFILL_L)])
            for v in vs.VARIANTS]


def tuning_jobs(parts) -> list[tuple]:
    """(target, op, shapes) of each part of the run, in order."""
    from uacompile.build import MODELS

    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"--only: unknown parts {unknown}; choose from {list(PARTS)}")
    llama = MODELS["llama3-8b"].ops()[0]
    jobs = []
    if "production" in parts:
        jobs.append(("cuda", llama, production_shapes()))
    if "tvm-cuda" in parts:
        jobs.append(("tvm-cuda", llama, tvm_cuda_shapes()))
    if "variants" in parts:
        jobs += [("cuda", op, shapes) for op, shapes in variant_jobs()]
    return jobs


def tvm_cuda_kernels(trials: int) -> list:
    """Every TVM-CUDA kernel a `--only tvm-cuda --trials N` run times, and those bench/tvm_cuda_bench.py runs
    (its default config), each once."""
    import tvm_cuda_bench as tb

    from uacompile.tune_space import space

    s = space("tvm-cuda")
    [(_, op, shapes)] = tuning_jobs(["tvm-cuda"])
    kernels = [s.kernel(op, c) for shape in shapes for c in trial_configs(s, op, shape, trials)] + tb.build_kernels()
    return list({k.symbol(): k for k in kernels}.values())


def prebuild_tvm_cuda(out: Path, trials: int, jobs: int) -> list[Path]:
    """tvm_cuda_kernels(trials) as out/<symbol>_sm_90.so (and its .cu): built through the kernel cache in a pool of
    jobs processes, then copied. Needs TVM and nvcc, no GPU."""
    from uacompile.lower.tvm_cuda import build_cuda_library
    from uacompile.tune_space import space

    kernels = tvm_cuda_kernels(trials)
    errors = build_all(space("tvm-cuda"), kernels, jobs)
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(kernels)} TVM-CUDA kernels did not build: "
                           f"{kernels[min(errors)].symbol()}: {errors[min(errors)]}")
    return [build_cuda_library(k, PREBUILT_ARCH, out) for k in kernels]


def build_ahead(jobs: list[tuple], spaces: dict, db: TuningDB, env: dict, trials: int, workers: int,
                force: bool) -> None:
    """Build the candidates of every shape the run will tune (not those the database holds) in one pool per
    target, so tune() finds them in the kernel cache; a failed build is tune()'s to report (it builds it again)."""
    todo = {}
    for target, op, shapes in jobs:
        s = spaces[target]
        for shape in shapes:
            if force or db.get(target, op, shape.bucket(), env) is None:
                for c in trial_configs(s, op, shape, trials):
                    try:
                        k = s.kernel(op, c)
                    except Exception:  # noqa: BLE001 - an invalid candidate is tune()'s to discard
                        continue
                    todo.setdefault(target, {})[k.symbol()] = k
    for target, kernels in todo.items():
        found = getattr(spaces[target], "kernel_dir", None) is not None  # prebuilt: only looked up, in this process
        errors = build_all(spaces[target], list(kernels.values()), 1 if found else workers)
        print(f"[tune] built {len(kernels) - len(errors)} of {len(kernels)} {target} candidates ahead", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--db", default=None, help="tuning database (default: the user cache's)")
    much = ap.add_mutually_exclusive_group()
    much.add_argument("--trials", type=int, default=12, help="candidates a shape (the default among them)")
    much.add_argument("--budget", type=float, default=None, help="seconds a shape, instead of --trials")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--only", default="production,variants", help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--tvm-cuda", action="store_true", help="also tvm-cuda (TVM's CUDA schedule at its shapes)")
    ap.add_argument("--tvm-cuda-dir", default=None, help="folder of prebuilt TVM-CUDA kernels (--prebuild-tvm-cuda): "
                                                         "for a GPU machine without TVM")
    ap.add_argument("--prebuild-tvm-cuda", metavar="DIR", default=None,
                    help="build (TVM + nvcc, no GPU) the TVM-CUDA kernels a tvm-cuda run with these --trials times "
                         "into DIR, and exit")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build processes")
    ap.add_argument("--force", action="store_true", help="re-tune shapes the database holds")
    args = ap.parse_args(argv)
    if args.prebuild_tvm_cuda:
        if args.budget is not None:
            ap.error("--prebuild-tvm-cuda builds the kernels of --trials N, not of a --budget")
        paths = prebuild_tvm_cuda(Path(args.prebuild_tvm_cuda), args.trials, args.jobs)
        print(f"{len(paths)} TVM-CUDA kernels in {args.prebuild_tvm_cuda}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/tune_device.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from uacompile.tune_space import space

    parts = args.only.split(",") + (["tvm-cuda"] if args.tvm_cuda and "tvm-cuda" not in args.only else [])
    jobs = tuning_jobs(parts)
    spaces = {t: space(t, kernel_dir=args.tvm_cuda_dir if t == "tvm-cuda" else None) for t, _, _ in jobs}
    db = TuningDB.open(args.db)
    env = environment("cuda")
    if args.budget is None:
        build_ahead(jobs, spaces, db, env, args.trials, args.jobs, args.force)
    results = []
    stem = f"tune-{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}"
    for target, op, shapes in jobs:
        results += tune(op, spaces[target], shapes, db, trials=None if args.budget else args.trials,
                        budget=args.budget, rounds=args.rounds, force=args.force, env=env,
                        jobs=1 if args.budget is None else min(8, args.jobs))
        write_report(results, Path(args.out), env, stem)  # a run cut short keeps its rows
    print(report_table(results))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
