"""Render an IR op into CUDA source from its Jinja template (templates/cuda/*.cu.j2).

    from uacompile.targets.cuda.render import render_op
    src = render_op(ReshapeAndCache(num_kv_heads=8, head_dim=128))   # a complete .cu file

Each op kind has a context builder `fn(op) -> (template_name, context)`. Every context also
gets the common keys below, so a template needs no Python beyond its builder:
    op, symbol (the launcher name), ns (a C++ namespace unique to the op: wrap all kernels
    and helpers in it, so several ops can share one translation unit), signature
    (ir.c_signature(op): `extern "C" {{ signature }} { ... return (int)cudaGetLastError(); }`).
C types come from ir.DTYPES[dtype].c (bf16 is a typedef of common.cuh).
Templates include the kernel headers of targets/cuda/include/uacompile (`#include "uacompile/common.cuh"`:
dtypes, vectors, quantisation; build.py passes the include path): a header holds a kernel's C++ as templates,
and the Jinja file is its configuration, its __global__ instantiation in the op's namespace and the launcher.
A template that needs Hopper-only instructions (wgmma) writes the marker line
`// UA_REQUIRES_SM90A` and guards that code for other archs; build.py then compiles it for
sm_90a. Builders get the target arch (`fn(op, arch)`); paged_attention's takes the kernel (op and
AttentionConfig) and sizes it with layout.py, which picks its Hopper path by the arch.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from uacompile import ir

from .config import QuantMatmulConfig, ReshapeConfig, config_of
from .layout import (TEMPLATE, check, cp_producer_below, cp_row_lanes, dynamic_prefill, layout, pdl, q_prefetch_min,
                     wgmma_width)

SM90A_MARKER = "// UA_REQUIRES_SM90A"


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
def _reshape_and_cache(kernel: ir.Kernel, arch: str = "sm_90"):
    """Template context of a reshape_and_cache kernel: its ReshapeConfig's fields where set (config.py documents
    them; bench/reshape_sweep.py builds candidates that way), the built-in rule for the rest."""
    op = kernel.op
    design = kernel.config.overrides() if isinstance(kernel.config, ReshapeConfig) else {}
    # Production knobs of quantised caches without RoPE; a candidate's knobs override them.
    # Lean + packed beat the classic path for int8 / fp8, bit-exact; a min_blocks=5 cap gains on int8
    # but spills, so it is left out.
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
    inv_freq = _inv_freq(op.rope_theta, op.head_dim) if op.rope else []
    return "cuda/reshape_and_cache.cu.j2", dict(
        Hkv=Hkv, D=op.head_dim, P=op.page_size, in_ctype=ir.DTYPES[op.dtype].c, cache_ctype=ir.DTYPES[op.kv_dtype].c,
        vec=vec, group=group, rows=rows, steps=steps, stages=stages, threads=int(design.get("threads", 256)),
        # H200 sweeps (bench/reshape_sweep.py): one task per lane group (waves=0) moved 83-84% / 72% /
        # 71-76% / 81% of the copy ceiling (fp16 / int8 / fp8 / RoPE) against 72 / 64 / 67 / 73% with a
        # persistent one-wave grid
        waves=int(design.get("waves", 0)), min_blocks=int(design.get("min_blocks", 0)),
        fast_quant=bool(design.get("fast_quant", True)), quant=quant, amax=amax, prefetch=int(design.get("prefetch", 0)),
        oneshot=bool(design.get("oneshot", False)),
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
        S=op.num_splits, H=op.num_heads, D=op.head_dim, out_ctype=ir.DTYPES[op.out_dtype].c, vec=vec,
        group=lane_group(op.head_dim // vec), threads=256, return_lse=op.return_lse)


def _c_float(x: float) -> str:
    return f"{float(x):.9e}f"


def _paged_attention(kernel: ir.Kernel, arch: str = "sm_90") -> tuple[str, dict]:
    op, cfg = kernel.op, config_of(kernel)
    check(op, cfg)
    lay = layout(op, cfg, arch)
    return TEMPLATE, dict(
        variant=op.variant, unified=op.variant == "unified_masked",
        Hq=op.num_q_heads, Hkv=op.num_kv_heads, D=op.head_dim, DW=wgmma_width(op.head_dim) if lay.wgmma else op.head_dim,
        P=op.page_size,
        q_dtype=op.q_dtype, kv_dtype=op.kv_dtype, q_ctype=ir.DTYPES[op.q_dtype].c, kv_ctype=ir.DTYPES[op.kv_dtype].c,
        quantized=op.quantized, num_splits=cfg.num_splits, write_lse=op.return_lse and cfg.num_splits == 1,
        fused_merge=cfg.fused_merge,
        window=op.window, softcap=op.softcap, softcap_c=_c_float(op.softcap or 1.0), alibi=op.alibi,
        scale_c=_c_float(op.sm_scale), bn_prefill=lay.bn_prefill, mt_prefill=lay.mt_prefill, kv_rows=lay.kv_rows,
        stages=lay.stages, smem_bytes=lay.smem_bytes, min_blocks=lay.min_blocks, prefill_rows=lay.prefill_rows,
        groups=lay.decode_groups, wgmma=lay.wgmma, decode_only=cfg.decode_only, pdl=pdl(arch),
        dynamic=dynamic_prefill(op, cfg, arch), bn_wg=lay.bn_wg, stages_wg=lay.stages_wg,
        smem_prefill=lay.smem_prefill, cp_producer_below=cp_producer_below(cfg),
        cp_row_lanes=cp_row_lanes(op.head_dim, cfg), q_prefetch_min=q_prefetch_min(cfg))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _inv_freq(theta: float, head_dim: int, freq_factors=()) -> list[str]:
    """The reference's float64 inv_freq (reference.rope_inv_freq), printed exactly (repr round-trips)."""
    from uacompile.reference import rope_inv_freq

    return [repr(float(f)) for f in rope_inv_freq(theta, head_dim, freq_factors)]


def _rms_norm(op: ir.RMSNorm, arch: str):
    """A row a block, in registers: two vectors a thread (E = 4096 bf16: 256 threads), up to 1024 threads."""
    vec = vector_width(op.hidden_size, ir.itemsize(op.dtype))
    chunks = op.hidden_size // vec
    threads = min(1024, max(32, _round_up(-(-chunks // 2), 32)))
    return "cuda/rms_norm.cu.j2", dict(E=op.hidden_size, vec=vec, threads=threads, residual=op.residual,
                                       eps_c=_c_float(op.eps), c_type=ir.DTYPES[op.dtype].c, pdl=pdl(arch))


def _silu_and_mul(op: ir.SiluAndMul, arch: str):
    """128-thread blocks of two vectors a thread over a row's columns (I = 12288 bf16: 6 blocks a token)."""
    vec = vector_width(op.intermediate_size, ir.itemsize(op.dtype))
    chunks = op.intermediate_size // vec
    return "cuda/silu_and_mul.cu.j2", dict(I=op.intermediate_size, vec=vec, threads=min(128, _round_up(chunks, 32)),
                                           per_thread=2, c_type=ir.DTYPES[op.dtype].c, pdl=pdl(arch))


def _rope(op: ir.Rope, arch: str):
    size = ir.itemsize(op.dtype)
    if op.interleaved:  # pairs (2i, 2i+1) inside one vector
        vec = max(2, vector_width(op.head_dim, size))
        chunks = op.head_dim // vec
    else:  # the partner vector D/2 further must start a vector
        vec = vector_width(op.head_dim // 2, size)
        chunks = op.head_dim // 2 // vec
    if chunks > 1024:
        raise ir.IRError("rope.head_dim", f"the CUDA template covers a head in one block (<= 1024 threads), got {op.head_dim}")
    return "cuda/rope.cu.j2", dict(H=op.num_heads, D=op.head_dim, vec=vec, interleaved=op.interleaved,
                                   c_type=ir.DTYPES[op.dtype].c,
                                   heads_per_pass=max(1, min(op.num_heads, 256 // chunks)),
                                   inv_freq=_inv_freq(op.rope_theta, op.head_dim, op.freq_factors))


def _qkv_rope_cache(op: ir.QKVRopeCache, arch: str):
    """A head row is one lane group, one 16-byte vector a lane (a rotate-half vector inside its half of the row);
    blocks of 128 threads (whole warps) hold a token's rows, so a one-token step still spreads over several SMs."""
    size = ir.itemsize(op.dtype)
    if op.rope_interleaved:  # pairs (2i, 2i+1) inside one vector
        vec = max(2, vector_width(op.head_dim, size))
    else:
        vec = vector_width(op.head_dim // 2, size)
    chunks = op.head_dim // vec
    if chunks > 32:
        raise ir.IRError("qkv_rope_cache.head_dim", f"the CUDA template holds a head in one lane group (<= 32 vectors of "
                                                    f"{vec * size} bytes), got {op.head_dim}")
    group = lane_group(chunks)
    heads = op.num_q_heads + 2 * op.num_kv_heads
    rows = min(128 // group, _round_up(heads, 32 // group))
    return "cuda/qkv_rope_cache.cu.j2", dict(
        Hq=op.num_q_heads, Hkv=op.num_kv_heads, D=op.head_dim, P=op.page_size, in_ctype=ir.DTYPES[op.dtype].c,
        cache_ctype=ir.DTYPES[op.kv_dtype].c, vec=vec, group=group, rows=rows, qk_norm=op.qk_norm,
        interleaved=op.rope_interleaved, quantized=op.quantized, pdl=pdl(arch), eps_c=_c_float(op.eps),
        inv_freq=_inv_freq(op.rope_theta, op.head_dim, op.freq_factors))


FMT_ENUMS = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}


SMEM_LIMIT = 227 * 1024  # bytes of shared memory a block (sm_80: 163 KB; sm_90: 227 KB)


def quant_matmul_smem(op: ir.QuantMatmul, warps: int, stages: int, m_tiles: int, token_tiles: int) -> int:
    """Shared memory of a block of the tensor-core kernel (QuantMatmul<...>::SMEM_BYTES of quant_matmul.cuh)."""
    f = op.format
    ub = 256 // f.block * f.nbytes
    stride = ((ub + 15) // 16 + 1) | 1
    ring = warps * stages * 16 * m_tiles * stride * 16
    red = warps * m_tiles * token_tiles * 4 * 32 * 4 if warps > 1 else 0
    return max(ring, red)


TOKEN_TILES = (1, 2, 4, 8)  # 8-token tiles of the kernels of 1-8, 9-16, 17-32 and 33+ tokens


def quant_matmul_tiles(op: ir.QuantMatmul, cfg: QuantMatmulConfig | None = None) -> list[tuple[int, int, int]]:
    """(warps, stages, m_tiles) of each token tile size: the config's fields where set, else the rule. The rule
    (H200, bench/quant_matmul_sweep.py, Qwen3-8B shapes): N <= 8192 rows (too few 16-row blocks to fill 132 SMs
    at 4 warps) split K 8 ways; 1-8 tokens keep one 16-row tile a warp (4 units in flight where the ring stays
    within 100 KB a block, else 2), more tokens take two tiles with 2 units in flight; 9-16 tokens of wide layers
    split K 8 ways too."""
    small = op.out_features <= 8192
    out = []
    for i, nt in enumerate(TOKEN_TILES):
        mt = 1 if i == 0 else 2
        w = 8 if small or i == 1 else 4
        st = 4 if i == 0 and small and quant_matmul_smem(op, w, 4, mt, nt) <= 100 * 1024 else 2
        if cfg is not None:
            w = cfg.warps[i] if cfg.warps else w
            st = cfg.stages[i] if cfg.stages else st
            mt = cfg.m_tiles[i] if cfg.m_tiles else mt
        out.append((w, st, mt))
    return out


def quant_matmul_fits(op: ir.QuantMatmul, cfg: QuantMatmulConfig | None = None, limit: int = SMEM_LIMIT) -> bool:
    return all(quant_matmul_smem(op, w, st, mt, nt) <= limit
               for (w, st, mt), nt in zip(quant_matmul_tiles(op, cfg), TOKEN_TILES))


GEMV_TOKENS = (1, 2, 4, 8)  # tokens of the CUDA-core kernels (QuantGemv's NT)
GEMV_SMS = 132  # multiprocessors the CUDA-core rule fills (H200)
GEMV_TWO_BLOCKS = 113 * 1024  # shared memory a block where two blocks share a multiprocessor (228 KB, 1 KB each kept)


def quant_gemv_smem(op: ir.QuantMatmul, tokens: int, warps: int, stages: int, pair: int) -> int:
    """Shared memory of a block of the CUDA-core kernel (QuantGemv<...>::Layout<row bytes>::SMEM_BYTES); pair:
    units of 256 weights a stage."""
    f = op.format
    ub, rb = 256 // f.block * f.nbytes, op.in_features // f.block * f.nbytes
    wide = rb % 16 == 0 and ub % 16 == 0
    wmax, cw = (pair * ub // 16, 16) if wide else ((pair * ub + 5) // 4, 4)
    stride = ((wmax * cw + 15) // 16) | 1
    warp = stages * 32 * stride * 16 + pair * tokens * (256 + 16) * 4
    return max(warps * warp, warps * tokens * 32 * 4)


# the rule's gemv_tokens by format: the most tokens at which the CUDA-core kernel was at least as fast as the
# tensor-core kernel on most Qwen3-8B shapes (H200, bench/results/quant_gemv-2026-12-02.md)
GEMV_RULE_TOKENS = {"q8_0": 2, "q4_0": 1, "q4_1": 1, "q4_k": 2, "q5_k": 2, "q6_k": 1}


def quant_gemv_tiles(op: ir.QuantMatmul, cfg: QuantMatmulConfig | None = None) -> list[tuple[int, int, int, int]]:
    """(tokens, warps, stages, units a stage) of each CUDA-core kernel, up to gemv_tokens tokens (GEMV_RULE_TOKENS
    of the format by the rule; none for float32). The rule: 8 warps a block where the blocks of 32 rows fit one wave of
    GEMV_SMS blocks (one a multiprocessor), else 4 warps with two blocks a multiprocessor (all of a 6144-row
    layer's 192 blocks resident at once); two units a stage up to 2 tokens where two stages of them fit, else
    one; then the most stages (up to 4) that fit."""
    if op.dtype == "fp32":
        return []
    most = cfg.gemv_tokens if cfg is not None and cfg.gemv_tokens is not None else GEMV_RULE_TOKENS[op.weight_format]
    out = []
    for nt in GEMV_TOKENS:
        if nt > most:
            break
        w = 8 if -(-op.out_features // 32) <= GEMV_SMS else 4
        w = cfg.gemv_warps if cfg is not None and cfg.gemv_warps else w
        limit = SMEM_LIMIT if w == 8 else GEMV_TWO_BLOCKS
        pair = 2 if nt <= 2 and quant_gemv_smem(op, nt, w, 2, 2) <= limit else 1
        st = next((s for s in (4, 3, 2) if quant_gemv_smem(op, nt, w, s, pair) <= limit), 2)
        st = cfg.gemv_stages if cfg is not None and cfg.gemv_stages else st
        if quant_gemv_smem(op, nt, w, st, pair) > SMEM_LIMIT:
            break
        out.append((nt, w, st, pair))
    return out


def _quant_matmul(kernel: ir.Kernel, arch: str):
    """16-bit activations run on CUDA cores up to gemv_tokens tokens (quant_gemv_tiles) and on tensor cores
    beyond (quant_matmul_tiles), float32 on CUDA cores."""
    op = kernel.op
    cfg = kernel.config if isinstance(kernel.config, QuantMatmulConfig) else None
    if op.dtype != "fp32" and not quant_matmul_fits(op, cfg):
        raise ir.IRError("QuantMatmulConfig", f"{cfg} needs more than {SMEM_LIMIT} bytes of shared memory a block "
                                               f"for {op.weight_format}: fewer warps, stages or m_tiles")
    use_pdl = pdl(arch) and (cfg.pdl if cfg is not None else True)
    return "cuda/quant_matmul.cu.j2", dict(
        N=op.out_features, K=op.in_features, fmt=op.weight_format, fmt_enum=FMT_ENUMS[op.weight_format],
        c_type=ir.DTYPES[op.dtype].c, tensor_cores=op.dtype != "fp32", tiles=quant_matmul_tiles(op, cfg),
        gemv=quant_gemv_tiles(op, cfg), pdl=use_pdl)


def _dequantize(op: ir.Dequantize, arch: str):
    return "cuda/dequantize.cu.j2", dict(K=op.in_features, fmt=op.weight_format, fmt_enum=FMT_ENUMS[op.weight_format],
                                         c_type=ir.DTYPES[op.dtype].c, threads=256)


def _quantize_rows(op: ir.QuantizeRows, arch: str):
    vec = vector_width(op.hidden_size, ir.itemsize(op.dtype))
    chunks = op.hidden_size // vec
    threads = min(1024, max(32, _round_up(-(-chunks // 4), 32)))  # a row in registers, as rms_norm
    return "cuda/quantize_rows.cu.j2", dict(E=op.hidden_size, vec=vec, threads=threads, c_type=ir.DTYPES[op.dtype].c,
                                            q_type="int8_t" if op.out_dtype == "int8" else "uint8_t")


def _kv_score(op: ir.KVScore, arch: str):
    method = {"andpro": "ua::SCORE_ANDPRO", "attention": "ua::SCORE_ATTENTION", "value_norm": "ua::SCORE_VALUE_NORM"}
    return "cuda/kv_score.cu.j2", dict(q_type=ir.DTYPES[op.q_dtype].c, kv_type=ir.DTYPES[op.kv_dtype].c,
                                       method=method[op.method], threads=128, scale_c=_c_float(op.sm_scale))


def _gather_tokens(op: ir.GatherTokens, arch: str):
    return "cuda/gather_tokens.cu.j2", dict(kv_type=ir.DTYPES[op.kv_dtype].c, quantized=op.quantized)


CONTEXT_BUILDERS = {
    "reshape_and_cache": _reshape_and_cache,
    "copy_blocks": lambda op, arch: ("cuda/copy_blocks.cu.j2", _page_copy(op)),
    "swap_blocks": lambda op, arch: ("cuda/swap_blocks.cu.j2", _page_copy(op)),
    "merge_state": _merge_state,
    "paged_attention": _paged_attention,
    "rms_norm": _rms_norm,
    "silu_and_mul": _silu_and_mul,
    "rope": _rope,
    "qkv_rope_cache": _qkv_rope_cache,
    "quant_matmul": _quant_matmul,
    "dequantize": _dequantize,
    "quantize_rows": _quantize_rows,
    "kv_score": _kv_score,
    "gather_tokens": _gather_tokens,
}


def render_op(op: ir.OpSpec | ir.Kernel, arch: str = "sm_90") -> str:
    """The complete CUDA source (headers included by path) of a kernel (an op and its config; an op alone runs the
    default config) for arch, with its extern "C" launcher."""
    kernel = ir.as_kernel(op)
    op = kernel.op
    if op.kind not in CONTEXT_BUILDERS:
        raise ir.IRError("op", f"has no CUDA template: {op.kind!r} (have {sorted(CONTEXT_BUILDERS)})")
    builder_arg = kernel if op.kind in ("paged_attention", "reshape_and_cache", "quant_matmul") else op
    template, ctx = CONTEXT_BUILDERS[op.kind](builder_arg, arch)
    common = dict(op=op, symbol=kernel.symbol(), ns=f"{kernel.symbol()}_impl", signature=ir.c_signature(kernel))
    return environment().get_template(template).render(**common, **ctx)


def needs_sm90a(source: str) -> bool:
    return SM90A_MARKER in source
