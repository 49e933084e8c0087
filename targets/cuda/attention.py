"""CUDA paged attention: template context, split-KV choice, and the call function.

    from uacompile.targets.cuda.attention import paged_attention
    out = paged_attention(op, q, k_cache, v_cache, token_seq, page_table, token_kv_len)

One template (templates/cuda/paged_attention.cu.j2) serves decode tokens, prefill chunks
and mixed ubatches in one launch; `template_context(op, arch)` is its context builder (render.py
calls it). On Hopper (sm_90) prefill tiles of 16-bit KV with head_dim 64, 80, 96, 128 or 256 (80 and
96 padded to 128 columns in shared memory: wgmma_width) run on wgmma with TMA loads (pages under 8
positions: cp.async from the producer warps) (templates/cuda/attention_wgmma.cuh.j2, built for sm_90a); everything else runs the mma.sync path, which every arch from sm_80 has. With num_splits > 1 the kernel writes split-KV
partials, and with fused_merge (what `paged_attention()` builds) the last split of each (token,
KV head) merges them in the same launch (`fused_merge=False`: merge_state, the plumbing template,
as a second launch); `paged_attention()` picks the split count from the shapes alone (so a CUDA
graph capture fixes it) and keeps the partial and counter workspaces cached.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from uacompile import ir
from uacompile.errors import IRError

TEMPLATE = "cuda/paged_attention.cu.j2"
WARPS = 4  # warps of a decode group, and of a block on the mma.sync path
WG_WARPS = 8  # consumer warps of a block on the wgmma path (+ a producer warpgroup): two warpgroups share each K/V tile; two decode groups
# wgmma tiles by the padded width (wgmma_width): (K/V positions per tile, TMA stages); the stages fill the
# shared memory that the 8-warp decode blocks of the same kernel take anyway. D 64: 192 positions halve the per-tile
# barriers and row reductions a position against 128 (H200, session 14, 4x4096 causal: 0.81x -> 0.86x SDPA)
WG_TILE = {128: (128, 3), 64: (192, 4), 256: (64, 2)}
WG_HEAD_DIMS = (64, 80, 96, 128, 256)  # head dims on the wgmma path (80 and 96 padded to 128 columns)
DECODE_TILE = 16  # K/V positions per warp tile in decode blocks
MIN_SPLIT_LEN = 256  # a split shorter than this spends more on its merge than it gains
MAX_SPLITS = 64
FULL_WAVE = 0.9  # prefill: items covering this share of the resident block slots keep every SM busy
WAVE_FILL_SLACK = 0.05  # decode: the fewest splits whose waves are within this of the best fill
MANY_WAVES = 4  # decode: items filling this many waves already leave little idle at the end
SMEM_PER_SM = 228 * 1024  # H100 / H200 (sm_90); 1 KB of it is reserved per block
# shared memory of an SM and a block's opt-in maximum, by arch (the CUDA programming guide's table): A100 and Orin;
# GA10x and Ada; anything else (sm_90 and newer data-centre parts) the H100's
SMEM_OF = {"sm_80": (164 * 1024, 163 * 1024), "sm_87": (164 * 1024, 163 * 1024),
           "sm_86": (100 * 1024, 99 * 1024), "sm_89": (100 * 1024, 99 * 1024)}
BLOCK_SMEM = 227 * 1024  # sm_90
STATIC_SMEM = 1024  # the template's static __shared__ (merge flags, range_smem, mbarriers): ptxas says 256-512 bytes
H200_SMS = 132


@dataclass(frozen=True)
class Layout:
    """Tile shapes and shared memory of one variant (the template checks smem_bytes)."""

    bn_prefill: int  # K/V positions per prefill tile
    mt_prefill: int  # 16-row mma tiles per warp in prefill blocks
    kv_rows: int  # K/V rows of one shared-memory stage
    stages: int  # cp.async pipeline depth
    smem_bytes: int
    min_blocks: int  # __launch_bounds__ minimum blocks per SM (a register cap)
    warps: int = WARPS  # of a block
    wgmma: bool = False  # prefill tiles on wgmma + TMA (sm_90a)
    bn_wg: int = 0  # K/V positions per wgmma tile
    stages_wg: int = 0  # TMA stages
    smem_prefill: int = 0  # the wgmma stages' shared memory (0: none)
    sm_smem: int = SMEM_PER_SM  # of the arch's SM (smem_per_sm)

    @property
    def prefill_rows(self) -> int:
        """Query rows of one prefill block: (token, head of the group) pairs."""
        return 16 * self.warps * (1 if self.wgmma else self.mt_prefill)

    @property
    def decode_groups(self) -> int:
        """Decode items a block runs side by side (4 warps each)."""
        return self.warps // WARPS

    @property
    def blocks_per_sm(self) -> int:
        return max(1, min(self.sm_smem // (self.smem_bytes + 1024 + 1024), self.min_blocks))


def check(op: ir.PagedAttention) -> None:
    """IRError for what the CUDA template does not cover (the IR allows more)."""
    if op.q_dtype not in ("fp16", "bf16"):
        raise IRError("paged_attention.q_dtype", f"the CUDA template takes fp16 or bf16, got {op.q_dtype}")
    if op.kv_dtype == "fp32":
        raise IRError("paged_attention.kv_dtype", "the CUDA template takes fp16, bf16, int8 or fp8_e4m3 KV, got fp32")
    if op.head_dim % 16 or not 16 <= op.head_dim <= 256:
        raise IRError("paged_attention.head_dim", f"the CUDA template needs a multiple of 16 in [16, 256], got {op.head_dim}")
    if op.group_size > 16:
        raise IRError("paged_attention.num_q_heads",
                      f"the CUDA template needs num_q_heads / num_kv_heads <= 16, got {op.group_size}")
    if op.variant == "unified_masked" and op.num_splits != 1:
        raise IRError("paged_attention.num_splits", f"unified_masked is built with num_splits=1, got {op.num_splits}")


def _smem_of(arch: str) -> tuple[int, int]:
    """(an SM's shared memory, a block's opt-in maximum) of arch: SMEM_OF, else the H100's."""
    return SMEM_OF.get(arch, (SMEM_PER_SM, BLOCK_SMEM))


def smem_per_sm(arch: str) -> int:
    """Shared memory of one SM of arch (SMEM_OF)."""
    return _smem_of(arch)[0]


def block_smem(arch: str) -> int:
    """The most dynamic shared memory one block of arch may take (SMEM_OF), less STATIC_SMEM for the template's
    static __shared__ variables."""
    return _smem_of(arch)[1] - STATIC_SMEM


@functools.lru_cache(maxsize=None)  # asked on every paged_attention() call; a refusal raises and is not kept
def check_fits(op: ir.PagedAttention, arch: str) -> None:
    """IRError where the op's blocks need more shared memory than one block of arch may take even at one cp.async
    stage (layout), which a launch would otherwise report as a bare CUDA error."""
    need, limit = layout(op, arch).smem_bytes, block_smem(arch)
    if need > limit:
        raise IRError("paged_attention.head_dim",
                      f"this variant's blocks take {need / 1024:.0f} KB of shared memory; an {arch} block at most "
                      f"{limit / 1024:.0f} KB (head_dim {op.head_dim}, {op.kv_dtype} KV, one cp.async stage)")


HOPPER_ARCHS = ("sm_90", "sm_90a")


def uses_wgmma(op: ir.PagedAttention, arch: str = "sm_90") -> bool:
    """Whether prefill tiles run the Hopper path: 16-bit KV of q's dtype (TMA copies it as is),
    head_dim in WG_HEAD_DIMS (wgmma_width), and not decode_only (no prefill tiles). Any page size: pages of >= 8
    positions are TMA boxes; smaller ones are copied by cp.async from the producer warps into the same swizzled
    layout (the template's CP_PRODUCER)."""
    return (arch in HOPPER_ARCHS and op.variant == "ua" and op.kv_dtype == op.q_dtype
            and op.head_dim in WG_HEAD_DIMS and not op.decode_only)


def wgmma_width(head_dim: int) -> int:
    """Columns of a K, V or Q row in the wgmma path's shared memory: head_dim rounded up to whole 64-column
    (128-byte swizzle) halves. TMA fills the columns past head_dim with zeros, S = Q K^T reads only the
    head_dim ones, and O += P V runs over all of them (the extra O columns stay zero and are not stored)."""
    return -(-head_dim // 64) * 64


def layout(op: ir.PagedAttention, arch: str = "sm_90") -> Layout:
    """The variant's tiles and shared memory on arch. Where a block would not fit the arch (A100: D 256, 165 KB
    against 163; GA10x / Ada: D 128, 102 KB against 99), fewer cp.async stages. Decode-only kernels keep the Q
    region as one more (DEC_QSTAGE) and prefill tiles share a stage two at a time, so both still stream 2 tiles
    deep; a mixed kernel's decode tokens stream 1 deep there."""
    for stage_cap in (3, 2, 1):
        lay = _layout(op, arch, stage_cap)
        if lay.smem_bytes <= block_smem(arch):
            break
    return lay


def _layout(op: ir.PagedAttention, arch: str, stage_cap: int) -> Layout:
    D = op.head_dim
    wgmma = uses_wgmma(op, arch)
    warps = WG_WARPS if wgmma else WARPS
    bn_prefill = 32  # two prefill tiles share a 64-row stage: a 4-deep pipeline in 2 stages' smem
    kv_rows = max(WARPS * DECODE_TILE, bn_prefill)
    # D 256 on the wgmma path: its two decode groups fit one SM's smem with one cp.async stage each (plus
    # the Q region, a second stage for decode warps: DEC_QSTAGE)
    stages = 1 if wgmma and D > 128 else 2
    tile = kv_rows * (D + 8) * 2
    quant_tiles = 2 * tile  # quantised KV: one converted K + V pair
    raw_stage = 2 * kv_rows * (D + 4) if op.quantized else 0
    mt_prefill = 2 if D <= 128 else 1  # 32 rows a warp halve smem reads per mma; D=256 lacks the registers
    min_blocks = 2 if D <= 128 else 1
    if op.decode_only:
        # one 4-warp decode group a block. 16-bit KV: the mixed kernel's smem (2 stages + the Q region as a
        # third), as many blocks an SM as it holds (below). Quantised KV, whose decode reads the raw stage (the
        # template's QFAST: D 64 or a multiple of 128), drops the converted tiles and half the Q rows for a third
        # raw stage and a third block an SM (the mixed kernel's prefill path holds it at 255 registers, 2 blocks).
        if op.quantized:
            stages, mt_prefill, min_blocks = 3, 1, 3 if D <= 128 else 2
            quant_tiles = 0 if D == 64 or D % 128 == 0 else 2 * tile  # else dequant_tile's converted pair
        else:
            mt_prefill = 2
    stages = min(stages, stage_cap)  # a smaller arch's block (layout)
    tiles = quant_tiles if op.quantized else 2 * stages * tile
    q_bytes = WARPS * 16 * mt_prefill * (D + 8) * 2  # resident Q rows (decode: its third K/V stage)
    combine = WARPS * 16 * (D + 4) * 4 + 2 * WARPS * 16 * 4
    smem = max(tiles + stages * raw_stage + q_bytes, combine)
    if op.decode_only and not op.quantized:
        # 16-bit decode-only: at least 2 blocks an SM, and as many as shared memory holds (D 64: 4, D 80: 3) up to 4:
        # the register cap stays >= 128, where ptxas fits these kernels without spills; the split rule then counts
        # the SM's real slots
        min_blocks = max(2, min(4, smem_per_sm(arch) // (smem + 2048)))
    if not wgmma:
        return Layout(bn_prefill, mt_prefill, kv_rows, stages, smem, min_blocks=min_blocks, sm_smem=smem_per_sm(arch))
    # wgmma: 2 consumer warpgroups x 64 rows share bn_wg-position K/V tiles (S: bn_wg / 2 registers a
    # thread, O: D / 2) that a third, producer warpgroup loads; TMA stages of K + V and the consumers'
    # Q rows, + 1 KB to align them; one 12-warp block a SM, whose decode items run as two 4-warp
    # groups, each with the mma.sync path's smem
    DW = wgmma_width(D)
    bn_wg, stages_wg = WG_TILE[DW]
    smem_prefill = stages_wg * 2 * bn_wg * DW * 2 + 2 * 64 * DW * 2 + 1024  # K + V stages, Q of 2 x 64 rows, alignment
    groups = warps // WARPS
    return Layout(bn_prefill, mt_prefill, kv_rows, stages, max(groups * smem, smem_prefill), min_blocks=1, warps=warps,
                  wgmma=True, bn_wg=bn_wg, stages_wg=stages_wg, smem_prefill=smem_prefill, sm_smem=smem_per_sm(arch))


def dynamic_prefill(op: ir.PagedAttention, arch: str = "sm_90") -> bool:
    """Whether prefill blocks are persistent and take their items from op's item_queue (the Hopper
    path with item_queue=True); else one prefill tile (x KV head x split group) a block."""
    return op.item_queue and uses_wgmma(op, arch)


def prefill_items(op: ir.PagedAttention, num_tokens: int, arch: str = "sm_90") -> int:
    """Prefill work items of a launch, as the template's launcher counts them: tiles of
    prefill_rows / group_size tokens x KV heads x split groups (a block runs the splits of a group
    one after another: decode_groups of them with split-KV). With dynamic_prefill, min(items, SMs)
    persistent blocks take them, so a block takes several when items exceed the SM count."""
    lay = layout(op, arch)
    split_group = lay.decode_groups if op.num_splits > 1 else 1
    return -(-num_tokens // (lay.prefill_rows // op.group_size)) * op.num_kv_heads * -(-op.num_splits // split_group)


def _c_float(x: float) -> str:
    return f"{float(x):.9e}f"


# ---------------------------------------------------------------- design knobs (launch choices)
# Choices paged_attention() reads through DESIGN_ENV ("prefill=static,decode=mixed"); the first value of
# each is the production choice.
DESIGN_ENV = "UACOMPILE_PA_VARIANT"
DESIGN_KNOBS = {
    # read by paged_attention(), not the render: "dynamic" launches Hopper-path ops with item_queue=True,
    # whose persistent prefill blocks take items from an atomic counter (bench/NOTES-attention.md v17:
    # 8x4096 0.80 -> 0.86x SDPA, 2x16384 0.93 -> 0.97x, interleaved timing, H200)
    "prefill": ("dynamic", "static"),
    # read by paged_attention(), not the render: "only" launches decode_only ops for launches of at most one
    # token a sequence (num_tokens <= num_seqs: a decode step), "mixed" the one kernel for every launch
    "decode": ("only", "mixed"),
}


def design_of(text: str | None = None) -> dict:
    """Knobs from "k=v,k=v" (default: $UACOMPILE_PA_VARIANT), production values for the rest.
    paged_attention() asks on every call (the prefill knob): the parse is cached per text."""
    import os

    return dict(_parse_design(os.environ.get(DESIGN_ENV, "") if text is None else text))


@functools.lru_cache(maxsize=64)
def _parse_design(text: str) -> tuple:
    design = {k: v[0] for k, v in DESIGN_KNOBS.items()}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition("=")
        if key not in DESIGN_KNOBS or value not in DESIGN_KNOBS[key]:
            raise ValueError(f"paged_attention design: {item!r} (knobs: {DESIGN_KNOBS})")
        design[key] = value
    return tuple(design.items())


def load_designs(designs: dict, ops: list, arch: str | None = None) -> dict:
    """{name: KernelLibrary or the exception its build raised}: one library a design ("k=v,..."),
    built in parallel spawned processes (loader.load_designs)."""
    from .loader import load_designs as load

    return load(DESIGN_ENV, designs, ops, arch)


def design_kernels(designs: dict, ops: list, arch: str | None = None) -> dict:
    """{name: kernel_of(op) -> CudaKernel of that design's library} for paged_attention(kernel_of=...), from
    load_designs; raises the first design's build failure."""
    from .api import CudaKernel

    libs = load_designs(designs, ops, arch)
    for lib in libs.values():
        if isinstance(lib, Exception):
            raise lib
    return {name: functools.cache(lambda op, lib=lib: CudaKernel(op, library=lib)) for name, lib in libs.items()}


# Per-shape choices of the template that are not part of the tile layout (the autotuner's to search, with Layout).
CP_PRODUCER_BELOW = 8  # Hopper path: pages under this many positions are copied by the producer warps' cp.async, not TMA


def cp_row_lanes(head_dim: int) -> int:
    """Hopper path, cp.async producer: lanes that copy one K/V row (the copies are issue-bound: each lane keeps >= 4
    16-byte chunks of the padded row)."""
    return 2 if wgmma_width(head_dim) == 64 else 4


Q_PREFETCH_MIN = 1024  # Hopper path: bytes of a token's Q rows (G * D * 2) from which the V producer prefetches them into L2


def pdl(arch: str) -> bool:
    """Whether the kernel launches with programmatic dependent launch (griddepcontrol, on the Hopper archs)."""
    return arch in HOPPER_ARCHS


def template_context(op: ir.PagedAttention, arch: str = "sm_90") -> tuple[str, dict]:
    check(op)
    lay = layout(op, arch)
    return TEMPLATE, dict(
        variant=op.variant, unified=op.variant == "unified_masked",
        Hq=op.num_q_heads, Hkv=op.num_kv_heads, D=op.head_dim, DW=wgmma_width(op.head_dim) if lay.wgmma else op.head_dim,
        P=op.page_size,
        q_dtype=op.q_dtype, kv_dtype=op.kv_dtype, q_ctype=ir.DTYPES[op.q_dtype][1], kv_ctype=ir.DTYPES[op.kv_dtype][1],
        quantized=op.quantized, num_splits=op.num_splits, write_lse=op.return_lse and op.num_splits == 1,
        window=op.window, softcap=op.softcap, softcap_c=_c_float(op.softcap or 1.0), alibi=op.alibi,
        scale_c=_c_float(op.sm_scale), bn_prefill=lay.bn_prefill, mt_prefill=lay.mt_prefill, kv_rows=lay.kv_rows, stages=lay.stages,
        smem_bytes=lay.smem_bytes, min_blocks=lay.min_blocks, prefill_rows=lay.prefill_rows, groups=lay.decode_groups,
        wgmma=lay.wgmma, decode_only=op.decode_only, pdl=pdl(arch), dynamic=dynamic_prefill(op, arch),
        bn_wg=lay.bn_wg, stages_wg=lay.stages_wg, smem_prefill=lay.smem_prefill,
        cp_producer_below=CP_PRODUCER_BELOW, cp_row_lanes=cp_row_lanes(op.head_dim), q_prefetch_min=Q_PREFETCH_MIN)


# ---------------------------------------------------------------- split-KV choice
def choose_splits(op: ir.PagedAttention, num_tokens: int, num_seqs: int, max_kv_len: int,
                  num_sms: int = H200_SMS, arch: str = "sm_90") -> int:
    """Occupancy-aware split count, from shapes only (graph-safe).

    Work items = blocks of one split: decode tokens (at most one per sequence) or prefill
    tiles, times KV heads; slots = items the GPU runs at once (resident blocks, times their
    decode groups on the Hopper path). Items of one split count take the same time, so they
    run in waves, and the last wave's empty slots are idle bandwidth: the wave fill of s splits
    is units / (waves * slots). The rule takes the fewest splits whose fill is within
    WAVE_FILL_SLACK of the best any count reaches (more splits: more block starts and merge
    traffic). H200 decode_sweep --extra (graph replay, session 5; GB/s by splits, fill):
    12 x 16384 2 (0.73) 3323, 4 (0.73) 3411, **8 (0.97) 3785**, 16 (0.97) 3630; 20 x 8192
    1 (0.61) 3047, 4 (0.81) 3413, **8 (0.97) 3608**, 16 (0.97) 3355; 8 x 16384 **4 (0.97)
    3808**, 8 (0.97) 3757. (Session 4's rule, a second wave only for splits of >= 1 MiB, took
    2 and 1 splits on the first two.)
    - No split for prefill items covering FULL_WAVE of the slots (causal tiles differ in
      length, so waves blur), nor for decode items filling MANY_WAVES waves (128 x 1024 at 3.88).
    Never a split shorter than MIN_SPLIT_LEN positions or more than MAX_SPLITS; on the Hopper path,
    whose blocks run two decode groups on consecutive splits, an even count.
    """
    if op.variant == "unified_masked" or num_tokens <= 0:
        return 1
    if op.window:
        max_kv_len = min(max_kv_len, op.window)
    decode_like = num_tokens <= 2 * num_seqs
    lay = layout(op, arch)
    tile_tokens = lay.prefill_rows // op.group_size
    items = (min(num_tokens, num_seqs) if decode_like else -(-num_tokens // tile_tokens)) * op.num_kv_heads
    slots = num_sms * lay.blocks_per_sm * (lay.decode_groups if decode_like else 1)
    if items >= (MANY_WAVES if decode_like else FULL_WAVE) * slots:
        return 1
    limit = min(MAX_SPLITS, max(1, max_kv_len // MIN_SPLIT_LEN))
    groups = lay.decode_groups if decode_like else 1  # a block's decode groups take consecutive splits
    counts = [s for s in range(1, limit + 1) if s == 1 or s % groups == 0]

    def fill(s: int) -> float:  # share of the waves' slots the (item, split) units take
        units = items * (s if s == 1 else -(-s // groups) * groups)
        return units / (-(-units // slots) * slots)

    best = max(fill(s) for s in counts)
    return next(s for s in counts if fill(s) >= best - WAVE_FILL_SLACK)


# ---------------------------------------------------------------- the call function
_workspaces: dict = {}


def _workspace(device, stream_id: int, splits: int, num_tokens: int, heads: int, head_dim: int):
    """o_partial / lse_partial, kept per (device, stream, shape): no allocation per call, and
    the same buffers in every replay of a captured graph."""
    import torch

    key = (str(device), stream_id, splits, num_tokens, heads, head_dim)
    ws = _workspaces.get(key)
    if ws is None:
        ws = (torch.empty((splits, num_tokens, heads, head_dim), dtype=torch.float32, device=device),
              torch.empty((splits, num_tokens, heads), dtype=torch.float32, device=device))
        _workspaces[key] = ws
    return ws


def _split_counters(device, stream_id: int, num_tokens: int, kv_heads: int):
    """fused_merge's counters, zeroed once and kept per (device, stream, shape): every launch
    leaves them zero again, so calls and graph replays on the stream reuse them as they are."""
    import torch

    key = (str(device), stream_id, "split_counters", num_tokens, kv_heads)
    counters = _workspaces.get(key)
    if counters is None:
        counters = _workspaces[key] = torch.zeros((num_tokens, kv_heads), dtype=torch.int32, device=device)
    return counters


def _item_queue(device, stream_id: int):
    """item_queue's two counters (next item, blocks done), zeroed once and kept per (device, stream):
    the last persistent block of every launch zeroes them again (graph replays too)."""
    import torch

    key = (str(device), stream_id, "item_queue")
    queue = _workspaces.get(key)
    if queue is None:
        queue = _workspaces[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return queue


def decode_launch(num_tokens: int, num_seqs: int, design: dict | None = None) -> bool:
    """Whether paged_attention() launches the decode_only op: at most one token a sequence by the shapes
    (a decode step; any ubatch would still be exact), unless the design's decode knob says mixed."""
    return (design or design_of())["decode"] == "only" and num_tokens <= num_seqs


def launch_splits(op: ir.PagedAttention, num_tokens: int, num_seqs: int, max_kv_len: int, num_sms: int = H200_SMS,
                  arch: str = "sm_90", design: dict | None = None) -> int:
    """The split count paged_attention() picks: choose_splits on the layout of the kernel it launches (the
    decode-only one for a decode step, decode_launch)."""
    run = op.replace(decode_only=decode_launch(num_tokens, num_seqs, design), item_queue=False)
    return choose_splits(run, num_tokens, num_seqs, max_kv_len, num_sms, arch)


def launched_op(op: ir.PagedAttention, num_splits: int, fused_merge: bool = True, arch: str = "sm_90",
                design: dict | None = None, decode_only: bool = False) -> ir.PagedAttention:
    """The op paged_attention() launches for `op` at num_splits (merge_state aside): the split
    fields, decode_only as given (decode_launch), and item_queue on the Hopper path when the
    design's prefill knob says dynamic."""
    design = design or design_of()
    op = op.replace(decode_only=decode_only, item_queue=False)
    if num_splits == 1:
        run = op.replace(num_splits=1, fused_merge=False)
    elif fused_merge:
        run = op.replace(num_splits=num_splits, fused_merge=True)
    else:
        run = op.replace(num_splits=num_splits, return_lse=False, fused_merge=False)
    return run.replace(item_queue=design["prefill"] == "dynamic" and uses_wgmma(run, arch))


def launch_plan(op: ir.PagedAttention, num_tokens: int, num_seqs: int, max_kv_len: int, num_splits: int | None = None,
                fused_merge: bool = True, num_sms: int = H200_SMS, arch: str = "sm_90",
                design: dict | None = None) -> tuple[ir.PagedAttention, int]:
    """(the op paged_attention() launches, its split count) for a launch's shapes: the decode-only kernel for a
    decode step (decode_launch), launch_splits' count unless num_splits is given, launched_op's fields."""
    design = design or design_of()
    if num_splits is None:
        num_splits = launch_splits(op, num_tokens, num_seqs, max_kv_len, num_sms, arch, design)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    decode_only = decode_launch(num_tokens, num_seqs, design)
    return launched_op(op, num_splits, fused_merge, arch, design, decode_only), num_splits


@functools.lru_cache(maxsize=None)
def _num_sms(device) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)  # asked on every paged_attention() call
def _arch(device) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def paged_attention(op: ir.PagedAttention, q, k_cache, v_cache, token_seq, page_table, token_kv_len, *,
                    k_scale=None, v_scale=None, alibi_slopes=None, out=None, lse=None, num_splits: int | None = None,
                    fused_merge: bool = True, kernel_of=None, design: dict | None = None):
    """Attention of a ubatch over the paged cache on torch's current stream; returns out
    (and lse when op.return_lse). num_splits=None picks split-KV from the shapes; the
    split count, item_queue and decode_only of `op` itself are ignored (launch_plan says what runs: with
    UACOMPILE_PA_VARIANT prefill=dynamic, the Hopper path takes the stream's item queue; a launch of at most
    one token a sequence runs the decode_only kernel unless decode=mixed). Tokens may come in any order (a sequence's
    tokens side by side share K/V loads as a prefill tile; a lone token is a decode item).
    With splits, fused_merge=False runs the partials and merge_state as two launches. kernel_of(op) gives
    the CudaKernel to launch (default api.kernel: this process's build; bench/decode_sweep.py passes another
    build's library); design: the knobs the call reads (decode, prefill; default design_of())."""
    import torch

    from .api import kernel as default_kernel

    kernel = kernel_of or default_kernel

    if not isinstance(op, ir.PagedAttention):
        raise TypeError(f"op must be an ir.PagedAttention, got {type(op).__name__}")
    check(op.replace(num_splits=1, fused_merge=False))
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, {op.num_q_heads}, {op.head_dim}], got shape {tuple(q.shape)}")
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be [num_seqs, max_pages], got shape {tuple(page_table.shape)}")
    T, S = q.shape[0], page_table.shape[0]
    arch = _arch(q.device)
    run, num_splits = launch_plan(op, T, S, page_table.shape[1] * op.page_size, num_splits, fused_merge,
                                  _num_sms(q.device), arch, design)
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, token_seq=token_seq, page_table=page_table,
                   token_kv_len=token_kv_len)
    if op.quantized:
        tensors.update(k_scale=k_scale, v_scale=v_scale)
    if op.alibi:
        tensors["alibi_slopes"] = alibi_slopes
    if out is None:
        out = torch.empty_like(q)
    if op.return_lse and lse is None:
        lse = torch.empty((T, op.num_q_heads), dtype=torch.float32, device=q.device)
    extra = dict(out=out, lse=lse) if op.return_lse else dict(out=out)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    check_fits(run, arch)
    if run.item_queue:
        tensors["item_queue"] = _item_queue(q.device, stream)
    if num_splits > 1:  # this stream's partials workspace
        o_part, lse_part = _workspace(q.device, stream, num_splits, T, op.num_q_heads, op.head_dim)
    if num_splits == 1:
        kernel(run)(**tensors, **extra)
    elif fused_merge:
        counters = _split_counters(q.device, stream, T, op.num_kv_heads)
        kernel(run)(**tensors, o_partial=o_part, lse_partial=lse_part, split_counters=counters, **extra)
    else:
        kernel(run)(**tensors, o_partial=o_part, lse_partial=lse_part)
        merge = ir.MergeState(num_heads=op.num_q_heads, head_dim=op.head_dim, num_splits=num_splits,
                              out_dtype=op.q_dtype, return_lse=op.return_lse)
        kernel(merge)(o_partial=o_part, lse_partial=lse_part, **extra)
    return (out, lse) if op.return_lse else out
