"""CUDA paged attention against the float64 reference (GPU tests run on the device).

Every case draws fresh random inputs (testing.attention_inputs: scattered page tables,
-1 past each sequence's pages), poisons the outputs with NaN, and checks every element.
A mixed ubatch (decode tokens, a prefill chunk, a whole prefill) is the default, so one
launch exercises both block kinds. A kernel is the op and its AttentionConfig (ir.Kernel); the
call function plans one per launch (attention.plan). The CPU tests at the bottom cover the
template's IR checks and the layout's fit.
"""
from __future__ import annotations


import numpy as np
import pytest
from cuda_helpers import cuda_api_with, pa_kernel

from uacompile import IRError, ir, reference, testing
from uacompile.targets.cuda import attention
from uacompile.targets.cuda.config import AttentionConfig
from uacompile.targets.cuda.layout import layout
from uacompile.targets.cuda.plan import choose_config
from uacompile.targets.cuda.render import render_op

torch = pytest.importorskip("torch")

gpu = pytest.mark.gpu
PA = ir.PagedAttention
MIXED = dict(kv_lens=[37, 300, 129, 1, 64, 515], q_lens=[1, 45, 1, 1, 64, 1])

CASES = {
    "bf16-d128-g4-p16": PA(32, 8, 128, 16, "bf16", "bf16"),
    "fp16-d64-g1-p1": PA(4, 4, 64, 1, "fp16", "fp16"),
    "bf16-d80-g2-p2": PA(8, 4, 80, 2, "bf16", "bf16"),
    "fp16-d96-g16-p256": PA(16, 1, 96, 256, "fp16", "fp16"),
    "bf16-d256-g4-p32": PA(8, 2, 256, 32, "bf16", "bf16"),
    "fp16-d128-g8-p64-lse": PA(16, 2, 128, 64, "fp16", "fp16", return_lse=True),
    "fp16-d128-g4-p4": PA(8, 2, 128, 4, "fp16", "fp16"),
    "bf16-int8-d128-g4-p16": PA(8, 2, 128, 16, "bf16", "int8"),
    "fp16-fp8-d128-g4-p8": PA(8, 2, 128, 8, "fp16", "fp8_e4m3"),
    "fp16-int8-d64-g2-p128": PA(4, 2, 64, 128, "fp16", "int8"),
    "bf16-fp8-d256-g2-p16": PA(4, 2, 256, 16, "bf16", "fp8_e4m3"),
    "bf16-window": PA(8, 2, 128, 16, "bf16", "bf16", window=50),
    "fp16-softcap": PA(8, 2, 128, 16, "fp16", "fp16", softcap=20.0, scale=0.3),
    "bf16-alibi": PA(8, 2, 128, 16, "bf16", "bf16", alibi=True),
    "int8-window-softcap-alibi-lse": PA(8, 4, 64, 16, "fp16", "int8", window=70, softcap=10.0, alibi=True,
                                       return_lse=True),
    "unified-fp16-d128-g4": PA(8, 2, 128, 16, "fp16", "fp16", variant="unified_masked", return_lse=True),
    "unified-bf16-d64-g1-p1": PA(2, 2, 64, 1, "bf16", "bf16", variant="unified_masked"),
}
SPLIT_CASES = {  # kernels writing split-KV partials (no merge)
    "bf16-d128-g4-s3": pa_kernel(PA(8, 2, 128, 16, "bf16", "bf16"), num_splits=3),
    "int8-window-s4": pa_kernel(PA(8, 2, 64, 8, "fp16", "int8", window=90), num_splits=4),
}
CALL_OPS = [PA(32, 8, 128, 16, "bf16", "bf16", return_lse=True)]
CALL_SPLITS = (2, 5, 11)


def _all_ops():
    ops = [pa_kernel(op) for op in CASES.values()] + list(SPLIT_CASES.values())
    for op in CALL_OPS:  # the call function's kernels for a decode step (choose_config: decode-only)
        ops += [pa_kernel(op, num_splits=s, fused_merge=True, decode_only=True) for s in CALL_SPLITS]
        ops += [pa_kernel(op, decode_only=True)]
    return ops


@pytest.fixture(scope="module")
def api():
    return cuda_api_with(_all_ops())


def to_dev(a):
    a = np.ascontiguousarray(a)
    if a.dtype == ir.numpy_dtype("bf16"):
        return torch.from_numpy(a.view(np.uint16)).cuda().view(torch.bfloat16)
    if a.dtype == ir.numpy_dtype("fp8_e4m3"):
        return torch.from_numpy(a.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
    return torch.from_numpy(a).cuda()


def device_inputs(op, inputs: dict) -> dict:
    """inputs on the device, those op (an op or ir.Kernel) takes."""
    names = {p.name for p in op.tensors()}
    return {k: to_dev(v) for k, v in inputs.items() if k in names}


def reference_of(op, inputs: dict):
    """The float64 reference of op (an op: out, lse; an ir.Kernel: what its config writes, partials or merged)."""
    names = {p.name for p in op.tensors() if p.role == "in"}
    return reference.run(op, **{k: v for k, v in inputs.items() if k in names})


def check_close(name, got, want, tol):
    got = got.float().cpu().numpy().astype(np.float64)
    assert not np.isnan(got).any(), f"{name}: {np.isnan(got).sum()} elements unwritten (NaN poison) or NaN"
    inf = np.isinf(want)
    assert (np.isinf(got) == inf).all() and (got[inf] == want[inf]).all(), f"{name}: -inf (empty) pattern differs"
    err = np.abs(got[~inf] - want[~inf]).max(initial=0.0)
    rel = np.linalg.norm(got[~inf] - want[~inf]) / max(np.linalg.norm(want[~inf]), 1e-30)
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g} (rel {rel:.3g})"


def run_kernel(api, op, rng, kv_lens, q_lens):
    """One launch of op's kernel (an op: the default AttentionConfig) on fresh inputs, outputs poisoned."""
    op = pa_kernel(op)
    inputs = testing.attention_inputs(op.op, rng, kv_lens, q_lens)
    dev = device_inputs(op, inputs)
    T = inputs["num_tokens"]
    outs = {p.name: torch.full([T if d == "num_tokens" else d for d in p.shape], float("nan"),
                               dtype=torch.float32 if p.dtype == "fp32" else dev["q"].dtype, device="cuda")
            for p in op.tensors() if p.role == "out"}
    api.kernel(op)(**dev, **outs)
    torch.cuda.synchronize()
    return inputs, outs


def tol_of(op):
    return testing.tolerance(op.q_dtype, op.kv_dtype)


@gpu
@pytest.mark.parametrize("name", list(CASES))
def test_mixed_ubatch_matches_reference(api, rng, name):
    op = CASES[name]
    inputs, outs = run_kernel(api, op, rng, **MIXED)
    ref_out, ref_lse = reference_of(op, inputs)
    check_close(f"{name}.out", outs["out"], ref_out, tol_of(op))
    if op.return_lse:
        check_close(f"{name}.lse", outs["lse"], ref_lse, 2 * tol_of(op))


@gpu
@pytest.mark.parametrize("shape", ["decode", "prefill", "interleaved"])
def test_batch_shapes(api, rng, shape):
    op = CASES["bf16-d128-g4-p16"]
    if shape == "decode":  # 40 sequences, one token each: decode blocks only
        lens = rng.integers(1, 700, size=40).tolist()
        inputs, outs = run_kernel(api, op, rng, lens, [1] * 40)
    elif shape == "prefill":  # whole prompts, tile edges not on sequence edges
        inputs, outs = run_kernel(api, op, rng, [203, 77], [203, 77])
    else:  # tokens of one sequence not side by side: lone tokens and runs in any order
        inputs = testing.attention_inputs(op, rng, [90, 40, 150], [20, 1, 30])
        perm = np.concatenate([rng.permutation(20), 20 + np.arange(31)[::-1]])
        perm = np.concatenate([perm[:10], perm[40:], perm[10:40]])
        for k in ("q", "token_seq", "token_kv_len"):
            inputs[k] = np.ascontiguousarray(inputs[k][perm])
        dev = device_inputs(op, inputs)
        outs = {"out": torch.full_like(dev["q"], float("nan"))}
        api.kernel(pa_kernel(op))(**dev, **outs)
        torch.cuda.synchronize()
    check_close(shape, outs["out"], reference_of(op, inputs)[0], tol_of(op))


@gpu
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_partials_match_reference(api, rng, name):
    op = SPLIT_CASES[name]
    inputs, outs = run_kernel(api, op, rng, kv_lens=[2, 300, 129, 64, 515], q_lens=[1, 45, 1, 64, 1])
    ref_o, ref_lse = reference_of(op, inputs)  # the kernel's partials
    assert ref_o.ndim == 4
    check_close(f"{name}.o_partial", outs["o_partial"], ref_o, tol_of(op))
    check_close(f"{name}.lse_partial", outs["lse_partial"], ref_lse, 2 * tol_of(op))


@gpu
@pytest.mark.parametrize("splits", [None, 1, *CALL_SPLITS])
def test_call_function_with_merge(api, rng, splits):
    op = CALL_OPS[0]
    inputs = testing.attention_inputs(op, rng, [4000, 33, 1500], [1, 1, 1])
    dev = device_inputs(op, inputs)
    out = torch.full_like(dev["q"], float("nan"))
    lse = torch.full(dev["q"].shape[:2], float("nan"), device="cuda")
    attention.paged_attention(op, **dev, out=out, lse=lse, num_splits=splits)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_of(op, inputs)
    check_close("out", out, ref_out, tol_of(op))
    check_close("lse", lse, ref_lse, 2 * tol_of(op))


@gpu
def test_graph_capture_and_replay(api, rng):
    op = CALL_OPS[0].replace(return_lse=False)
    inputs = testing.attention_inputs(op, rng, [3000, 700], [1, 1])
    dev = device_inputs(op, inputs)
    assert choose_config(op, 2, 2, dev["page_table"].shape[1] * op.page_size).num_splits > 1
    out = torch.empty_like(dev["q"])
    ws = attention.Workspace(dev["q"].device)  # kept across calls: the capture allocates nothing
    attention.paged_attention(op, **dev, out=out, workspace=ws)  # warm-up: builds, grows the workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention.paged_attention(op, **dev, out=out, workspace=ws)
    for _ in range(2):  # fresh q and KV each replay, same buffers
        fresh = testing.attention_inputs(op, rng, [3000, 700], [1, 1])
        fresh["page_table"], fresh["num_pages"] = inputs["page_table"], inputs["num_pages"]
        for k in ("q", "k_cache", "v_cache"):
            dev[k].copy_(to_dev(fresh[k]))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_close("replay", out, reference_of(op, fresh)[0], tol_of(op))


@gpu
def test_call_errors_name_the_argument(api, rng):
    op = CALL_OPS[0]
    dev = device_inputs(op, testing.attention_inputs(op, rng, [40], [1]))
    with pytest.raises(TypeError, match="q"):
        attention.paged_attention(op, **{**dev, "q": dev["q"].float()})
    with pytest.raises(ValueError, match="q"):
        attention.paged_attention(op, **{**dev, "q": dev["q"][0]})
    with pytest.raises(ValueError, match="k_cache"):
        attention.paged_attention(op, **{**dev, "k_cache": dev["k_cache"][:, :8]})
    with pytest.raises(ValueError, match="num_splits"):
        attention.paged_attention(op, **dev, num_splits=0)


# ---------------------------------------------------------------- CPU: IR checks, layout
@pytest.mark.parametrize("bad, config, field", [
    (dict(q_dtype="fp32", kv_dtype="fp32"), {}, "q_dtype"),
    (dict(kv_dtype="fp32"), {}, "kv_dtype"),
    (dict(head_dim=72), {}, "head_dim"),
    (dict(num_q_heads=64, num_kv_heads=2), {}, "num_q_heads"),
    (dict(variant="unified_masked"), dict(num_splits=2), "num_splits"),
])
def test_template_rejects_what_it_does_not_cover(bad, config, field):
    op = PA(**{**dict(num_q_heads=8, num_kv_heads=2, head_dim=128, q_dtype="fp16", kv_dtype="fp16"), **bad})
    with pytest.raises(IRError, match=field):
        render_op(pa_kernel(op, **config))


def test_layout_matches_template_check():
    """The template static_asserts smem_bytes; here: it fits the SM and two blocks fit where promised."""
    for D in (64, 80, 96, 128, 256):
        for kv in ("fp16", "int8"):
            for config in (AttentionConfig(), AttentionConfig(decode_only=True)):
                lay = layout(PA(8, 2, D, 16, "fp16", kv), config)
                assert lay.smem_bytes <= 227 * 1024
                assert lay.blocks_per_sm >= 1
