"""How the AscendC target runs an op: a frozen config, separate from the op (the math)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from uacompile.ir import check_splits


@dataclass(frozen=True)
class AscendConfig:
    """num_splits > 1: paged attention writes split-KV partials (merged by a merge_state op)."""

    num_splits: int = 1

    def __post_init__(self):
        check_splits(self.num_splits, False, "AscendConfig")

    def signature(self) -> dict:
        return dict(num_splits=self.num_splits)

    def to_dict(self) -> dict:
        return asdict(self)
