"""lower/config.py's TVMConfig schedule knobs: every value gives the reference's result (CPU, LLVM) on every
attention variant they touch, reshape_and_cache's grain stays bit-exact, the CUDA knobs set the launch shape of
TVM's CUDA source (no nvcc needed), and bad knobs are one-line IRErrors."""
import re

import numpy as np
import pytest

pytest.importorskip("tvm")

from uacompile import IRError, reference, testing  # noqa: E402
from uacompile.ir import Kernel, PagedAttention, ReshapeAndCache  # noqa: E402
from uacompile.lower.config import TVMConfig  # noqa: E402
from uacompile.lower.tvm_build import cpu_kernel  # noqa: E402

BASE = PagedAttention(8, 2, 64, page_size=16)
KNOBS = [TVMConfig(grain=3, dot_lanes=4, acc_vec=16, page_group=3, unroll_dot=True),
         TVMConfig(grain=8, dot_lanes=1, acc_vec=4, page_group=2),
         TVMConfig(dot_lanes=16, page_group=4)]


def tensors(d):
    return {k: v for k, v in d.items() if isinstance(v, np.ndarray)}


def check(kernel, rng, kv_lens, q_lens):
    op = kernel.op
    inp = testing.attention_inputs(op, rng, kv_lens, q_lens)
    ref_o, ref_lse = reference.run(op, **tensors(inp))
    T = inp["num_tokens"]
    outs = {"out": np.full((T, op.num_q_heads, op.head_dim), np.nan, ref_o.dtype if op.q_dtype == "fp32" else
                           inp["q"].dtype)}
    if op.return_lse:
        outs["lse"] = np.full((T, op.num_q_heads), np.nan, np.float32)
    if kernel.config.num_splits > 1:
        S = kernel.config.num_splits
        outs["o_partial"] = np.zeros((S, T, op.num_q_heads, op.head_dim), np.float32)
        outs["lse_partial"] = np.zeros((S, T, op.num_q_heads), np.float32)
        outs["split_counters"] = np.zeros((T, op.num_kv_heads), np.int32)
    cpu_kernel(kernel)(**tensors(inp), **outs)
    tol = testing.tolerance(op.q_dtype, op.kv_dtype)
    np.testing.assert_allclose(outs["out"].astype(np.float64), ref_o, atol=tol, rtol=0)
    if op.return_lse:
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(outs["lse"][fin], ref_lse[fin], atol=max(tol, 1e-4), rtol=1e-4)


@pytest.mark.parametrize("cfg", KNOBS, ids=["g3-l4-v16-p3-unroll", "g8-l1-v4-p2", "l16-p4"])
@pytest.mark.parametrize("op", [
    BASE,
    BASE.replace(window=37, softcap=30.0, alibi=True, return_lse=True),
    BASE.replace(kv_dtype="int8", q_dtype="bf16"),
    BASE.replace(variant="unified_masked"),
], ids=["fp16", "window-softcap-alibi-lse", "int8-kv", "unified-masked"])
def test_schedule_knobs_give_the_reference(rng, op, cfg):
    # decode at, below and past page ends, a full prefill and a chunk: partial first and last page groups
    check(Kernel(op, cfg), rng, [1, 15, 16, 17, 300, 40, 33], [1, 1, 1, 1, 1, 40, 5])


def test_schedule_knobs_with_fused_splits(rng):
    check(Kernel(BASE, KNOBS[0].replace(num_splits=3, fused_merge=True)), rng, [300, 17, 90], [1, 1, 20])


def test_reshape_and_cache_grain_is_bit_exact(rng):
    op = ReshapeAndCache(2, 64, 16, "fp16", "int8")
    for grain in (1, 3, 8):
        inp = tensors(testing.reshape_and_cache_inputs(op, rng, 23, 6))
        ref = {k: v.copy() for k, v in inp.items()}
        reference.run(op, **ref)
        cpu_kernel(Kernel(op, TVMConfig(grain=grain)))(**inp)
        for k in inp:
            np.testing.assert_array_equal(inp[k], ref[k], err_msg=f"grain {grain}: {k}")


def test_cuda_knobs_set_the_launch_shape():
    from uacompile.lower.tvm_cuda import cuda_source

    def block(cfg):
        src = cuda_source(Kernel(BASE, cfg), "sm_90")
        m = re.search(r"dim3\(\(unsigned\)(\d+)LL, \(unsigned\)(\d+)LL, \(unsigned\)(\d+)LL\)", src)
        return ", ".join(m.groups())

    assert block(TVMConfig()) == "32, 4, 1"  # 32 lanes a row of 64, 128 threads
    assert block(TVMConfig(lanes=8, threads=256)) == "8, 32, 1"


def test_bad_knobs_are_refused():
    for bad, field in ((dict(grain=0), "grain"), (dict(dot_lanes=3), "dot_lanes"), (dict(unroll_dot=1), "unroll_dot"),
                       (dict(lanes=64), "lanes"), (dict(threads=2048), "threads"), (dict(page_group=0), "page_group")):
        with pytest.raises(IRError, match=f"TVMConfig.{field}"):
            TVMConfig(**bad)
    with pytest.raises(IRError, match="must divide head_dim"):
        cpu_kernel(Kernel(BASE.replace(head_dim=24), TVMConfig(dot_lanes=16)))
    assert TVMConfig(grain=4).signature() == {}  # schedule knobs change no parameters


def test_cuda_vec_and_heads_checked_against_the_op():
    gqa = PagedAttention(32, 8, 128, page_size=16, q_dtype="bf16", kv_dtype="bf16")
    for cfg in (TVMConfig(vec=4), TVMConfig(lanes=16, vec=8), TVMConfig(heads=2), TVMConfig(heads=4, threads=512),
                TVMConfig(lanes=8, vec=16, heads=4)):
        cfg.check(gqa.replace(kv_dtype="fp8_e4m3") if cfg.vec == 16 else gqa)
    for cfg, msg in ((TVMConfig(vec=8), "TVMConfig.vec.*must divide the 4 elements a lane owns"),
                     (TVMConfig(lanes=4, vec=16), "TVMConfig.vec.*at most 16 bytes"),
                     (TVMConfig(heads=8, threads=512), "TVMConfig.heads.*must divide the group size 4"),
                     (TVMConfig(heads=4, threads=64), "TVMConfig.threads.*lanes 32 x heads 4"),
                     (TVMConfig(lanes=4, threads=512), "shared memory")):
        with pytest.raises(IRError, match=msg):
            cfg.check(gqa)
    with pytest.raises(IRError, match="TVMConfig.heads.*paged_attention knob"):
        TVMConfig(heads=2).check(ReshapeAndCache(8, 128))
    for bad in (dict(vec=3), dict(vec=0), dict(heads=0)):
        with pytest.raises(IRError, match=f"TVMConfig.{next(iter(bad))}"):
            TVMConfig(**bad)


def test_cuda_vec_and_heads_at_1_keep_the_kernel_key():
    """vec and heads at 1 (today's kernel) stay out of the key, so earlier kernels keep their symbols."""
    k = Kernel(BASE, TVMConfig(num_splits=2, fused_merge=True))
    assert "vec" not in k.to_dict()["config"] and "heads" not in k.to_dict()["config"]
    assert k.key() == "0d5fbcf9f58e" and Kernel(BASE, TVMConfig()).key() == "ec74327252cc"  # keys without the knobs
    assert len({k.key(), Kernel(BASE, TVMConfig(num_splits=2, fused_merge=True, vec=2)).key(),
                Kernel(BASE, TVMConfig(num_splits=2, fused_merge=True, heads=2)).key()}) == 3


def test_cuda_heads_sets_the_launch_shape():
    from uacompile.lower.tvm_cuda import cuda_source

    src = cuda_source(Kernel(BASE, TVMConfig(heads=4, threads=256, lanes=16)), "sm_90")
    assert "{((int64_t)num_tokens), 2LL, 1LL}" in src  # Hq 8 / 4 heads a block
    assert "dim3((unsigned)16LL, (unsigned)4LL, (unsigned)4LL)" in src  # 16 lanes, 4 lane groups, 4 heads
