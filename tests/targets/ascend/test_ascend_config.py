"""targets/ascend/config.py's schedule fields (tile, block_dim): every value the generator takes gives the
reference's result on the CPU emulator (correctness only: the emulator says nothing of speed); values that do
not fit are one-line IRErrors."""
from __future__ import annotations

import pytest

from uacompile import IRError, testing
from uacompile.ir import Kernel, PagedAttention, ReshapeAndCache
from uacompile.targets.ascend.build import load
from uacompile.targets.ascend.config import AscendConfig
from uacompile.targets.ascend.generate import plan
from uacompile.targets.ascend.verify import attention_error, run_attention

OP = PagedAttention(4, 2, 64, 16)


@pytest.mark.parametrize("cfg", [AscendConfig(tile=4, block_dim=3), AscendConfig(tile=16, block_dim=1),
                                 AscendConfig(num_splits=2, tile=8, block_dim=5)], ids=["t4-b3", "t16-b1", "s2-t8-b5"])
def test_attention_tile_and_block_dim_give_the_reference(cfg, rng):
    k = Kernel(OP, cfg)
    p = plan(k)
    assert p.consts["TILE"] == cfg.tile and p.max_block_dim == cfg.block_dim
    inputs = testing.attention_inputs(OP, rng, [1, 15, 16, 17, 53, 40], [1, 1, 1, 1, 1, 9])
    err = attention_error(k, inputs, run_attention(load(k), inputs))
    assert err <= testing.tolerance(OP.q_dtype, OP.kv_dtype), err


def test_reshape_and_cache_block_dim(rng):
    import numpy as np

    from uacompile.targets.ascend.verify import run_inplace

    op = ReshapeAndCache(2, 64, 16, "fp16", "int8")
    k = Kernel(op, AscendConfig(block_dim=2))
    assert plan(k).max_block_dim == 2
    got, want = run_inplace(load(k), testing.reshape_and_cache_inputs(op, rng, 13, 4))
    for n in ("k_cache", "v_cache", "k_scale", "v_scale"):
        np.testing.assert_array_equal(got[n].view(np.uint8), want[n].view(np.uint8), err_msg=n)


def test_values_that_do_not_fit_are_refused():
    with pytest.raises(IRError, match="AscendConfig.tile"):
        AscendConfig(tile=3)
    with pytest.raises(IRError, match="AscendConfig.block_dim"):
        AscendConfig(block_dim=-1)
    with pytest.raises(IRError, match="AscendConfig.tile"):
        plan(Kernel(PagedAttention(4, 2, 64, 8), AscendConfig(tile=16)))  # longer than a page
    with pytest.raises(IRError, match="AscendConfig.tile"):
        plan(Kernel(PagedAttention(32, 1, 256, 128, "fp32", "fp32"), AscendConfig(tile=128)))  # UB budget
    with pytest.raises(IRError, match="blockDim cap"):
        plan(Kernel(OP, AscendConfig(block_dim=1000)))
    assert AscendConfig(tile=4).signature() == {}
