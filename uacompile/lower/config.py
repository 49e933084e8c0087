"""How the TVM lowerings run an op: a frozen config, separate from the op (the math).

    kernel = ir.Kernel(op, TVMConfig(num_splits=4, fused_merge=True))
    cpu_kernel(kernel)(**tensors)

TVMConfig.num_splits > 1 makes paged attention write split-KV partials (the op's split contract);
fused_merge merges them in the same kernel.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..ir import check_splits


@dataclass(frozen=True)
class TVMConfig:
    num_splits: int = 1
    fused_merge: bool = False

    def __post_init__(self):
        check_splits(self.num_splits, self.fused_merge, "TVMConfig")

    def signature(self) -> dict:
        return dict(num_splits=self.num_splits, fused_merge=self.fused_merge)

    def to_dict(self) -> dict:
        return asdict(self)


def splits_of(kernel) -> tuple[int, bool]:
    """(num_splits, fused_merge) of a kernel's config (1, False without one)."""
    sig = kernel.signature()
    if sig.get("item_queue"):
        from ..errors import IRError

        raise IRError("config.item_queue", "the TVM lowerings have no persistent schedule: build with item_queue=False")
    return sig.get("num_splits", 1), sig.get("fused_merge", False)
