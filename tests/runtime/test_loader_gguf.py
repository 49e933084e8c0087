"""GGUF loading for qwen2, qwen3 and Mistral (written by llama.cpp's converter as `llama`) with a
byte-level BPE (`gpt2`) tokenizer: tiny random transformers models written here as GGUF with the gguf
library (llama.cpp's tensor names from its TensorNameMap; F32, F16, BF16 and Q8_0 tensors), loaded by
the runtime and checked against transformers running the same (dequantised) weights; the BPE vocab is
trained here with `tokenizers` and checked against transformers' tokenizer on the same vocab/merges."""
import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from model_helpers import assert_logits_match, gguf_writer, hf_greedy, make_hf_model, runtime_logits  # noqa: E402

from uacompile.runtime import LLM, SamplingParams  # noqa: E402
from uacompile.runtime.loader import load  # noqa: E402
from uacompile.runtime.tokenizer import IncrementalDecoder, gguf_tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0)
# 2-D tensors by role; each arch stores them in a rotation of TYPES, so every arch has all four types
ROLES = ("embed_tokens", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONTROL, USER_DEFINED, NORMAL = 3, 4, 1  # gguf.TokenType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
CORPUS = ["Hello world, this is a tiny corpus for a tiny tokenizer.",
          "The quick brown fox jumps over the lazy dog. I'm sure they'll see it; we've done it.",
          "naïve café résumé — Ünïcödé 東京 日本語 emoji 🚀🙂 numbers 12345 67890",
          "def f(x):\n    return x * 2  # code\n\n\tindent", "  spaces   and\r\nnewlines\n\n"]
TEXTS = ["Hello world", "The quick brown fox, I'm sure they'll see it.", "  leading and   inner spaces\n\nx\t",
         "naïve café — 東京 🚀", "cafe\u0301 (decomposed e + accent)", "numbers 1234567 and 3.14",
         "<|im_start|>user\nhi there<|im_end|>", "a<tool_call>b <|endoftext|>", "unseen: Ωμέγα ǅ 𝔘", ""]


# ---------------------------------------------------------------- the formats, written out independently
def expected_dequant(x: np.ndarray, qt) -> np.ndarray:
    """What a tensor of type qt decodes to: F16/BF16 round to nearest even; Q8_0 as ggml defines it
    (blocks of 32 along a row, d = max|x| / 127, q = round(x / d) half away from zero, value = fp16(d) * q)."""
    x = x.astype(np.float32)
    if qt == Q.F32:
        return x
    if qt == Q.F16:
        return x.astype(np.float16).astype(np.float32)
    if qt == Q.BF16:
        return torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    scaled = blocks * inv
    q = np.trunc(scaled + np.copysign(np.float32(0.5), scaled))
    return (d.astype(np.float16).astype(np.float32) * q).reshape(x.shape)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's permute for `llama`: per head, rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (printable Latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


BYTE_CHARS = _byte_chars()


def bytes_to_unicode(text: str) -> str:
    return "".join(BYTE_CHARS[b] for b in text.encode("utf-8"))


def gguf_vocab(hf_tok) -> dict:
    """tokenizer.ggml.* for a byte-level BPE transformers tokenizer, as llama.cpp's converter writes it."""
    size = len(hf_tok)
    tokens = hf_tok.convert_ids_to_tokens(list(range(size)))
    added = hf_tok.added_tokens_decoder
    types = [(CONTROL if added[i].special else USER_DEFINED) if i in added else NORMAL for i in range(size)]
    merges = json.loads(hf_tok.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return {"tokens": tokens, "types": types, "merges": merges}


def write_gguf(path, model, gguf_arch: str, first_type: int, vocab: dict | None = None, pre: str = "qwen2",
               sliding_window: int | None = None, eos: int | None = None, drop=()) -> dict[str, np.ndarray]:
    """Write model as GGUF (2-D tensors in TYPES rotated by first_type, 1-D in F32 as llama.cpp keeps
    them); returns the HF state dict the file decodes to."""
    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[gguf_arch], cfg.num_hidden_layers)
    w = gguf_writer(path, gguf_arch, cfg)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    if vocab:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(vocab["tokens"])
        w.add_token_types(vocab["types"])
        w.add_token_merges(vocab["merges"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(eos if eos is not None else 0)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    want = {}
    for hf_name, t in model.state_dict().items():
        x = t.float().numpy()
        role = next((r for r in ROLES if f"{r}." in hf_name), None)
        qt = Q.F32 if role is None else TYPES[(first_type + ROLES.index(role)) % len(TYPES)]
        want[hf_name] = expected_dequant(x, qt)
        if gguf_arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name):
            x = llama_cpp_permute(x, H if "q_proj" in hf_name else Hkv)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name in drop:
            continue
        if qt in (Q.F32, Q.F16):
            w.add_tensor(name, x.astype(np.float32 if qt == Q.F32 else np.float16))
        else:
            raw = gguf.quants.quantize(x, qt)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return want


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf_tokenizer():
    """A 300-token byte-level BPE trained here, as transformers' Qwen2Tokenizer (vocab + merges), with
    three special tokens and one plain added token."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    vocab = tok.get_vocab()
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    hf = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>", extra_special_tokens=["<|im_start|>"])
    hf.add_tokens(["<tool_call>"])  # a non-special added token (USER_DEFINED in GGUF)
    assert len(hf) == len(vocab) + 1
    return hf


ARCHS = {  # case -> (transformers arch, GGUF arch, overrides, first type, GGUF sliding window)
    "qwen2": ("qwen2", "qwen2", {}, 0, None),
    "qwen3": ("qwen3", "qwen3", {"head_dim": 32}, 1, None),  # 4 heads x 32 != hidden 64
    "mistral": ("mistral", "llama", {"sliding_window": 6}, 2, 6),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def written(request, tmp_path_factory, hf_tokenizer):
    arch, gguf_arch, overrides, first, window = ARCHS[request.param]
    vocab = gguf_vocab(hf_tokenizer)
    model = make_hf_model(arch, seed=7 + first, vocab_size=len(vocab["tokens"]), **overrides)
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    want = write_gguf(path, model, gguf_arch, first, vocab, sliding_window=window,
                      eos=hf_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in want.items()})  # the weights the file holds
    return request.param, path, want, model


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_tensor_types_round_trip(tmp_path, qt, rng):
    """Each type through GGUFWriter -> file -> loader decodes to the format's definition, close to the source."""
    model = make_hf_model("qwen2", seed=1, num_hidden_layers=1)
    x = rng.normal(0, 1, size=(64, 96)).astype(np.float32)
    x[3, :32] = 0  # an all-zero Q8_0 block
    x[5, 7] = 1e-30  # underflows fp16, not bf16
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.copy_(torch.from_numpy(x))
    path = tmp_path / "types.gguf"
    want = write_gguf(path, model, "qwen2", TYPES.index(qt) - ROLES.index("down_proj"))
    loaded = load(path)
    got = loaded.weights
    # the type holding most elements (embeddings and down_proj here) is the checkpoint dtype the engine sees
    assert loaded.config.torch_dtype == {Q.F32: "float32", Q.F16: "float16", Q.BF16: "bfloat16",
                                         Q.Q8_0: "bfloat16"}[qt]
    assert set(got) == set(want)
    for name, w in got.items():
        np.testing.assert_array_equal(w.numpy(), want[name], err_msg=name)
    down = got["model.layers.0.mlp.down_proj.weight"].numpy()
    tol = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 8e-3}[qt]
    assert np.abs(down - x).max() <= tol * np.abs(x).max()


def test_gguf_config_and_tokenizer(written, hf_tokenizer):
    case, path, _, model = written
    loaded = load(path)
    cfg = loaded.config
    hf = model.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads,
                                                               hf.head_dim)
    assert cfg.qkv_bias == (case == "qwen2") and cfg.qk_norm == (case == "qwen3")
    assert cfg.sliding_window == (6 if case == "mistral" else 0)
    assert cfg.eos_token_ids == (2, 0) and not cfg.tie_word_embeddings  # EOS <|im_end|>, then <|endoftext|>
    assert [loaded.tokenizer.encode(t) for t in TEXTS] == [hf_tokenizer.encode(t) for t in TEXTS]


def test_gguf_logits_match_transformers(written, rng):
    case, path, _, model = written
    llm = LLM(str(path), cpu_threads=1, page_size=4, num_pages=64)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in (13, 6)]
    got = runtime_logits(llm.engine.executor, prompts, [[5, 4, 1, 1, 1, 1], [1, 1, 4]], rng)
    assert_logits_match(model, prompts, got, 2e-4, case)
    if case == "qwen2":  # a text prompt through the GGUF's BPE tokenizer, greedy as transformers
        out = llm.generate("Hello world, the quick fox", SamplingParams(temperature=0, max_tokens=6,
                                                                         ignore_eos=True))[0]
        assert out.outputs[0].token_ids == hf_greedy(model, out.prompt_token_ids, 6)


@pytest.fixture(scope="module")
def bpe_fields(tmp_path_factory, hf_tokenizer) -> dict:
    """The metadata of a GGUF carrying hf_tokenizer's vocab (pre-tokenizer qwen2, EOS <|im_end|>, no BOS)."""
    model = make_hf_model("qwen2", seed=2, num_hidden_layers=1, vocab_size=len(hf_tokenizer))
    path = tmp_path_factory.mktemp("bpe") / "bpe.gguf"
    write_gguf(path, model, "qwen2", 0, gguf_vocab(hf_tokenizer), eos=hf_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}


@pytest.mark.parametrize("pre", ["qwen2", "gpt-2"])
def test_bpe_tokenizer_matches_transformers(bpe_fields, hf_tokenizer, pre):
    tok = gguf_tokenizer({**bpe_fields, "tokenizer.ggml.pre": pre})
    if pre == "gpt-2":
        ref = transformers.GPT2Tokenizer(
            vocab={t: i for i, t in enumerate(bpe_fields["tokenizer.ggml.tokens"])},
            merges=[tuple(m.split(" ")) for m in bpe_fields["tokenizer.ggml.merges"]])
        ref.add_special_tokens({"additional_special_tokens": SPECIALS})
        ref.add_tokens(["<tool_call>"])
    else:
        ref = hf_tokenizer
    assert tok.vocab_size == len(ref) and not tok.add_bos and tok.eos_token_ids == (2, 0)
    assert (tok.chat_template, tok.bos_token, tok.eos_token) == (CHAT_TEMPLATE, "<|endoftext|>", "<|im_end|>")
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=True)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert len(tok.encode("<|im_start|>")) == 1 and len(tok.encode("<tool_call>")) == 1
    assert tok.decode(tok.encode("<|im_end|>x<tool_call>")) == "x<tool_call>"  # special skipped, added kept
    if pre == "qwen2":  # NFC first: a decomposed accent encodes as the composed one
        assert tok.encode("cafe\u0301") == tok.encode("caf\u00e9")
    ids = tok.encode("x 東京 🚀 unseen Ωμέγα")  # characters outside the vocab: several byte tokens each
    dec = IncrementalDecoder(tok, ids[:1])
    pieces = [dec.add([t]) for t in ids[1:]]
    assert "" in pieces and all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tok.decode(ids)[1:]


PRE_SPLITS = {  # "I'M HTTPServer 1234567 x" as each pre-tokenizer splits it
    "gpt-2": ["I", "'", "M", " HTTPServer", " 1234567", " x"],  # case-sensitive contractions, whole numbers
    "qwen2": ["I", "'M", " HTTPServer", " ", "1", "2", "3", "4", "5", "6", "7", " x"],  # single digits
    "llama-bpe": ["I", "'M", " HTTPServer", " ", "123", "456", "7", " x"],  # digits in threes
    "tekken": ["I", "'M", " HTTPServer", " ", "1", "2", "3", "4", "5", "6", "7", " x"],
    "smollm": ["I", "'", "M", " HTTPServer", " ", "1", "2", "3", "4", "5", "6", "7", " x"],  # digits first, then GPT-2's
}


@pytest.mark.parametrize("pre", list(PRE_SPLITS))
def test_bpe_pre_tokenizers_split_as_their_models(bpe_fields, pre):
    """A vocab holding every case's words (and "1234567"), each reachable by a chain of merges: a word
    comes back as one token exactly when the pre-tokenizer splits it out, so the tokens are the splits."""
    words = [bytes_to_unicode(w) for w in dict.fromkeys(sum(PRE_SPLITS.values(), []) + ["1234567"])]
    merges = list(dict.fromkeys(f"{w[:i]} {w[i]}" for w in words for i in range(1, len(w))))
    tokens = list(dict.fromkeys(BYTE_CHARS + [w[:i] for w in words for i in range(2, len(w) + 1)]))
    fields = {**bpe_fields, "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.token_type": [NORMAL] * len(tokens), "tokenizer.ggml.merges": merges}
    tok = gguf_tokenizer(fields)
    assert [tokens[i] for i in tok.encode("I'M HTTPServer 1234567 x")] == [bytes_to_unicode(w) for w in PRE_SPLITS[pre]]


def test_bpe_bos_and_errors(bpe_fields):
    """add_bos_token puts BOS in front; unknown pre-tokenizers and tokenizer models are one-line errors."""
    plain = gguf_tokenizer(bpe_fields)
    with_bos = gguf_tokenizer({**bpe_fields, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 1})
    assert with_bos.encode("Hello") == [1] + plain.encode("Hello") and with_bos.add_bos and not plain.add_bos
    assert with_bos.encode("Hello", add_special_tokens=False) == plain.encode("Hello")
    assert with_bos.decode(with_bos.encode("Hello")) == "Hello"
    # without tokenizer.ggml.add_bos_token, llama.cpp's default for the pre-tokenizer: BOS for llama-bpe
    defaults = {k: v for k, v in bpe_fields.items() if k != "tokenizer.ggml.add_bos_token"}
    assert gguf_tokenizer({**defaults, "tokenizer.ggml.pre": "llama-bpe"}).encode("Hello")[0] == 0
    assert not gguf_tokenizer(defaults).add_bos
    # end of generation: EOS, the EOT id the file marks, then the end-of-turn / end-of-text tokens by text
    assert gguf_tokenizer({**bpe_fields, "tokenizer.ggml.eot_token_id": 1}).eos_token_ids == (2, 1, 0)
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'falcon' is not supported"):
        gguf_tokenizer({**bpe_fields, "tokenizer.ggml.pre": "falcon"})
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert' is not supported"):
        gguf_tokenizer({**bpe_fields, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="no tokenizer.ggml.merges"):
        gguf_tokenizer({k: v for k, v in bpe_fields.items() if k != "tokenizer.ggml.merges"})


def test_qwen2_without_biases_is_an_error(tmp_path):
    model = make_hf_model("qwen2", seed=4, num_hidden_layers=1)
    path = tmp_path / "nobias.gguf"
    write_gguf(path, model, "qwen2", 0, drop=("blk.0.attn_q.bias",))
    with pytest.raises(ValueError, match="missing tensors.*layers.0.self_attn.q_proj.bias"):
        LLM(str(path))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_loads_round_the_decoded_weights_once(written, dtype):
    """Loading in a 16-bit dtype decodes straight into it (no float32 copy of the model), to the same values
    as rounding the float32 decode: every parameter, fused q/k/v and gate/up included."""
    from uacompile.runtime.model import LlamaForCausalLM

    _, path, _, _ = written
    loaded = load(path)
    full = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, "cpu", torch.float32).state_dict()
    half = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, "cpu", dtype).state_dict()
    assert set(half) == set(full) and any("qkv_proj" in n for n in half) and any("gate_up_proj" in n for n in half)
    for name, t in half.items():
        assert t.dtype == dtype, name
        assert torch.equal(t, full[name].to(dtype)), name


PEAK_SCRIPT = """
import json, sys
import gguf, torch
from uacompile.runtime.loader import load
from uacompile.runtime.model import LlamaForCausalLM

def kb(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

# torch's first ops set up its kernels and thread pool (tens of MiB, once per process): run them before measuring
out = torch.empty(4096, 32, dtype=torch.bfloat16)
torch.mul(torch.ones(4096, 32, dtype=torch.int8), torch.ones(4096, 1, dtype=torch.float16).float(), out=out)
out.copy_(torch.ones(4096, 32)), out.copy_(torch.ones(4096, 32, dtype=torch.float16))
out[torch.arange(4096)]
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak from here on
before = kb("VmRSS")
loaded = load(sys.argv[1])
model = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, "cpu", torch.bfloat16)
print(json.dumps({"peak": (kb("VmHWM") - before) * 1024, "model": sum(p.nbytes for p in model.parameters())}))
"""


def test_host_peak_is_the_model_plus_one_tensor(tmp_path, rng):
    """A Q8_0 GGUF (llama: its Q/K rows un-permuted as they load) loaded in bf16, in a fresh process: the
    resident-memory peak of load + from_weights is at most the bf16 model, the mapped file and the largest
    tensor in float32 (plus 24 MiB of allocator slack); a loader that decodes the whole model to float32
    first peaks at twice the bf16 model or more."""
    import subprocess
    import sys
    from types import SimpleNamespace

    cfg = SimpleNamespace(max_position_embeddings=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64, rope_parameters={"rope_theta": 1e4},
                          rms_norm_eps=1e-5)
    vocab, E, F_, D = 8192, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    path = tmp_path / "peak.gguf"
    w = gguf_writer(path, "llama", cfg)
    shapes = {"token_embd.weight": (vocab, E), "output.weight": (vocab, E), "output_norm.weight": (E,)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (E,), f"blk.{i}.ffn_norm.weight": (E,),
                       f"blk.{i}.attn_q.weight": (8 * D, E), f"blk.{i}.attn_k.weight": (4 * D, E),
                       f"blk.{i}.attn_v.weight": (4 * D, E), f"blk.{i}.attn_output.weight": (E, 8 * D),
                       f"blk.{i}.ffn_gate.weight": (F_, E), f"blk.{i}.ffn_up.weight": (F_, E),
                       f"blk.{i}.ffn_down.weight": (E, F_)})
    for name, shape in shapes.items():
        x = rng.normal(0, 0.05, size=shape).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, x)
        else:
            raw = gguf.quants.quantize(x, Q.Q8_0)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=Q.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    elements = sum(int(np.prod(s)) for s in shapes.values())
    assert got["model"] == 2 * elements
    largest = 4 * max(int(np.prod(s)) for s in shapes.values())
    bound = got["model"] + path.stat().st_size + largest + (24 << 20)
    assert got["peak"] <= bound, f"host peak {got['peak'] / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
