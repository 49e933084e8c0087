"""A request in flight: its tokens, sampling parameters, and how far its KV cache has caught up."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # not yet admitted, or preempted by recompute
    RUNNING = enum.auto()   # holds device pages
    SWAPPED = enum.auto()   # its pages live in the CPU swap pool
    FINISHED = enum.auto()


@dataclass
class SamplingParams:
    """Per-request sampling knobs (vLLM's names). top_k = 0 and top_p = 1 mean "off"."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= 2**64 - 1):
            raise ValueError(f"seed must be an int in [0, 2**64 - 1] or None, got {self.seed!r}")
        if isinstance(self.stop, str):  # a lone string is the common mistake: accept it as one stop string
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, (list, tuple))
                                      or not all(isinstance(s, str) and s for s in self.stop)):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, (list, tuple))
                                                or not all(is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation stream. K/V of token_ids[:num_computed_tokens] are in the cache."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0                       # lower number = more important
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0            # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)  # device page ids, in order
    # additive extras (bookkeeping for metrics and the API; the engine may ignore them)
    num_cached_tokens: int = 0              # prefix-cache hit on first admission
    num_preemptions: int = 0
    finish_reason: str | None = None        # "stop" | "length" | "abort", set by whoever finishes it
    parent_id: int | None = None            # set on forked children (n > 1)

    def __post_init__(self):
        if not isinstance(self.token_ids, list):
            self.token_ids = list(self.token_ids)
        if not 0 < self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(f"num_prompt_tokens must be in [1, len(token_ids)={len(self.token_ids)}], "
                             f"got {self.num_prompt_tokens}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens} "
                f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, "
                f"pages={self.block_table})")
