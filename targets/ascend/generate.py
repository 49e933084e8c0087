"""AscendC code generation: plan (tiling, UB budget, blockDim) and render the templates.

The plan is the one place for every size the kernel is built with: the templates take
their InitBuffer sizes, tile lengths and the blockDim cap from it, and Plan.check holds it
to the limits the emulator enforces (see README.md for the documentation of each): the UB
less an 8 KB scratch reserve, 8 queue buffers per TPosition, 64 buffers per kernel, 32 B
alignment, 40/48 vector cores. It runs before any source is written. What is verified: the generated kernels run
on this project's clean-room CPU emulator against the numpy reference; they have not
run on NPU hardware (see HARDWARE_VALIDATION.md).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jinja2

from uacompile.errors import IRError
from uacompile.ir import (DTYPES, CopyBlocks, Kernel, OpSpec, PagedAttention, ReshapeAndCache, SwapBlocks, as_kernel,
                          c_signature, itemsize)

from .config import TILES, config_of

UB_BYTES = 196_608  # Unified Buffer per vector core, 910B
UB_SCRATCH_RESERVE = 8192  # UB left free for API scratch space (emulator: kUbScratchReserve)
UB_BUDGET = UB_BYTES - UB_SCRATCH_RESERVE  # what a kernel's InitBuffer calls may take
MAX_QUEUE_BUFFERS_PER_POSITION = 8  # A2 has 8 event IDs; each freed TQue buffer holds one (TQue docs)
MAX_BUFFERS_PER_KERNEL = 64  # every InitBuffer'd buffer of a kernel (TPipe::InitBuffer docs)
MEMCPY_ALIGN = 64  # aclrtMemcpyAsync source / destination alignment (CANN 8.0)
ALIGN = 32  # DataCopy / UB alignment unit
HBM_BYTES_PER_S = 1.6e12  # 910B HBM, +-20% (roofline estimates only)
# vector (AIV) and cube (AIC) core counts of the 910B family, by CANN's SOC_VERSION name
SOCS = {"Ascend910B1": (48, 24), "Ascend910B2": (48, 24), "Ascend910B2C": (48, 24), "Ascend910B3": (40, 20),
        "Ascend910B4": (40, 20), "Ascend910B4-1": (40, 20)}
DEFAULT_SOC = "Ascend910B1"
QUEUE_POSITIONS = ("VECIN", "VECOUT")  # TQue positions; TBufs (VECCALC) hold no event IDs
STATUS = "generated and emulator-checked (clean-room CPU emulation of AscendC); not run on NPU hardware"
COPY_CHUNK_BYTES = 32 * 1024  # per buffer of the GM -> UB -> GM copy queue (x2: double buffered)

TEMPLATE_DIR = Path(__file__).resolve().parent.parent.parent / "templates"
EMULATOR_DIR = Path(__file__).resolve().parent / "emulator"


def _template_dir() -> Path:
    try:
        import uacompile.templates as t

        return Path(t.__file__).resolve().parent
    except ImportError:  # running from a source tree without the package mapping
        return TEMPLATE_DIR


@dataclass(frozen=True)
class Buffer:
    """One InitBuffer call: `num` buffers of `bytes` each (already rounded to 32 B) at a
    TPosition (VECIN / VECOUT for queues, counted on a TQueBind's source; VECCALC for a TBuf)."""

    name: str
    num: int
    bytes: int
    position: str = "VECCALC"

    @property
    def total(self) -> int:
        return self.num * self.bytes


@dataclass
class Plan:
    op: OpSpec
    soc: str
    max_block_dim: int  # blockDim = min(units, this); units computed on the host at launch
    buffers: dict[str, Buffer] = field(default_factory=dict)
    consts: dict = field(default_factory=dict)  # tile sizes etc. rendered as constexpr

    @property
    def ub_bytes(self) -> int:
        return sum(b.total for b in self.buffers.values())

    def add(self, name: str, bytes_: int, num: int = 1, position: str = "VECCALC") -> None:
        self.buffers[name] = Buffer(name, num, _round(bytes_), position)

    def queue_buffers(self) -> dict[str, int]:
        """Queue buffers per TPosition."""
        out = {pos: 0 for pos in QUEUE_POSITIONS}
        for b in self.buffers.values():
            if b.position in out:
                out[b.position] += b.num
        return out

    def check(self) -> "Plan":
        """The limits the emulator enforces, each with an IRError naming it."""
        kind = self.op.kind
        if self.ub_bytes > UB_BUDGET:
            raise IRError(f"{kind}.head_dim", f"UB budget: the AscendC kernel needs {self.ub_bytes} B of UB per core, over "
                                              f"the {UB_BUDGET} B a kernel may take ({UB_BYTES} B on the 910B less "
                                              f"{UB_SCRATCH_RESERVE} B scratch reserve)")
        for pos, n in self.queue_buffers().items():
            if n > MAX_QUEUE_BUFFERS_PER_POSITION:
                names = ", ".join(f"{b.name} {b.num}" for b in self.buffers.values() if b.position == pos)
                raise IRError(f"{kind}.plan", f"buffers per position: {n} queue buffers on {pos} ({names}), over the "
                                              f"{MAX_QUEUE_BUFFERS_PER_POSITION} event IDs a position has on A2")
        total = sum(b.num for b in self.buffers.values())
        if total > MAX_BUFFERS_PER_KERNEL:
            raise IRError(f"{kind}.plan", f"buffers per kernel: {total} InitBuffer'd buffers, over the "
                                          f"{MAX_BUFFERS_PER_KERNEL} a kernel may have")
        for b in self.buffers.values():
            if b.bytes % ALIGN or b.num < 1 or b.position not in ("VECCALC", *QUEUE_POSITIONS):
                raise IRError(f"{kind}.plan", f"buffer {b.name}: {b.num} x {b.bytes} B on {b.position} is not a whole "
                                              f"number of 32 B blocks on a vector position")
        vec_cores = SOCS[self.soc][0]
        if not 1 <= self.max_block_dim <= vec_cores:
            raise IRError("soc", f"blockDim cap {self.max_block_dim} outside [1, {vec_cores}] for {self.soc}")
        return self

    def to_dict(self) -> dict:
        return {"soc": self.soc, "max_block_dim": self.max_block_dim, "ub_bytes": self.ub_bytes,
                "ub_budget": UB_BUDGET, "queue_buffers": self.queue_buffers(),
                "buffers": [asdict(b) for b in self.buffers.values()], "consts": self.consts}


def _round(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _block_dim(kernel, soc: str) -> int:
    """The blockDim cap: the config's, else every vector core of the part (Plan.check holds it to them)."""
    return config_of(kernel).block_dim or SOCS[soc][0]


def _require(cond: bool, field_: str, rule: str) -> None:
    if not cond:
        raise IRError(field_, rule)


# ---------------------------------------------------------------- plans per op
def _plan_attention(op: PagedAttention, soc: str) -> Plan:
    k = op.kind
    _require(op.variant == "ua", f"{k}.variant", "the AscendC target implements only variant 'ua'")
    sig = op.signature()
    _require(not sig.get("fused_merge"), "config.fused_merge",
             "the AscendC target writes split-KV partials only (fused_merge=False); merge them in a second op")
    _require(not sig.get("item_queue"), "config.item_queue", "the AscendC target has no persistent schedule (item_queue=False)")
    _require(op.kv_dtype in ("fp16", "bf16", "fp32", "int8"), f"{k}.kv_dtype",
             f"the AscendC target supports fp16/bf16/fp32/int8 KV (910B has no fp8), got {op.kv_dtype}")
    D, G, Hkv = op.head_dim, op.group_size, op.num_kv_heads
    sq, skv = itemsize(op.q_dtype), itemsize(op.kv_dtype)
    for dt in (op.q_dtype, op.kv_dtype):
        _require(D * itemsize(dt) % ALIGN == 0, f"{k}.head_dim",
                 f"head_dim * sizeof({dt}) must be a multiple of 32 B for DataCopy, got {D}")
    _require((Hkv - 1) * D * skv // ALIGN <= 65535, f"{k}.num_kv_heads", "KV row gap exceeds DataCopy's 16-bit stride")
    partial = splits_of(op) > 1
    out_size = 4 if partial else sq
    with_lse = partial or op.return_lse
    cfg = config_of(op)
    _require(cfg.tile <= op.page_size, "AscendConfig.tile", f"must be <= page_size {op.page_size}, got {cfg.tile}")
    for tile in (cfg.tile,) if cfg.tile else TILES:
        if tile > op.page_size:
            continue
        srow = _round(tile, 8)  # score row: tile floats, padded to 32 B
        p = Plan(op, soc, _block_dim(op, soc))
        p.add("q", G * D * sq, 1, "VECIN")
        p.add("k", tile * D * skv, 2, "VECIN")
        p.add("v", tile * D * skv, 2, "VECIN")
        if op.quantized:
            p.add("scale", 2 * tile * ALIGN, 2, "VECIN")  # K then V scales, one per 32 B row (DataCopyPad)
            p.add("kv_half", tile * D * 2)  # int8 -> half -> float
        if op.kv_dtype != "fp32":
            p.add("kf", tile * D * 4)
            p.add("vf", tile * D * 4)
        p.add("qf", G * D * 4)
        p.add("acc", G * D * 4)
        p.add("score", srow * 4)
        p.add("red", tile * ALIGN)  # per-position ReduceSum results, 32 B apart
        p.add("tmp", D * 4)
        p.add("work", max(D, srow) * 4)
        p.add("small", ALIGN)
        if op.alibi:
            p.add("iota", srow * 4)
        if with_lse:
            p.add("lse_l", G * 4)
            p.add("lse_m", G * 4)
            p.add("lse_out", G * 4, 2, "VECOUT")
        p.add("out", D * out_size, 2, "VECOUT")
        p.consts = {"TILE": tile, "SROW": srow}
        if p.ub_bytes <= UB_BUDGET:
            return p.check()
    if cfg.tile:
        raise IRError("AscendConfig.tile", f"UB budget: a tile of {cfg.tile} positions does not fit the {UB_BUDGET} B "
                                           f"a kernel may take of the UB (head_dim={D}, group={G})")
    raise IRError(f"{k}.head_dim", f"UB budget: no KV tile fits the {UB_BUDGET} B a kernel may take of the UB "
                                   f"(head_dim={D}, group={G})")


def _plan_reshape(op: ReshapeAndCache, soc: str) -> Plan:
    k = op.kind
    _require(not op.rope, f"{k}.rope", "the AscendC target does not fuse RoPE yet (rope=True)")
    _require(op.kv_dtype in ("fp16", "bf16", "fp32", "int8"), f"{k}.kv_dtype",
             f"the AscendC target supports fp16/bf16/fp32/int8 KV (910B has no fp8), got {op.kv_dtype}")
    p = Plan(op, soc, _block_dim(op, soc))
    row = op.num_kv_heads * op.head_dim
    if not op.quantized:
        p.add("chunk", COPY_CHUNK_BYTES, 2, "VECIN")
        p.consts = {"CHUNK": COPY_CHUNK_BYTES // itemsize(op.dtype)}
        return p.check()
    _require(op.head_dim % 8 == 0, f"{k}.head_dim", f"int8 KV needs head_dim % 8 == 0 (32 B float rows), got {op.head_dim}")
    p.add("x_in", row * itemsize(op.dtype), 2, "VECIN")
    p.add("xf", row * 4)
    p.add("den", row * 4)  # |x|, then the per-head scale broadcast, then int32 / half views
    p.add("red", op.num_kv_heads * ALIGN)
    p.add("work", op.head_dim * 4)
    p.add("q_out", row, 2, "VECOUT")
    p.add("scale_out", op.num_kv_heads * 4, 2, "VECOUT")
    p.consts = {"ROW": row}
    return p.check()


def _plan_copy(op: CopyBlocks, soc: str) -> Plan:
    p = Plan(op, soc, _block_dim(op, soc))
    p.add("chunk", COPY_CHUNK_BYTES, 2, "VECIN")
    p.consts = {"CHUNK_BYTES": COPY_CHUNK_BYTES}
    return p.check()


def _plan_swap(op: SwapBlocks, soc: str) -> Plan:
    # host-side copies only (no kernel): every run starts on a page boundary, so pages must
    # keep aclrtMemcpyAsync's 64 B alignment
    page = op.page_size * op.num_kv_heads * op.head_dim * itemsize(op.kv_dtype)
    _require(page % MEMCPY_ALIGN == 0, f"{op.kind}.head_dim",
             f"a page of {page} B breaks aclrtMemcpyAsync's {MEMCPY_ALIGN} B alignment between pages")
    if op.quantized:
        scales = op.page_size * op.num_kv_heads * 4
        _require(scales % MEMCPY_ALIGN == 0, f"{op.kind}.page_size",
                 f"a page of {scales} B of scales breaks aclrtMemcpyAsync's {MEMCPY_ALIGN} B alignment between pages")
    return Plan(op, soc, 1)


PLANNERS = {"paged_attention": _plan_attention, "reshape_and_cache": _plan_reshape, "copy_blocks": _plan_copy,
            "swap_blocks": _plan_swap}


def splits_of(kernel: Kernel) -> int:
    return kernel.signature().get("num_splits", 1)


def soc_name(soc: str) -> str:
    """CANN's SOC_VERSION spelling of a 910B part, given in any case (ascend910b2c -> Ascend910B2C)."""
    names = {name.lower(): name for name in SOCS}
    if soc.lower() not in names:
        raise IRError("soc", f"must be one of {sorted(SOCS)} (any case), got {soc!r}")
    return names[soc.lower()]


def plan(op: OpSpec | Kernel, soc: str = DEFAULT_SOC) -> Plan:
    """The tiling / UB plan of a kernel (an op and its AscendConfig; an op alone: the default) for a 910B part;
    IRError when the target cannot build it."""
    op = as_kernel(op)
    soc = soc_name(soc)
    if op.kind not in PLANNERS:
        raise IRError("op", f"the AscendC target has no lowering for {op.kind}")
    return PLANNERS[op.kind](op, soc)


# ---------------------------------------------------------------- rendering
@dataclass
class KernelSources:
    symbol: str  # launcher: int <symbol>(void* tensors..., int64_t sizes..., aclrtStream)
    kernel: str | None  # the __global__ __aicore__ function, None for host-only ops
    files: dict[str, str]  # file name -> text
    plan: Plan
    meta: dict

    def write(self, out_dir) -> list[Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, text in self.files.items():
            (out / name).write_text(text)
            paths.append(out / name)
        return paths


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(_template_dir())), trim_blocks=True,
                              lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)


def _numel_expr(shape) -> str:
    return " * ".join(f"(uint64_t){d}" for d in shape) if shape else "1"


def _context(op: OpSpec, p: Plan) -> dict:
    tensors = [dict(name=t.name, ctype=DTYPES[t.dtype].ascendc, numel=_numel_expr(t.shape), role=t.role)
               for t in op.tensors()]
    ctx = dict(op=op, sym=op.symbol(), kernel=f"{op.symbol()}_kernel", plan=p, b=p.buffers, c=p.consts,
               tensors=tensors, sizes=[s.name for s in op.sizes()], status=STATUS,
               signature=c_signature(op, stream_type="aclrtStream"),
               op_json=json.dumps(op.to_dict(), sort_keys=True))
    if op.kind == "paged_attention":
        ctx.update(q_t=DTYPES[op.q_dtype].ascendc, kv_t=DTYPES[op.kv_dtype].ascendc, num_splits=splits_of(op),
                   out_t="float" if splits_of(op) > 1 else DTYPES[op.q_dtype].ascendc,
                   with_lse=splits_of(op) > 1 or op.return_lse, scale=repr(float(op.sm_scale)),
                   softcap=repr(float(op.softcap)))
    elif op.kind == "reshape_and_cache":
        ctx.update(in_t=DTYPES[op.dtype].ascendc, kv_t=DTYPES[op.kv_dtype].ascendc)
    elif op.kind in ("copy_blocks", "swap_blocks"):
        ctx.update(kv_t=DTYPES[op.kv_dtype].ascendc)
    return ctx


UNITS = {  # work items the blocks share (C expression over the tiling fields)
    "paged_attention": "t.num_tokens * {hkv} * {splits}",
    "reshape_and_cache": "t.num_tokens",
    "copy_blocks": "t.num_layers * 2 * t.num_pairs",
}


def generate(op: OpSpec | Kernel, soc: str = DEFAULT_SOC) -> KernelSources:
    """Render a kernel's (an op and its AscendConfig) AscendC sources: <sym>_kernel.cpp, <sym>_tiling.h,
    <sym>_host.cpp, CMakeLists.txt and <sym>.json (metadata)."""
    op = as_kernel(op)
    p = plan(op, soc)
    env = _env()
    ctx = _context(op, p)
    sym = ctx["sym"]
    files = {}
    if op.kind == "swap_blocks":
        kernel = None
        files[f"{sym}_host.cpp"] = env.get_template("ascend/swap_blocks.cpp.j2").render(ctx)
    else:
        kernel = ctx["kernel"]
        units = UNITS[op.kind].format(hkv=getattr(op, "num_kv_heads", 1), splits=splits_of(op))
        ctx.update(units=units)
        files[f"{sym}_tiling.h"] = env.get_template("ascend/tiling.h.j2").render(ctx)
        files[f"{sym}_kernel.cpp"] = env.get_template(f"ascend/{op.kind}.cpp.j2").render(ctx)
        files[f"{sym}_host.cpp"] = env.get_template("ascend/launcher.cpp.j2").render(ctx)
    files["CMakeLists.txt"] = env.get_template("ascend/CMakeLists.txt.j2").render(ctx)
    meta = {"target": "ascend", "op": op.to_dict(), "symbol": sym, "kernel": kernel, "plan": p.to_dict(),
            "launcher": c_signature(op, stream_type="aclrtStream"), "status": STATUS, "verified": "no",
            "speed": "no measured NPU speed; see roofline_estimate() (910B HBM ~1.6 TB/s +-20%)"}
    files[f"{sym}.json"] = json.dumps(meta, indent=2, sort_keys=True) + "\n"
    return KernelSources(sym, kernel, files, p, meta)


# ---------------------------------------------------------------- roofline
def roofline_estimate(op: OpSpec, **sizes) -> dict:
    """Bytes moved through HBM and the time that takes at 1.6 TB/s (+-20%): an estimate
    from the 910B's published figures, not a measurement."""
    if op.kind == "paged_attention":
        T, kv_len = sizes["num_tokens"], sizes["kv_len"]  # kv_len: positions read per (token, kv head)
        row = op.head_dim * itemsize(op.kv_dtype) + (4 if op.quantized else 0)
        moved = T * op.num_kv_heads * kv_len * 2 * row + 2 * T * op.num_q_heads * op.head_dim * itemsize(op.q_dtype)
    elif op.kind == "reshape_and_cache":
        row = op.num_kv_heads * op.head_dim
        moved = sizes["num_tokens"] * 2 * (row * itemsize(op.dtype) + row * itemsize(op.kv_dtype))
    elif op.kind == "copy_blocks":
        page = op.page_size * op.num_kv_heads * op.head_dim * itemsize(op.kv_dtype)
        moved = 2 * sizes["num_layers"] * 2 * sizes["num_pairs"] * page  # read + write
    else:
        raise ValueError(f"op: no HBM roofline for {op.kind} (swap_blocks is bound by the host link, not HBM)")
    t = moved / HBM_BYTES_PER_S
    return {"bytes": int(moved), "seconds": t, "seconds_range": [t / 1.2, t / 0.8], "basis": "910B HBM 1.6 TB/s +-20%",
            "measured": False}
