"""TVM lowering on the CPU (LLVM): every op against the numpy reference on fresh random inputs.

Kernels are built once per variant (cached through uacompile.cache), so the parametrisation
below reuses a small set of variants across many shapes.
"""
import time

import numpy as np
import pytest

import tvm  # noqa: F401

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from uacompile import IRError, reference, testing  # noqa: E402
from uacompile.ir import (CopyBlocks, Kernel, MergeState, PagedAttention, ReshapeAndCache, SwapBlocks,  # noqa: E402
                          as_kernel, numpy_dtype)
from uacompile.lower.config import TVMConfig  # noqa: E402
from uacompile.targets.cuda.config import AttentionConfig  # noqa: E402
from uacompile.lower import tvm_build  # noqa: E402
from uacompile.lower.tvm_build import cpu_kernel  # noqa: E402
from uacompile.lower.tvm_kernels import prim_func  # noqa: E402

BASE = PagedAttention(8, 2, 64, page_size=16)  # fp16, GQA 4


def tensors(d):
    return {k: v for k, v in d.items() if isinstance(v, np.ndarray)}


def poisoned_outputs(op, sizes):
    """Every output, NaN-filled (so an unwritten element fails the comparison)."""
    outs = {}
    for p in op.params():
        if p.role == "out":
            shape = [sizes[d] if isinstance(d, str) else d for d in p.shape]
            outs[p.name] = np.full(shape, np.nan, dtype=numpy_dtype(p.dtype))
    return outs


def split(op, num_splits, fused_merge=False) -> Kernel:
    return Kernel(op, TVMConfig(num_splits=num_splits, fused_merge=fused_merge))


def run_attention(op, inp):
    outs = poisoned_outputs(op, inp)
    if as_kernel(op).signature().get("fused_merge"):  # the workspace: zero on entry (and on exit)
        outs["split_counters"] = np.zeros((inp["num_tokens"], op.num_kv_heads), np.int32)
    cpu_kernel(op)(**tensors(inp), **outs)
    return outs


def check_attention(op, rng, kv_lens, q_lens=None, inp=None):
    inp = inp or testing.attention_inputs(op, rng, kv_lens, q_lens)
    outs = run_attention(op, inp)
    ref_o, ref_lse = reference.run(op, **tensors(inp))
    tol = testing.tolerance(op.q_dtype, op.kv_dtype)
    partials = "o_partial" in outs and "out" not in outs
    got = outs["o_partial" if partials else "out"].astype(np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN) outputs"
    np.testing.assert_allclose(got, ref_o, atol=tol, rtol=0)
    lse_name = "lse_partial" if partials else ("lse" if op.return_lse else None)
    if lse_name:
        lse = outs[lse_name]
        assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=max(tol, 1e-4), rtol=1e-4)
    return inp, outs


# ---------------------------------------------------------------- paged attention
@pytest.mark.parametrize("kv_lens,q_lens", [
    ([1], [1]),
    ([15], [1]),  # P - 1
    ([16], [1]),  # P
    ([17], [1]),  # P + 1
    ([300], [1]),  # many pages
    ([1, 15, 16, 17, 300], None),  # decode batch
    ([40, 7, 33, 90], [40, 1, 5, 17]),  # mixed: full prefill, decode, chunked prefill
])
def test_attention_lengths(rng, kv_lens, q_lens):
    check_attention(BASE, rng, kv_lens, q_lens)


@pytest.mark.parametrize("op", [
    PagedAttention(4, 4, 8, page_size=4, q_dtype="fp32", kv_dtype="fp32", return_lse=True),  # GQA 1, D 8
    PagedAttention(8, 1, 128, q_dtype="bf16", kv_dtype="bf16"),  # GQA 8, D 128
    PagedAttention(4, 2, 256, page_size=8, return_lse=True),  # D 256
    PagedAttention(8, 2, 64, q_dtype="fp16", kv_dtype="fp32", scale=0.3),  # fp32 KV, explicit scale
], ids=["gqa1-d8-fp32", "gqa8-d128-bf16", "d256-fp16", "fp32kv-scale"])
def test_attention_shapes_dtypes(rng, op):
    check_attention(op, rng, [1, 9, 33, 70], [1, 9, 4, 1])


def test_attention_window_softcap_alibi(rng):
    op = PagedAttention(8, 2, 64, q_dtype="fp32", kv_dtype="fp32", window=20, softcap=15.0, alibi=True,
                        return_lse=True)
    inp = testing.attention_inputs(op, rng, [5, 20, 21, 64, 130], [5, 1, 3, 30, 1])
    inp["q"] = inp["q"] * np.float32(4)  # large logits so the soft-cap bites
    check_attention(op, rng, None, inp=inp)


@pytest.mark.parametrize("op", [
    PagedAttention(8, 2, 64, kv_dtype="int8", return_lse=True),
    PagedAttention(8, 2, 128, q_dtype="bf16", kv_dtype="fp8_e4m3"),
    PagedAttention(4, 1, 64, page_size=8, q_dtype="fp32", kv_dtype="fp8_e4m3", alibi=True, window=12),
], ids=["int8", "fp8-bf16", "fp8-alibi-window"])
def test_attention_quantized_kv(rng, op):
    check_attention(op, rng, [1, 8, 9, 50], [1, 8, 2, 1])


def test_attention_splits_and_merge_state(rng):
    """Split-KV partials match the reference split contract (incl. empty splits), and
    merge_state of them equals the unsplit attention."""
    inp, outs = check_attention(split(PagedAttention(8, 2, 64), 3), rng, [1, 2, 16, 45, 200], [1, 2, 3, 1, 9])
    assert np.isneginf(outs["lse_partial"]).any(), "want some empty splits in this case"
    merge = MergeState(8, 64, 3, out_dtype="fp16", return_lse=True)
    merged = poisoned_outputs(merge, inp)
    cpu_kernel(merge)(o_partial=outs["o_partial"], lse_partial=outs["lse_partial"], **merged)
    whole = BASE.replace(return_lse=True)
    full = run_attention(whole, inp)
    np.testing.assert_allclose(merged["out"].astype(np.float64), full["out"].astype(np.float64), atol=2e-3)
    np.testing.assert_allclose(merged["lse"], full["lse"], atol=1e-4)


@pytest.mark.parametrize("op", [split(PagedAttention(8, 2, 64, return_lse=True), 3, True),
                                split(PagedAttention(8, 4, 64, kv_dtype="int8", window=30, alibi=True), 4, True)],
                         ids=["lse", "int8-window-alibi"])
def test_attention_fused_merge(rng, op):
    """fused_merge writes out (and lse) itself; its partials follow the split contract; the
    counter workspace is zero again afterwards."""
    inp, outs = check_attention(op, rng, [1, 2, 16, 45, 200], [1, 2, 3, 1, 9])
    ref_o, ref_lse = reference.paged_attention(op.op, **tensors(inp), num_splits=op.config.num_splits)
    np.testing.assert_allclose(outs["o_partial"], ref_o, atol=testing.tolerance(op.q_dtype, op.kv_dtype), rtol=0)
    assert (np.isneginf(outs["lse_partial"]) == np.isneginf(ref_lse)).all()
    assert not outs["split_counters"].any()


def test_unified_masked_equals_ua(rng):
    unified = BASE.replace(variant="unified_masked", return_lse=True)
    inp, outs = check_attention(unified, rng, [40, 7, 33, 90], [40, 1, 5, 17])
    ua = run_attention(BASE.replace(return_lse=True), inp)
    np.testing.assert_allclose(outs["out"].astype(np.float64), ua["out"].astype(np.float64), atol=2e-3)
    np.testing.assert_allclose(outs["lse"], ua["lse"], atol=1e-4)


def test_unified_masked_all_options(rng):
    op = split(PagedAttention(8, 2, 64, page_size=8, q_dtype="fp32", kv_dtype="int8", window=25, alibi=True,
                              softcap=20.0, variant="unified_masked"), 2)
    check_attention(op, rng, [1, 8, 30, 61], [1, 3, 1, 20])


def test_unified_masked_skips_unused_table_entries(rng):
    """-1 entries must never be read: point a poisoned page at nothing and scramble free pages."""
    op = BASE.replace(variant="unified_masked")
    inp = testing.attention_inputs(op, rng, [3, 50, 17])
    used = set(inp["page_table"][inp["page_table"] >= 0].tolist())
    for p in range(inp["num_pages"]):
        if p not in used:  # pages no sequence owns: NaN (read them and the output is NaN)
            inp["k_cache"][p] = np.nan
            inp["v_cache"][p] = np.nan
    check_attention(op, rng, None, inp=inp)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_attention_property_random_ubatches(data):
    """Random mixes of sequence lengths and query chunks, over a few page sizes."""
    P = data.draw(st.sampled_from([1, 4, 16]), label="page_size")
    op = BASE.replace(page_size=P, num_q_heads=4, num_kv_heads=2, head_dim=16, return_lse=True)
    n = data.draw(st.integers(1, 5), label="num_seqs")
    kv_lens = data.draw(st.lists(st.integers(1, 70), min_size=n, max_size=n), label="kv_lens")
    q_lens = [data.draw(st.integers(1, L), label="q_len") for L in kv_lens]
    seed = data.draw(st.integers(0, 2 ** 32 - 1), label="seed")
    check_attention(op, np.random.default_rng(seed), kv_lens, q_lens)


def test_attention_torch_cpu_tensors(rng):
    import torch
    op = PagedAttention(8, 2, 64, q_dtype="bf16", kv_dtype="bf16")
    inp = testing.attention_inputs(op, rng, [5, 40], [5, 1])
    as_torch = {k: torch.from_numpy(v.view(np.uint16)).view(torch.bfloat16) if v.dtype == numpy_dtype("bf16")
                else torch.from_numpy(v) for k, v in tensors(inp).items()}
    out = torch.full((inp["num_tokens"], 8, 64), float("nan"), dtype=torch.bfloat16)
    cpu_kernel(op)(**as_torch, out=out)
    ref, _ = reference.paged_attention(op, **tensors(inp))
    np.testing.assert_allclose(out.float().numpy(), ref, atol=testing.tolerance("bf16"))


# ---------------------------------------------------------------- reshape_and_cache
def same_bits(a, b):
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def run_reshape(op, rng, num_tokens=23):
    num_pages = 2 * num_tokens // op.page_size + 2  # room for scattered slots, some cells left alone
    inp = testing.reshape_and_cache_inputs(op, rng, num_tokens, num_pages)
    got = {k: v.copy() for k, v in tensors(inp).items()}
    cpu_kernel(op)(**got)
    want = {k: v.copy() for k, v in tensors(inp).items()}
    reference.reshape_and_cache(op, **want)
    return got, want


@pytest.mark.parametrize("op", [
    ReshapeAndCache(2, 64, dtype="fp16", kv_dtype="fp16"),
    ReshapeAndCache(1, 128, page_size=4, dtype="bf16", kv_dtype="bf16"),
    ReshapeAndCache(2, 64, dtype="fp16", kv_dtype="int8"),
    ReshapeAndCache(4, 32, page_size=8, dtype="bf16", kv_dtype="fp8_e4m3"),
    ReshapeAndCache(2, 8, page_size=2, dtype="fp32", kv_dtype="fp8_e4m3"),
], ids=["fp16", "bf16", "fp16-int8", "bf16-fp8", "fp32-fp8"])
def test_reshape_and_cache_bit_exact(rng, op):
    """Copies and quantisation (values and per token-head scales) match the reference bit for bit;
    slot -1 tokens and every other cell stay untouched."""
    got, want = run_reshape(op, rng)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        if name in want:
            assert same_bits(got[name], want[name]), name


def test_quantize_fp8_edge_values(rng):
    """fp8 encoding: subnormals, the 2^-6 boundary, ties, saturation, zeros (whole row zero -> scale 1)."""
    op = ReshapeAndCache(1, 16, page_size=1, dtype="fp32", kv_dtype="fp8_e4m3")
    row = np.array([448, -448, 1e-3, -2 ** -7, 2 ** -6 * 0.999, 2 ** -9 * 1.5, 2 ** -9 * 2.5, 3.3, 1.0625, 1.1875,
                    -0.0, 17.5, 2 ** -10, 200.0, -5e-4, 0.5], np.float32)
    k = np.stack([row, np.zeros_like(row)])[:, None, :]
    inp = dict(k=k, v=k[::-1].copy(), slot_mapping=np.array([0, 1], np.int64),
               k_cache=np.zeros((2, 1, 1, 16), numpy_dtype("fp8_e4m3")), v_cache=np.zeros((2, 1, 1, 16), numpy_dtype("fp8_e4m3")),
               k_scale=np.zeros((2, 1, 1), np.float32), v_scale=np.zeros((2, 1, 1), np.float32))
    got = {n: a.copy() for n, a in inp.items()}
    cpu_kernel(op)(**got)
    reference.reshape_and_cache(op, **inp)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert same_bits(got[name], inp[name]), name


@pytest.mark.parametrize("op", [
    ReshapeAndCache(2, 64, dtype="fp16", kv_dtype="fp16", rope=True),
    ReshapeAndCache(2, 32, page_size=8, dtype="bf16", kv_dtype="int8", rope=True, rope_interleaved=True,
                    rope_theta=500000.0),
], ids=["neox-fp16", "gptj-bf16-int8"])
def test_reshape_and_cache_rope(rng, op):
    got, want = run_reshape(op, rng)
    if op.quantized:  # compare dequantised: a 1-ulp difference before quantisation may move a step
        g = reference.dequantize(got["k_cache"], got["k_scale"])
        w = reference.dequantize(want["k_cache"], want["k_scale"])
        np.testing.assert_allclose(g, w, atol=3e-2 * np.abs(w).max())
        assert same_bits(got["v_cache"], want["v_cache"]) and same_bits(got["v_scale"], want["v_scale"])
    else:
        np.testing.assert_allclose(got["k_cache"].astype(np.float64), want["k_cache"].astype(np.float64),
                                   rtol=2e-3, atol=1e-3)
        assert same_bits(got["v_cache"], want["v_cache"])


def test_reshape_and_cache_torch_fp8(rng):
    import torch
    op = ReshapeAndCache(2, 32, page_size=8, dtype="fp16", kv_dtype="fp8_e4m3")
    inp = testing.reshape_and_cache_inputs(op, rng, 11, 4)
    want = {k: v.copy() for k, v in tensors(inp).items()}
    reference.reshape_and_cache(op, **want)
    t = {k: torch.from_numpy(v.view(np.uint8) if v.dtype == numpy_dtype("fp8_e4m3") else v.copy())
         for k, v in tensors(inp).items()}
    t["k_cache"], t["v_cache"] = t["k_cache"].view(torch.float8_e4m3fn), t["v_cache"].view(torch.float8_e4m3fn)
    cpu_kernel(op)(**t)
    assert same_bits(t["k_cache"].view(torch.uint8).numpy(), want["k_cache"])
    assert same_bits(t["v_scale"].numpy(), want["v_scale"])


# ---------------------------------------------------------------- copy / swap / merge
@pytest.mark.parametrize("op", [CopyBlocks(2, 64, kv_dtype="fp16"), CopyBlocks(1, 32, page_size=4, kv_dtype="int8")],
                         ids=["fp16", "int8-scales"])
def test_copy_blocks(rng, op):
    inp = testing.copy_blocks_inputs(op, rng, num_layers=3, num_pages=12, num_pairs=5)
    got = {k: v.copy() for k, v in tensors(inp).items()}
    cpu_kernel(op)(**got)
    reference.copy_blocks(op, **tensors(inp))
    assert same_bits(got["kv"], inp["kv"])
    if op.quantized:
        assert same_bits(got["scales"], inp["scales"])


@pytest.mark.parametrize("op", [SwapBlocks(2, 64, kv_dtype="bf16"), SwapBlocks(1, 16, page_size=8, kv_dtype="fp8_e4m3")],
                         ids=["bf16", "fp8-scales"])
def test_swap_blocks(rng, op):
    inp = testing.swap_blocks_inputs(op, rng, num_layers=2, num_src_pages=7, num_dst_pages=11, num_pairs=4)
    got = {k: v.copy() for k, v in tensors(inp).items()}
    cpu_kernel(op)(**got)
    reference.swap_blocks(op, **tensors(inp))
    assert same_bits(got["dst"], inp["dst"]) and same_bits(got["src"], inp["src"])
    if op.quantized:
        assert same_bits(got["dst_scales"], inp["dst_scales"])


@pytest.mark.parametrize("op", [MergeState(4, 64, 3, out_dtype="fp32", return_lse=True),
                                MergeState(2, 128, 5, out_dtype="bf16")], ids=["fp32-lse", "bf16"])
def test_merge_state(rng, op):
    inp = testing.merge_state_inputs(op, rng, num_tokens=17, empty_fraction=0.3)
    inp["lse_partial"][:, 0] = -np.inf  # a token with every split empty
    inp["o_partial"][:, 0] = 0
    outs = poisoned_outputs(op, inp)
    cpu_kernel(op)(**tensors(inp), **outs)
    ref_o, ref_lse = reference.merge_state(op, **tensors(inp))
    tol = {"fp32": 1e-5, "bf16": 1.6e-2}[op.out_dtype]
    np.testing.assert_allclose(outs["out"].astype(np.float64), ref_o, atol=tol, rtol=tol)
    if op.return_lse:
        assert (np.isneginf(outs["lse"]) == np.isneginf(ref_lse)).all()
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(outs["lse"][fin], ref_lse[fin], atol=1e-5)


# ---------------------------------------------------------------- cache, errors
def test_second_build_is_a_cache_hit(rng, monkeypatch):
    op = MergeState(2, 8, 2, out_dtype="fp32")
    cpu_kernel(op)  # built (or already cached)
    monkeypatch.setattr(tvm_build, "_loaded", {})  # forget the in-process copy

    def no_codegen(*a, **k):
        raise AssertionError("a cache hit must not generate or compile TIR")

    monkeypatch.setattr(tvm_build, "prim_func", no_codegen)
    t0 = time.perf_counter()
    k = cpu_kernel(op)
    assert k.cache_hit and time.perf_counter() - t0 < 1.0
    inp = testing.merge_state_inputs(op, rng, 5)
    outs = poisoned_outputs(op, inp)
    k(**tensors(inp), **outs)
    np.testing.assert_allclose(outs["out"], reference.merge_state(op, **tensors(inp))[0], atol=1e-5)


def test_call_errors(rng):
    op = MergeState(2, 8, 2, out_dtype="fp32")
    k = cpu_kernel(op)
    inp = tensors(testing.merge_state_inputs(op, rng, 4))
    out = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(TypeError, match="merge_state: missing tensor argument 'out'"):
        k(**inp)
    with pytest.raises(TypeError, match="merge_state: unexpected argument 'bogus'"):
        k(**inp, out=out, bogus=1)
    with pytest.raises(TypeError, match="merge_state.out: expected dtype float32, got float16"):
        k(**inp, out=out.astype(np.float16))
    with pytest.raises(ValueError, match="out: dim 0 .num_tokens. is 5"):
        k(**inp, out=np.zeros((5, 2, 8), np.float32))
    with pytest.raises(ValueError, match="out: dim 2 must be 8"):
        k(**inp, out=np.zeros((4, 2, 9), np.float32))
    with pytest.raises(ValueError, match="num_tokens: given 3"):
        k(**inp, out=out, num_tokens=3)
    with pytest.raises(ValueError, match="o_partial: must be C-contiguous"):
        k(**{**inp, "o_partial": np.asfortranarray(inp["o_partial"])}, out=out)
    with pytest.raises(TypeError, match="lse_partial: expected a numpy array"):
        k(**{**inp, "lse_partial": inp["lse_partial"].tolist()}, out=out)
    k(**inp, out=out, num_tokens=4)  # explicit sizes are fine when they agree


def test_bad_ir_and_target():
    with pytest.raises(IRError, match="num_q_heads"):
        PagedAttention(6, 4, 64)
    with pytest.raises(ValueError, match="target"):
        prim_func(BASE, "rocm")
    with pytest.raises(IRError, match="item_queue"):  # the CUDA Hopper path's schedule: no TVM lowering takes it
        prim_func(Kernel(BASE, AttentionConfig(item_queue=True)), "cpu")
    with pytest.raises(TypeError, match="op"):
        cpu_kernel({"op": "merge_state"})
