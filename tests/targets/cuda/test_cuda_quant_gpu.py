"""Quantised-KV decode on the raw 8-bit K/V stage (docs/attention-rationale.md, "Quantised KV").

Decode warps attend the raw 8-bit K/V stage directly (register conversion, scales applied to the
scores and to P); head dims outside QFAST_D take the dequantising pass. The production build is checked
against the float64 reference: int8 and fp8_e4m3 KV,
fp16 and bf16 q, head_dim 64 and 128, kv lengths 1, page edges and long, 1 and several splits (fused
merge), mixed ubatches with prefill chunks (whose tiles keep the dequantising path). Outputs are
poisoned with NaN (run_fused).
"""
from __future__ import annotations

import numpy as np
import pytest

from uacompile import ir, testing

torch = pytest.importorskip("torch")
from cuda_helpers import cuda_api_with  # noqa: E402
from test_cuda_decode_gpu import MIXED, check_outputs, fused, run_fused  # noqa: E402

gpu = pytest.mark.gpu
PA = ir.PagedAttention

OPS = {
    "int8-bf16-d128-g4": PA(32, 8, 128, 16, "bf16", "int8", return_lse=True),
    "fp8-bf16-d128-g4": PA(32, 8, 128, 16, "bf16", "fp8_e4m3", return_lse=True),
    "int8-fp16-d64-g1": PA(8, 8, 64, 16, "fp16", "int8", return_lse=True),
    "fp8-fp16-d64-g8-p32": PA(16, 2, 64, 32, "fp16", "fp8_e4m3", return_lse=True),
    "int8-fp16-d128-g8-p32": PA(16, 2, 128, 32, "fp16", "int8"),
    "fp8-bf16-d64-g4": PA(16, 4, 64, 16, "bf16", "fp8_e4m3"),
}
# window + softcap + alibi (scores scaled by k before the soft-cap) and the unified_masked variant
OPTIONS = {
    "int8-window-softcap-alibi": PA(8, 4, 64, 16, "fp16", "int8", window=700, softcap=10.0, alibi=True, return_lse=True),
    "fp8-unified": PA(8, 2, 128, 16, "bf16", "fp8_e4m3", variant="unified_masked"),
}
SPLITS = (1, 3, 16)
# unified_masked is built with one split only (IR rule)
OPTION_CASES = [("int8-window-softcap-alibi", 1), ("int8-window-softcap-alibi", 7), ("fp8-unified", 1)]
# 1 position, page edges (16, 17, 32, 33), a stage edge (64, 65), long
DECODE_LENS = [1, 16, 17, 33, 64, 65, 5000, 2900]


def _ops():
    ops = [fused(op, s) for op in OPS.values() for s in SPLITS]
    ops += [fused(OPTIONS[name], s) for name, s in OPTION_CASES]
    return list(dict.fromkeys(ops))


@pytest.fixture(scope="module")
def quant_fast():
    """kernel_of(kernel): the module's kernels built at once (api.kernel)."""
    return cuda_api_with(_ops()).kernel


def check(kernel_of, name, op, splits, inputs):
    outs = run_fused(None, op, splits, inputs, kernel_of=kernel_of)
    check_outputs(f"{name}/s{splits}", op, inputs, outs["out"], outs.get("lse"))
    if splits > 1:
        assert not outs["split_counters"].any(), "the counters must be zero after the launch"


@gpu
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("name", list(OPS))
def test_quant_decode_matches_reference(quant_fast, rng, name, splits):
    op = OPS[name]
    check(quant_fast, name, op, splits, testing.attention_inputs(op, rng, DECODE_LENS))


@gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", ["int8-bf16-d128-g4", "fp8-fp16-d64-g8-p32"])
def test_quant_fast_mixed_ubatches(quant_fast, rng, name, splits):
    """Decode tokens (raw-stage path) beside prefill chunks (dequantising tiles) in one launch."""
    op = OPS[name]
    check(quant_fast, f"{name}/mixed", op, splits, testing.attention_inputs(op, rng, **MIXED))
    inputs = testing.attention_inputs(op, rng, [900, 400, 1500], [3, 3, 70])
    perm = np.concatenate([[0, 3, 1, 4, 2, 5], 6 + np.arange(70)[::-1]])  # lone tokens, then a reversed run
    for k in ("q", "token_seq", "token_kv_len"):
        inputs[k] = np.ascontiguousarray(inputs[k][perm])
    check(quant_fast, f"{name}/interleaved", op, splits, inputs)


@gpu
@pytest.mark.parametrize("name, splits", OPTION_CASES)
def test_quant_fast_with_options(quant_fast, rng, name, splits):
    op = OPTIONS[name]
    check(quant_fast, name, op, splits, testing.attention_inputs(op, rng, [2000, 299, 300, 301, 5, 900]))


@gpu
def test_quant_fast_scaled_caches(quant_fast, rng):
    """k scales x 4 (peaked softmax: the scores carry the k scale) and v scales x 0.25."""
    op = OPS["int8-bf16-d128-g4"]
    inputs = testing.attention_inputs(op, rng, [700, 3000, 1])
    inputs["k_scale"] = (inputs["k_scale"] * 4).astype(np.float32)
    inputs["v_scale"] = (inputs["v_scale"] * 0.25).astype(np.float32)
    check(quant_fast, "scaled", op, 3, inputs)
