"""How the CUDA target runs an op: frozen configs, separate from the op (the math).

    from uacompile.targets.cuda.config import AttentionConfig
    kernel = ir.Kernel(op, AttentionConfig(num_splits=4, fused_merge=True, decode_only=True))

A field here changes speed, never the result (split-KV partials aside: their layout is the split
contract in ir.PagedAttention's docstring). plan.plan() picks a config for a step's shapes; an
explicit one overrides it. This is the space `uacompile tune` searches.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

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
    """

    num_splits: int = 1
    fused_merge: bool = False
    decode_only: bool = False
    item_queue: bool = False

    def __post_init__(self):
        ir.check_splits(self.num_splits, self.fused_merge, "AttentionConfig")
        for name in ("decode_only", "item_queue"):
            if not isinstance(getattr(self, name), bool):
                raise IRError(f"AttentionConfig.{name}", f"must be a bool, got {getattr(self, name)!r}")
        if self.decode_only and self.item_queue:
            raise IRError("AttentionConfig.decode_only", "has no prefill blocks to take items: item_queue=False")

    def signature(self) -> dict:
        """The fields that change the kernel's parameters (ir.PagedAttention.params)."""
        return dict(num_splits=self.num_splits, fused_merge=self.fused_merge, item_queue=self.item_queue)

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> "AttentionConfig":
        return replace(self, **changes)


def config_of(kernel: ir.Kernel) -> AttentionConfig:
    """A paged-attention kernel's config (the default one where none is given)."""
    return kernel.config if kernel.config is not None else AttentionConfig()


__all__ = ["AttentionConfig", "config_of"]
