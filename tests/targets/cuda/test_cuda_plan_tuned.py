"""targets/cuda/plan.py with a tuning database, without a GPU: choose_config takes the record of the step's bucket
(looked up once per (op, bucket)), the built-in rule where there is none, where it is stale or does not run here;
reachable_configs lists the tuned kernels for a server to build."""
from __future__ import annotations

import pytest

from uacompile import ir
from uacompile.targets.cuda.config import AttentionConfig
from uacompile.targets.cuda.layout import H200_SMS
from uacompile.targets.cuda.plan import choose_config, reachable_configs
from uacompile.tunedb import Record, Tuned, TuningDB, config_to_dict

LLAMA = ir.PagedAttention(32, 8, 128, 16, "bf16", "bf16")
ENV = {"device": "NVIDIA H200", "toolchain": {"cuda": "13.0", "driver": "580", "nvcc": "13.0"}}
TUNED = AttentionConfig(num_splits=8, fused_merge=False, decode_only=True)  # the rule always fuses


def db_with(tmp_path, config=TUNED, bucket="decode:8x16384", env=ENV, op=LLAMA):
    db = TuningDB(tmp_path / "t.json")
    db.put(Record("cuda", op.to_dict(), op.key(), bucket, bucket, env["device"], env["toolchain"],
                  config_to_dict(config), config_to_dict(AttentionConfig()), 1.0, 0.8))
    return db


def config(T, S, L, tuned=None, arch="sm_90", **kw):
    return choose_config(LLAMA, T, S, L, H200_SMS, arch, tuned=tuned, **kw)


def test_the_record_of_the_steps_bucket_wins(tmp_path, monkeypatch):
    db = db_with(tmp_path)
    tuned = Tuned(db, "cuda", ENV)
    gets = []
    get = db.get
    monkeypatch.setattr(db, "get", lambda *a: gets.append(a) or get(*a))
    rule = config(8, 8, 16384)
    assert rule != TUNED
    for L in (9000, 12000, 16384):  # one bucket
        assert config(8, 8, L, tuned) == TUNED
    assert config(7, 7, 16000, tuned) == TUNED  # 7 sequences round up to the bucket of 8
    assert len(gets) == 1
    assert config(8, 8, 20000, tuned) == config(8, 8, 20000)  # another bucket: the rule
    assert config(8 * 512, 8, 16384, tuned) == config(8 * 512, 8, 16384)  # a prefill step
    assert config(8, 8, 16384, tuned, num_splits=2).num_splits == 2  # an explicit split count: the rule


def test_stale_and_unfitting_records_leave_the_rule(tmp_path):
    other = {"device": "NVIDIA A100", "toolchain": ENV["toolchain"]}
    assert config(8, 8, 16384, Tuned(db_with(tmp_path, env=other), "cuda", ENV)) == config(8, 8, 16384)
    old = {"device": ENV["device"], "toolchain": {**ENV["toolchain"], "driver": "550"}}
    assert config(8, 8, 16384, Tuned(db_with(tmp_path, env=old), "cuda", ENV)) == config(8, 8, 16384)
    # a record whose config the op cannot run (item queue off the wgmma path is dropped; a decode-only record
    # never serves a prefill step)
    q = AttentionConfig(item_queue=True)
    tuned = Tuned(db_with(tmp_path, config=q, bucket="prefill:4x4096"), "cuda", ENV)
    assert config(4 * 4096, 4, 4096, tuned, arch="sm_80") == AttentionConfig()


def test_reachable_configs_include_the_tuned_kernels(tmp_path):
    tuned = Tuned(db_with(tmp_path), "cuda", ENV)
    plain = reachable_configs(LLAMA, 512, 8, 16384)
    assert TUNED not in plain
    assert reachable_configs(LLAMA, 512, 8, 16384, tuned=tuned) == plain | {TUNED}


@pytest.mark.gpu
def test_plan_takes_the_record_on_the_gpu(tmp_path):
    """plan() with a Tuned of this GPU's environment launches the recorded config."""
    import torch

    from uacompile.targets.cuda.plan import plan
    from uacompile.tunedb import cuda_environment

    env = cuda_environment(0)
    tuned = Tuned(db_with(tmp_path, env=env), "cuda", env)
    p = plan(LLAMA, 8, 8, 16384, torch.device("cuda", 0), tuned=tuned)
    assert p.config == TUNED
    assert plan(LLAMA, 8, 8, 16384, torch.device("cuda", 0), tuned=False).config == config(
        8, 8, 16384, arch=f"sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}")
