"""How the TVM lowerings run an op: a frozen config, separate from the op (the math).

    kernel = ir.Kernel(op, TVMConfig(num_splits=4, fused_merge=True))
    cpu_kernel(kernel)(**tensors)

TVMConfig.num_splits > 1 makes paged attention write split-KV partials (the op's split contract);
fused_merge merges them in the same kernel. The other fields are schedule knobs: they change how the
loops are split, vectorised, parallelised and bound to threads, never the result. They are the space
`uacompile tune` searches for the TVM lowerings (uacompile/tune_space.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ..errors import IRError
from ..ir import check_splits

# the schedule knobs and the values each may take (0: the generator's built-in rule)
POW2 = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class TVMConfig:
    """num_splits, fused_merge: split-KV (see above).

    CPU (LLVM) schedule:
      grain: (token, q head) rows one parallel task takes (paged_attention), tokens one task takes
        (reshape_and_cache);
      dot_lanes: fp32 partial sums of the q.k dot product, vectorised (0: 8, 4 or 1 by head_dim);
      acc_vec: vector width of the softmax-weighted V accumulation over head_dim (0: all of head_dim);
      page_group: KV pages scored before one online-softmax update (the page walk's split factor);
      unroll_dot: unroll the dot product's loop over head_dim.
    CUDA schedule (TVM's CUDA source):
      lanes: threads sharing one row of head_dim, a power of two (0: the most <= 32 dividing head_dim);
      threads: threads a block; threads // lanes lane groups take interleaved KV positions.
    """

    num_splits: int = 1
    fused_merge: bool = False
    grain: int = 1
    dot_lanes: int = 0
    acc_vec: int = 0
    page_group: int = 1
    unroll_dot: bool = False
    lanes: int = 0
    threads: int = 128

    def __post_init__(self):
        check_splits(self.num_splits, self.fused_merge, "TVMConfig")
        for name in ("unroll_dot",):
            if not isinstance(getattr(self, name), bool):
                raise IRError(f"TVMConfig.{name}", f"must be a bool, got {getattr(self, name)!r}")
        for name, lo in (("grain", 1), ("dot_lanes", 0), ("acc_vec", 0), ("page_group", 1), ("lanes", 0),
                         ("threads", 32)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise IRError(f"TVMConfig.{name}", f"must be an int >= {lo}, got {v!r}")
        for name in ("dot_lanes", "acc_vec", "lanes", "threads"):
            v = getattr(self, name)
            if v and v not in POW2:
                raise IRError(f"TVMConfig.{name}", f"must be 0 or a power of two, got {v}")
        if self.lanes > 32:
            raise IRError("TVMConfig.lanes", f"must be <= 32 (one warp shares a row), got {self.lanes}")
        if self.threads > 1024:
            raise IRError("TVMConfig.threads", f"must be <= 1024, got {self.threads}")

    def check(self, op) -> None:
        """Refuse knobs that do not fit the op (IRError naming the field)."""
        D = getattr(op, "head_dim", None)
        if D is None:
            return
        for name in ("dot_lanes", "acc_vec", "lanes"):
            v = getattr(self, name)
            if v and D % v:
                raise IRError(f"TVMConfig.{name}", f"must divide head_dim {D}, got {v}")
        if self.threads < self.row_lanes(D):
            raise IRError("TVMConfig.threads", f"must be >= lanes {self.row_lanes(D)}, got {self.threads}")

    # the values the generators use, rules applied
    def dot_lanes_for(self, head_dim: int) -> int:
        return self.dot_lanes or (8 if head_dim % 8 == 0 else 4 if head_dim % 4 == 0 else 1)

    def acc_vec_for(self, head_dim: int) -> int:
        return self.acc_vec or head_dim

    def row_lanes(self, head_dim: int) -> int:
        from .tvm_tir import lanes_for

        return lanes_for(head_dim, self.lanes or 32)

    def signature(self) -> dict:
        """The fields that change the kernel's parameters: the split fields, where there are splits (so a
        schedule-only config also serves the ops that have no splits)."""
        if self.num_splits == 1:
            return {}
        return dict(num_splits=self.num_splits, fused_merge=self.fused_merge)

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> "TVMConfig":
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def splits_of(kernel) -> tuple[int, bool]:
    """(num_splits, fused_merge) of a kernel's config (1, False without one)."""
    sig = kernel.signature()
    if sig.get("item_queue"):
        raise IRError("config.item_queue", "the TVM lowerings have no persistent schedule: build with item_queue=False")
    return sig.get("num_splits", 1), sig.get("fused_merge", False)


def schedule_of(kernel) -> TVMConfig:
    """A kernel's TVM schedule: its TVMConfig, or the default knobs for another target's config (or none)."""
    cfg = getattr(kernel, "config", None)
    if isinstance(cfg, TVMConfig):
        cfg.check(kernel.op)
        return cfg
    return TVMConfig()
