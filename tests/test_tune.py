"""uacompile/tune.py and tune_space.py on the CPU (TVM, LLVM): the tuner finds a faster config than a deliberately
slow default, discards a wrong candidate, records winners, reuses them (no re-timing), resumes an interrupted run;
the CUDA spaces' candidates (no GPU needed to list them); the report; the CLI; `uacompile build` with records."""
import json
import time

import pytest

pytest.importorskip("tvm")

from uacompile import build, ir  # noqa: E402
from uacompile.cli import main  # noqa: E402
from uacompile.lower.config import TVMConfig  # noqa: E402
from uacompile.targets.cuda.config import AttentionConfig  # noqa: E402
from uacompile.tune import ops_to_tune, report_table, tune, write_report  # noqa: E402
from uacompile.tune_space import CPUSpace, CUDASpace, TVMCUDASpace, check_shape  # noqa: E402
from uacompile.tunedb import Shape, TuningDB, config_to_dict, cpu_environment  # noqa: E402

OP = ir.PagedAttention(8, 4, 8, 16, "fp32", "fp32")  # stories260K's attention
ENV = {"device": "test-cpu", "toolchain": {"tvm": "test"}}
SHAPES = [Shape.parse("decode:2x200")]
FAST, OTHER, WRONG = TVMConfig(grain=2), TVMConfig(dot_lanes=1), TVMConfig(page_group=2)


class SmallSpace(CPUSpace):
    """The CPU space cut to a few candidates; `slow` sleeps in every sample of a config, `wrong` corrupts its
    output (an injected incorrect candidate); counts the benches it makes."""

    def __init__(self, configs=(FAST, OTHER), slow=(), wrong=()):
        self.configs, self.slow, self.wrong, self.benches = list(configs), set(slow), set(wrong), []

    def candidates(self, op, shape):
        return [self.default(op, shape), *self.configs]

    def bench(self, kernel, shape, seed=0):
        b = super().bench(kernel, shape, seed)
        self.benches.append(kernel.config)
        cfg, call, sample = kernel.config, b.call, b.sample
        if cfg in self.wrong:
            def bad_call(inp):
                call(inp)
                inp["out"] += 1e-2
            b.call = bad_call
        if cfg in self.slow:
            b.sample = lambda calls=1: (time.sleep(0.004), sample(calls))[1] + 0.004
        return b


def run(space, db, **kw):
    return tune(OP, space, SHAPES, db, rounds=kw.pop("rounds", 4), jobs=1, env=ENV, progress=False, **kw)


def test_slow_default_loses_and_the_winner_is_recorded(tmp_path):
    db = TuningDB(tmp_path / "t.json")
    space = SmallSpace(slow=[TVMConfig()])
    [r] = run(space, db)
    assert r.error is None and not r.cached and r.timed == 3
    assert r.config != config_to_dict(TVMConfig()) and r.speedup > 1.5
    rec = TuningDB.open(tmp_path / "t.json").get("cpu", OP, "decode:2x256", ENV)
    assert rec.config == r.config and rec.default_config == config_to_dict(TVMConfig())
    assert rec.tuned_ms < rec.default_ms
    assert db.partial == {}  # a finished shape keeps no partial samples


def test_a_wrong_candidate_is_discarded_never_recorded(tmp_path):
    db = TuningDB(tmp_path / "t.json")
    space = SmallSpace(configs=(WRONG, FAST), slow=[TVMConfig(), FAST], wrong=[WRONG])
    [r] = run(space, db)
    assert [c for c, _ in r.discarded] == [config_to_dict(WRONG)] and "reference" in r.discarded[0][1]
    assert r.timed == 2 and r.config != config_to_dict(WRONG)
    rec = db.get("cpu", OP, "decode:2x256", ENV)
    assert rec.config != config_to_dict(WRONG) and rec.discarded == 1
    assert all(config_to_dict(WRONG) != json.loads(k) for v in db.partial.values() for k in v)


def test_a_failing_default_records_nothing(tmp_path):
    db = TuningDB(tmp_path / "t.json")
    [r] = run(SmallSpace(wrong=[TVMConfig()]), db)
    assert r.error and "default config fails" in r.error and db.records == {}


def test_a_rerun_is_a_cache_hit(tmp_path):
    db = TuningDB(tmp_path / "t.json")
    run(SmallSpace(slow=[TVMConfig()]), db)
    space = SmallSpace(slow=[TVMConfig()])
    [r] = run(space, TuningDB.open(tmp_path / "t.json"))
    assert r.cached and space.benches == []  # nothing built, checked or timed
    [r] = run(space, TuningDB.open(tmp_path / "t.json"), force=True)
    assert not r.cached and len(space.benches) == 3


def test_an_interrupted_run_resumes_from_its_samples(tmp_path):
    db = TuningDB(tmp_path / "t.json")
    space = SmallSpace()
    made = []

    class Stop(Exception):
        pass

    real_bench = space.bench

    def bench(kernel, shape, seed=0):  # the third round's first sample is interrupted
        b = real_bench(kernel, shape, seed)
        sample = b.sample

        def counted(calls=1):
            made.append(kernel.config)
            if len(made) == 3 * 2 + 3 * 2 + 1:  # 2 warm-up samples each, 2 rounds of 3
                raise Stop
            return sample(calls)
        b.sample = counted
        return b

    space.bench = bench
    with pytest.raises(Stop):
        run(space, db)
    saved = TuningDB.open(tmp_path / "t.json")
    [partial] = saved.partial.values()
    assert sorted(len(v) for v in partial.values()) == [2, 2, 2]
    made.clear()
    space2 = SmallSpace()
    timed = []
    real2 = space2.bench

    def bench2(kernel, shape, seed=0):
        b = real2(kernel, shape, seed)
        sample = b.sample
        b.sample = lambda calls=1: timed.append(kernel.config) or sample(calls)
        return b

    space2.bench = bench2
    [r] = run(space2, saved)
    assert len(timed) == 3 * 2 + 3 * 2  # warm-up, then only the 2 rounds still missing of 4
    assert r.timed == 3 and saved.partial == {}


def test_a_budget_bounds_the_candidates_and_rounds(tmp_path):
    """A tiny budget: the first build chunk (the default) only, and the 3 rounds every timing takes at least."""
    db = TuningDB(tmp_path / "t.json")
    [r] = tune(OP, SmallSpace(), SHAPES, db, budget=1e-3, rounds=10, jobs=1, env=ENV, progress=False)
    assert r.timed == 1 and r.config == config_to_dict(TVMConfig()) and r.speedup == 1.0
    with pytest.raises(ValueError, match="budget"):
        tune(OP, SmallSpace(), SHAPES, db, budget=0, env=ENV, progress=False)


def test_cpu_space_candidates_are_valid_and_default_first():
    cands = CPUSpace().candidates(OP, SHAPES[0])
    assert cands[0] == TVMConfig() and len(cands) == len(set(cands)) > 20
    changed = [sum(a != b for a, b in zip(vars(c).values(), vars(TVMConfig()).values())) for c in cands]
    assert changed == sorted(changed) and changed[1] == 1  # nearest the rule first
    for c in cands:
        c.check(OP)
    rc = CPUSpace().candidates(ir.ReshapeAndCache(4, 8, 16, "fp32", "fp32"), SHAPES[0])
    assert [c.grain for c in rc][0] == 1 and len(rc) == 6
    assert check_shape(Shape.parse("prefill:4x4096")) == Shape("prefill", 2, 96)


def test_cuda_spaces_list_configs_that_fit_without_a_gpu():
    """The H200's space (sm_90, 132 SMs) when no GPU is here: the built-in rule first, every config fitting."""
    from uacompile.targets.cuda import layout

    op = ir.PagedAttention(32, 8, 128, 16, "bf16", "bf16")
    space = CUDASpace()
    decode = space.candidates(op, Shape.parse("decode:8x16384"))
    assert decode[0] == AttentionConfig(num_splits=4, fused_merge=True, decode_only=True)
    assert any(c.decode_only for c in decode[1:]) and any(not c.decode_only for c in decode)
    prefill = space.candidates(op, Shape.parse("prefill:4x4096"))
    assert prefill[0] == AttentionConfig(item_queue=True) and not any(c.decode_only for c in prefill)
    for c in decode + prefill:
        layout.check_fits(op, c, "sm_90")
    assert max(c.num_splits for c in decode) <= 64
    tc = TVMCUDASpace().candidates(op, Shape.parse("decode:8x16384"))
    assert tc[0] == TVMConfig() and all(c.num_splits == 1 or c.fused_merge for c in tc)
    assert {c.threads for c in tc} == {64, 128, 256, 512}
    rs = space.candidates(ir.ReshapeAndCache(8, 128, 16, "bf16", "bf16"), Shape.parse("prefill:4x4096"))
    assert rs[0].overrides() == {} and len(rs) > 10


def test_ascend_space_checks_on_the_emulator_and_times_nothing(tmp_path):
    from uacompile.targets.ascend.config import AscendConfig
    from uacompile.tune_space import AscendSpace

    op = ir.PagedAttention(4, 2, 64, 16)
    space = AscendSpace()
    cands = space.candidates(op, Shape.parse("decode:2x40"))
    assert cands[0] == AscendConfig() and {c.tile for c in cands} == {0, 1, 2, 4, 8, 16}
    db = TuningDB(tmp_path / "t.json")
    [r] = tune(op, space, [Shape.parse("decode:2x40")], db, trials=3, jobs=1, progress=False)
    assert r.checked_only and r.candidates == 3 and r.discarded == [] and r.timed == 0
    assert db.records == {} and "not timed (emulator)" in report_table([r])


def test_report_table_json_and_plot(tmp_path):
    db = TuningDB(tmp_path / "t.json")
    results = run(SmallSpace(slow=[TVMConfig()]), db, rounds=3)
    text = report_table(results)
    assert "decode:2x200" in text and "x |" in text
    paths = write_report(results, tmp_path / "rep", ENV, stem="tune-test")
    assert [p.name for p in paths] == ["tune-test.json", "tune-test.md", "tune-test.png"]
    data = json.loads(paths[0].read_text())
    assert data["results"][0]["speedup"] > 1 and data["environment"] == ENV
    # a device without matplotlib writes the JSON; the table and plot are rewritten from it elsewhere
    assert main(["tune", "--rerender", str(paths[0]), "--report", str(tmp_path / "re")]) == 0
    assert (tmp_path / "re" / "tune-test.png").exists()
    assert (tmp_path / "re" / "tune-test.md").read_text() == paths[1].read_text()


def test_ops_to_tune():
    [op] = ops_to_tune("cpu", op_name="paged_attention", sets={"head_dim": 64})
    assert op.head_dim == 64 and op.num_q_heads == 32  # the default preset's first model, changed
    assert [o.kind for o in ops_to_tune("cpu", preset="tiny")] == ["paged_attention", "reshape_and_cache"]
    with pytest.raises(ValueError, match="tunes"):
        ops_to_tune("tvm-cuda", op_name="copy_blocks")


def test_cli_tune_show_and_errors(tmp_path, capsys):
    db = tmp_path / "t.json"
    sets = ["--set", "num_q_heads=8", "--set", "num_kv_heads=4", "--set", "head_dim=8", "--set", "q_dtype=fp32",
            "--set", "kv_dtype=fp32"]
    argv = ["tune", "--op", "paged_attention", *sets, "--target", "cpu", "--shapes", "decode:2x200", "--trials", "2",
            "--rounds", "2", "--jobs", "1", "--db", str(db), "--quiet", "--report", str(tmp_path / "rep")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "decode:2x200" in out and "2 / 2" in out
    assert len(TuningDB.open(db).records) == 1 and list((tmp_path / "rep").glob("tune-*.png"))
    assert main(argv) == 0 and "cached" in capsys.readouterr().out
    assert main(["tune", "--show", "--db", str(db)]) == 0 and "1 records" in capsys.readouterr().out
    assert main(["tune", "--op", "paged_attention", "--db", str(db)]) == 2
    assert "--target is required" in capsys.readouterr().err
    assert main(["tune", "--target", "cpu", "--op", "copy_blocks", "--db", str(db)]) == 2
    assert main(["tune", "--target", "cpu", "--op", "paged_attention", "--shapes", "decode:8", "--db", str(db)]) == 2


def test_build_adds_the_tuned_kernels(tmp_path):
    db = TuningDB(tmp_path / "t.json")
    env = cpu_environment()
    from uacompile.tunedb import Record

    op = build.MODELS["stories260k"].ops()[0]
    for dev in (env["device"], "another cpu"):
        db.put(Record("cpu", op.to_dict(), op.key(), "decode:4x512", "decode:4x512", dev, env["toolchain"],
                      config_to_dict(TVMConfig(grain=4 if dev == env["device"] else 8)),
                      config_to_dict(TVMConfig()), 2.0, 1.0))
    kernels = build.preset_kernels("tiny", "cpu", "tvm", db)
    assert ir.Kernel(op, TVMConfig(grain=4)) in kernels and ir.Kernel(op, TVMConfig(grain=8)) not in kernels
    assert len(kernels) == len(build.preset_kernels("tiny", "cpu", "tvm")) + 1


# ---------------------------------------------------------------- on the device
