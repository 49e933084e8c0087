"""TVM lowering of the KV-eviction ops on the CPU against the float64 reference: kv_score (every method, GQA,
several sequences with interleaved window queries, one without any, scores past kv_len), outputs poisoned first;
gather_tokens bit for bit (float and 8-bit caches with their scales, skipped destinations)."""
import numpy as np
import pytest

pytest.importorskip("tvm")

from uacompile import reference, testing  # noqa: E402
from uacompile.ir import SCORE_METHODS, GatherTokens, KVScore  # noqa: E402
from uacompile.lower.tvm_build import cpu_kernel  # noqa: E402


def arrays(d):
    return {k: v for k, v in d.items() if isinstance(v, np.ndarray)}


SCORE_OPS = [KVScore(4, 2, 16, 4, "fp32", "fp32", method=m) for m in SCORE_METHODS] + [
    KVScore(8, 2, 32, 16, "fp16", "fp16", method="andpro"), KVScore(2, 2, 8, 8, "bf16", "bf16", method="value_norm"),
    KVScore(6, 1, 8, 2, "fp16", "fp32", 0.5, "attention")]


@pytest.mark.parametrize("op", SCORE_OPS, ids=lambda o: f"{o.method}-{o.q_dtype}-{o.kv_dtype}-G{o.group_size}")
def test_kv_score(op, rng):
    inp = testing.kv_score_inputs(op, rng, [37, 5, 20, 9], [6, 2, 0, 9], max_kv_len=41)
    want = reference.kv_score(op, **arrays(inp), max_kv_len=41)
    out = np.full(want.shape, np.nan, np.float32)
    cpu_kernel(op)(**arrays(inp), scores=out)
    assert (np.isneginf(out) == np.isneginf(want)).all()
    fin = np.isfinite(want)
    assert np.isfinite(out[fin]).all()
    tol = 2e-6 if op.q_dtype == "fp32" else 1e-3
    np.testing.assert_allclose(out[fin], want[fin], rtol=tol, atol=tol * np.abs(want[fin]).max())
    assert (out[2][fin[2]] == 0).all()  # no window query: nothing is known, every score 0


def test_kv_score_methods_differ(rng):
    ops = [KVScore(4, 2, 16, 4, "fp32", "fp32", method=m) for m in SCORE_METHODS]
    inp = testing.kv_score_inputs(ops[0], rng, [30], [4])
    outs = [reference.kv_score(op, **arrays(inp)) for op in ops]
    assert (outs[0] < 0).any() and (outs[1] > 0).all() and not np.allclose(outs[1], outs[2])
    np.testing.assert_allclose(outs[1].sum(axis=-1), 1.0)  # mean attention weights sum to one per KV head


@pytest.mark.parametrize("op", [GatherTokens(2, 16, 4, "fp32"), GatherTokens(3, 8, 16, "bf16"),
                                GatherTokens(2, 32, 8, "int8"), GatherTokens(1, 16, 4, "fp8_e4m3")],
                         ids=lambda o: f"{o.kv_dtype}-H{o.num_kv_heads}-P{o.page_size}")
def test_gather_tokens_bit_exact(op, rng):
    inp = testing.gather_tokens_inputs(op, rng, num_layers=3, num_src_pages=6, num_tokens=13)
    want = {k: v.copy() for k, v in arrays(inp).items()}
    reference.gather_tokens(op, want["kv"], want["src_slots"], want["dst_slots"], want.get("scales"))
    cpu_kernel(op)(**arrays(inp))
    np.testing.assert_array_equal(inp["kv"].view(np.uint8), want["kv"].view(np.uint8))
    if op.quantized:
        np.testing.assert_array_equal(inp["scales"], want["scales"])
