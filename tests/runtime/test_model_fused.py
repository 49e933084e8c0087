"""The model's fused layers on the CPU: fuse() merges q/k/v and gate/up (biases too) from the HF names; the
layer ops run through a backend's kernels (here the TVM CPU kernels of ir.RMSNorm / SiluAndMul / Rope, on
the same KernelLayerOps code the CUDA backend runs) give transformers' logits, as the torch layers do, with
each op called as often as the model's layers need, scaled RoPE (linear, llama3) included."""
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tvm")

from model_helpers import hf_logits, make_hf_model, runtime_logits, saved_hf_model  # noqa: E402

from uacompile import ir  # noqa: E402
from uacompile.runtime import LLM  # noqa: E402
from uacompile.runtime.kernels import KernelLayerOps  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {"hidden_size": 48}),
}


class TVMLayerOps(KernelLayerOps):
    """KernelLayerOps on the TVM CPU kernels, counting launches per op kind."""

    def __init__(self):
        self.launches: dict[str, int] = {}

    def build_layer_kernel(self, op):
        from uacompile.lower.tvm_build import cpu_kernel

        kern = cpu_kernel(op)

        def launch(**tensors):
            self.launches[op.kind] = self.launches.get(op.kind, 0) + 1
            kern(**tensors)

        return launch


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    return (request.param, *saved_hf_model(tmp_path_factory, request.param, arch, len(request.param), **overrides))


def test_fuse_merges_projections_with_biases(tmp_path):
    hf = make_hf_model("qwen2", seed=3)
    hf.save_pretrained(tmp_path)
    model = LLM(str(tmp_path), cpu_threads=1, page_size=4, num_pages=16).engine.model
    sd = hf.state_dict()
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")
        p = f"model.layers.{i}."
        for name, parts in (("weight", ("q_proj", "k_proj", "v_proj")), ("bias", ("q_proj", "k_proj", "v_proj"))):
            want = torch.cat([sd[f"{p}self_attn.{n}.{name}"] for n in parts])
            assert torch.equal(getattr(attn.qkv_proj, name), want)
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]]))
        assert mlp.gate_up_proj.bias is None


def test_layer_ops_of_a_model(case):
    name, _, path = case
    model = LLM(str(path), cpu_threads=1, page_size=4, num_pages=16).engine.model
    ops = model.layer_ops(torch.float32)
    cfg = model.cfg
    assert ir.RMSNorm(cfg.hidden_size, "fp32", cfg.rms_norm_eps, True) in ops
    assert ir.SiluAndMul(cfg.intermediate_size, "fp32") in ops
    assert (ir.RMSNorm(cfg.head_dim, "fp32", cfg.rms_norm_eps) in ops) == (name == "qwen3-qk-norm")
    rope = [op for op in ops if op.kind == "rope"]
    assert {op.num_heads for op in rope} == {cfg.num_heads, cfg.num_kv_heads}
    assert all(op.rope_theta == cfg.rope_theta and op.freq_factors == model.rope_freq_factors for op in rope)
    factors = np.array(model.rope_freq_factors)
    if name == "llama-linear-rope":
        np.testing.assert_allclose(factors, 4.0, rtol=1e-15)
    elif name == "llama3-rope":  # high frequencies kept, low ones divided by 8, a smooth band between
        assert factors[0] == 1.0 and factors[-1] == 8.0 and len(set(factors.tolist())) > 2
    else:
        assert model.rope_freq_factors == ()


def test_kernel_layers_match_transformers_and_torch_layers(case):
    name, model, path = case
    llm = LLM(str(path), cpu_threads=1, page_size=4, num_pages=64)
    prompts = [np.random.default_rng(5).integers(3, 512, size=n).tolist() for n in (13, 9, 6)]
    chunks = [[5, 4, 1, 1, 1, 1], [1] * 9, [6]]
    runtime = llm.engine.model
    assert not isinstance(runtime.layer_backend, KernelLayerOps)  # the CPU backend's layer ops are torch's
    torch_rows = runtime_logits(llm.engine.executor, prompts, chunks, np.random.default_rng(7))
    layers = TVMLayerOps()
    runtime.use_kernels(layers)
    kernel_rows = runtime_logits(llm.engine.executor, prompts, chunks, np.random.default_rng(7))
    cfg, steps = runtime.cfg, max(map(len, chunks))  # the executor steps of the chunk plan above
    per_step = dict(rms_norm=(2 + 2 * cfg.qk_norm) * cfg.num_layers + 1, silu_and_mul=cfg.num_layers,
                    rope=2 * cfg.num_layers)
    assert layers.launches == {k: v * steps for k, v in per_step.items()}
    for ids, by_torch, by_kernels in zip(prompts, torch_rows, kernel_rows):
        want = hf_logits(model, ids)
        for pos, row in by_kernels.items():
            scale = np.abs(want[pos]).max()
            np.testing.assert_allclose(row, want[pos], atol=2e-4 * scale, rtol=0, err_msg=f"{name}: position {pos}")
            np.testing.assert_allclose(row, by_torch[pos], atol=2e-5 * scale, rtol=0, err_msg=f"{name}: position {pos}")
