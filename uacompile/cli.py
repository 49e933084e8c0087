"""`uacompile` command line: build kernel sets, generate one kernel's source, show op docs, tune run configs,
serve a model over an OpenAI-compatible API, benchmark a server.

Bad input (a flag, a value, a path) answers with one line on stderr and exit status 2; --debug
shows the traceback instead.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import typing
from pathlib import Path

from .errors import IRError

BOOLS = {"true": True, "1": True, "false": False, "0": False}


class UsageError(ValueError):
    """A bad flag, value or path: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump or traceback
        self.exit(2, f"uacompile: error: {message}\n")


# ---------------------------------------------------------------- values
def _field_types(cls) -> dict:
    return typing.get_type_hints(cls)


def _value(cls, key: str, text: str):
    """--set KEY=TEXT as the op field's type: bool (true/false/1/0 only), int, float, str, or None."""
    hint = _field_types(cls).get(key)
    if hint is None:
        return text  # not a field: op_from_dict names the fields
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if optional and text.lower() in ("none", "null"):
        return None
    where = f"--set {key}={text}"
    if base is bool:
        if text.lower() not in BOOLS:
            raise UsageError(f"{where}: {key} is a boolean: use true, false, 1 or 0")
        return BOOLS[text.lower()]
    if base is int:
        try:
            return int(text)
        except ValueError:
            raise UsageError(f"{where}: {key} must be an integer") from None
    if base is float:
        try:
            v = float(text)
        except ValueError:
            raise UsageError(f"{where}: {key} must be a number{' or none' if optional else ''}") from None
        if not math.isfinite(v):
            raise UsageError(f"{where}: {key} must be a finite number")
        return v
    return text


def _sets(kind: str, pairs: list[str]) -> dict:
    """--set key=value pairs as the op's typed fields."""
    from .ir import OPS

    cls, fields = OPS[kind], {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--set expects key=value, got {pair!r}")
        fields[key] = _value(cls, key, text)
    return fields


def _op(kind: str, pairs: list[str]):
    from .ir import op_from_dict

    return op_from_dict({"op": kind, **_sets(kind, pairs)})


# ---------------------------------------------------------------- paths
def _writable_dir(flag: str, text: str) -> Path:
    """--out as a directory: created if missing; must take a new file."""
    if not text:
        raise UsageError(f"{flag}: must not be empty")
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {text}: is a file, not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {text}: cannot write there ({e.strerror or e})") from None
    return p


def _writable_file(flag: str, text: str) -> Path:
    """--out as a file: its folder must exist and take a new file."""
    if not text:
        raise UsageError(f"{flag}: must not be empty")
    p = Path(text)
    if p.is_dir():
        raise UsageError(f"{flag} {text}: is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{flag} {text}: directory {parent} does not exist")
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{flag} {text}: not writable")
    return p


def _write(flag: str, path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write ({e.strerror or e})") from None


# ---------------------------------------------------------------- commands
def cmd_build(args) -> int:
    from .build import DEFAULT_TARGETS, TARGETS, build_set
    from .tunedb import TuningDB, default_db_path

    out = _writable_dir("--out", args.out)
    targets = {"all": TARGETS, None: DEFAULT_TARGETS}.get(args.target, (args.target,))
    db_path = Path(args.tuning_db) if args.tuning_db else default_db_path()
    db = None if args.no_tuned or not db_path.exists() else TuningDB.open(db_path)
    manifest = build_set(args.preset, targets, out, progress=not args.quiet, tuning=db)
    built = sum(e["library"] is not None for e in manifest["kernels"])
    print(f"{built}/{len(manifest['kernels'])} kernels built -> {out / 'manifest.json'}")
    for e in manifest["kernels"]:
        for est in e.get("estimate", ()):  # ascend paged attention: per-shape estimates, not measurements
            print(f"  estimate {e['target']} {e['symbol']}: {est['shape']}: ~{est['estimate_us']:,.0f} us vs HBM floor "
                  f"{est['hbm_floor_us']:,.0f} us ({est['vs_floor']:.1f}x), {est['vector_instructions'] / 1e6:,.1f} M "
                  f"vector instr, {est['matmul_flops'] / 1e9:,.1f} GFLOP matmul, {est['hbm_bytes'] / 1e6:,.0f} MB "
                  f"[estimate: {est['basis']}]")
    for e in manifest["kernels"]:
        if e["library"] is None:  # the symbol tells variants of one op apart
            print(f"  not built: {e['target']}/{e['lowering']} {e['symbol']}: {e['reason']}")
    return 0


def cmd_generate(args) -> int:
    from .build import generate_sources, lowerings_for

    op = _op(args.op, args.set)
    lowering = args.lowering or lowerings_for(args.target)[-1]
    if lowering not in lowerings_for(args.target):
        raise UsageError(f"--lowering {lowering}: target {args.target} has {lowerings_for(args.target)}")
    many = args.target == "ascend"  # a project of several files
    out = None
    if args.out is not None:
        out = _writable_dir("--out", args.out) if many else _writable_file("--out", args.out)
    try:
        files = generate_sources(op, args.target, lowering)
    except NotImplementedError as e:
        raise UsageError(f"{args.target}/{lowering} has no {args.op} kernel for this variant: {e}") from None
    if out is None:
        for name, text in files.items():
            if len(files) > 1:
                sys.stdout.write(f"// ---- {name}\n")
            sys.stdout.write(text)
        return 0
    for name, text in files.items():
        path = out / name if many else out
        _write("--out", path, text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_ops(args) -> int:
    from .ir import OPS, describe, reference_doc

    if args.markdown:
        print(reference_doc())
        return 0
    if args.op:
        print(describe(_op(args.op, args.set)))
        return 0
    if args.set:
        raise UsageError("--set needs --op")
    width = max(map(len, OPS))
    for name, cls in OPS.items():
        print(f"{name:<{width}}  {(cls.__doc__ or '').strip().splitlines()[0]}")
    return 0


def _check_writable(flag: str, path: str, folder: bool) -> None:
    """A path written later (after the work): its nearest existing ancestor must be a writable folder, and the
    path itself, if it exists, a writable folder (folder=True) or file."""
    p = Path(path)
    if p.exists():
        if p.is_dir() != folder:
            raise UsageError(f"{flag} {path} is {'not a folder' if folder else 'a folder'}")
        if not os.access(p, os.W_OK):
            raise UsageError(f"{flag} {path} is not writable")
        return
    up = p.parent
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        raise UsageError(f"{flag} {path}: {up} is not a folder")
    if not os.access(up, os.W_OK):
        raise UsageError(f"{flag} {path}: {up} is not writable")


def cmd_tune(args) -> int:
    import logging

    from .tune import DEFAULT_SHAPES, ops_to_tune, report_table, tune, write_report
    from .tune_space import space as make_space
    from .tunedb import TuningDB, parse_shapes

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.report:  # checked before any tuning runs
        _check_writable("--report", args.report, folder=True)
    if args.db and not (args.show or args.rerender):
        _check_writable("--db", args.db, folder=False)
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
    ops = ops_to_tune(args.target, args.preset, args.op, _sets(args.op, args.set) if args.op else {})
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


SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")
API_KEY_ENV = "UACOMPILE_API_KEY"


def _check_serve_extra() -> None:
    import importlib

    missing = []
    for name in SERVE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UsageError(f"serve needs the serve extra (missing: {', '.join(missing)}): "
                         f"pip install 'uacompile[serve]'")


def _api_key(args) -> str | None:
    """--api-key, else the first line of --api-key-file, else $UACOMPILE_API_KEY (none: no key asked)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise UsageError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise UsageError(f"--api-key-file {args.api_key_file}: {e.strerror or e}") from None
        if not key or "\n" in key:
            raise UsageError(f"--api-key-file {args.api_key_file} must hold one line, the key")
        return key
    return args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def cmd_serve(args) -> int:
    _check_serve_extra()
    from .runtime.server import serve

    args.api_key = _api_key(args)
    kw = {k: v for k, v in vars(args).items()
          if k not in ("func", "command", "debug", "api_key_file") and v is not None}
    if "cpu_offload_gb" in kw:
        kw["cpu_offload_bytes"] = int(kw.pop("cpu_offload_gb") * 1e9)
    serve(**kw)
    return 0


def cmd_bench_serve(args) -> int:
    from .bench_serve import main as bench_main

    return bench_main(args)


# ---------------------------------------------------------------- parser
def _preset_help() -> str:
    from .build import MODELS, PRESETS

    lines = ["presets (each model gives paged_attention, its split-KV variant + merge_state, reshape_and_cache,",
             "copy_blocks and swap_blocks):"]
    for name, models in PRESETS.items():
        lines.append(f"  {name}: {', '.join(models)}")
    lines.append("models:")
    for m in MODELS.values():
        lines.append(f"  {m.name}: {m.num_q_heads} q heads, {m.num_kv_heads} kv heads, head_dim {m.head_dim}, "
                     f"page {m.page_size}, {m.dtype}, {m.decode_splits} decode splits")
    return "\n".join(lines)


def _add_tune(sub, common) -> None:
    from .build import PRESETS
    from .ir import OPS
    from .tune_space import SPACES

    t = sub.add_parser("tune", parents=[common], help="search a target's run configs per shape; record the winners in the tuning database")
    what = t.add_mutually_exclusive_group()
    what.add_argument("--preset", choices=sorted(PRESETS), help="the preset's ops that the target tunes")
    what.add_argument("--op", choices=sorted(OPS), help="one op (the default preset's, with --set fields)")
    what.add_argument("--show", action="store_true", help="print the tuning database")
    what.add_argument("--rerender", default=None, metavar="JSON",
                      help="rewrite a report's table and plot from its JSON (into --report, else beside it)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="op field, e.g. head_dim=64")
    t.add_argument("--target", choices=SPACES, default=None, help="the target whose run configs are searched")
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
    t.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="logging level (default: warning)")
    t.set_defaults(func=cmd_tune)


def _kv_budget(text: str) -> int | float:
    """--kv-budget: an int (tokens) or a float (a share of the prompt)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int (tokens) or a float in (0, 1], got {text!r}") from None


def _add_serve(sub, common) -> None:
    s = sub.add_parser("serve", parents=[common], help="serve a model over an OpenAI-compatible HTTP API")
    s.add_argument("--model", required=True, help="a .gguf file or a Hugging Face directory")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs (default: cpu)")
    s.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    s.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer KEY on /v1/* and /completion (visible in ps: prefer "
                        f"--api-key-file or ${API_KEY_ENV})")
    s.add_argument("--api-key-file", default=None, metavar="FILE", help="the API key, the file's one line")
    s.add_argument("--served-model-name", default=None, help="default: the model file's stem")
    s.add_argument("--max-num-seqs", type=int, default=None, help="sequences running at once (engine default 32)")
    s.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of a step")
    s.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    s.add_argument("--page-size", type=int, default=None, help="KV positions a page (default 16)")
    s.add_argument("--num-pages", type=int, default=None, help="KV pages (default: sized from memory)")
    s.add_argument("--policy", default=None, help="fcfs | sjf | priority | prefix")
    s.add_argument("--preemption", default=None, help="recompute | swap | offload (needs --cpu-offload-gb)")
    s.add_argument("--kv-budget", type=_kv_budget, default=None, metavar="N|F",
                   help="KV eviction: cached tokens a sequence keeps (an int) or a share of its prompt (a float in "
                        "(0, 1]); sink, recent and top-scored tokens are kept (default: no eviction)")
    s.add_argument("--kv-evict-method", default=None, choices=["andpro", "attention", "value_norm"],
                   help="how eviction scores tokens (default: andpro)")
    s.add_argument("--cpu-offload-gb", type=float, default=None,
                   help="a CPU offload tier of KV pages in this many GB (1e9 bytes) of host memory (pinned on CUDA): "
                        "preempted sequences and evicted prefixes come back from it instead of being recomputed")
    s.add_argument("--kernel-backend", default=None, help="auto | tvm-cpu | cuda | reference")
    s.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="model dtype (default: float32 on the CPU, the checkpoint's 16-bit type on CUDA)")
    s.add_argument("--quantization", default=None, choices=["auto", "none", "fp8", "q8_0"],
                   help="weights: auto (block-quantised GGUF weights stay packed where the backend runs them), none "
                        "(decode all to --dtype), q8_0 or fp8 (quantise float weights at load; fp8 on CUDA)")
    s.add_argument("--kv-cache-dtype", default=None, choices=["auto", "bf16", "fp16", "fp8_e4m3", "int8"],
                   help="KV cache dtype: auto (the model's, the default), bf16 / fp16 (must be the model's), "
                        "fp8_e4m3 or int8 (8-bit pages with float32 scales: about twice the pages)")
    s.add_argument("--cpu-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    s.add_argument("--seed", type=int, default=None, help="seed of requests that bring none")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests accepted beyond --max-num-seqs before answering 503")
    s.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                   help="longest request body; a longer one gets 413 (default: 4 MiB)")
    s.add_argument("--shutdown-timeout", type=float, default=None, metavar="SECONDS",
                   help="on SIGTERM / SIGINT, seconds the requests in flight get to finish before they are ended "
                        "with an error (default: 30)")
    s.add_argument("--trace", default=None, metavar="FILE",
                   help="write a Chrome-trace JSON of steps, kernel calls and KV events (the first 500k) at shutdown")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="logging level (default: info)")
    s.set_defaults(func=cmd_serve)


def _add_bench(sub, common) -> None:
    from .bench_serve import add_arguments

    b = sub.add_parser("bench", parents=[common], help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True, parser_class=_Parser, metavar="BENCH", help="one of:")
    s = bsub.add_parser("serve", parents=[common], help="load-test an OpenAI-compatible server (like `vllm bench serve`)")
    add_arguments(s)
    s.set_defaults(func=cmd_bench_serve)


def make_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .build import PRESETS, TARGETS
    from .ir import OPS

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    p = _Parser(prog="uacompile", description="Kernel compiler for paged attention and cache ops.")
    p.add_argument("--version", action="version", version=f"uacompile {__version__}")
    p.add_argument("--debug", action="store_true", default=False, help="show the traceback of an error")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, help="one of:")
    fmt = argparse.RawDescriptionHelpFormatter
    b = sub.add_parser("build", parents=[common], help="build a preset kernel set and write DIR/manifest.json",
                       epilog=_preset_help(), formatter_class=fmt)
    b.add_argument("--preset", default="default", choices=sorted(PRESETS),
                   help="which kernel set (listed below; default: default)")
    b.add_argument("--target", choices=[*TARGETS, "all"], default=None,
                   help="cpu, cuda or ascend (default: cpu and cuda; all adds ascend)")
    b.add_argument("--out", default="uacompile-build", metavar="DIR",
                   help="directory for the kernels and manifest.json, created if missing (default: uacompile-build)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--tuning-db", default=None, metavar="PATH",
                   help="add the tuned configs' kernels of this database (default: the user cache's, if any)")
    b.add_argument("--no-tuned", action="store_true", help="build the built-in rules' kernels only")
    b.set_defaults(func=cmd_build)
    _add_tune(sub, common)
    g = sub.add_parser("generate", parents=[common], help="print or write one kernel's source (runs no compiler)")
    g.add_argument("--op", required=True, choices=sorted(OPS), help="the op (see `uacompile ops`)")
    g.add_argument("--target", required=True, choices=TARGETS, help="cpu (TVM TIR), cuda or ascend (AscendC)")
    g.add_argument("--lowering", choices=["tvm", "jinja"], default=None,
                   help="tvm or jinja (default: jinja for cuda and ascend, tvm for cpu)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="op field, e.g. head_dim=128 (booleans: true/false/1/0; repeat for each field)")
    g.add_argument("--out", default=None, metavar="PATH",
                   help="file to write (ascend: a directory for its files); default: stdout")
    g.set_defaults(func=cmd_generate)
    o = sub.add_parser("ops", parents=[common], help="list the ops, or show one variant's parameters")
    o.add_argument("--op", choices=sorted(OPS), help="show this op's kernel parameters")
    o.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="op field, as for generate")
    o.add_argument("--markdown", action="store_true", help="print docs/OPS.md")
    o.set_defaults(func=cmd_ops)
    _add_serve(sub, common)
    _add_bench(sub, common)
    return p


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `uacompile`: the commands
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.debug:
            raise
        user = isinstance(e, (UsageError, IRError, ValueError, TypeError, OSError))
        text = " ".join(str(e).split()) or type(e).__name__
        text = text if len(text) <= 400 else text[:400] + " ..."
        hint = "" if user else f" ({type(e).__name__}; --debug shows the traceback)"
        print(f"uacompile: error: {text}{hint}", file=sys.stderr)
        return 2 if user else 1


if __name__ == "__main__":
    sys.exit(main())
