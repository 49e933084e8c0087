"""`uacompile tune` on the device: the production shapes and the variant sweep's geometries, one report.

    python3 bench/tune_device.py --out bench/results [--trials 12 | --budget S] [--tvm-cuda] [--only production,variants]

Tunes the CUDA (Jinja) attention config of Llama-3-8B / Qwen3-8B (one attention shape) at the production table's
shapes (bench/attention_bench.py), and of each bench/variant_sweep.py geometry at its decode batch and 4 x 4096
prefill; with --tvm-cuda, TVM's CUDA schedule at the production shapes too. Winners go to the tuning database
(--db, default the user cache's), and the report, default against tuned per shape with the speedup, to
OUT/tune-<date>.json and .md (.png where matplotlib is; else `uacompile tune --rerender OUT/tune-<date>.json`).
A shape takes about its candidates' nvcc builds (in parallel) and checks; `--only production` and `--only variants`
split the run across device calls (the database keeps what is done: a rerun skips it).
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from uacompile.tune import report_table, tune, write_report  # noqa: E402
from uacompile.tunedb import Shape, TuningDB, environment  # noqa: E402


def production_shapes() -> list[Shape]:
    import attention_bench as ab

    return ([Shape("decode", B, L) for B, L in ab.DECODE_SHAPES]
            + [Shape("prefill", B, L) for B, L in ab.PREFILL_SHAPES])


def variant_jobs():
    """(op, shapes) of each variant-sweep geometry."""
    import variant_sweep as vs

    return [(v.op(), [Shape("decode", vs.DECODE_B, v.decode_len()), Shape("prefill", vs.PREFILL_B, vs.PREFILL_L)])
            for v in vs.VARIANTS]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--db", default=None, help="tuning database (default: the user cache's)")
    much = ap.add_mutually_exclusive_group()
    much.add_argument("--trials", type=int, default=12, help="candidates a shape (the default among them)")
    much.add_argument("--budget", type=float, default=None, help="seconds a shape, instead of --trials")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--only", default="production,variants", help="comma list of production, variants")
    ap.add_argument("--tvm-cuda", action="store_true", help="also TVM's CUDA schedule at the production shapes")
    ap.add_argument("--force", action="store_true", help="re-tune shapes the database holds")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/tune_device.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from uacompile.build import MODELS
    from uacompile.tune_space import space

    db = TuningDB.open(args.db)
    only = args.only.split(",")
    llama = MODELS["llama3-8b"].ops()[0]
    jobs = []
    if "production" in only:
        jobs.append(("cuda", llama, production_shapes()))
        if args.tvm_cuda:
            jobs.append(("tvm-cuda", llama, production_shapes()))
    if "variants" in only:
        jobs += [("cuda", op, shapes) for op, shapes in variant_jobs()]
    results = []
    stem = f"tune-{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}"
    env = environment("cuda")
    for target, op, shapes in jobs:
        results += tune(op, space(target), shapes, db, trials=None if args.budget else args.trials,
                        budget=args.budget, rounds=args.rounds, force=args.force)
        write_report(results, Path(args.out), env, stem)  # a run cut short keeps its rows
    print(report_table(results))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
