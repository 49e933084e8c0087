"""Structured output: a request's output constrained to a JSON schema, any JSON object, a regex, a list of choices
or a grammar (llama.cpp's GBNF, or Lark), with llguidance as the grammar engine.

    Guide.json_schema({...}) / Guide.json_object() / Guide.regex("...") / Guide.choice([...]) / Guide.grammar("...")

A Guide is what SamplingParams.guided holds: the constraint as text, hashable. Grammars (one per tokenizer) compiles
a Guide once into an llguidance matcher (an LRU cache keyed by the Guide; compile() is safe to call from any thread,
so a server compiles off its event loop) and copies that matcher for each sequence. GuideStates keeps the
engine's matchers, one per sequence: fill() computes the next-token bitmask of a batch's sequences (one int32 word
per 32 tokens, bit t % 32 of word t // 32 set where token t is allowed; in a worker thread, started before the
forward pass and joined by the sampler, except on a CPU engine whose kernels take every core), advance() consumes
each accepted token, release() drops a finished or aborted sequence's matcher. apply_token_bitmask() masks logits
to -inf where a bit is clear, as torch ops on the logits' device (numpy on the calling thread for host logits).

A JSON schema is compiled with the separators ", " and ": " and no other whitespace: a small model cannot run on
in blank space, and the text reads as json.dumps writes it.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("uacompile.runtime.structured")
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL = "structured output needs llguidance: pip install llguidance (or the serve extra: pip install 'uacompile[serve]')"


@dataclass(frozen=True)
class Guide:
    """A constraint on a request's output. kind: json_schema (spec: the schema as JSON text), json_object (any
    JSON object), regex, choice (spec: a JSON list of the strings allowed), grammar (llama.cpp's GBNF or a Lark
    grammar, llguidance's syntax). Build one with the class methods; ValueError on a malformed spec."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"guided kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"a guide's spec must be a str, got {type(self.spec).__name__}")

    @classmethod
    def json_schema(cls, schema: "dict | str") -> "Guide":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise ValueError("the JSON schema is not valid JSON") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Guide":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Guide":
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("a guided regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list) -> "Guide":
        if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("guided choices must be a non-empty list of strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, text: str) -> "Guide":
        """llama.cpp's GBNF (a `root ::= ...` rule) or a Lark grammar (a `start:` rule)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a grammar must be a non-empty string")
        return cls("grammar", text)

    def describe(self) -> str:
        return self.kind if not self.spec else f"{self.kind} ({len(self.spec)} characters)"


def from_request(response_format: dict | None = None, guided_json=None, guided_regex: str | None = None,
                 guided_choice: list | None = None, guided_grammar: str | None = None) -> tuple[Guide | None, str | None]:
    """The guide of an OpenAI / vLLM request's fields (response_format {"type": "text" | "json_object" |
    "json_schema", "json_schema": {"schema": ...}}, guided_json, guided_regex, guided_choice, guided_grammar) and the
    field it came from; ValueError (one line) for a malformed one or for more than one."""
    given = [(name, v) for name, v in (("guided_json", guided_json), ("guided_regex", guided_regex),
                                       ("guided_choice", guided_choice), ("guided_grammar", guided_grammar))
             if v is not None]
    if response_format is not None and response_format.get("type") != "text":
        given.insert(0, ("response_format", response_format))
    if len(given) > 1:
        raise ValueError(f"give one of response_format, guided_json, guided_regex, guided_choice and guided_grammar; "
                         f"got {', '.join(n for n, _ in given)}")
    if not given:
        return None, None
    name, v = given[0]
    if name == "response_format":
        kind = v.get("type")
        if kind == "json_object":
            return Guide.json_object(), name
        if kind != "json_schema":
            raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        schema = (v.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ValueError("response_format json_schema needs json_schema.schema")
        return Guide.json_schema(schema), name
    make = {"guided_json": Guide.json_schema, "guided_regex": Guide.regex, "guided_choice": Guide.choice,
            "guided_grammar": Guide.grammar}[name]
    return make(v), name


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError(INSTALL) from None
    return llguidance


def _one_line(message: str) -> str:
    """llguidance's errors span lines (a caret under the grammar); the first lines that say what is wrong."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    return "; ".join(lines[:2])[:300] if lines else "the grammar engine refused it"


def grammar_text(guide: Guide) -> str:
    """llguidance's grammar for a guide (ValueError with a one-line message where it cannot be converted)."""
    llg = _llguidance()
    M = llg.LLMatcher
    try:
        if guide.kind == "json_schema":
            return M.grammar_from_json_schema(guide.spec, defaults=dict(JSON_OPTIONS))
        if guide.kind == "json_object":
            return M.grammar_from_json_schema('{"type": "object"}', defaults=dict(JSON_OPTIONS))
        if guide.kind == "regex":
            return M.grammar_from_regex(guide.spec)
        if guide.kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(guide.spec)))
        return llg.grammar_from("grammar", guide.spec)  # GBNF or Lark
    except ValueError as e:
        raise ValueError(f"cannot compile the {guide.kind}: {_one_line(e)}") from None


class Grammars:
    """A tokenizer's compiled guides: compile(guide) checks and compiles once (LRU, `capacity` guides), matcher(guide)
    a fresh copy of the compiled matcher. vocab_size is the logits' width; eos_token_ids end an accepted output."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, capacity: int = 64):
        self.tokenizer, self.vocab_size, self.capacity = tokenizer, vocab_size, capacity
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self._lock = threading.Lock()
        self._compiled: OrderedDict[Guide, object] = OrderedDict()
        self._ll = None
        self.compiles = 0  # compilations done (cache misses)

    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (built on first use: about 0.2 s for a 49k vocabulary)."""
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; this model has none")
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(_llguidance(), self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._ll

    def compile(self, guide: Guide):
        """The compiled matcher of a guide (cached); ValueError with a one-line message where it does not compile."""
        if not isinstance(guide, Guide):
            raise TypeError(f"guided must be a structured.Guide, got {type(guide).__name__}")
        with self._lock:
            m = self._compiled.get(guide)
            if m is not None:
                self._compiled.move_to_end(guide)
                return m
        llg, ll = _llguidance(), self.ll_tokenizer()
        text = grammar_text(guide)
        m = llg.LLMatcher(ll, text, log_level=0)
        if m.is_error():
            raise ValueError(f"cannot compile the {guide.kind}: {_one_line(m.get_error())}")
        with self._lock:
            self.compiles += 1
            self._compiled[guide] = m
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return m

    def matcher(self, guide: Guide):
        return self.compile(guide).deep_copy()


def _ll_tokenizer(llg, tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """An llguidance tokenizer: a `tokenizers` one from its JSON, another from each token's bytes (special tokens
    marked with a leading 0xFF, llguidance's convention)."""
    backend = getattr(tokenizer, "tok", None)
    if backend is not None and hasattr(backend, "to_str"):
        return llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids or None)
    special = set(tokenizer.special_token_ids())
    tokens = [b"\xff" + tokenizer.token_name(t).encode() if t in special else tokenizer.token_bytes(t)
              for t in range(tokenizer.vocab_size)]
    tokens += [b""] * (vocab_size - len(tokens))

    class Wrapped:  # what llguidance.TokenizerWrapper reads
        eos_token_id = eos_token_ids[0] if eos_token_ids else 0
        bos_token_id = tokenizer.bos_token_id
        special_token_ids = sorted(special)

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text):
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            return tokenizer.encode_fragment(text)

    return llg.LLTokenizer(llg.TokenizerWrapper(Wrapped()), n_vocab=vocab_size,
                           eos_token=eos_token_ids or None)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with -inf where the bitmask [N, ceil(V / 32)] int32 (on the logits' device) has the token's bit
    clear: the bits unpacked by one shift-and, applied by one masked_fill."""
    dev = logits.device
    if dev.type == "cpu":
        return _apply_token_bitmask_host(logits, bitmask)
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    N, V = logits.shape
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(N, -1)[:, :V]
    return logits.masked_fill(allowed == 0, float("-inf"))


def _apply_token_bitmask_host(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """apply_token_bitmask on the CPU, in numpy on the calling thread: torch would split these vocabulary-wide
    elementwise ops over its OpenMP pool, whose threads then spin on the cores the next step's kernels need."""
    N, V = logits.shape
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")[:, :V]
    out = logits.contiguous().numpy().copy()
    out[bits == 0] = -np.inf
    return torch.from_numpy(out)


@dataclass
class MaskJob:
    """The bitmask of a batch's guided sequences, being computed in a worker thread: rows[seq_id] is the row of
    host[...] (int32 [len(rows), words]) that holds it."""

    rows: dict[int, int]
    host: torch.Tensor
    future: Future | None

    def wait(self) -> torch.Tensor:
        if self.future is not None:
            self.future.result()
        return self.host

    def for_batch(self, seqs, device) -> torch.Tensor | None:
        """The bitmask of seqs in order (every token allowed for a sequence without a guide), on device; None when
        none of them has a guide. A batch of the guided sequences alone, in fill()'s order, copies host as it is
        (pinned by GuideStates for a GPU: an asynchronous copy)."""
        host = self.wait()
        rows = [self.rows.get(s.seq_id, -1) for s in seqs]
        if max(rows) < 0:
            return None
        cuda = torch.device(device).type == "cuda"
        if rows == list(range(host.shape[0])):
            return host.to(device, non_blocking=True) if cuda else host
        full = torch.cat([host, torch.full((1, host.shape[1]), -1, dtype=torch.int32)])  # the last: all allowed
        out = full.index_select(0, torch.tensor([r if r >= 0 else host.shape[0] for r in rows], dtype=torch.int64))
        return out.to(device) if cuda else out


class GuideStates:
    """The engine's matchers, one per guided sequence (seq_id -> llguidance matcher)."""

    def __init__(self, grammars: Grammars, background: bool = True, pinned: bool = False):
        """background: fill() computes in a worker thread while the step runs; False computes on the calling
        thread (a CPU engine whose kernels take every core: a worker beside them stalls their parallel launches).
        pinned: the masks go to a GPU, so fill() writes them into page-locked buffers, two used in turn (a step's
        copy has finished before the step after next fills its buffer: guided steps are not overlapped)."""
        self.grammars, self.background, self.pinned = grammars, background, pinned
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self.matchers: dict[int, object] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._executor = None  # llguidance's parallel mask filler, for batches of several guided sequences

    def add(self, seq_id: int, guide: Guide) -> None:
        self.matchers[seq_id] = self.grammars.matcher(guide)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.matchers

    def __len__(self) -> int:
        return len(self.matchers)

    def fill(self, seqs) -> MaskJob | None:
        """Start computing the next-token bitmask of the guided ones among seqs (in a worker thread)."""
        rows, ms = {}, []
        for s in seqs:
            m = self.matchers.get(s.seq_id)
            if m is not None and s.seq_id not in rows:
                rows[s.seq_id] = len(ms)
                ms.append(m)
        if not ms:
            return None
        host = self._host(len(ms))
        if not self.background:
            self._fill(ms, host)
            return MaskJob(rows, host, None)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="uacompile-grammar")
        return MaskJob(rows, host, self._pool.submit(self._fill, ms, host))

    def _host(self, n: int) -> torch.Tensor:
        words = mask_words(self.grammars.vocab_size)
        if not self.pinned:
            return torch.empty(n, words, dtype=torch.int32)
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf is None or buf.shape[0] < n:
            buf = self._buffers[self._turn] = torch.empty(max(n, 8), words, dtype=torch.int32, pin_memory=True)
        return buf[:n]

    def _fill(self, ms: list, host: torch.Tensor) -> None:
        row_bytes = host.shape[1] * 4
        if len(ms) == 1:
            ms[0].unsafe_compute_mask_ptr(host.data_ptr(), row_bytes)
            return
        if self._executor is None:
            self._executor = _llguidance().LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], host.data_ptr(), row_bytes,
                                               len(ms))

    def advance(self, seq_id: int, token_id: int) -> bool:
        """Consume a sampled token; True when the grammar is complete (nothing but the end may follow) or the
        token broke it (logged: the mask should have made that impossible)."""
        m = self.matchers.get(seq_id)
        if m is None:
            return False
        if not m.consume_token(int(token_id)):
            log.warning("sequence %d: token %d does not fit its grammar (%s); the output ends here", seq_id,
                        token_id, _one_line(m.get_error()))
            return True
        return m.is_stopped()

    def release(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
