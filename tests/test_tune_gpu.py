"""uacompile tune on the GPU (the CUDA space's candidates built, checked against the reference and timed with CUDA
events). No TVM needed for the cuda target, so this module imports none."""
import pytest

from uacompile import ir
from uacompile.tune import tune
from uacompile.tunedb import Shape, TuningDB, config_to_dict


@pytest.mark.gpu
@pytest.mark.parametrize("target,op,shape", [
    ("cuda", ir.PagedAttention(32, 8, 128, 16, "bf16", "bf16"), "decode:8x4096"),
    ("cuda", ir.PagedAttention(32, 8, 128, 16, "bf16", "bf16"), "prefill:2x1024"),
    ("cuda", ir.ReshapeAndCache(8, 128, 16, "bf16", "bf16"), "prefill:1x1024"),
    ("tvm-cuda", ir.PagedAttention(8, 2, 64, 16, "fp16", "fp16"), "decode:4x2048"),
], ids=["cuda-decode", "cuda-prefill", "cuda-reshape", "tvm-cuda-decode"])
def test_tuner_on_the_gpu(tmp_path, target, op, shape):
    """Candidates built in the process pool, checked against the reference on the GPU, timed with CUDA events;
    the planner launches the recorded config of the step's bucket. (tvm-cuda generates its candidates with TVM:
    run it where TVM is installed.)"""
    if target == "tvm-cuda":
        pytest.importorskip("tvm")
    from uacompile.tune_space import space
    from uacompile.tunedb import Tuned, cuda_environment

    env = cuda_environment(0)
    db = TuningDB(tmp_path / "t.json")
    s = Shape.parse(shape)
    [r] = tune(op, space(target), [s], db, trials=4, rounds=3, jobs=2, env=env, progress=False)
    assert r.error is None and r.timed >= 1 and r.tuned_ms <= r.default_ms, r
    assert db.get(target, op, s.bucket(), env).config == r.config
    if (target, op.kind) == ("cuda", "paged_attention"):
        import torch

        from uacompile.targets.cuda.plan import plan

        p = plan(op, s.num_tokens, s.num_seqs, s.max_kv_len, torch.device("cuda", 0), tuned=Tuned(db, target, env))
        assert config_to_dict(p.config) == r.config
