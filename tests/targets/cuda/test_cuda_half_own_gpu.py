"""The half-wide last tile's scores in registers of their own (templates/cuda/attention_wgmma.cuh.j2 HALF_OWN,
docs/attention-rationale.md, "ptxas' wgmma serialisation"): production (-DUA_PREFILL_HALF_OWN=1) and the scores in the
first half of S as before (=0), each design built in its own process, run through paged_attention() (the launched
item-queue ops, the fused merge) on prefill chunks whose runs end in half-wide tiles. Each is checked against the
float64 reference with poisoned outputs, and the two against each other bit for bit (the same wgmmas and arithmetic,
other registers). Split counts: the benchmarks' 1 and the census' worst case 8 (serialised in every code shape before
the half tile's own scores, bench/wgmma_census.py). 4 and 24 also passed; they are left out because this module's builds
took 181 s of the suite (the aliased design rebuilds most ops in further code shapes). D 128, D 64, the masked softmax.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from uacompile import ir, testing
from uacompile.targets.cuda import attention

torch = pytest.importorskip("torch")
from test_cuda_attention_gpu import check_close, device_inputs  # noqa: E402
from test_cuda_decode_gpu import reference_of  # noqa: E402

gpu = pytest.mark.gpu
PA = ir.PagedAttention
DESIGNS = {"own": "|-DUA_PREFILL_HALF_OWN=1", "aliased": "|-DUA_PREFILL_HALF_OWN=0"}
OPS = {
    "bf16-d128-g4-lse": PA(32, 8, 128, 16, "bf16", "bf16", return_lse=True),
    "fp16-d64-g4": PA(16, 4, 64, 16, "fp16", "fp16"),
    "bf16-d64-g8-p128-window-softcap": PA(16, 2, 64, 128, "bf16", "bf16", window=300, softcap=15.0),
}
SPLITS = (1, 8)
# kv lengths 700 and 1300 end 60 and 20 positions into a 128-position tile (half-wide last tiles), 200 does not;
# every 128-row tile of a chunk is a run of its own, ending at its own last token
SHAPES = {
    "chunks": dict(kv_lens=[700, 1300, 90, 200], q_lens=[200, 77, 90, 150]),
    "long": dict(kv_lens=[1300, 700], q_lens=[300, 130]),
}
_cases: dict = {}


def case(name, shape):
    """(inputs, float64 (out, lse)) of one op and shape, drawn once (fixed seed): the split counts share them."""
    if (name, shape) not in _cases:
        op = OPS[name]
        inputs = testing.attention_inputs(op, np.random.default_rng(zlib.crc32(f"{name}/{shape}".encode())),
                                          **SHAPES[shape])
        _cases[(name, shape)] = inputs, reference_of(op, inputs)
    return _cases[(name, shape)]


@pytest.fixture(scope="module")
def half_libs():
    """{design: kernel_of(op)} for the sm_90 build of every launched op."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma path is for sm_90")
    ops = list(dict.fromkeys(attention.launched_op(op, s, design=attention.design_of(""))
                             for op in OPS.values() for s in SPLITS))
    return attention.design_kernels(DESIGNS, ops, "sm_90")


def run(op, splits, inputs, kernel_of):
    """paged_attention() on poisoned out (and lse): (out, lse or None)."""
    dev = device_inputs(op, inputs)
    out = torch.full_like(dev["q"], float("nan"))
    lse = torch.full((inputs["num_tokens"], op.num_q_heads), float("nan"), device="cuda") if op.return_lse else None
    args = {k: dev[k] for k in ("q", "k_cache", "v_cache", "token_seq", "page_table", "token_kv_len")}
    attention.paged_attention(op, **args, out=out, lse=lse, num_splits=splits, kernel_of=kernel_of)
    torch.cuda.synchronize()
    return out, lse


@gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("name", list(OPS))
def test_half_tile_scores_match_reference_and_each_other(half_libs, name, splits, shape):
    op = OPS[name]
    inputs, (ref_out, ref_lse) = case(name, shape)
    tol = testing.tolerance(op.q_dtype, op.kv_dtype)
    results = {}
    for design, kernel_of in half_libs.items():
        out, lse = run(op, splits, inputs, kernel_of)
        check_close(f"{design}/{name}/s{splits}/{shape}.out", out, ref_out, tol)
        if op.return_lse:
            check_close(f"{design}/{name}/s{splits}/{shape}.lse", lse, ref_lse, 2 * tol)
        results[design] = (out, lse)
    (own_out, own_lse), (old_out, old_lse) = results["own"], results["aliased"]
    assert torch.equal(own_out, old_out), f"{name}/s{splits}/{shape}: out differs between the designs"
    if op.return_lse:
        assert torch.equal(own_lse, old_lse), f"{name}/s{splits}/{shape}: lse differs between the designs"
