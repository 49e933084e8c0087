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
from ..ir import DTYPES, check_splits

# the schedule knobs and the values each may take (0: the generator's built-in rule)
POW2 = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SHARED_BYTES = 49152  # static shared memory a CUDA block may hold (lower.tvm_cuda.cuda_target's limit)


@dataclass(frozen=True)
class TVMConfig:
    """num_splits, fused_merge: split-KV (see above).

    CPU (LLVM) schedule:
      grain: (token, q head) rows one parallel task takes (paged_attention), tokens one task takes
        (reshape_and_cache);
      dot_lanes: fp32 partial sums of the q.k dot product, vectorised (0: 8, 4 or 1 by head_dim);
      acc_vec: vector width of the softmax-weighted V accumulation over head_dim (0: all of head_dim);
      page_group: KV pages scored before one online-softmax update (the page walk's split factor);
      unroll_dot: unroll the dot product's loop over head_dim (quant_matmul: the loop over a row's blocks);
      rows: output rows one parallel task takes (quant_matmul, dequantize; 0: lower.tvm_quant's rule);
      token_tile: tokens quant_matmul multiplies into each decoded group of weights (0: lower.tvm_quant's rule).
    CUDA schedule (TVM's CUDA source):
      lanes: threads sharing one row of head_dim, a power of two (0: the most <= 32 dividing head_dim);
      threads: threads a block; threads // (lanes * heads) lane groups a q head take interleaved KV positions;
      vec: elements of a q / K / V row one load moves (1: scalar loads; a power of two dividing the elements a lane
        owns, head_dim // lanes, and at most 16 bytes of K/V), so nvcc emits 2- to 16-byte vector loads. Vector
        loads need q, k_cache and v_cache data pointers aligned to vec elements (torch's allocations are);
      heads: q heads of one KV head's group a block serves (1: one block a q head; a divisor of group_size). With
        heads > 1 the block stages each tile of K/V rows (the positions its lane groups take an iteration) in shared
        memory once and its heads (threadIdx.z) all compute from it, so a block reads each K/V row once for `heads`
        q heads.
    vec and heads at 1 are today's kernel: to_dict() leaves them out there, so those kernels keep their keys.
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
    vec: int = 1
    heads: int = 1
    rows: int = 0
    token_tile: int = 0

    def __post_init__(self):
        check_splits(self.num_splits, self.fused_merge, "TVMConfig")
        for name in ("unroll_dot",):
            if not isinstance(getattr(self, name), bool):
                raise IRError(f"TVMConfig.{name}", f"must be a bool, got {getattr(self, name)!r}")
        for name, lo in (("grain", 1), ("dot_lanes", 0), ("acc_vec", 0), ("page_group", 1), ("lanes", 0),
                         ("threads", 32), ("vec", 1), ("heads", 1), ("rows", 0), ("token_tile", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise IRError(f"TVMConfig.{name}", f"must be an int >= {lo}, got {v!r}")
        for name in ("dot_lanes", "acc_vec", "lanes", "threads", "vec"):
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
        TX = self.row_lanes(D)
        if op.kind != "paged_attention":
            for name in ("vec", "heads"):
                if getattr(self, name) != 1:
                    raise IRError(f"TVMConfig.{name}", f"is a paged_attention knob, must be 1 for {op.kind}")
            if self.threads < TX:
                raise IRError("TVMConfig.threads", f"must be >= lanes {TX}, got {self.threads}")
            return
        if self.threads < TX * self.heads:
            raise IRError("TVMConfig.threads", f"must be >= lanes {TX} x heads {self.heads}, got {self.threads}")
        if self.vec > 1:
            kv_bytes = DTYPES[op.kv_dtype].itemsize
            if (D // TX) % self.vec:
                raise IRError("TVMConfig.vec", f"must divide the {D // TX} elements a lane owns (head_dim {D} / "
                                               f"lanes {TX}), got {self.vec}")
            if self.vec * kv_bytes > 16:
                raise IRError("TVMConfig.vec", f"must load at most 16 bytes of {op.kv_dtype} K/V "
                                               f"(<= {16 // kv_bytes} elements), got {self.vec}")
        if self.heads > 1:
            G = op.group_size
            if G % self.heads:
                raise IRError("TVMConfig.heads", f"must divide the group size {G} (q heads a KV head), "
                                                 f"got {self.heads}")
        smem = self.shared_bytes(op)
        if smem > SHARED_BYTES:
            raise IRError("TVMConfig", f"lanes {TX}, threads {self.threads}, heads {self.heads} need {smem} bytes "
                                       f"of shared memory a block, over {SHARED_BYTES}")

    def shared_bytes(self, op) -> int:
        """Shared memory of one CUDA attention block: each lane group's softmax state (max, sum, acc[D]) for the
        merge, and with heads > 1 the staged K/V tile (a row a lane group of one head) with its scales."""
        D = op.head_dim
        NY = self.threads // (self.row_lanes(D) * self.heads)
        merge = self.heads * NY * (D + 2) * 4
        tile = NY * (2 * D * DTYPES[op.kv_dtype].itemsize + 2 * 4) if self.heads > 1 else 0
        return merge + tile

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
        """The fields, vec and heads left out at 1 and rows and token_tile at 0 (ir.Kernel's key hashes this, so
        kernels of the other ops keep their keys)."""
        d = asdict(self)
        for name, default in (("vec", 1), ("heads", 1), ("rows", 0), ("token_tile", 0)):
            if d[name] == default:
                del d[name]
        return d

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
