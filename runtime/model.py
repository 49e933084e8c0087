"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) in torch.

Parameter names follow Hugging Face's checkpoints, so a HF state dict loads as is and the
GGUF loader only renames. q/k/v and gate/up run as one projection each (one matmul): from_weights
builds the fused model and reads each checkpoint tensor into its rows of the fused weight, in the
model's dtype, one tensor at a time (Weights.read_into). Matmuls are torch; the layer ops (RMSNorm
with the residual add, SiLU-and-mul, RoPE) go through `self.layer_backend` (kernels.TorchLayerOps, or
the kernel backend given to use_kernels), K/V writes and attention through the executor's callback
(one paged-attention launch per layer for the whole batch).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .kernels import TorchLayerOps, torch_rms_norm
from .quant import QUANTIZATIONS, Fp8Linear, Part, QuantEmbedding, QuantLinear, fp8_rows, quantize_q8_0

ROPE_TYPES = ("default", "linear", "llama3")
LOAD_PROGRESS_BYTES = 256 << 20  # models this large (in their dtype) show a progress bar while their weights load


@dataclass(slots=True)
class ModelConfig:
    arch: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qk_norm: bool = False      # Qwen3: RMSNorm over head_dim on q and k before RoPE
    qkv_bias: bool = False     # Qwen2, Llama attention_bias
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int = 0    # 0 = full attention (Mistral v0.1 uses 4096)
    rope_freq_factors: bool = False  # GGUF rope_freqs tensor (llama3 scaling baked per frequency)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"  # the checkpoint's dtype

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"model config: {name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        rtype = (self.rope_scaling or {}).get("rope_type", "default")
        if rtype not in ROPE_TYPES:
            raise ValueError(f"model config: rope scaling {rtype!r} is not supported (supported: {ROPE_TYPES})")


class Weights(Mapping):
    """A checkpoint's tensors by Hugging Face name. shape(name) reads no data; read_into(name, out) writes the
    tensor into out (its dtype and device), holding at most one tensor's temporary on the host. A checkpoint
    format that decodes (GGUF) overrides both and reads each tensor straight into the model's dtype; self[name]
    is the tensor as stored (or decoded exactly)."""

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self[name].shape)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        out.copy_(self[name])

    def stored_format(self, name: str) -> str | None:
        """The block format (ir.WEIGHT_FORMATS) the tensor is stored in, or None for a float tensor."""
        return None

    def read_packed_into(self, name: str, out: torch.Tensor) -> None:
        """Copy a block-quantised tensor's packed rows (uint8 [rows, row bytes]) into out, as stored."""
        raise ValueError(f"tensor {name} is not stored block-quantised")


class TensorWeights(Weights):
    """Weights held as tensors in memory (a state dict)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim/2] (float64), with transformers' rope scaling rules."""
    D = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64, device="cpu") / D)
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_freq_factors(cfg: ModelConfig, inv_freq: torch.Tensor) -> tuple[float, ...]:
    """inv_freq as divisors of the unscaled 1 / theta^(2i / D) (ir.Rope.freq_factors); () when unscaled."""
    D = cfg.head_dim
    plain = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    factors = plain / inv_freq.to("cpu", torch.float64)
    return () if bool((factors == 1).all()) else tuple(factors.tolist())


@dataclass(slots=True)
class RopeTables:
    """The torch RoPE's cos / sin tables [T, 1, D/2] of a step's positions, made at the first get() (a backend's
    rope kernel works out its own angles and never asks)."""

    inv_freq: torch.Tensor  # [D/2] float64
    positions: torch.Tensor
    dtype: torch.dtype
    tables: tuple | None = None

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tables is None:
            ang = self.positions.to(torch.float64)[:, None] * self.inv_freq[None, :]  # float64: exact at long positions
            self.tables = ang.cos().to(self.dtype)[:, None, :], ang.sin().to(self.dtype)[:, None, :]
        return self.tables


class RMSNorm(nn.Module):
    """A norm's weight (HF name `weight`) and eps; the model runs it through its layer ops."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_rms_norm(x, self.weight, self.eps)


def merged_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (weights and biases stacked by rows); on the meta
    device only its shape (no torch.cat or skip_init there: they load torch's Python meta kernels, tens of MiB)."""
    first, rows = parts[0], sum(p.out_features for p in parts)
    w = first.weight
    fused = nn.Linear(first.in_features, rows, bias=first.bias is not None, device=w.device, dtype=w.dtype)
    if w.device.type != "meta":
        with torch.no_grad():
            row = 0
            for p in parts:
                fused.weight[row:row + p.out_features].copy_(p.weight)
                if fused.bias is not None:
                    fused.bias[row:row + p.out_features].copy_(p.bias)
                row += p.out_features
    return fused


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        H, Hkv, D, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.layer, self.H, self.Hkv, self.D = layer, H, Hkv, D
        self.q_proj = nn.Linear(E, H * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(E, Hkv * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(E, Hkv * D, bias=cfg.qkv_bias)
        self.qkv_proj = None  # fuse(): q, k and v in one matmul
        self.o_proj = nn.Linear(H * D, E, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(D, cfg.rms_norm_eps), RMSNorm(D, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def fuse(self) -> None:
        self.qkv_proj = merged_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, rope, attn, ops: TorchLayerOps) -> torch.Tensor:
        T, H, Hkv, D = x.shape[0], self.H, self.Hkv, self.D
        qkv = ops.linear(self.qkv_proj, x)
        prologue = getattr(attn, "prologue", None)
        if prologue is not None:  # the backend's one launch: q/k norms, RoPE, the cache write (ir.QKVRopeCache)
            norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
            out = prologue(self.layer, qkv.view(T, H + 2 * Hkv, D), *norms)
            return ops.linear(self.o_proj, out.reshape(T, H * D))
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        if self.q_norm is not None:  # Qwen3: RMSNorm of each head's q and k, before RoPE
            q = ops.rms_norm(q.reshape(T * H, D), self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k.reshape(T * Hkv, D), self.k_norm.weight, self.k_norm.eps)
        q, k = rope(q.reshape(T, H, D)), rope(k.reshape(T, Hkv, D))
        out = attn(self.layer, q, k, v.reshape(T, Hkv, D).contiguous())  # cache write + one paged-attention launch
        return ops.linear(self.o_proj, out.reshape(T, H * D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, F_ = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(E, F_, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(E, F_, bias=cfg.mlp_bias)
        self.gate_up_proj = None  # fuse(): gate and up in one matmul
        self.down_proj = nn.Linear(F_, E, bias=cfg.mlp_bias)

    def fuse(self) -> None:
        self.gate_up_proj = merged_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x, ops: TorchLayerOps):
        return ops.linear(self.down_proj, ops.silu_and_mul(ops.linear(self.gate_up_proj, x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, attn, ops: TorchLayerOps):
        """x: the previous layer's output, residual: the stream before it (None in the first layer, where x is
        the stream). Returns (this layer's output, the stream before it): each norm adds the pending output to
        the stream as it normalises it (rms_norm with the residual)."""
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            h, residual = ops.rms_norm(x, norm_in.weight, norm_in.eps), x
        else:
            h, residual = ops.rms_norm(x, norm_in.weight, norm_in.eps, residual)
        h = self.self_attn(h, rope, attn, ops)
        h, residual = ops.rms_norm(h, norm_post.weight, norm_post.eps, residual)
        return self.mlp(h, ops), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # an explicit weight skips the random init (normal_ on the meta device imports torch._dynamo)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], attn) -> hidden [T, E]; logits(hidden rows) -> [N, V] float32.

    attn(layer, q, k, v) -> out [T, Hq, D] is the executor's per-step attention callback.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if cfg.rope_freq_factors:  # GGUF rope_freqs: llama.cpp divides each frequency by its factor
            self.register_buffer("rope_freqs", torch.ones(cfg.head_dim // 2, dtype=torch.float32))
        self.inv_freq = rope_inv_freq(cfg)  # float64, deliberately not a buffer: .to(dtype) must not round it
        self.rope_freq_factors: tuple[float, ...] = ()  # ir.Rope's form of inv_freq, set with it by _refresh_rope
        self.layer_backend: TorchLayerOps = TorchLayerOps()  # runs the layer ops (use_kernels: a backend's kernels)
        self.prologue = None  # ir.QKVRopeCache where the backend fuses the attention prologue (use_kernels)

    def _refresh_rope(self, rope_freqs: torch.Tensor | None = None) -> None:
        """inv_freq and its ir.Rope form, from the config and rope_freqs (default: the buffer)."""
        inv = rope_inv_freq(self.cfg)
        if self.cfg.rope_freq_factors:
            inv = inv / (self.rope_freqs if rope_freqs is None else rope_freqs).to(torch.float64).cpu()
        self.inv_freq = inv.to(self.model.embed_tokens.weight.device)
        self.rope_freq_factors = rope_freq_factors(self.cfg, inv)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        return RopeTables(self.inv_freq, positions, dtype)

    def fuse(self) -> None:
        """Merge each layer's q/k/v and gate/up projections into one matmul each (biases merged too); on the
        meta device this only shapes the model that load_weights fills."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def layer_ops(self, dtype: torch.dtype, fused_prologue: bool = False) -> list:
        """The IR layer ops this model launches at dtype (a kernel backend builds them up front); with fused_prologue
        (prologue_op runs the q/k norms and RoPE) neither the head norm nor Rope."""
        from uacompile import ir

        cfg, dt = self.cfg, ir.from_torch(dtype)
        ops = [ir.RMSNorm(cfg.hidden_size, dt, cfg.rms_norm_eps), ir.RMSNorm(cfg.hidden_size, dt, cfg.rms_norm_eps, True),
               ir.SiluAndMul(cfg.intermediate_size, dt)]
        if cfg.qk_norm and not fused_prologue:
            ops.append(ir.RMSNorm(cfg.head_dim, dt, cfg.rms_norm_eps))
        if not fused_prologue:
            ops += [ir.Rope(n, cfg.head_dim, dt, cfg.rope_theta, freq_factors=self.rope_freq_factors)
                    for n in sorted({cfg.num_heads, cfg.num_kv_heads})]
        quant = {}  # the packed layers' decode matmuls, their row decoders (prefill, embedding lookups), fp8 inputs
        for module in self.modules():
            if isinstance(module, QuantLinear):
                for part, _ in module.packed():
                    quant[ir.QuantMatmul(module.in_features, part.rows, part.weight_format, dt)] = None
                    quant[ir.Dequantize(module.in_features, part.weight_format, dt)] = None
            elif isinstance(module, QuantEmbedding):
                quant[ir.Dequantize(module.embedding_dim, module.weight_format, dt)] = None
            elif isinstance(module, Fp8Linear):  # its activations' e4m3 rows (CUDA only, as fp8 quantisation)
                quant[ir.QuantizeRows(module.in_features, dt)] = None
        return ops + list(quant)

    def prologue_op(self, cache_write):
        """The attention prologue of a layer as one ir.QKVRopeCache over the packed qkv projection, for the cache
        cache_write (ir.ReshapeAndCache) describes: q/k norms (Qwen3), RoPE (rotate-half, the model's scaled
        frequencies), the K/V write."""
        from uacompile import ir

        cfg = self.cfg
        return ir.QKVRopeCache(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cache_write.page_size, cache_write.dtype,
                               cache_write.kv_dtype, cfg.qk_norm, cfg.rms_norm_eps, cfg.rope_theta,
                               freq_factors=self.rope_freq_factors)

    def use_kernels(self, backend: TorchLayerOps) -> None:
        """Run the layer ops through a kernel backend (kernels.KernelBackend), its kernels built now; a backend that
        fuses the attention prologue (fuses_prologue) runs prologue_op in place of the norms, RoPE and cache write."""
        ops = self.layer_ops(self.dtype, backend.fuses_prologue)
        self.prologue = self.prologue_op(backend.ops.cache_write) if backend.fuses_prologue else None
        backend.prepare_layers(ops + ([self.prologue] if self.prologue is not None else []))
        self.layer_backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        ops = self.layer_backend
        x = ops.embed(self.model.embed_tokens, input_ids)
        tables = self.rope_tables(positions, x.dtype)  # the torch RoPE's, made if it runs
        theta, factors = self.cfg.rope_theta, self.rope_freq_factors

        def rope(t):
            return ops.rope(t, positions, theta, factors, tables)

        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, attn, ops)
        norm = self.model.norm
        return ops.rms_norm(x, norm.weight, norm.eps, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer_backend.linear(self.lm_head, hidden).float()

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], device="cpu",
                     dtype: torch.dtype = torch.float32, progress: bool = False, packed: frozenset = frozenset(),
                     quantization: str = "none") -> "LlamaForCausalLM":
        """The fused model in dtype on device, each checkpoint tensor read into its place (Weights.read_into,
        a plain dict of tensors is wrapped as TensorWeights): no second copy of the model on the host or device.
        Layers whose checkpoint tensors are stored in a block format of `packed` (the formats the model's backend
        runs packed) stay packed (QuantLinear / QuantEmbedding); quantization "q8_0" / "fp8" then quantises the
        float ones (quantize_)."""
        weights = weights if isinstance(weights, Weights) else TensorWeights(weights)
        with torch.device("meta"):  # no memory and no random init for the parameters that load_weights fills
            model = cls(cfg)
            model.fuse()
        model = model.to(dtype)
        model.keep_packed(weights, packed)
        model.load_weights(weights, device, progress)
        model.quantize_(quantization)
        return model.eval()

    @classmethod
    def random(cls, cfg: ModelConfig, device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0
               ) -> "LlamaForCausalLM":
        """Random weights made on the device (a model's shape without its checkpoint, for benchmarks): linear and
        embedding weights N(0, 0.02), norms 1."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to(dtype)
        model._allocate(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)
            if cfg.rope_freq_factors:
                model.rope_freqs.fill_(1.0)
        model._refresh_rope()
        model.fuse()
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its activations; packed weights are bytes)."""
        return self.model.norm.weight.dtype

    def _allocate(self, device) -> None:
        """Uninitialised parameters and buffers on device in their dtypes, for the meta ones (Module.to_empty, or
        empty_like of a meta tensor, does the same but imports sympy on the way: tens of MiB)."""
        for module in self.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.is_meta:
                    empty = torch.empty(p.shape, dtype=p.dtype, device=device)
                    setattr(module, name, nn.Parameter(empty, p.requires_grad))
            for name, b in list(module.named_buffers(recurse=False)):
                if b.is_meta:
                    setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))
        self._tie()

    def _tie(self) -> None:
        """A tied lm_head reads the embedding's weight (dense, or its packed rows)."""
        if not self.cfg.tie_word_embeddings:
            return
        if isinstance(self.lm_head, QuantLinear):
            self.lm_head.weight0 = self.model.embed_tokens.weight
        else:
            self.lm_head.weight = self.model.embed_tokens.weight

    def weight_formats(self) -> str:
        """How the projections are stored, counted by kind: "q4_k x 180, q6_k x 72" or "bfloat16 x 253"."""
        from collections import Counter

        kinds = Counter()
        for module in [*self.projections().values(), self.model.embed_tokens]:
            if isinstance(module, QuantLinear):
                kinds.update(p.weight_format for p in module.parts)
            elif isinstance(module, QuantEmbedding):
                kinds[module.weight_format] += 1
            elif isinstance(module, Fp8Linear):
                kinds["fp8_e4m3"] += 1
            else:
                kinds[str(module.weight.dtype).removeprefix("torch.")] += 1
        return ", ".join(f"{k} x {n}" for k, n in kinds.most_common())

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers on its device (a tied weight once)."""
        seen, total = set(), 0
        for t in [*self.parameters(), *self.buffers()]:
            if t.data_ptr() not in seen and not t.is_meta:
                seen.add(t.data_ptr())
                total += t.nbytes
        return total

    def decode_read_bytes(self) -> int:
        """The weight bytes a decode step reads: every projection and the lm_head whole (the embedding only gathers
        rows), in the form they are stored (packed, e4m3 + scales, or dense)."""
        from .quant import linear_weight_bytes

        heads = [] if not self.cfg.tie_word_embeddings else [self.lm_head]
        return sum(linear_weight_bytes(m) for m in [*self.projections().values(), *heads])

    def projections(self) -> dict[str, nn.Module]:
        """The matmul layers by module path: each layer's qkv, o, gate_up and down projections, and an untied lm_head."""
        out = {}
        for i, layer in enumerate(self.model.layers):
            for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                out[f"model.layers.{i}.{path}"] = layer.get_submodule(path)
        if not self.cfg.tie_word_embeddings:
            out["lm_head"] = self.lm_head
        return out

    def keep_packed(self, weights: Weights, packed: frozenset) -> None:
        """On the meta model: each projection whose checkpoint tensors are all stored in formats of `packed` becomes
        a QuantLinear over them (a run of rows a format), a block-quantised embedding a QuantEmbedding (with a tied
        lm_head a QuantLinear over its rows)."""
        if not packed:
            return
        places = self.checkpoint_places()
        by_target: dict[str, list[tuple[str, int, int]]] = {}
        for name, (target, start, stop) in places.items():
            by_target.setdefault(target, []).append((name, start, stop))
        cfg = self.cfg
        for path, module in self.projections().items():
            parts = sorted(by_target.get(f"{path}.weight", []), key=lambda p: p[1])
            formats = [weights.stored_format(name) if name in weights else None for name, _, _ in parts]
            if not parts or not all(f in packed for f in formats):
                continue
            runs: list[Part] = []
            for f, (_, start, stop) in zip(formats, parts):
                if runs and runs[-1].weight_format == f:
                    runs[-1] = Part(f, runs[-1].start, stop)
                else:
                    runs.append(Part(f, start, stop))
            self.set_submodule(path, QuantLinear(module.in_features, runs, module.bias is not None, self.dtype))
        fmt = weights.stored_format("model.embed_tokens.weight") if "model.embed_tokens.weight" in weights else None
        if fmt in packed:
            self.model.embed_tokens = QuantEmbedding(cfg.vocab_size, cfg.hidden_size, fmt, self.dtype)
            if cfg.tie_word_embeddings:
                self.lm_head = QuantLinear(cfg.hidden_size, [Part(fmt, 0, cfg.vocab_size)], False, self.dtype)

    def quantize_(self, quantization: str) -> None:
        """Quantise the float projections in place: "q8_0" into Q8_0 blocks (ggml's quantiser; the embedding too,
        as llama.cpp's Q8_0 files have it), "fp8" into e4m3 rows with a scale each (the lm_head stays in the model's
        dtype); "none" / "auto" leave them. Each dense weight is freed as its quantised form is made."""
        if quantization in ("none", "auto"):
            return
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        dtype = self.dtype
        with torch.no_grad():
            for path in list(self.projections()):  # paths only: a module held here would keep its dense weight
                module = self.get_submodule(path)
                if not isinstance(module, nn.Linear) or module.in_features % 32:
                    continue
                if quantization == "fp8" and path == "lm_head":
                    continue
                w, bias = module.weight, module.bias
                if quantization == "q8_0":
                    new = QuantLinear(module.in_features, [Part("q8_0", 0, module.out_features)], bias is not None,
                                      dtype, device=w.device)
                    new.weight0 = quantize_q8_0(w)
                else:
                    new = Fp8Linear(module.in_features, module.out_features, bias is not None, dtype, device=w.device)
                    new.weight, new.scale = fp8_rows(w)
                if bias is not None:
                    new.bias = bias
                self.set_submodule(path, new)
                del w, module
            emb = self.model.embed_tokens
            if quantization == "q8_0" and isinstance(emb, nn.Embedding) and self.cfg.hidden_size % 32 == 0:
                V, E = emb.weight.shape
                packed = QuantEmbedding(V, E, "q8_0", dtype, device=emb.weight.device)
                packed.weight = quantize_q8_0(emb.weight)
                self.model.embed_tokens = packed
                if self.cfg.tie_word_embeddings:
                    self.lm_head = QuantLinear(E, [Part("q8_0", 0, V)], False, dtype, device=emb.weight.device)
                self._tie()

    def checkpoint_places(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint (HF) name -> (this model's parameter or buffer, first row, end row): a fused projection
        holds its parts' rows in order (q, k, v; gate, up); a packed one (QuantLinear) in the buffer of the run of
        rows holding them; every other tensor fills its own parameter. A tied lm_head is the embedding (no place
        of its own)."""
        cfg = self.cfg
        places = {}
        for name, module in self.named_modules():
            if name == "lm_head" and cfg.tie_word_embeddings:
                continue
            if isinstance(module, (nn.Linear, QuantLinear)):
                places[f"{name}.weight"] = (f"{name}.weight", 0, module.out_features)
                if module.bias is not None:
                    places[f"{name}.bias"] = (f"{name}.bias", 0, module.out_features)
            elif isinstance(module, (nn.Embedding, QuantEmbedding)):
                places[f"{name}.weight"] = (f"{name}.weight", 0, module.num_embeddings)
            elif isinstance(module, RMSNorm):
                places[f"{name}.weight"] = (f"{name}.weight", 0, module.weight.shape[0])
        if cfg.rope_freq_factors:
            places["rope_freqs"] = ("rope_freqs", 0, cfg.head_dim // 2)
        H, Hkv, D, F_ = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        fused = {"self_attn.qkv_proj": (("self_attn.q_proj", H * D), ("self_attn.k_proj", Hkv * D),
                                        ("self_attn.v_proj", Hkv * D)),
                 "mlp.gate_up_proj": (("mlp.gate_proj", F_), ("mlp.up_proj", F_))}
        for i in range(cfg.num_layers):
            for whole, parts in fused.items():
                for kind in ("weight", "bias"):
                    target = f"model.layers.{i}.{whole}.{kind}"
                    if places.pop(target, None) is None:
                        continue
                    row = 0
                    for part, rows in parts:
                        places[f"model.layers.{i}.{part}.{kind}"] = (target, row, row + rows)
                        row += rows
        for name, (target, start, stop) in list(places.items()):
            path, _, kind = target.rpartition(".")
            module = self.get_submodule(path) if path else None
            if kind == "weight" and isinstance(module, QuantLinear):
                buffer, a, b = module.place(start, stop)
                places[name] = (f"{path}.{buffer}", a, b)
        return places

    def load_weights(self, weights: Weights, device="cpu", progress: bool = False) -> None:
        """Strict load by HF name into this fused model on the meta device: a missing or unexpected tensor, or a
        wrong shape, is a ValueError. The parameters are made on device in their dtype, then each checkpoint
        tensor is read into its rows (packed rows as stored; rope_freqs at full precision for the rotary table)."""
        places = self.checkpoint_places()
        names = set(weights) - ({"lm_head.weight"} if self.cfg.tie_word_embeddings else set())
        missing, unexpected = sorted(set(places) - names), sorted(names - set(places))
        for what, found in (("is missing", missing), ("has unexpected", unexpected)):
            if found:
                raise ValueError(f"checkpoint {what} tensors: {found[:5]}{' ...' if len(found) > 5 else ''}")
        own = dict(self.named_parameters()) | dict(self.named_buffers())

        def logical_cols(target: str) -> tuple[int, ...]:
            t, module = own[target], self.get_submodule(target.rpartition(".")[0]) if "." in target else None
            if t.dtype == torch.uint8:  # packed rows: the checkpoint tensor's shape is the weights'
                return (getattr(module, "in_features", None) or module.embedding_dim,)
            return tuple(t.shape[1:])

        for name, (target, start, stop) in places.items():
            want, got = (stop - start, *logical_cols(target)), tuple(weights.shape(name))
            if got != want:
                raise ValueError(f"tensor {name}: shape {got} does not match the config's {want}")
        rope_freqs = None
        if "rope_freqs" in places:
            rope_freqs = torch.empty(weights.shape("rope_freqs"), dtype=torch.float32)
            weights.read_into("rope_freqs", rope_freqs)
        self._allocate(device)
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        from tqdm import tqdm

        total = sum(t.nbytes for t in own.values())
        with torch.no_grad(), tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", dynamic_ncols=True,
                                   disable=not progress or total < LOAD_PROGRESS_BYTES) as bar:
            for name, (target, start, stop) in places.items():
                out = own[target][start:stop]
                if name == "rope_freqs":
                    out.copy_(rope_freqs)
                elif out.dtype == torch.uint8:
                    weights.read_packed_into(name, out)
                else:
                    weights.read_into(name, out)
                bar.update(out.nbytes)
        self._refresh_rope(rope_freqs)
