"""Paged attention's tiles, shared memory and limits on each CUDA arch (no torch, no build).

layout(op, config, arch) is the one place that sizes a kernel: the template's context (render.py), the split rule
(plan.py) and the fit check all read it. On Hopper (sm_90) prefill tiles of 16-bit KV with head_dim 64, 80, 96,
128 or 256 (80 and 96 padded to 128 columns in shared memory: wgmma_width) run on wgmma with TMA loads (pages
under 8 positions: cp.async from the producer warps); everything else runs the mma.sync path, which every arch
from sm_80 has.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass

from uacompile import ir
from uacompile.errors import IRError

from .config import AttentionConfig

TEMPLATE = "cuda/paged_attention.cu.j2"
WARPS = 4  # warps of a decode group, and of a block on the mma.sync path
WG_WARPS = 8  # consumer warps of a block on the wgmma path (+ a producer warpgroup): two warpgroups share each K/V tile; two decode groups
# the built-in rule's wgmma tiles by the padded width (wgmma_width): (K/V positions per tile, TMA stages); the stages
# fill the shared memory that the 8-warp decode blocks of the same kernel take anyway. D 64: 192 positions halve the
# per-tile barriers and row reductions a position against 128 (docs/attention-rationale.md). Read-only: a kernel
# that wants another tile says so in its config (AttentionConfig.wg_tile)
WG_TILE = types.MappingProxyType({128: (128, 3), 64: (192, 4), 256: (64, 2)})
WG_HEAD_DIMS = (64, 80, 96, 128, 256)  # head dims on the wgmma path (80 and 96 padded to 128 columns)
DECODE_TILE = 16  # K/V positions per warp tile in decode blocks
SMEM_PER_SM = 228 * 1024  # H100 / H200 (sm_90); 1 KB of it is reserved per block
# shared memory of an SM and a block's opt-in maximum, by arch (the CUDA programming guide's table): A100 and Orin;
# GA10x and Ada; anything else (sm_90 and newer data-centre parts) the H100's
SMEM_OF = {"sm_80": (164 * 1024, 163 * 1024), "sm_87": (164 * 1024, 163 * 1024),
           "sm_86": (100 * 1024, 99 * 1024), "sm_89": (100 * 1024, 99 * 1024)}
BLOCK_SMEM = 227 * 1024  # sm_90
STATIC_SMEM = 1024  # the template's static __shared__ (merge flags, range_smem, mbarriers): ptxas says 256-512 bytes
H200_SMS = 132
CP_PRODUCER_BELOW = 8  # Hopper path: pages under this many positions are copied by the producer warps' cp.async, not TMA
Q_PREFETCH_MIN = 1024  # Hopper path: bytes of a token's Q rows (G * D * 2) from which the V producer prefetches them
CONSUMER_REGS = 240  # Hopper path: registers a consumer thread may take (paged_attention.cuh's setmaxnreg CONSUMER_REGS)


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


def check(op: ir.PagedAttention, config: AttentionConfig | None = None) -> None:
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
    if config is not None and op.variant == "unified_masked" and config.num_splits != 1:
        raise IRError("AttentionConfig.num_splits", f"unified_masked is built with num_splits=1, got {config.num_splits}")


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


@functools.lru_cache(maxsize=None)  # a refusal raises and is not kept
def check_fits(op: ir.PagedAttention, config: AttentionConfig, arch: str) -> None:
    """IRError where the op's blocks need more shared memory than one block of arch may take even at one cp.async
    stage (layout), which a launch would otherwise report as a bare CUDA error, or where the Hopper prefill tile
    does not fit the op's pages (wgmma_tile_error), which nvcc would report as a failed static_assert."""
    lay = layout(op, config, arch)
    need, limit = lay.smem_bytes, block_smem(arch)
    if need > limit:
        tile = f", wgmma tile {lay.bn_wg} x {lay.stages_wg} stages" if lay.wgmma else ""
        raise IRError("AttentionConfig.wg_tile" if config.wg_tile and lay.smem_prefill > limit else "paged_attention.head_dim",
                      f"this variant's blocks take {need / 1024:.0f} KB of shared memory; an {arch} block at most "
                      f"{limit / 1024:.0f} KB (head_dim {op.head_dim}, {op.kv_dtype} KV, one cp.async stage{tile})")
    err = wgmma_tile_error(op, config, lay.bn_wg, lay.stages_wg) if lay.wgmma else None
    if err is not None:
        raise err


def wgmma_tile_error(op: ir.PagedAttention, config: AttentionConfig, bn: int, stages: int) -> IRError | None:
    """The IRError (returned, not raised) where the Hopper prefill path's tile of bn K/V positions in `stages` TMA
    stages and its producer do not fit the op's pages, as the template's static_asserts (paged_attention.cuh) say:
    a ring of >= 2 stages; TMA boxes of min(page, bn's lowest power of two) rows that tile bn, at most 192 of them;
    with the cp.async producer (pages under cp_producer_below, at most 8), cp_row_lanes of 2, 4 or 8 lanes dividing
    a row's 16-byte chunks, and the lanes' box groups covering the tile exactly. None where it fits."""
    P, DW = op.page_size, wgmma_width(op.head_dim)
    if stages < 2:
        return IRError("AttentionConfig.wg_tile", f"the wgmma path needs >= 2 TMA stages, got {stages}")
    below = cp_producer_below(config)
    if below > CP_PRODUCER_BELOW:
        return IRError("AttentionConfig.cp_producer_below",
                       f"must be <= {CP_PRODUCER_BELOW} (TMA boxes of fewer rows issue too slowly), got {below}")
    pb = min(P, bn & -bn)
    if bn % pb or bn // pb > 192:
        return IRError("AttentionConfig.wg_tile", f"a tile of {bn} positions is {bn / pb:g} TMA boxes of {pb} rows at "
                                                  f"page size {P} (whole boxes, at most 192)")
    if P >= below:
        return None
    lanes, group_rows = cp_row_lanes(op.head_dim, config), min(32 * P, bn)
    if lanes not in (2, 4, 8) or (DW // 8) % lanes or group_rows % (32 // lanes * 2):
        return IRError("AttentionConfig.cp_row_lanes",
                       f"the cp.async producer takes 2, 4 or 8 lanes a row dividing its {DW // 8} 16-byte chunks, "
                       f"got {lanes} (page size {P})")
    covered = -(-(bn // pb) // 32) * group_rows
    if covered != bn:
        return IRError("AttentionConfig.wg_tile", f"the cp.async producer's lanes cover {covered} rows of a {bn}-position "
                                                  f"tile at page size {P}")
    return None


HOPPER_ARCHS = ("sm_90", "sm_90a")


def uses_wgmma(op: ir.PagedAttention, config: AttentionConfig, arch: str = "sm_90") -> bool:
    """Whether prefill tiles run the Hopper path: 16-bit KV of q's dtype (TMA copies it as is),
    head_dim in WG_HEAD_DIMS (wgmma_width), and not decode_only (no prefill tiles). Any page size: pages of >= 8
    positions are TMA boxes; smaller ones are copied by cp.async from the producer warps into the same swizzled
    layout (the template's CP_PRODUCER)."""
    return (arch in HOPPER_ARCHS and op.variant == "ua" and op.kv_dtype == op.q_dtype
            and op.head_dim in WG_HEAD_DIMS and not config.decode_only)


def cp_row_lanes(head_dim: int, config: AttentionConfig | None = None) -> int:
    """Hopper path, cp.async producer: lanes that copy one K/V row (the copies are issue-bound: each lane keeps >= 4
    16-byte chunks of the padded row); the config's where it sets one."""
    if config is not None and config.cp_row_lanes is not None:
        return config.cp_row_lanes
    return 2 if wgmma_width(head_dim) == 64 else 4


def cp_producer_below(config: AttentionConfig | None = None) -> int:
    return CP_PRODUCER_BELOW if config is None or config.cp_producer_below is None else config.cp_producer_below


def q_prefetch_min(config: AttentionConfig | None = None) -> int:
    return Q_PREFETCH_MIN if config is None or config.q_prefetch_min is None else config.q_prefetch_min


def pdl(arch: str) -> bool:
    """Whether the kernel launches with programmatic dependent launch (griddepcontrol, on the Hopper archs)."""
    return arch in HOPPER_ARCHS


def wgmma_width(head_dim: int) -> int:
    """Columns of a K, V or Q row in the wgmma path's shared memory: head_dim rounded up to whole 64-column
    (128-byte swizzle) halves. TMA fills the columns past head_dim with zeros, S = Q K^T reads only the
    head_dim ones, and O += P V runs over all of them (the extra O columns stay zero and are not stored)."""
    return -(-head_dim // 64) * 64


@functools.lru_cache(maxsize=4096)
def layout(op: ir.PagedAttention, config: AttentionConfig, arch: str = "sm_90") -> Layout:
    """The variant's tiles and shared memory on arch. Where a block would not fit the arch (A100: D 256, 165 KB
    against 163; GA10x / Ada: D 128, 102 KB against 99), fewer cp.async stages. Decode-only kernels keep the Q
    region as one more (DEC_QSTAGE) and prefill tiles share a stage two at a time, so both still stream 2 tiles
    deep; a mixed kernel's decode tokens stream 1 deep there."""
    for stage_cap in (3, 2, 1):
        lay = layout_at(op, config, arch, stage_cap)
        if lay.smem_bytes <= block_smem(arch):
            break
    return lay


def layout_at(op: ir.PagedAttention, config: AttentionConfig, arch: str, stage_cap: int) -> Layout:
    """The layout with at most stage_cap cp.async stages (layout() takes the most that fit the arch)."""
    D = op.head_dim
    wgmma = uses_wgmma(op, config, arch)
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
    if config.decode_only:
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
    if config.decode_only and not op.quantized:
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
    bn_wg, stages_wg = config.wg_tile or rule_wg_tile(op, config)
    smem_prefill = stages_wg * 2 * bn_wg * DW * 2 + 2 * 64 * DW * 2 + 1024  # K + V stages, Q of 2 x 64 rows, alignment
    groups = warps // WARPS
    return Layout(bn_prefill, mt_prefill, kv_rows, stages, max(groups * smem, smem_prefill), min_blocks=1, warps=warps,
                  wgmma=True, bn_wg=bn_wg, stages_wg=stages_wg, smem_prefill=smem_prefill, sm_smem=smem_per_sm(arch))


def rule_wg_tile(op: ir.PagedAttention, config: AttentionConfig) -> tuple[int, int]:
    """The built-in Hopper prefill tile (K/V positions, TMA stages): WG_TILE by the padded width; where the op's
    pages do not tile it (D 64's 192 positions at pages of 4, copied by cp.async: wgmma_tile_error), the widest
    power-of-two tile below it that they do, with as many more stages as keep its shared memory."""
    bn, stages = WG_TILE[wgmma_width(op.head_dim)]
    if wgmma_tile_error(op, config, bn, stages) is None:
        return bn, stages
    for b in (128, 64):
        if b < bn and wgmma_tile_error(op, config, b, min(6, stages * bn // b)) is None:
            return b, min(6, stages * bn // b)
    return bn, stages  # check_fits names what is wrong


def dynamic_prefill(op: ir.PagedAttention, config: AttentionConfig, arch: str = "sm_90") -> bool:
    """Whether prefill blocks are persistent and take their items from the config's item_queue (the Hopper
    path with item_queue=True); else one prefill tile (x KV head x split group) a block."""
    return config.item_queue and uses_wgmma(op, config, arch)


def prefill_items(op: ir.PagedAttention, config: AttentionConfig, num_tokens: int, arch: str = "sm_90") -> int:
    """Prefill work items of a launch, as the template's launcher counts them: tiles of
    prefill_rows / group_size tokens x KV heads x split groups (a block runs the splits of a group
    one after another: decode_groups of them with split-KV). With dynamic_prefill, min(items, SMs)
    persistent blocks take them, so a block takes several when items exceed the SM count."""
    lay = layout(op, config, arch)
    split_group = lay.decode_groups if config.num_splits > 1 else 1
    return -(-num_tokens // (lay.prefill_rows // op.group_size)) * op.num_kv_heads * -(-config.num_splits // split_group)
