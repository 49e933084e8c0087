"""CPU: the KV-eviction templates (kv_score for every method, gather_tokens for float and 8-bit caches) render
with the IR launcher and compile with nvcc for sm_80 and sm_90, with no register spills."""
from __future__ import annotations

import shutil

import pytest

from uacompile import ir

from cuda_helpers import assert_renders_with_launcher, spill_stores

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

EVICT_VARIANTS = [ir.KVScore(32, 8, 128, 16, "bf16", "bf16", method=m) for m in ir.SCORE_METHODS] + [
    ir.KVScore(9, 3, 64, 16, "fp32", "fp32"), ir.KVScore(6, 6, 80, 8, "fp16", "fp16", 0.25, "attention"),
    ir.GatherTokens(8, 128, 16, "bf16"), ir.GatherTokens(8, 128, 16, "int8"), ir.GatherTokens(2, 64, 4, "fp8_e4m3"),
    ir.GatherTokens(3, 8, 16, "fp32")]


def test_render_has_the_ir_launcher():
    assert_renders_with_launcher(EVICT_VARIANTS)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_evict_ops_compile_and_export_launchers(arch):
    from uacompile.targets.cuda.build import build
    from uacompile.targets.cuda.loader import load_library

    res = build(EVICT_VARIANTS, arch)
    lib = load_library(res.path, EVICT_VARIANTS, res)
    for op in EVICT_VARIANTS:
        assert lib.function(op) is not None


def test_evict_ops_do_not_spill(tmp_path):
    assert max(spill_stores(EVICT_VARIANTS, tmp_path)) == 0
