"""How the CUDA target runs an op: frozen configs, separate from the op (the math).

    from uacompile.targets.cuda.config import AttentionConfig
    kernel = ir.Kernel(op, AttentionConfig(num_splits=4, fused_merge=True, decode_only=True))

A field here changes speed, never the result (split-KV partials aside: their layout is the split
contract in ir.PagedAttention's docstring). plan.plan() picks a config for a step's shapes; an
explicit one overrides it. This is the space `uacompile tune` searches.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from uacompile import ir
from uacompile.errors import IRError


@dataclass(frozen=True)
class AttentionConfig:
    """Paged attention on CUDA.

    num_splits: split-KV count (> 1: partials, merged by fused_merge in the same launch or by merge_state).
    fused_merge: the last split of a (token, KV head) merges the partials (workspace split_counters).
    decode_only: every token is its own decode item; the kernel has no prefill path (decode steps).
    item_queue: Hopper prefill blocks are persistent and take work items from a counter (workspace item_queue);
        only on the wgmma path (plan.py turns it off elsewhere).
    The rest default to None, the built-in rule (layout.py):
    wg_tile: (K/V positions a wgmma tile, TMA stages) of the Hopper prefill path.
    cp_row_lanes: producer lanes copying one K/V row where pages are copied by cp.async (a power of two <= 8).
    cp_producer_below: pages under this many positions are copied by cp.async from the producer warps, not TMA.
    q_prefetch_min: bytes of a token's Q rows from which the V producer prefetches them into L2.
    """

    num_splits: int = 1
    fused_merge: bool = False
    decode_only: bool = False
    item_queue: bool = False
    wg_tile: tuple[int, int] | None = None
    cp_row_lanes: int | None = None
    cp_producer_below: int | None = None
    q_prefetch_min: int | None = None

    def __post_init__(self):
        ir.check_splits(self.num_splits, self.fused_merge, "AttentionConfig")
        for name in ("decode_only", "item_queue"):
            if not isinstance(getattr(self, name), bool):
                raise IRError(f"AttentionConfig.{name}", f"must be a bool, got {getattr(self, name)!r}")
        if self.decode_only and self.item_queue:
            raise IRError("AttentionConfig.decode_only", "has no prefill blocks to take items: item_queue=False")
        if self.wg_tile is not None:
            if not (isinstance(self.wg_tile, tuple) and len(self.wg_tile) == 2 and self.wg_tile[0] in (64, 128, 192, 256)
                    and self.wg_tile[1] in (1, 2, 3, 4, 5, 6)):
                raise IRError("AttentionConfig.wg_tile", f"must be (64 | 128 | 192 | 256 positions, 1-6 stages), "
                                                         f"got {self.wg_tile!r}")
        if self.cp_row_lanes is not None and self.cp_row_lanes not in (1, 2, 4, 8):
            raise IRError("AttentionConfig.cp_row_lanes", f"must be 1, 2, 4 or 8, got {self.cp_row_lanes!r}")
        for name in ("cp_producer_below", "q_prefetch_min"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise IRError(f"AttentionConfig.{name}", f"must be an int >= 0, got {v!r}")

    def signature(self) -> dict:
        """The fields that change the kernel's parameters (ir.PagedAttention.params)."""
        return dict(num_splits=self.num_splits, fused_merge=self.fused_merge, item_queue=self.item_queue)

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> "AttentionConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class ReshapeConfig:
    """reshape_and_cache on CUDA; None leaves a field to the built-in rule (render.py's _reshape_and_cache).

    rows: K/V heads a step (a cap: the largest divisor of Hkv not above it); steps: steps a task (rows * steps
    divides Hkv); threads a block; waves: grid cap in resident-block waves (0: one task a lane group);
    min_blocks: __launch_bounds__ minimum; stages: steps in flight through shared memory by cp.async (0: a
    register double buffer); fast_quant; neox: "paired" | "reload" (RoPE's rotate-half partner); group: lanes a
    row (a power of two, at most the rule's); quant: "classic" | "lean"; amax: "bits" | "packed" (with lean);
    prefetch: L2 prefetch this many tokens ahead (0: off); oneshot: with waves=0, a warp's one round known at
    compile time.
    """

    rows: int | None = None
    steps: int | None = None
    threads: int | None = None
    waves: int | None = None
    min_blocks: int | None = None
    stages: int | None = None
    fast_quant: bool | None = None
    neox: str | None = None
    group: int | None = None
    quant: str | None = None
    amax: str | None = None
    prefetch: int | None = None
    oneshot: bool | None = None

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name in ("neox", "quant", "amax"):
                allowed = {"neox": ("paired", "reload"), "quant": ("classic", "lean"), "amax": ("bits", "packed")}
                if v not in allowed[f.name]:
                    raise IRError(f"ReshapeConfig.{f.name}", f"must be one of {allowed[f.name]}, got {v!r}")
            elif f.name in ("fast_quant", "oneshot"):
                if not isinstance(v, bool):
                    raise IRError(f"ReshapeConfig.{f.name}", f"must be a bool, got {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise IRError(f"ReshapeConfig.{f.name}", f"must be an int >= 0, got {v!r}")

    def overrides(self) -> dict:
        """The fields set (the rest are the rule's)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def parse(cls, text: str) -> "ReshapeConfig":
        """From "rows=4,oneshot=1" (a sweep's candidate): ints, 0/1 for the bools, words for the rest."""
        types = {f.name: f.type for f in fields(cls)}
        out = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, _, value = item.partition("=")
            if key not in types:
                raise IRError(f"ReshapeConfig.{key}", f"is not a field; fields: {sorted(types)}")
            out[key] = (value if key in ("neox", "quant", "amax") else bool(int(value))
                        if key in ("fast_quant", "oneshot") else int(value))
        return cls(**out)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class QuantMatmulConfig:
    """quant_matmul on CUDA (uacompile/quant_matmul.cuh's tensor-core kernel; the float32 op runs on CUDA cores
    and takes no config). Each field holds one value a token tile size, the kernels of 1-8, 9-16, 17-32 and 33+
    tokens (an int sets all four); None leaves it to the built-in rule (render.quant_matmul_tiles, from the
    H200 sweep of bench/quant_matmul_sweep.py).

    warps: warps a block, splitting K into units of 256 weights (added up in the block at the end).
    stages: units a warp has in flight (cp.async into shared memory), 2-8.
    m_tiles: 16-row weight tiles a warp (1, 2 or 4): more rows a warp reuse each activation fragment more.

    Up to gemv_tokens tokens (0, 1, 2, 4 or 8; None: the format's render.GEMV_RULE_TOKENS) run on CUDA cores instead
    (QuantGemv: 32 rows a block, kernels of 1, 2, 4 and 8 tokens); gemv_warps (4 or 8) and gemv_stages (2-4) set
    its warps a block and stages in flight a warp.
    pdl: both kernels launch with programmatic dependent launch on Hopper (their first weights load while the
    kernel before them drains).
    """

    warps: tuple[int, int, int, int] | int | None = None
    stages: tuple[int, int, int, int] | int | None = None
    m_tiles: tuple[int, int, int, int] | int | None = None
    gemv_tokens: int | None = None
    gemv_warps: int | None = None
    gemv_stages: int | None = None
    pdl: bool = True

    def __post_init__(self):
        for name, ok in {"gemv_tokens": (0, 1, 2, 4, 8), "gemv_warps": (4, 8), "gemv_stages": (2, 3, 4)}.items():
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or v not in ok):
                raise IRError(f"QuantMatmulConfig.{name}", f"must be one of {ok} or None, got {v!r}")
        if not isinstance(self.pdl, bool):
            raise IRError("QuantMatmulConfig.pdl", f"must be a bool, got {self.pdl!r}")
        allowed = {"warps": (1, 2, 4, 8), "stages": tuple(range(2, 9)), "m_tiles": (1, 2, 4)}
        for name, ok in allowed.items():
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, int) and not isinstance(v, bool):
                v = (v,) * 4
                object.__setattr__(self, name, v)
            if not (isinstance(v, tuple) and len(v) == 4 and all(isinstance(x, int) and x in ok for x in v)):
                raise IRError(f"QuantMatmulConfig.{name}", f"must be one of {ok} or 4 of them (a token tile size "
                                                           f"each), got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def config_of(kernel: ir.Kernel) -> AttentionConfig:
    """A paged-attention kernel's config (the default one where none is given)."""
    return kernel.config if kernel.config is not None else AttentionConfig()


__all__ = ["AttentionConfig", "QuantMatmulConfig", "ReshapeConfig", "config_of"]
