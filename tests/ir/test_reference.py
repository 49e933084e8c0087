"""The reference is the spec, so it is checked against independent formulations."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from uacompile import reference as R
from uacompile import testing as U
from uacompile.ir import CopyBlocks, MergeState, PagedAttention, ReshapeAndCache, SwapBlocks, numpy_dtype


def arrays(d):
    return {k: v for k, v in d.items() if isinstance(v, np.ndarray)}


def dense_attention(op, d):
    """Independent formulation: gather each sequence's KV contiguously, then one masked
    matrix softmax per sequence with torch in float64."""
    K = R.dequantize(d["k_cache"], d["k_scale"]) if op.quantized else R.f64(d["k_cache"])
    V = R.dequantize(d["v_cache"], d["v_scale"]) if op.quantized else R.f64(d["v_cache"])
    q = torch.from_numpy(R.f64(d["q"]))
    out = torch.zeros_like(q)
    for s in range(d["num_seqs"]):
        toks = np.nonzero(d["token_seq"] == s)[0]
        L = int(d["token_kv_len"][toks].max())
        pages = d["page_table"][s][: -(-L // op.page_size)]
        k = torch.from_numpy(K[pages].reshape(-1, op.num_kv_heads, op.head_dim)[:L])
        v = torch.from_numpy(V[pages].reshape(-1, op.num_kv_heads, op.head_dim)[:L])
        k, v = k.repeat_interleave(op.group_size, 1), v.repeat_interleave(op.group_size, 1)
        lens = torch.from_numpy(d["token_kv_len"][toks].astype(np.int64))
        j = torch.arange(L)
        mask = j[None, :] < lens[:, None]
        if op.window:
            mask &= j[None, :] >= (lens[:, None] - op.window)
        s_ = torch.einsum("thd,jhd->thj", q[toks], k) * op.sm_scale
        if op.softcap:
            s_ = op.softcap * torch.tanh(s_ / op.softcap)
        if op.alibi:
            slopes = torch.from_numpy(R.f64(d["alibi_slopes"]))
            s_ = s_ + slopes[None, :, None] * (j[None, None, :] - (lens[:, None, None] - 1))
        s_ = s_.masked_fill(~mask[:, None, :], float("-inf"))
        out[toks] = torch.einsum("thj,jhd->thd", torch.softmax(s_, -1), v)
    return out.numpy()


@pytest.mark.parametrize("kw", [
    dict(),
    dict(kv_dtype="int8"),
    dict(kv_dtype="fp8_e4m3", q_dtype="bf16"),
    dict(window=7, softcap=20.0, alibi=True),
    dict(num_q_heads=8, num_kv_heads=8),
])
def test_paged_attention_matches_dense(rng, kw):
    op = PagedAttention(**{"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 16, "page_size": 4, **kw})
    d = U.attention_inputs(op, rng, kv_lens=[1, 3, 4, 5, 23], q_lens=[1, 2, 4, 1, 9])
    out, lse = R.paged_attention(op, **arrays(d))
    np.testing.assert_allclose(out, dense_attention(op, d), atol=1e-12)
    assert np.isfinite(lse).all()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(2, 6), st.integers(0, 2**31))
def test_split_kv_then_merge_equals_unsplit(kv_lens, splits, seed):
    rng = np.random.default_rng(seed)
    op = PagedAttention(4, 2, 8, 4, "fp32", "fp32", window=int(rng.integers(0, 12)), return_lse=True)
    d = arrays(U.attention_inputs(op, rng, kv_lens, [int(rng.integers(1, n + 1)) for n in kv_lens]))
    out, lse = R.paged_attention(op, **d)
    o_p, lse_p = R.paged_attention(op, **d, num_splits=splits)
    assert o_p.shape[0] == splits
    mo, ml = R.merge_state(MergeState(4, 8, splits, "fp32"), o_p, lse_p)
    np.testing.assert_allclose(mo, out, atol=1e-12)
    np.testing.assert_allclose(ml, lse, atol=1e-12)
    fo, fl = R.paged_attention(op, **d, split_counters=np.zeros((len(d["q"]), 2), np.int32),
                               num_splits=splits, fused_merge=True)  # the fused form: out, lse
    np.testing.assert_allclose(fo, out, atol=1e-12)
    np.testing.assert_allclose(fl, lse, atol=1e-12)


def test_split_ranges_cover_the_visible_range():
    assert R.split_ranges(3, 10, 3) == [(3, 6), (6, 9), (9, 10)]
    assert R.split_ranges(0, 2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert R.split_ranges(5, 5, 2) == [(5, 5), (5, 5)]


def test_merge_state_all_empty_is_zero_and_minus_inf():
    o = np.ones((3, 2, 1, 4), np.float32)
    lse = np.full((3, 2, 1), -np.inf, np.float32)
    out, l = R.merge_state(MergeState(1, 4, 3), o, lse)
    assert (out == 0).all() and np.isneginf(l).all()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantize_roundtrip_error_is_bounded(rng, kv_dtype):
    x = rng.standard_normal((64, 4, 32)).astype(np.float32) * 3
    q, s = R.quantize(x, kv_dtype)
    assert q.dtype == numpy_dtype(kv_dtype) and s.dtype == np.float32 and s.shape == (64, 4)
    err = np.abs(R.dequantize(q, s) - x) / np.abs(x).max(-1, keepdims=True)
    assert err.max() < (0.5 / 127 + 1e-6 if kv_dtype == "int8" else 1 / 16 + 1e-6)
    # the largest element of each row maps to the top of the range
    assert np.allclose(np.abs(R.f64(q)).max(-1), 127 if kv_dtype == "int8" else 448)


def test_quantize_zero_rows_have_unit_scale():
    q, s = R.quantize(np.zeros((2, 8), np.float32), "int8")
    assert (s == 1).all() and (q == 0).all()


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_matches_complex_rotation(rng, interleaved):
    x = rng.standard_normal((5, 2, 8))
    pos = np.array([0, 1, 7, 100, 3000])
    got = R.rope(x, pos, 10000.0, interleaved)
    if interleaved:
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., :4] + 1j * x[..., 4:]
    freqs = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    zr = z * np.exp(1j * pos[:, None, None] * freqs)
    want = np.empty_like(x)
    if interleaved:
        want[..., 0::2], want[..., 1::2] = zr.real, zr.imag
    else:
        want[..., :4], want[..., 4:] = zr.real, zr.imag
    np.testing.assert_allclose(got, want, atol=1e-12)
    assert np.allclose(R.rope(x, np.zeros(5), 10000.0, interleaved), x)


@pytest.mark.parametrize("kv_dtype,rope", [("fp16", False), ("int8", False), ("fp8_e4m3", True), ("bf16", True)])
def test_reshape_and_cache_writes_slots_and_skips_padding(rng, kv_dtype, rope):
    dtype = "bf16" if kv_dtype == "bf16" else "fp16"
    op = ReshapeAndCache(2, 8, 4, dtype, kv_dtype, rope=rope)
    d = U.reshape_and_cache_inputs(op, rng, num_tokens=10, num_pages=6)
    before = {k: v.copy() for k, v in arrays(d).items()}
    R.reshape_and_cache(op, **arrays(d))
    slots = d["slot_mapping"]
    touched = np.zeros((6, 4), bool)
    touched[slots[slots >= 0] // 4, slots[slots >= 0] % 4] = True
    for name in ("k_cache", "v_cache") + (("k_scale", "v_scale") if op.quantized else ()):
        assert (d[name][~touched].view(np.uint8) == before[name][~touched].view(np.uint8)).all(), name
    for t, s in enumerate(slots):
        if s < 0:
            continue
        v_written = d["v_cache"][s // 4, s % 4]
        if op.quantized:
            v_written = R.dequantize(v_written, d["v_scale"][s // 4, s % 4])
            assert np.abs(v_written - R.f64(d["v"][t])).max() <= 0.07 * np.abs(R.f64(d["v"][t])).max()
        else:
            assert (v_written == d["v"][t]).all()


def test_copy_and_swap_blocks_move_whole_pages_of_all_layers(rng):
    op = CopyBlocks(2, 8, 4, "int8")
    d = U.copy_blocks_inputs(op, rng, num_layers=3, num_pages=10, num_pairs=3)
    before = d["kv"].copy()
    R.copy_blocks(op, d["kv"], d["mapping"], d["scales"])
    for src, dst in d["mapping"]:
        assert (d["kv"][:, :, dst] == before[:, :, src]).all()
    untouched = np.setdiff1d(np.arange(10), d["mapping"][:, 1])
    assert (d["kv"][:, :, untouched] == before[:, :, untouched]).all()

    sop = SwapBlocks(2, 8, 4, "bf16")
    s = U.swap_blocks_inputs(sop, rng, num_layers=2, num_src_pages=5, num_dst_pages=7, num_pairs=4)
    R.swap_blocks(sop, s["src"], s["dst"], s["mapping"])
    for src, dst in s["mapping"]:
        assert (s["dst"][:, :, dst].view(np.uint16) == s["src"][:, :, src].view(np.uint16)).all()


def test_unified_masked_variant_has_ua_semantics(rng):
    op = PagedAttention(4, 1, 8, 2, "fp32", "fp32")
    d = arrays(U.attention_inputs(op, rng, [3, 9], [3, 1]))
    a, _ = R.paged_attention(op, **d)
    b, _ = R.paged_attention(op.replace(variant="unified_masked"), **d)
    assert (a == b).all()
