"""runtime/kernels.py's tvm-cpu backend with a tuning database: a step's attention runs the tuned TVMConfig of its
bucket (the same tokens as the default schedule), the default kernel where there is no current record (a one-token
step's in one parallel task a thread, bit for bit the default's)."""
import numpy as np
import pytest
import torch

pytest.importorskip("tvm")

from uacompile import testing  # noqa: E402
from uacompile.lower.config import TVMConfig  # noqa: E402
from uacompile.runtime.kernels import KernelOps, TVMCPUBackend  # noqa: E402
from uacompile.tunedb import Record, Tuned, TuningDB, config_to_dict, cpu_environment  # noqa: E402

OPS = KernelOps.for_model(8, 4, 8, 16, torch.float32)  # stories260K
TUNED = TVMConfig(grain=2)


def db_with(path, buckets, env, config=TUNED):
    db = TuningDB(path)
    op = OPS.attention
    for b in buckets:
        db.put(Record("cpu", op.to_dict(), op.key(), b, b, env["device"], env["toolchain"], config_to_dict(config),
                      config_to_dict(TVMConfig()), 1.0, 0.5))
    return db


def attention_out(backend, inp: dict, plan):
    """The backend's paged attention over testing.attention_inputs arrays, under plan (None: unplanned), into a
    NaN-poisoned output."""
    t = {n: torch.from_numpy(v) for n, v in inp.items() if isinstance(v, np.ndarray)}
    out = torch.full_like(t["q"], float("nan"))
    backend.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["token_seq"], t["page_table"], t["token_kv_len"],
                            out, plan=plan)
    return out


def test_plan_step_takes_the_tuned_kernel_of_the_bucket(tmp_path, rng):
    env = cpu_environment()
    backend = TVMCPUBackend(OPS, tuned=Tuned(db_with(tmp_path / "t.json", ["decode:4x512"], env), "cpu", env))
    k = backend.plan_step(4, 4, 300)
    assert k is not None and k.op.config == TUNED
    assert backend.plan_step(4, 4, 600) is None and backend.plan_step(40, 4, 300) is None  # other buckets
    inp = testing.attention_inputs(OPS.attention, rng, [300, 17, 250, 1])
    outs = [attention_out(backend, inp, plan) for plan in (k, None)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    stale = {"device": "another cpu", "toolchain": env["toolchain"]}
    backend = TVMCPUBackend(OPS, tuned=Tuned(db_with(tmp_path / "s.json", ["decode:4x512"], stale), "cpu", env))
    assert backend.plan_step(4, 4, 300) is None
    assert TVMCPUBackend(OPS, tuned=False).plan_step(4, 4, 300) is None


@pytest.mark.parametrize("threads", [1, 3])
def test_one_token_steps_run_a_task_a_thread_bit_for_bit(threads, rng):
    backend = TVMCPUBackend(OPS, tuned=False)
    backend.threads = threads  # the grain is worked out from it (set_threads would resize the process's pool)
    k = backend.plan_step(1, 1, 300)
    assert k.op.config == TVMConfig(grain=-(-8 // threads)) and backend.plan_step(1, 1, 40) is k
    inp = testing.attention_inputs(OPS.attention, rng, [300])
    outs = [attention_out(backend, inp, plan) for plan in (k, None)]
    assert bool(torch.isfinite(outs[0]).all()) and torch.equal(outs[0], outs[1])


def test_the_runtime_serves_with_the_default_databases_records(tmp_path, monkeypatch):
    """LLM on stories260K with a default database holding records for its steps' buckets: every step's attention
    runs the tuned kernel, and greedy decoding gives the same tokens as with no database."""
    from uacompile import tunedb
    from uacompile.runtime import LLM, SamplingParams
    from uacompile.runtime.loader import models_dir

    path = models_dir() / "stories260K.gguf"
    assert path.exists(), f"{path} not found (set UACOMPILE_MODELS_DIR to the folder holding stories260K.gguf)"
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompt = "Once upon a time"
    monkeypatch.setattr(tunedb, "default_db_path", lambda: tmp_path / "none.json")
    tunedb.default_tuned.cache_clear()
    plain = LLM(str(path), device="cpu", kernel_backend="tvm-cpu").generate([prompt], params)[0]

    env = cpu_environment()
    buckets = [f"{k}:1x{2 ** i}" for k in ("decode", "prefill") for i in range(9)]
    db_with(tmp_path / "tuning.json", buckets, env).save()
    monkeypatch.setattr(tunedb, "default_db_path", lambda: tmp_path / "tuning.json")
    tunedb.default_tuned.cache_clear()
    used = []
    real = TVMCPUBackend.plan_step
    monkeypatch.setattr(TVMCPUBackend, "plan_step", lambda self, *a: used.append(real(self, *a)) or used[-1])
    try:
        tuned = LLM(str(path), device="cpu", kernel_backend="tvm-cpu").generate([prompt], params)[0]
    finally:
        tunedb.default_tuned.cache_clear()
    assert used and all(k is not None and k.op.config == TUNED for k in used)
    assert len(tuned.outputs[0].token_ids) == 12 and tuned.outputs[0].token_ids == plain.outputs[0].token_ids
