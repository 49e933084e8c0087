"""CPU: the quantize_rows template (ir.QuantizeRows: rows to e4m3 / int8 with a float32 scale each) renders with the
IR launcher, compiles with nvcc for sm_80 and sm_90 without spills; the op checks its fields and the friendly call
its arguments before any device work; the reference is the KV caches' quantiser row by row."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from uacompile import IRError, ir, reference

from cuda_helpers import assert_renders_with_launcher, spill_stores

Q = ir.QuantizeRows
# Qwen3-8B's projection inputs (hidden 4096, intermediate 12288), a one-vector row, an odd width (1-element vectors)
VARIANTS = [Q(4096, "bf16"), Q(12288, "bf16"), Q(4096, "fp16", "int8"), Q(8, "fp32"), Q(27, "fp16"), Q(576, "bf16", "int8")]
nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def test_fields_are_checked():
    with pytest.raises(IRError, match="quantize_rows.out_dtype"):
        Q(4096, "bf16", "fp16")
    with pytest.raises(IRError, match="quantize_rows.dtype"):
        Q(4096, "int8")
    with pytest.raises(IRError, match="quantize_rows.hidden_size"):
        Q(0)
    assert [p.name for p in Q(64).params()] == ["x", "out", "scale", "num_tokens"]
    assert ir.op_from_dict(Q(64, "fp16", "int8").to_dict()) == Q(64, "fp16", "int8")


def test_reference_is_the_kv_quantiser_a_row_at_a_time(rng):
    x = rng.standard_normal((5, 64)).astype(np.float32) * np.array([1, 1e-3, 1e3, 0, 1], np.float32)[:, None]
    x[4, 7] = np.nan
    for out_dtype in ir.QUANT_DTYPES:
        with np.errstate(invalid="ignore"):  # int8 has no NaN: the cast's value is numpy's
            out, scale = reference.run(Q(64, "fp32", out_dtype), x=x)
            rows = [reference.quantize(x[t], out_dtype) for t in range(5)]
        for t, (q, s) in enumerate(rows):
            assert np.array_equal(out[t].view(np.uint8), np.asarray(q).view(np.uint8)) and scale[t] == s
    out, scale = reference.run(Q(64, "fp32"), x=x)
    assert scale[3] == 1 and scale[4] == 1 and np.isnan(out[4, 7].astype(np.float32))  # zero row, NaN row
    assert np.abs(out[:3].astype(np.float32)).max(axis=1).tolist() == [448.0] * 3


def test_render_has_the_ir_launcher():
    assert_renders_with_launcher(VARIANTS)


@nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_and_exports_launchers(arch):
    from uacompile.targets.cuda.build import build
    from uacompile.targets.cuda.loader import load_library

    res = build(VARIANTS, arch)
    lib = load_library(res.path, VARIANTS, res)
    assert all(lib.function(op) is not None for op in VARIANTS)


@nvcc
def test_does_not_spill(tmp_path):
    assert max(spill_stores(VARIANTS, tmp_path)) == 0


def test_friendly_call_rejects_bad_arguments():
    torch = pytest.importorskip("torch")
    from uacompile.targets.cuda import api

    with pytest.raises(ValueError, match=r"x: expected 2 dims"):
        api.quantize_rows(torch.zeros(4, 2, 8))
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        api.quantize_rows(torch.zeros(4, 8), "fp16")
