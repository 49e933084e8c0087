"""How the AscendC target runs an op: a frozen config, separate from the op (the math)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from uacompile.errors import IRError
from uacompile.ir import check_splits

TILES = (128, 64, 32, 16, 8, 4, 2, 1)


@dataclass(frozen=True)
class AscendConfig:
    """num_splits > 1: paged attention writes split-KV partials (merged by a merge_state op).
    tile: KV positions paged attention stages through the UB at a time (a power of two <= the page size; 0: the
    largest that fits the UB budget). block_dim: the blockDim cap, blocks sharing the work items by a grid-stride
    loop (0: every vector core of the part). Schedule fields: checked on the CPU emulator for correctness only."""

    num_splits: int = 1
    tile: int = 0
    block_dim: int = 0

    def __post_init__(self):
        check_splits(self.num_splits, False, "AscendConfig")
        if self.tile and self.tile not in TILES:
            raise IRError("AscendConfig.tile", f"must be 0 or one of {TILES}, got {self.tile!r}")
        if not isinstance(self.block_dim, int) or isinstance(self.block_dim, bool) or self.block_dim < 0:
            raise IRError("AscendConfig.block_dim", f"must be an int >= 0, got {self.block_dim!r}")

    def signature(self) -> dict:
        """The fields that change the kernel's parameters: the split count, where there are splits."""
        return dict(num_splits=self.num_splits) if self.num_splits > 1 else {}

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> "AscendConfig":
        return replace(self, **changes)


def config_of(kernel) -> AscendConfig:
    """A kernel's AscendConfig (the default where it has none, or another target's)."""
    cfg = getattr(kernel, "config", None)
    return cfg if isinstance(cfg, AscendConfig) else AscendConfig()
