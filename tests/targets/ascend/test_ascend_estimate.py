"""targets/ascend/estimate: per-shape estimates of the vector attention kernel, labelled as
estimates, in the manifest entry and printed by `uacompile build --target ascend`."""
from __future__ import annotations

import pytest

from uacompile.ir import PagedAttention, ReshapeAndCache
from uacompile.targets.ascend import build
from uacompile.targets.ascend.estimate import CLOCK_HZ, CYCLES_PER_DEPENDENT_INSTR, SHAPES, estimate, summary
from uacompile.targets.ascend.generate import SOCS, DEFAULT_SOC

OP = PagedAttention(32, 8, 128, 16)


def test_32_x_4k_decode_counts_and_floor():
    e = {x["shape"]: x for x in estimate(OP)}["decode 32 x 4K"]
    positions = 32 * 4096
    kv = positions * 8 * 128 * 2 * 2
    assert e["hbm_bytes"] == kv + 2 * 32 * 32 * 128 * 2
    assert e["hbm_floor_us"] == pytest.approx(e["hbm_bytes"] / 1.6e12 * 1e6) and 330 < e["hbm_floor_us"] < 340
    tiles = 32 * (4096 // e["tile"])
    assert e["vector_instructions"] == 32 * (4 * positions + 7 * tiles)
    assert e["matmul_flops"] == 4 * 32 * 128 * positions and e["cube_flops"] == 0
    vec_us = e["vector_instructions"] / SOCS[DEFAULT_SOC][0] * CYCLES_PER_DEPENDENT_INSTR / CLOCK_HZ * 1e6
    assert e["estimate_us"] == pytest.approx(e["hbm_floor_us"] + vec_us, rel=1e-3)
    assert e["vs_floor"] > 1.5  # the vector kernel is far from the floor (see the report)
    assert e["label"] == "estimate (not measured)" and "[estimate]" in summary(e)


def test_prefill_is_causal_and_every_shape_is_present():
    es = estimate(OP)
    assert [e["shape"] for e in es] == [s[0] for s in SHAPES]
    pre = es[-1]
    L = 16384
    assert pre["vector_instructions"] > 32 * 4 * L * (L + 1) // 2


def test_only_paged_attention_has_an_estimate():
    with pytest.raises(ValueError, match="paged_attention"):
        estimate(ReshapeAndCache(4, 64, 16))


def test_the_manifest_entry_carries_the_estimates(tmp_path):
    op = PagedAttention(4, 2, 32, 16)
    entry = build.build_and_verify(op, tmp_path)
    assert entry["verified"] == "emulator"
    assert [e["shape"] for e in entry["estimate"]] == [s[0] for s in SHAPES]
    assert all(e["label"] == "estimate (not measured)" for e in entry["estimate"])
