"""A request in flight: its tokens, sampling parameters, and how far its KV cache has caught up."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .structured import Guide


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # not yet admitted, or preempted by recompute
    RUNNING = enum.auto()   # holds device pages
    SWAPPED = enum.auto()   # its pages live in the CPU swap pool
    RESTORING = enum.auto()  # admitted; its prefix is being copied back from the CPU offload tier
    FINISHED = enum.auto()


MAX_LOGPROBS = 20
SEED_RANGE = (0, (1 << 64) - 1)  # what torch.Generator.manual_seed takes


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """Per-request sampling knobs (vLLM's names). top_k = 0, top_p = 1, min_p = 0 and the neutral
    penalties (0, 0, 1) mean "off". logprobs = k returns the chosen token's log-probability and the
    k most likely (None: none); logit_bias maps token id -> value added to its logit; guided (a structured.Guide)
    holds the output to a JSON schema, regex, choice or grammar."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0                       # no EOS, stop token or stop string ends it before this many tokens
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    prompt_logprobs: int | None = None        # k: each prompt token's log-probability and the k most likely
    kv_budget: int | float | None = None      # KV eviction: tokens of cache kept (int) or a share of the prompt
    #                                           (float in (0, 1]); None: the engine's default (no eviction)
    guided: Guide | None = None               # structured output: the output is held to this constraint

    def __post_init__(self):
        def number_in(name, lo, hi, lo_open=False, hi_text=None):
            v = getattr(self, name)
            ok = _is_number(v) and (lo < v if lo_open else lo <= v) and v <= hi
            if not ok:
                lo_text = f"({lo}" if lo_open else f"[{lo}"
                raise ValueError(f"{name} must be a number in {lo_text}, {hi_text or hi}], got {v!r}")

        if not _is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        number_in("top_p", 0, 1, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        number_in("min_p", 0, 1)
        number_in("presence_penalty", -2, 2)
        number_in("frequency_penalty", -2, 2)
        number_in("repetition_penalty", 0, 100, lo_open=True)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an int in [0, 2**64 - 1] or None, got {self.seed!r}")
        if isinstance(self.stop, str):  # a lone string is the common mistake: accept it as one stop string
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, (list, tuple))
                                      or not all(isinstance(s, str) and s for s in self.stop)):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, (list, tuple))
                                                or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(k) and k >= 0 and _is_number(v) and -100 <= v <= 100
                    for k, v in self.logit_bias.items()):
                raise ValueError(f"logit_bias must map token ids >= 0 to numbers in [-100, 100], "
                                 f"got {self.logit_bias!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.prompt_logprobs is not None and not (_is_int(self.prompt_logprobs)
                                                     and 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}] or None, "
                             f"got {self.prompt_logprobs!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        b = self.kv_budget
        if b is not None and not ((_is_int(b) and b >= 1) or (isinstance(b, float) and 0 < b <= 1)):
            raise ValueError(f"kv_budget must be an int >= 1 (tokens), a float in (0, 1] (a share of the prompt) "
                             f"or None, got {b!r}")
        if self.guided is not None and not isinstance(self.guided, Guide):
            raise ValueError(f"guided must be a structured.Guide or None, got {type(self.guided).__name__}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")

    def budget_tokens(self, num_prompt_tokens: int, default: int | float | None = None) -> int | None:
        """The KV budget in tokens (kv_budget, else default; a share counts the prompt, at least 1), or None."""
        b = self.kv_budget if self.kv_budget is not None else default
        if b is None:
            return None
        return b if isinstance(b, int) else max(1, int(b * num_prompt_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing applied to the logits first and no log-probabilities asked: the token is the argmax."""
        return (self.greedy and not self.logit_bias and not self.has_penalties and self.logprobs is None
                and not self.min_tokens and self.guided is None)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def stop_cut(self, text: str, floor: int = 0) -> int | None:
        """Where the text ends at the earliest stop string whose match ends after `floor` characters (the text
        of the first min_tokens - 1 tokens): the match's start, or its end with include_stop_str_in_output.
        None: no stop string ends it."""
        best = None
        for s in self.stop or ():
            i = text.find(s, max(0, floor - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(s))
        if best is None:
            return None
        return best[1] if self.include_stop_str_in_output else best[0]

    def check_vocab(self, vocab_size: int) -> None:
        """logit_bias may only name token ids in [0, vocab_size)."""
        bad = [t for t in self.logit_bias or {} if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation stream. K/V of token_ids[:num_computed_tokens] have been computed; the cache holds kv_len of
    them: all but num_evicted, which KV eviction dropped. Token i sits at position i (RoPE, max_model_len) whatever
    was evicted; the cache slot of a token computed after the last eviction is its position - num_evicted."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0                       # lower number = more important
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0            # tokens whose K/V were computed
    num_evicted: int = 0                    # of those, dropped from the cache by KV eviction
    block_table: list[int] = field(default_factory=list)  # device page ids, in order
    # additive extras (bookkeeping for metrics and the API; the engine may ignore them)
    num_cached_tokens: int = 0              # prefix-cache hit on first admission
    num_preemptions: int = 0
    finish_reason: str | None = None        # "stop" | "length" | "abort", set by whoever finishes it
    parent_id: int | None = None            # set on forked children (n > 1)
    # params.prompt_logprobs: entry p is token p + 1's (a TokenLogprob), filled in as the prompt is computed
    prompt_logprobs: list = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.token_ids, list):
            self.token_ids = list(self.token_ids)
        if not 0 < self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(f"num_prompt_tokens must be in [1, len(token_ids)={len(self.token_ids)}], "
                             f"got {self.num_prompt_tokens}")

    @property
    def kv_len(self) -> int:
        """Tokens in the cache: what attention reads."""
        return self.num_computed_tokens - self.num_evicted

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
