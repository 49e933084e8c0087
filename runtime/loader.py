"""Load a Llama-family model: GGUF (llama.cpp) or a Hugging Face directory.

Both produce (ModelConfig, weights by HF name, tokenizer). The weights are a model.Weights: read one tensor
at a time into the model's parameters, in the model's dtype, so loading holds the model once plus one
tensor (the files are memory-mapped). GGUF architectures: `llama` (Llama and Mistral: llama.cpp's converter
writes MistralForCausalLM as `llama`), `qwen2` (q/k/v biases) and `qwen3` (per-head q/k RMSNorm). GGUF
tensors (F32, F16, BF16, Q8_0) decode straight into the target dtype: F16 and BF16 convert element-wise
(BF16 -> bf16 is a copy), Q8_0's products (exact in float32) round once to the target. For `llama` the
Q/K rows are un-permuted from llama.cpp's interleaved rotary layout back to the rotate-half layout the
model uses; qwen2/qwen3 are stored unpermuted (llama.cpp runs them with NeoX rotary, which is rotate-half).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from uacompile import ir, reference

from .model import ModelConfig, Weights
from .tokenizer import Tokenizer, gguf_tokenizer, hf_tokenizer

log = logging.getLogger(__name__)

HF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
GGUF_ARCHS = ("llama", "qwen2", "qwen3")
GGUF_PERMUTED_QK = ("llama",)  # archs whose converter permutes Q/K rows for interleaved rotary
# the block-quantised GGUF types (ir.WEIGHT_FORMATS, by their GGUF names) and the float ones
GGUF_QUANT_TYPES = {f.gguf: f.name for f in ir.WEIGHT_FORMATS.values()}
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", *GGUF_QUANT_TYPES)
# the checkpoint dtype a GGUF reports (ModelConfig.torch_dtype), by the type holding most of its elements;
# quantised weights (exact in neither half type) run in bf16: these models were trained in bf16 and their
# activations can leave fp16's range
GGUF_CHECKPOINT_DTYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16",
                         **dict.fromkeys(GGUF_QUANT_TYPES, "bfloat16")}
GGUF_CHUNK_ELEMENTS = 1 << 20  # rows are decoded this many elements at a time
# GGUF tensor name -> HF name ({i} = layer)
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def models_dir() -> Path:
    """The folder of the models shipped in the package (uacompile.models: stories260K.gguf)."""
    from uacompile import models

    return models.DIR


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Weights | None  # None: a config alone (the engine makes random weights)
    tokenizer: Tokenizer | None


def load(path: str | Path) -> LoadedModel:
    """A .gguf file or a HF directory (config.json + *.safetensors [+ tokenizer.json])."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if (p / "config.json").exists():
            return load_hf(p)
        if len(ggufs) == 1:
            return load_gguf(ggufs[0])
        raise ValueError(f"{p}: expected config.json (Hugging Face) or a single .gguf file in the directory")
    return load_gguf(p)


# ---------------------------------------------------------------- GGUF
def rope_row_order(rows: int, num_heads: int) -> np.ndarray:
    """The GGUF row each HF row comes from for llama.cpp's convert permute (per head, rows (pair j, half h)
    -> (half h, pair j)): HF row (head, h, j) <- GGUF row (head, j, h)."""
    return np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).swapaxes(1, 2).reshape(rows)


def _decode_rows(src: np.ndarray, kind: str, out: torch.Tensor) -> None:
    """Decode GGUF rows (src: the stored rows, elements for F32/F16, bytes for BF16 and the block formats) into
    out [rows, cols]: block formats in ggml's float32 arithmetic (reference.dequantize_blocks), rounded once."""
    if kind in ("F32", "F16"):
        out.copy_(torch.from_numpy(src))
    elif kind == "BF16":
        out.copy_(torch.from_numpy(src.view(np.int16)).view(torch.bfloat16))
    elif kind == "Q8_0":  # blocks of an fp16 scale and 32 int8 values; the product is exact in float32
        blocks = src.reshape(-1, 34)
        scale = torch.from_numpy(blocks[:, :2].view(np.float16)).float()
        torch.mul(torch.from_numpy(blocks[:, 2:].view(np.int8)), scale, out=out.view(-1, 32))
    else:
        rows = out.shape[0] if out.dim() > 1 else 1
        out.copy_(torch.from_numpy(reference.dequantize_blocks(src.reshape(rows, -1), GGUF_QUANT_TYPES[kind],
                                                               out.shape[-1])).view(out.shape))


class GGUFWeights(Weights):
    """A GGUF file's tensors by HF name, memory-mapped; read_into decodes one into the target's dtype, row chunk by
    row chunk (llama's Q/K rows un-permuted as they are read); self[name] is the tensor decoded to float32, which
    holds every supported type exactly."""

    def __init__(self, tensors: dict, row_orders: dict[str, np.ndarray]):
        self.tensors, self.row_orders = tensors, row_orders  # HF name -> gguf ReaderTensor / source row per row

    def __getitem__(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shape(name), dtype=torch.float32)
        self.read_into(name, out)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def stored_format(self, name: str) -> str | None:
        return GGUF_QUANT_TYPES.get(self.tensors[name].tensor_type.name)

    def read_packed_into(self, name: str, out: torch.Tensor) -> None:
        """The tensor's blocks as stored (uint8 [rows, row bytes]; llama's Q/K rows un-permuted), copied into out."""
        t, order = self.tensors[name], self.row_orders.get(name)
        if self.stored_format(name) is None:
            raise ValueError(f"GGUF tensor {t.name} is {t.tensor_type.name}, not block-quantised")
        src = t.data.reshape(out.shape[0], -1)
        if order is not None:
            src = src[order]
        out.copy_(torch.from_numpy(np.ascontiguousarray(src)))

    def read_into(self, name: str, out: torch.Tensor) -> None:
        if out.device.type != "cpu" or not out.is_contiguous():
            host = torch.empty(out.shape, dtype=out.dtype)
            self.read_into(name, host)
            out.copy_(host)
            return
        t, order = self.tensors[name], self.row_orders.get(name)
        kind = t.tensor_type.name
        if out.dim() == 1 and order is not None:  # a permuted bias: small, decoded whole then reordered
            whole = torch.empty(out.shape, dtype=out.dtype)
            _decode_rows(t.data.reshape(1, -1), kind, whole.view(1, -1))
            out.copy_(whole[torch.from_numpy(order)])
            return
        rows = out.shape[0] if out.dim() > 1 else 1
        src, dst = t.data.reshape(rows, -1), out.view(rows, -1)
        step = max(1, GGUF_CHUNK_ELEMENTS // dst.shape[1])
        for a in range(0, rows, step):
            _decode_rows(src[a:a + step] if order is None else src[order[a:a + step]], kind, dst[a:a + step])


def _gguf_tensor_checked(t) -> None:
    """A one-line error for a tensor of an unsupported type or whose data does not fit its header shape."""
    import gguf

    kind = t.tensor_type.name
    if kind not in GGUF_TENSOR_TYPES:
        raise ValueError(f"GGUF tensor {t.name}: type {kind} is not supported (supported: {GGUF_TENSOR_TYPES})")
    block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    shape = tuple(int(d) for d in reversed(t.shape))
    elements = int(np.prod(shape))
    if shape[-1] % block or t.data.nbytes != elements // block * size:
        raise ValueError(f"GGUF tensor {t.name}: {t.data.nbytes} bytes of {kind}, header says shape {shape} "
                         "(corrupt file?)")


def load_gguf(path: Path) -> LoadedModel:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "c")  # copy-on-write: writable views (torch wants them), the file untouched
        fields = {k: f.contents() for k, f in reader.fields.items()}
    except Exception as e:  # bad magic, truncated file, bad offsets...
        raise ValueError(f"{path}: not a readable GGUF file, corrupt or truncated ({type(e).__name__}: {e})") from None
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {GGUF_ARCHS})")

    def get(key, default=None, required=False):
        v = fields.get(f"{arch}.{key}", default)
        if v is None and required:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return v

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    E, H = int(get("embedding_length", required=True)), int(get("attention.head_count", required=True))
    Hkv = int(get("attention.head_count_kv", H))
    D = int(get("attention.key_length", E // H))
    if int(get("attention.value_length", D)) != D:
        raise ValueError(f"{path}: key_length != value_length is not supported")
    if int(get("rope.dimension_count", D)) != D:
        raise ValueError(f"{path}: partial rotary (rope.dimension_count {get('rope.dimension_count')} < head_dim {D}) "
                         "is not supported")
    rope_scaling = None
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    elif kind not in ("none", None):
        raise ValueError(f"{path}: GGUF rope scaling {kind!r} is not supported (supported: none, linear)")
    tokenizer = gguf_tokenizer(fields) if "tokenizer.ggml.tokens" in fields else None
    vocab = int(tensors["token_embd.weight"].shape[1])
    n_layers = int(get("block_count", required=True))
    named, row_orders, elements = {}, {}, dict.fromkeys(GGUF_TENSOR_TYPES, 0)
    for name, t in tensors.items():
        hf = _gguf_to_hf(name, n_layers)
        if hf is None:
            raise ValueError(f"{path}: unexpected GGUF tensor {name!r} for architecture {arch}")
        _gguf_tensor_checked(t)
        named[hf] = t
        elements[t.tensor_type.name] += int(t.n_elements)
        if arch in GGUF_PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
            row_orders[hf] = rope_row_order(int(t.shape[-1]), H if ".attn_q." in name else Hkv)
    log.info("%s: GGUF %s, %d layers, tensor elements by type %s, tokenizer %s", path.name, arch, n_layers,
             {k: v for k, v in elements.items() if v}, fields.get("tokenizer.ggml.model"))
    cfg = ModelConfig(
        arch=arch, vocab_size=vocab, hidden_size=E, intermediate_size=int(get("feed_forward_length", required=True)),
        num_layers=n_layers, num_heads=H, num_kv_heads=Hkv, head_dim=D,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling, max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors, o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm=arch == "qwen3", sliding_window=int(get("attention.sliding_window", 0)),
        rope_freq_factors="rope_freqs.weight" in tensors,
        bos_token_id=tokenizer.bos_token_id if tokenizer else None,
        eos_token_ids=tokenizer.eos_token_ids if tokenizer else (),
        torch_dtype=GGUF_CHECKPOINT_DTYPE[max(elements, key=elements.get)])
    return LoadedModel(cfg, GGUFWeights(named, row_orders), tokenizer)


def _gguf_to_hf(name: str, n_layers: int) -> str | None:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers:
        hf = GGUF_NAMES.get(f"blk.{{i}}.{parts[2]}")
        return hf.format(i=parts[1]) if hf else None
    return None


# ---------------------------------------------------------------- Hugging Face
def _hf_rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5's rope_parameters or the older rope_theta/rope_scaling."""
    rp = dict(cfg.get("rope_parameters") or {})
    rs = dict(cfg.get("rope_scaling") or {})
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**rs, **rp}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return theta, None
    merged["rope_type"] = kind
    return theta, merged


def load_hf(model_dir: Path) -> LoadedModel:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{model_dir}/config.json: invalid JSON ({e})") from None
    arch = raw.get("model_type")
    if arch not in HF_ARCHS:
        raise ValueError(f"{model_dir}: model_type {arch!r} is not supported (supported: {HF_ARCHS})")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{model_dir}: {arch} with use_sliding_window=true is not supported")
    for key in ("num_attention_heads", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        v = raw.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{model_dir}/config.json: {key} must be an int >= 1, "
                             f"{'is missing' if key not in raw else f'got {v!r}'}")
    H = raw["num_attention_heads"]
    theta, scaling = _hf_rope(raw)
    eos = raw.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    window = raw.get("sliding_window") if arch == "mistral" else None
    cfg = ModelConfig(
        arch=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"], num_heads=H,
        num_kv_heads=raw.get("num_key_value_heads") or H,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // H, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), qk_norm=arch == "qwen3",
        qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        o_bias=arch != "qwen2" and bool(raw.get("attention_bias", False)), mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=int(window or 0), bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids,
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"))
    return LoadedModel(cfg, _read_safetensors(model_dir), hf_tokenizer(model_dir, eos_ids, cfg.bos_token_id))


class SafetensorsWeights(Weights):
    """A Hugging Face checkpoint's *.safetensors, memory-mapped: each tensor is read when asked for (self[name] in the
    checkpoint's dtype; read_into converts it into the target)."""

    def __init__(self, files: dict[str, object]):
        self.files = files  # name -> the safe_open handle holding it

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.files[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.files[name].get_slice(name).get_shape())


def _read_safetensors(model_dir: Path) -> SafetensorsWeights:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        extra = " (pytorch_model.bin is not supported; convert to safetensors)" if any(model_dir.glob("*.bin")) else ""
        raise ValueError(f"{model_dir}: no *.safetensors weights{extra}")
    handles = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:
            raise ValueError(f"{f}: cannot read safetensors ({type(e).__name__}: {e})") from None
        # checkpoints of older transformers carry the rotary table; it is recomputed
        handles.update({k: handle for k in handle.keys() if not k.endswith("rotary_emb.inv_freq")})
    return SafetensorsWeights(handles)
