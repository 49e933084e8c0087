"""`uacompile` command line: build kernel sets, generate one kernel's source, show op docs, serve a
model over an OpenAI-compatible API, benchmark a server."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import IRError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump or traceback
        self.exit(2, f"uacompile: error: {message}\n")


def _value(text: str):
    """--set values: JSON scalars (3, 0.5, true, null) or bare strings (bf16)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_sets(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, val = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        out[key] = _value(val)
    return out


def cmd_build(args) -> int:
    from .build import DEFAULT_TARGETS, TARGETS, build_set
    from .tunedb import TuningDB, default_db_path

    targets = {"all": TARGETS, None: DEFAULT_TARGETS}.get(args.target, (args.target,))
    db_path = Path(args.tuning_db) if args.tuning_db else default_db_path()
    db = None if args.no_tuned or not db_path.exists() else TuningDB.open(db_path)
    manifest = build_set(args.preset, targets, Path(args.out), progress=not args.quiet, tuning=db)
    built = sum(e["library"] is not None for e in manifest["kernels"])
    print(f"{built}/{len(manifest['kernels'])} kernels built -> {Path(args.out) / 'manifest.json'}")
    for e in manifest["kernels"]:
        if e["library"] is None:
            print(f"  not built: {e['target']}/{e['lowering']} {e['op']}: {e['reason']}")
    return 0


def cmd_generate(args) -> int:
    from .build import LOWERINGS, lowerings_for
    from .ir import op_from_dict

    op = op_from_dict({"op": args.op, **_parse_sets(args.set)})
    lowering = args.lowering or lowerings_for(args.target)[-1]
    if (args.target, lowering) not in LOWERINGS:
        raise ValueError(f"no lowering {lowering!r} for target {args.target!r}; have {lowerings_for(args.target)}")
    from .build import build_one

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        entry = build_one(op, args.target, lowering, Path(tmp))
        if entry["source"] is None:
            raise ValueError(f"cannot generate {args.op} for {args.target}/{lowering}: {entry['reason']}")
        text = Path(entry["source"]).read_text()
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out} ({entry['symbol']})", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_tune(args) -> int:
    import logging

    from .tune import DEFAULT_SHAPES, ops_to_tune, report_table, tune, write_report
    from .tune_space import space as make_space
    from .tunedb import TuningDB, parse_shapes

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.rerender:
        from .tune import read_report

        results, env = read_report(Path(args.rerender))
        print(report_table(results))
        for path in write_report(results, Path(args.report or Path(args.rerender).parent), env,
                                 stem=Path(args.rerender).stem):
            print(f"wrote {path}", file=sys.stderr)
        return 0
    db = TuningDB.open(args.db)
    if args.show:
        print(db.table())
        return 0
    if args.target is None:
        raise ValueError("tune: --target is required (cpu, cuda, tvm-cuda or ascend)")
    if args.preset is None and args.op is None:
        raise ValueError("tune: give --preset NAME or --op OP (or --show)")
    if args.set and args.op is None:
        raise ValueError("tune: --set changes the fields of --op's op")
    ops = ops_to_tune(args.target, args.preset, args.op, _parse_sets(args.set))
    shapes = parse_shapes(args.shapes or DEFAULT_SHAPES[args.target])
    space = make_space(args.target)
    results = []
    for op in ops:
        results += tune(op, space, shapes, db, trials=args.trials, budget=args.budget, rounds=args.rounds,
                        jobs=args.jobs, force=args.force, progress=not args.quiet)
    print(report_table(results))
    if args.report:
        from .tunedb import environment

        env = None if args.target == "ascend" else environment("cpu" if args.target == "cpu" else "cuda")
        for path in write_report(results, Path(args.report), env):
            print(f"wrote {path}", file=sys.stderr)
    print(f"tuning database: {db.path}", file=sys.stderr)
    return 1 if any(r.error for r in results) else 0


def cmd_ops(args) -> int:
    from .ir import OPS, describe, reference_doc

    if args.markdown:
        print(reference_doc())
        return 0
    for cls in OPS.values():
        print((cls.__doc__ or "").strip().splitlines()[0])
    if args.op:
        from .ir import op_from_dict

        print(describe(op_from_dict({"op": args.op, **_parse_sets(args.set)})))
    return 0


def cmd_serve(args) -> int:
    from .runtime.server import serve

    kw = {k: v for k, v in vars(args).items() if k not in ("func", "command") and v is not None}
    serve(**kw)
    return 0


def cmd_bench_serve(args) -> int:
    from .bench_serve import main as bench_main

    return bench_main(args)


def _add_tune(sub) -> None:
    from .build import PRESETS
    from .ir import OPS
    from .tune_space import SPACES

    t = sub.add_parser("tune", help="search a target's run configs per shape; record the winners in the tuning database")
    what = t.add_mutually_exclusive_group()
    what.add_argument("--preset", choices=sorted(PRESETS), help="the preset's ops that the target tunes")
    what.add_argument("--op", choices=sorted(OPS), help="one op (the default preset's, with --set fields)")
    what.add_argument("--show", action="store_true", help="print the tuning database")
    what.add_argument("--rerender", default=None, metavar="JSON",
                      help="rewrite a report's table and plot from its JSON (into --report, else beside it)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="op field, e.g. head_dim=64")
    t.add_argument("--target", choices=SPACES, default=None)
    t.add_argument("--shapes", default=None, help="decode:BxL,prefill:BxL,... (default: the target's)")
    much = t.add_mutually_exclusive_group()
    much.add_argument("--trials", type=int, default=None, help="candidates a shape, the default among them (default 24)")
    much.add_argument("--budget", type=float, default=None, metavar="SECONDS", help="seconds a shape")
    t.add_argument("--rounds", type=int, default=15, help="timed samples a candidate (round-robin)")
    t.add_argument("--jobs", type=int, default=None, help="build processes (default: the cores, at most 8)")
    t.add_argument("--db", default=None, metavar="PATH", help="tuning database (default: <user cache>/tuning.json)")
    t.add_argument("--force", action="store_true", help="re-tune shapes the database already holds")
    t.add_argument("--report", default=None, metavar="DIR", help="write DIR/tune-<date>.json, .md and .png")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    t.set_defaults(func=cmd_tune)


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    s.add_argument("--model", required=True, help="a .gguf file or a Hugging Face directory")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    s.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/* and /completion")
    s.add_argument("--served-model-name", default=None, help="default: the model file's stem")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-num-batched-tokens", type=int, default=None)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--page-size", type=int, default=None)
    s.add_argument("--num-pages", type=int, default=None)
    s.add_argument("--policy", default=None, help="fcfs | sjf | priority | prefix")
    s.add_argument("--preemption", default=None, help="recompute | swap")
    s.add_argument("--kernel-backend", default=None, help="auto | tvm-cpu | cuda | reference")
    s.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    s.add_argument("--cpu-threads", type=int, default=None)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests accepted beyond --max-num-seqs before answering 503")
    s.add_argument("--trace", default=None, metavar="FILE",
                   help="write a Chrome-trace JSON of steps, kernel calls and KV events (the first 500k) at shutdown")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)


def _add_bench(sub) -> None:
    from .bench_serve import add_arguments

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True, parser_class=_Parser)
    s = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (like `vllm bench serve`)")
    add_arguments(s)
    s.set_defaults(func=cmd_bench_serve)


def make_parser() -> argparse.ArgumentParser:
    from .build import PRESETS, TARGETS
    from .ir import OPS

    p = _Parser(prog="uacompile", description="Kernel compiler for paged attention and cache ops.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    b = sub.add_parser("build", help="build a preset kernel set and write DIR/manifest.json")
    b.add_argument("--preset", default="default", choices=sorted(PRESETS))
    b.add_argument("--target", choices=[*TARGETS, "all"], default=None,
                   help="default: cpu and cuda; all adds ascend")
    b.add_argument("--out", default="uacompile-build")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--tuning-db", default=None, metavar="PATH",
                   help="add the tuned configs' kernels of this database (default: the user cache's, if any)")
    b.add_argument("--no-tuned", action="store_true", help="build the built-in rules' kernels only")
    b.set_defaults(func=cmd_build)
    _add_tune(sub)
    g = sub.add_parser("generate", help="write one kernel's source")
    g.add_argument("--op", required=True, choices=sorted(OPS))
    g.add_argument("--target", required=True, choices=TARGETS)
    g.add_argument("--lowering", choices=["tvm", "jinja"], default=None)
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="op field, e.g. head_dim=128")
    g.add_argument("--out", default=None, help="file (default: stdout)")
    g.set_defaults(func=cmd_generate)
    o = sub.add_parser("ops", help="list ops, or show one variant's parameters")
    o.add_argument("--op", choices=sorted(OPS))
    o.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    o.add_argument("--markdown", action="store_true", help="print docs/OPS.md")
    o.set_defaults(func=cmd_ops)
    _add_serve(sub)
    _add_bench(sub)
    return p


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (IRError, ValueError, TypeError, FileNotFoundError) as e:
        print(f"uacompile: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
