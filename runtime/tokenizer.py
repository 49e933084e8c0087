"""Tokenizers: a GGUF's vocab (llama.cpp's SentencePiece-style `llama` model, or its byte-level BPE `gpt2`
model built with the `tokenizers` library) and HF tokenizer.json.

All expose encode(text) -> ids (with BOS when the model wants it), decode(ids) -> str
(special tokens skipped), decode_continuation(context, new) for output text, token_text(id) for
log-prob listings, and the model's chat template (a Jinja string) when it ships one.
IncrementalDecoder turns a growing list of output ids into text pieces that never split a UTF-8
character.
"""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

SPACE = "\u2581"  # SentencePiece's visible space
# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class Tokenizer:
    """Shared interface. Subclasses set bos_token_id, eos_token_ids, add_bos, vocab_size."""

    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos: bool = True
    vocab_size: int = 0
    chat_template: str | None = None
    bos_token: str = ""   # the special tokens' text, for chat templates
    eos_token: str = ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to the output (b"" for a control token)."""
        return self.token_text(token_id).encode("utf-8")

    def special_token_ids(self) -> list[int]:
        """Control tokens: they never stand for text."""
        return []

    def token_name(self, token_id: int) -> str:
        """A token's vocabulary entry (a control token's name, e.g. "</s>")."""
        return self.token_text(token_id)

    def encode_fragment(self, text: str) -> list[int]:
        """Ids of text that continues an output: no BOS, no SentencePiece space prefix."""
        return self.encode(text, add_special_tokens=False)

    def decode_continuation(self, context: list[int], new: list[int]) -> str:
        """Text that `new` adds after `context` (keeps the word-leading spaces a bare decode drops)."""
        ctx = list(context[-CONTEXT_TOKENS:])
        return self.decode(ctx + list(new))[len(self.decode(ctx)):]


CONTEXT_TOKENS = 8  # a few tokens of context are enough to settle leading spaces


class IncrementalDecoder:
    """Output text piece by piece: decodes a short window of ids (the previous piece's tokens plus the
    new ones) and emits what it adds, holding back text that ends in an incomplete UTF-8 character
    (U+FFFD) until the bytes that complete it arrive. The pieces concatenate to decode_continuation."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0                # window start
        self.read = len(self.ids)      # ids before this are emitted
        self.text = ""                 # everything emitted so far

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        piece = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += piece
        return piece


class SPMTokenizer(Tokenizer):
    """llama.cpp's `llama` (SPM) tokenizer: highest-score bigram merges over UTF-8 characters,
    unknown characters fall back to <0xNN> byte tokens, ' ' is escaped to '\u2581' and a
    space is prefixed to the text (add_space_prefix)."""

    def __init__(self, tokens: list[str], scores: list[float], types: list[int], bos_token_id: int | None,
                 eos_token_id: int | None, unk_token_id: int | None = None, add_bos: bool = True,
                 add_eos: bool = False, add_space_prefix: bool = True):
        if not (len(tokens) == len(scores) == len(types)):
            raise ValueError(f"tokenizer: tokens/scores/types lengths differ "
                             f"({len(tokens)}, {len(scores)}, {len(types)})")
        self.tokens, self.scores, self.types = list(tokens), [float(s) for s in scores], [int(t) for t in types]
        self.vocab_size = len(tokens)
        self.token_to_id: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            self.token_to_id.setdefault(t, i)  # first id wins on duplicates, as in llama.cpp
        self.bos_token_id, self.unk_token_id = bos_token_id, unk_token_id
        self.eos_token_ids = (eos_token_id,) if eos_token_id is not None else ()
        self.add_bos, self.add_eos, self.add_space_prefix = add_bos, add_eos, add_space_prefix
        self._byte_ids = [self._byte_token(b) for b in range(256)]

    def _byte_token(self, b: int) -> int | None:
        tid = self.token_to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 128:
            tid = self.token_to_id.get(chr(b))
        return tid

    def _tokenize(self, text: str) -> list[int]:
        # symbols: a doubly linked list of UTF-8 characters, merged in place
        syms = list(text)
        prev = list(range(-1, len(syms) - 1))
        nxt = list(range(1, len(syms) + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []

        def try_bigram(left: int, right: int):
            if left < 0 or right < 0:
                return
            merged = syms[left] + syms[right]
            tid = self.token_to_id.get(merged)
            if tid is not None:
                # highest score first, then leftmost (llama.cpp's comparator)
                heapq.heappush(heap, (-self.scores[tid], left, right, len(merged)))

        for i in range(1, len(syms)):
            try_bigram(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
                continue  # stale: one side was merged away since
            syms[left], syms[right] = syms[left] + syms[right], ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_bigram(prev[left], left)
            try_bigram(left, nxt[left])

        out, i = [], 0
        while i != -1:
            tid = self.token_to_id.get(syms[i])
            if tid is not None:
                out.append(tid)
            else:  # a character outside the vocab: its UTF-8 bytes as byte tokens
                for b in syms[i].encode("utf-8"):
                    bt = self._byte_ids[b]
                    if bt is None:
                        if self.unk_token_id is None:
                            raise ValueError(f"tokenizer: no token for byte 0x{b:02X} and no unknown token")
                        bt = self.unk_token_id
                    out.append(bt)
            i = nxt[i]
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = [self.bos_token_id] if add_special_tokens and self.add_bos and self.bos_token_id is not None else []
        if text:
            if self.add_space_prefix:
                text = " " + text
            ids += self._tokenize(text.replace(" ", SPACE))
        if add_special_tokens and self.add_eos and self.eos_token_ids:
            ids.append(self.eos_token_ids[0])
        return ids

    def _piece(self, tid: int) -> bytes:
        if not 0 <= tid < self.vocab_size:
            raise ValueError(f"token id {tid} is outside the vocabulary [0, {self.vocab_size})")
        kind, text = self.types[tid], self.tokens[tid]
        if kind == BYTE:
            return bytes([int(text[3:-1], 16)])
        if kind in (CONTROL, UNUSED):
            return b""
        if kind == UNKNOWN:
            return "\u2585".encode()  # llama.cpp renders unknown as a block
        return text.replace(SPACE, " ").encode("utf-8")

    def decode(self, ids: list[int]) -> str:
        text = b"".join(self._piece(int(t)) for t in ids).decode("utf-8", errors="replace")
        # SentencePiece drops the space it prefixed on encode
        return text[1:] if self.add_space_prefix and text.startswith(" ") else text

    def token_text(self, token_id: int) -> str:
        return self._piece(int(token_id)).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._piece(int(token_id))

    def special_token_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.types) if k == CONTROL]

    def token_name(self, token_id: int) -> str:
        return self.tokens[int(token_id)]

    def encode_fragment(self, text: str) -> list[int]:
        return self._tokenize(text.replace(" ", SPACE)) if text else []


class HFTokenizer(Tokenizer):
    """A `tokenizers` Tokenizer (tokenizer.json, or a GGUF BPE vocab); its post-processor adds BOS when the
    model wants it."""

    def __init__(self, tok, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None):
        self.tok = tok
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id, self.eos_token_ids = bos_token_id, tuple(eos_token_ids)
        self.add_bos = bos_token_id is not None and bos_token_id in self.tok.encode("a", add_special_tokens=True).ids

    @classmethod
    def from_file(cls, path: str | Path, eos_token_ids: tuple[int, ...] = (),
                  bos_token_id: int | None = None) -> "HFTokenizer":
        from tokenizers import Tokenizer as _Tok

        try:
            tok = _Tok.from_file(str(path))
        except Exception as e:
            raise ValueError(f"{path}: cannot read tokenizer ({e})") from None
        return cls(tok, eos_token_ids, bos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(t) for t in ids], skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([int(token_id)], skip_special_tokens=False)


@dataclass(frozen=True)
class BPEPre:
    """How a byte-level BPE vocab splits text before the merges: the split regex of the model's
    tokenizer.json (None: GPT-2's, built into the ByteLevel pre-tokenizer), whether every digit (\\p{N})
    is split off on its own before that regex (llama.cpp's "\\p{N}" first regex; HF's Digits(individual_digits)),
    NFC normalisation first, whether a word found whole in the vocab skips the merges, and whether BOS is
    added when the GGUF has no tokenizer.ggml.add_bos_token (llama.cpp's defaults per pre-tokenizer)."""

    regex: str | None
    nfc: bool = False
    ignore_merges: bool = False
    add_bos: bool = False
    split_digits: bool = False


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre (llama.cpp's name for the pre-tokenizer) -> the HF tokenizer.json it was converted from
BPE_PRE = {
    "gpt-2": BPEPre(None),
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM (llama-vocab.cpp, as STARCODER / REFACT): the regexes "\p{N}"
    # then GPT-2's, no BOS by default; SmolLM / SmolLM2's tokenizer.json: Digits(individual) then ByteLevel
    "smollm": BPEPre(None, split_digits=True),
    "qwen2": BPEPre(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+", nfc=True),
    "llama-bpe": BPEPre(LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "llama3": BPEPre(LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "llama-v3": BPEPre(LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "tekken": BPEPre(r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                     r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                     r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+", ignore_merges=True, add_bos=True),
}


# token texts llama.cpp ends generation on besides the GGUF's EOS / EOT / EOM ids (chat-turn ends, a base
# model's end of text): a Qwen instruct model stops on <|im_end|> and <|endoftext|> both, as with transformers
GGUF_EOG_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>",
                  "<end_of_turn>")


def gguf_tokenizer(fields: dict) -> Tokenizer:
    """The tokenizer a GGUF's metadata (already read into plain Python values) describes; its
    eos_token_ids are every end-of-generation token (EOS first)."""
    model = fields.get("tokenizer.ggml.model")
    if model == "llama":
        tok = spm_from_gguf_fields(fields)
    elif model == "gpt2":
        tok = bpe_from_gguf_fields(fields)
    else:
        raise ValueError(f"GGUF tokenizer.ggml.model {model!r} is not supported "
                         "(supported: 'llama' SentencePiece-style, 'gpt2' byte-level BPE)")
    marked = (_gguf_token_id(fields, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom"))
    by_text = (i for i, t in enumerate(fields["tokenizer.ggml.tokens"]) if t in GGUF_EOG_TEXTS)
    tok.eos_token_ids = tuple(dict.fromkeys([*tok.eos_token_ids, *(i for i in marked if i is not None), *by_text]))
    return tok


def _gguf_token_id(fields: dict, key: str) -> int | None:
    v = fields.get(key)
    return int(v) if v is not None and 0 <= int(v) < len(fields["tokenizer.ggml.tokens"]) else None


def bpe_from_gguf_fields(fields: dict) -> HFTokenizer:
    """llama.cpp's `gpt2` vocab (byte-level BPE: tokens, merges, token types, pre-tokenizer name) as a
    `tokenizers` BPE model; CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as _Tok

    tokens = list(fields["tokenizer.ggml.tokens"])
    pre_name = fields.get("tokenizer.ggml.pre")
    pre = BPE_PRE.get(pre_name)
    if pre is None:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre_name!r} is not supported (supported: {sorted(BPE_PRE)})")
    merges = []
    for m in fields.get("tokenizer.ggml.merges") or ():
        pair = m.split(" ")
        if len(pair) != 2:
            raise ValueError(f"GGUF tokenizer.ggml.merges: {m!r} is not two tokens separated by one space")
        merges.append((pair[0], pair[1]))
    if not merges:
        raise ValueError("GGUF BPE tokenizer has no tokenizer.ggml.merges")
    types = [int(t) for t in fields.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer: tokens/token_type lengths differ ({len(tokens)}, {len(types)})")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # first id wins on duplicates, as in llama.cpp
    tok = _Tok(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges, fuse_unk=False,
                          byte_fallback=False))
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    splits = [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated", invert=False)] if pre.split_digits else []
    if pre.regex is None:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        splits.append(pre_tokenizers.Split(Regex(pre.regex), behavior="isolated", invert=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level]) if splits else byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos = _gguf_token_id(fields, "tokenizer.ggml.bos_token_id")
    eos = _gguf_token_id(fields, "tokenizer.ggml.eos_token_id")
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", pre.add_bos)) and bos is not None
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        def template(seq: str) -> str:
            return " ".join([tokens[bos]] * add_bos + [seq] + [tokens[eos]] * add_eos)

        specials = {tokens[i]: i for i, on in ((bos, add_bos), (eos, add_eos)) if on}
        tok.post_processor = processors.TemplateProcessing(
            single=template("$A"), pair=f"{template('$A')} {template('$B:1')}", special_tokens=list(specials.items()))
    return _with_gguf_chat_fields(HFTokenizer(tok, () if eos is None else (eos,), bos), fields)


def spm_from_gguf_fields(fields: dict) -> SPMTokenizer:
    """Build the tokenizer from GGUF metadata (already read into plain Python values)."""
    model = fields.get("tokenizer.ggml.model")
    if model != "llama":
        raise ValueError(f"GGUF tokenizer.ggml.model {model!r} is not supported (only 'llama', SentencePiece-style)")

    def tid(key):
        return _gguf_token_id(fields, key)

    tokens = fields["tokenizer.ggml.tokens"]
    tok = SPMTokenizer(
        tokens, fields.get("tokenizer.ggml.scores", [0.0] * len(tokens)),
        fields.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)),
        bos_token_id=tid("tokenizer.ggml.bos_token_id"), eos_token_id=tid("tokenizer.ggml.eos_token_id"),
        unk_token_id=tid("tokenizer.ggml.unknown_token_id"),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", True)),
        add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", True)))
    return _with_gguf_chat_fields(tok, fields)


def _with_gguf_chat_fields(tok: Tokenizer, fields: dict) -> Tokenizer:
    """The chat template and the BOS/EOS text a GGUF's metadata gives the tokenizer."""
    tokens = fields["tokenizer.ggml.tokens"]
    template = fields.get("tokenizer.chat_template")
    tok.chat_template = template if isinstance(template, str) and template else None
    if tok.bos_token_id is not None:
        tok.bos_token = tokens[tok.bos_token_id]
    if tok.eos_token_ids:
        tok.eos_token = tokens[tok.eos_token_ids[0]]
    return tok


def hf_tokenizer(model_dir: Path, eos_token_ids: tuple[int, ...], bos_token_id: int | None) -> HFTokenizer | None:
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    # tokenizer_config.json may name BOS/EOS by text; the ids in config.json are the default
    cfg_path = model_dir / "tokenizer_config.json"
    tok = HFTokenizer.from_file(path, eos_token_ids, bos_token_id)
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        eos = cfg.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        eos_id = tok.tok.token_to_id(eos) if isinstance(eos, str) else None
        if eos_id is not None and eos_id not in tok.eos_token_ids:
            tok.eos_token_ids = tok.eos_token_ids + (eos_id,)
        tok.chat_template = _hf_chat_template(cfg.get("chat_template"))
        bos = cfg.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        tok.bos_token, tok.eos_token = bos if isinstance(bos, str) else "", eos if isinstance(eos, str) else ""
    if tok.chat_template is None and (model_dir / "chat_template.jinja").exists():
        tok.chat_template = (model_dir / "chat_template.jinja").read_text()
    return tok


def _hf_chat_template(value) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (the "default" one)."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None
