"""Render an IR op into CUDA source from its Jinja template (templates/cuda/*.cu.j2).

    from uacompile.targets.cuda.render import render_op
    src = render_op(ReshapeAndCache(num_kv_heads=8, head_dim=128))   # a complete .cu file

Each op kind has a context builder `fn(op) -> (template_name, context)`. Every context also
gets the common keys below, so a template needs no Python beyond its builder:
    op, symbol (the launcher name), ns (a C++ namespace unique to the op: wrap all kernels
    and helpers in it, so several ops can share one translation unit), signature
    (ir.c_signature(op): `extern "C" {{ signature }} { ... return (int)cudaGetLastError(); }`),
    ctype (IR dtype -> C type inside namespace ua, e.g. ctype['bf16'] == 'bf16').
Templates start with `{% include "cuda/common.cuh.j2" %}` (dtypes, vectors, quantisation).
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

from ... import ir

SM90A_MARKER = "// UA_REQUIRES_SM90A"
CTYPE = {name: c for name, (_, c, _) in ir.DTYPES.items()}


@functools.cache
def template_dir() -> Path:
    from ... import templates

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
def _reshape_and_cache(op: ir.ReshapeAndCache, arch: str):
    size = ir.itemsize(op.dtype)
    vec = vector_width(op.head_dim, size)
    if op.rope and not op.rope_interleaved:  # the rotate-half partner must start a vector
        vec = vector_width(op.head_dim // 2, size, vec * size)
    if op.rope and op.rope_interleaved:  # pairs (2i, 2i+1) inside one vector
        vec = max(vec, 2)
    chunks = op.head_dim // vec
    group = lane_group(chunks)
    per_lane = -(-chunks // group)
    # heads per lane group: the largest divisor of Hkv with <= 8 vectors per lane in flight
    # (<= 2 when quantising: its per-row reduce + math then overlaps other groups' loads;
    # measured on the H200, 8 rows made int8/fp8 writes 20% slower than 1)
    cap = 2 if op.quantized else 8
    rows = max(r for r in range(1, op.num_kv_heads + 1) if op.num_kv_heads % r == 0 and r * per_lane <= cap)
    inv_freq = []
    if op.rope:  # the reference's float64 inv_freq, same expression, printed exactly (repr round-trips)
        import numpy as np

        D = op.head_dim
        inv_freq = [repr(float(f)) for f in 1.0 / op.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)]
    return "cuda/reshape_and_cache.cu.j2", dict(
        Hkv=op.num_kv_heads, D=op.head_dim, P=op.page_size, in_ctype=CTYPE[op.dtype], cache_ctype=CTYPE[op.kv_dtype],
        vec=vec, group=group, rows=rows, threads=256, quantized=op.quantized, rope=op.rope,
        rope_theta=op.rope_theta, inv_freq=inv_freq, rope_interleaved=op.rope_interleaved)


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


def _paged_attention(op, arch: str):
    return importlib.import_module(".attention", __package__).template_context(op, arch)


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
