"""Render an IR op into CUDA source from its Jinja template (templates/cuda/*.cu.j2).

    from uacompile.targets.cuda.render import render_op
    src = render_op(ReshapeAndCache(num_kv_heads=8, head_dim=128))   # a complete .cu file

Each op kind has a context builder `fn(op) -> (template_name, context)`. Every context also
gets the common keys below, so a template needs no Python beyond its builder:
    op, symbol (the launcher name), ns (a C++ namespace unique to the op: wrap all kernels
    and helpers in it, so several ops can share one translation unit), signature
    (ir.c_signature(op): `extern "C" {{ signature }} { ... return (int)cudaGetLastError(); }`),
    ctype (IR dtype -> C type inside namespace ua, e.g. ctype['bf16'] == 'bf16').
Templates include the kernel headers of targets/cuda/include/uacompile (`#include "uacompile/common.cuh"`:
dtypes, vectors, quantisation; build.py passes the include path): a header holds a kernel's C++ as templates,
and the Jinja file is its configuration, its __global__ instantiation in the op's namespace and the launcher.
A template that needs Hopper-only instructions (wgmma) writes the marker line
`// UA_REQUIRES_SM90A` and guards that code for other archs; build.py then compiles it for
sm_90a. Builders get the target arch (`fn(op, arch)`); paged_attention's lives in attention.py as
`template_context(op, arch)` and picks its Hopper path by it.
"""
from __future__ import annotations

import functools
import importlib
from pathlib import Path

import jinja2

from uacompile import ir

SM90A_MARKER = "// UA_REQUIRES_SM90A"
CTYPE = {name: c for name, (_, c, _) in ir.DTYPES.items()}


@functools.cache
def template_dir() -> Path:
    from uacompile import templates

    return Path(templates.__file__).parent


@functools.cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def vector_width(n: int, itemsize: int, max_bytes: int = 16) -> int:
    """Widest power-of-two element count whose access is <= max_bytes and divides n."""
    vec = max_bytes // itemsize
    while vec > 1 and n % vec:
        vec //= 2
    return vec


def lane_group(chunks: int) -> int:
    """Lanes that share one row of `chunks` vectors: a power of two <= 32."""
    return min(32, _next_pow2(chunks))


# ---------------------------------------------------------------- per-op context builders
RC_DESIGN_ENV = "UACOMPILE_RC_VARIANT"  # reshape_and_cache design knobs of a build worker (bench/reshape_sweep.py)


def _reshape_and_cache(op: ir.ReshapeAndCache, arch: str = "sm_90", **design):
    """Template context; `design` overrides the tuned choices (bench/reshape_sweep.py builds
    candidates that way, in worker processes, through UACOMPILE_RC_VARIANT="rows=4,waves=0"):
    rows (R heads per step: the largest divisor of Hkv up to it), steps (S steps per task; R*S divides Hkv), threads,
    waves (grid cap in resident-block waves, 0 = one task per lane group), min_blocks
    (__launch_bounds__ minimum), stages (steps in flight through shared memory by cp.async; 0 =
    a register double buffer), fast_quant (0/1), neox ("paired" / "reload"), group (lanes per
    row: a power of two, at most the default; fewer lanes hold more vectors of the row each),
    quant ("classic" / "lean": the general quantisation path once per step, no division or
    reciprocal calls on the fast path), amax ("bits" / "packed": K and V rows' 16-bit maxima in one shuffle; with quant=lean),
    prefetch (L2 prefetch of the rows this many tokens ahead; 0 = off), oneshot (0/1, with waves=0:
    a warp's one round known at compile time, no next-task loads or loop-carried copies)."""
    import os

    if not design and os.environ.get(RC_DESIGN_ENV):
        design = dict(kv.split("=", 1) for kv in os.environ[RC_DESIGN_ENV].split(","))
    unknown = set(design) - {"rows", "steps", "threads", "waves", "min_blocks", "stages", "fast_quant", "neox",
                             "group", "quant", "amax", "prefetch", "oneshot"}
    if unknown:
        raise ValueError(f"reshape_and_cache design: unknown knobs {sorted(unknown)}")
    # Production knobs of quantised caches without RoPE; a candidate's knobs override them.
    # H200 (bench/results/reshape-sweep-lean-2026-11-30.log): lean + packed 78% / 80% of the copy
    # ceiling for int8 / fp8 against the classic path's 72% / 75%, bit-exact; a min_blocks=5 cap
    # gains 2% on int8 but spills, so it is left out.
    quantized_choice = dict(quant="lean", amax="packed")
    if op.quantized and not op.rope:
        design = {**quantized_choice, **design}
    size = ir.itemsize(op.dtype)
    vec = vector_width(op.head_dim, size)
    if op.rope and not op.rope_interleaved:  # the rotate-half partner must start a vector
        vec = vector_width(op.head_dim // 2, size, vec * size)
    if op.rope and op.rope_interleaved:  # pairs (2i, 2i+1) inside one vector
        vec = max(vec, 2)
    chunks = op.head_dim // vec
    group = min(lane_group(chunks), int(design.get("group", 32)))
    if group < 1 or group & (group - 1):
        raise ValueError(f"reshape_and_cache design: group = {group} must be a power of two")
    per_lane = -(-chunks // group)
    Hkv = op.num_kv_heads
    # R: the largest divisor of Hkv with <= 2 vectors per lane and row (a step holds 2R rows, K
    # and V, and the pipeline two steps). S: RoPE computes its angles once per task, so a task
    # is the whole token; otherwise one step per task (finer work balance).
    # A rows knob is a cap: the largest divisor of Hkv not above it (one knob fits every head count).
    row_cap = int(design.get("rows", Hkv))
    rows = max(r for r in range(1, Hkv + 1) if Hkv % r == 0 and (r <= row_cap if "rows" in design else r * min(per_lane, 2) <= 2))
    steps = int(design.get("steps", Hkv // rows if op.rope else 1))
    # RoPE's float64 math holds ~75 registers: its steps in flight go through shared memory
    # instead (3 stages: 60 KB a block at R=2, 3 blocks an SM); cp.async moves >= 4 bytes
    stages = int(design.get("stages", 3 if op.rope else 0)) if vec * size >= 4 else 0
    if Hkv % (rows * steps):
        raise ValueError(f"reshape_and_cache design: rows * steps = {rows * steps} must divide Hkv = {Hkv}")
    if not op.rope:
        mode = ""
    elif op.rope_interleaved:
        mode = "interleaved"
    elif per_lane == 1 and vec % 2 == 0 and design.get("neox", "paired") == "paired":
        mode = "paired"  # one sincos per pair, the halves exchanged by shuffles
    else:
        mode = "reload"
    quant, amax = design.get("quant", "classic"), design.get("amax", "bits")
    if quant not in ("classic", "lean") or amax not in ("bits", "packed") or (amax == "packed" and quant != "lean"):
        raise ValueError(f"reshape_and_cache design: quant={quant} amax={amax} (packed needs lean)")
    inv_freq = []
    if op.rope:  # the reference's float64 inv_freq, same expression, printed exactly (repr round-trips)
        import numpy as np

        D = op.head_dim
        inv_freq = [repr(float(f)) for f in 1.0 / op.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)]
    return "cuda/reshape_and_cache.cu.j2", dict(
        Hkv=Hkv, D=op.head_dim, P=op.page_size, in_ctype=CTYPE[op.dtype], cache_ctype=CTYPE[op.kv_dtype],
        vec=vec, group=group, rows=rows, steps=steps, stages=stages, threads=int(design.get("threads", 256)),
        # H200 sweeps (bench/reshape_sweep.py): one task per lane group (waves=0) moved 83-84% / 72% /
        # 71-76% / 81% of the copy ceiling (fp16 / int8 / fp8 / RoPE) against 72 / 64 / 67 / 73% with a
        # persistent one-wave grid
        waves=int(design.get("waves", 0)), min_blocks=int(design.get("min_blocks", 0)),
        fast_quant=bool(int(design.get("fast_quant", 1))), quant=quant, amax=amax, prefetch=int(design.get("prefetch", 0)),
        oneshot=bool(int(design.get("oneshot", 0))),
        quantized=op.quantized, rope=op.rope,
        rope_theta=op.rope_theta, inv_freq=inv_freq, rope_interleaved=op.rope_interleaved, rope_mode=mode)


def _page_copy(op):
    """Shared by copy_blocks and swap_blocks: one page of one layer's K or V, and its scales."""
    page_bytes = op.page_size * op.num_kv_heads * op.head_dim * ir.itemsize(op.kv_dtype)
    scale_bytes = op.page_size * op.num_kv_heads * 4
    return dict(page_bytes=page_bytes, vec_bytes=vector_width(page_bytes, 1), scale_bytes=scale_bytes,
                scale_vec_bytes=vector_width(scale_bytes, 1), quantized=op.quantized, threads=256, unroll=4)


def _merge_state(op: ir.MergeState, arch: str):
    vec = vector_width(op.head_dim, 4)
    return "cuda/merge_state.cu.j2", dict(
        S=op.num_splits, H=op.num_heads, D=op.head_dim, out_ctype=CTYPE[op.out_dtype], vec=vec,
        group=lane_group(op.head_dim // vec), threads=256, return_lse=op.return_lse)


def _attention():
    return importlib.import_module(".attention", __package__)


def _paged_attention(op, arch: str):
    return _attention().template_context(op, arch)


CONTEXT_BUILDERS = {
    "reshape_and_cache": _reshape_and_cache,
    "copy_blocks": lambda op, arch: ("cuda/copy_blocks.cu.j2", _page_copy(op)),
    "swap_blocks": lambda op, arch: ("cuda/swap_blocks.cu.j2", _page_copy(op)),
    "merge_state": _merge_state,
    "paged_attention": _paged_attention,
}


def render_op(op: ir.OpSpec, arch: str = "sm_90") -> str:
    """The complete CUDA source (header included) of op for arch, with its extern "C" launcher."""
    if op.kind not in CONTEXT_BUILDERS:
        raise ir.IRError("op", f"has no CUDA template: {op.kind!r} (have {sorted(CONTEXT_BUILDERS)})")
    template, ctx = CONTEXT_BUILDERS[op.kind](op, arch)
    common = dict(op=op, symbol=op.symbol(), ns=f"{op.symbol()}_impl", signature=ir.c_signature(op), ctype=CTYPE)
    return environment().get_template(template).render(**common, **ctx)


def needs_sm90a(source: str) -> bool:
    return SM90A_MARKER in source
