import json
import subprocess
import sys
from pathlib import Path

import pytest

from uacompile.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "uacompile.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args,needle", [
    (["build", "--target", "tpu"], "invalid choice: 'tpu'"),
    (["build", "--preset", "nope"], "invalid choice: 'nope'"),
    (["generate", "--op", "paged_attention", "--target", "cpu", "--set", "num_q_heads=8"], "num_kv_heads: is required"),
    (["generate", "--op", "paged_attention", "--target", "cpu", "--set", "num_q_heads=8", "--set", "num_kv_heads=3",
      "--set", "head_dim=8"], "paged_attention.num_q_heads: must be a multiple of num_kv_heads"),
    (["generate", "--op", "copy_blocks", "--target", "cpu", "--set", "oops"], "--set expects key=value"),
    (["generate", "--op", "copy_blocks", "--target", "cpu", "--set", "colour=red"], "copy_blocks.colour: is not a field"),
    (["generate", "--op", "paged_attention", "--target", "cpu", "--set", "num_q_heads=8", "--set", "num_kv_heads=4",
      "--set", "head_dim=8", "--set", "q_dtype=fp32", "--set", "kv_dtype=fp32", "--set", "scale=abc"],
     "--set scale=abc: scale must be a number"),
    (["generate", "--op", "copy_blocks", "--target", "cpu", "--set", "num_kv_heads=x", "--set", "head_dim=8"],
     "--set num_kv_heads=x: num_kv_heads must be an integer"),
    (["generate", "--op", "merge_state", "--target", "ascend", "--set", "num_heads=8", "--set", "head_dim=8",
      "--set", "num_splits=2"], "no lowering for merge_state"),
    (["ops", "--set", "head_dim=8"], "--set needs --op"),
    (["build", "--bogus"], "unrecognized arguments: --bogus"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["build", "--out", ""], "--out: must not be empty"),
    (["build", "--out", "/proc/uacompile-test"], "--out /proc/uacompile-test: cannot write there"),
    (["build", "--out", "/sys"], "--out /sys: cannot write there"),  # an existing read-only folder, even for root
    (["build", "--out", str(ROOT / "setup.cfg")], "is a file, not a directory"),
    (["generate", "--op", "copy_blocks", "--target", "cpu", "--set", "num_kv_heads=2", "--set", "head_dim=8",
      "--out", str(ROOT)], "is a directory; give a file name"),
    (["generate", "--op", "copy_blocks", "--target", "cpu", "--set", "num_kv_heads=2", "--set", "head_dim=8",
      "--out", str(ROOT / "no-such-dir" / "k.py")], "no-such-dir does not exist"),
    (["generate", "--op", "copy_blocks", "--target", "cpu", "--set", "num_kv_heads=2", "--set", "head_dim=8",
      "--out", ""], "--out: must not be empty"),
    (["generate", "--op", "copy_blocks", "--target", "ascend", "--set", "num_kv_heads=2", "--set", "head_dim=8",
      "--out", str(ROOT / "setup.cfg")], "is a file, not a directory"),
])
def test_bad_arguments_exit_2_with_one_line(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, r
    assert r.stderr.count("\n") == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ops_doc_is_generated_from_the_ir(capsys):
    assert main(["ops", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == (ROOT / "docs" / "OPS.md").read_text().strip(), \
        "docs/OPS.md is stale: run `uacompile ops --markdown > docs/OPS.md`"


def test_generate_writes_cpu_and_cuda_sources(tmp_path):
    sets = ["--set", "num_q_heads=8", "--set", "num_kv_heads=4", "--set", "head_dim=8", "--set", "q_dtype=fp32",
            "--set", "kv_dtype=fp32"]
    r = run_cli("generate", "--op", "paged_attention", "--target", "cuda", "--lowering", "tvm", *sets,
                "--out", str(tmp_path / "k.cu"))
    assert r.returncode == 0, r.stderr
    src = (tmp_path / "k.cu").read_text()
    assert "__global__" in src and 'extern "C"' in src


def test_build_tiny_preset_writes_a_complete_manifest(tmp_path):
    r = run_cli("build", "--preset", "tiny", "--target", "cpu", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "manifest.json").read_text())
    ops = {e["op"] for e in m["kernels"]}
    assert ops == {"paged_attention", "merge_state", "reshape_and_cache", "copy_blocks", "swap_blocks"}
    for e in m["kernels"]:
        assert set(e) >= {"op", "target", "params", "source", "library", "hash"}
        assert e["library"] is not None and Path(e["library"]).exists(), e
        assert Path(e["source"]).exists()


def test_build_ascend_records_emulator_verification(tmp_path):
    r = run_cli("build", "--preset", "tiny", "--target", "ascend", "--out", str(tmp_path), "--quiet")
    assert r.returncode == 0, r.stderr
    kernels = json.loads((tmp_path / "manifest.json").read_text())["kernels"]
    verified = {e["op"]: e.get("verified") for e in kernels}
    for op in ("paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks"):
        assert verified[op] == "emulator", kernels
    merge = next(e for e in kernels if e["op"] == "merge_state")
    assert merge["library"] is None and "no lowering for merge_state" in merge["reason"]
    attn = [e for e in kernels if e["op"] == "paged_attention"]
    assert attn and all(x["label"] == "estimate (not measured)" for e in attn for x in e["estimate"])
    assert "estimate ascend" in r.stdout and "decode 32 x 4K" in r.stdout and "[estimate:" in r.stdout


PA8 = ["--set", "num_q_heads=8", "--set", "num_kv_heads=4", "--set", "head_dim=8", "--set", "q_dtype=fp32",
       "--set", "kv_dtype=fp32"]


@pytest.mark.parametrize("text,value", [("true", True), ("True", True), ("1", True), ("false", False),
                                        ("FALSE", False), ("0", False)])
def test_set_booleans_take_true_false_1_0(text, value):
    from uacompile.cli import _op

    assert _op("paged_attention", PA8[1::2] + [f"alibi={text}"]).alibi is value


@pytest.mark.parametrize("text", ["yes", "no", "2", "-1", "on", "", "False!"])
def test_set_booleans_reject_everything_else(text, capsys):
    assert main(["ops", "--op", "paged_attention", *PA8, "--set", f"alibi={text}"]) == 2
    err = capsys.readouterr().err
    assert err == f"uacompile: error: --set alibi={text}: alibi is a boolean: use true, false, 1 or 0\n"


def test_set_none_and_numbers_take_the_field_type():
    from uacompile.cli import _op

    op = _op("paged_attention", PA8[1::2] + ["scale=0.5", "window=64", "softcap=0.5"])
    assert op.scale == 0.5 and op.window == 64 and op.softcap == 0.5
    assert _op("paged_attention", PA8[1::2] + ["scale=none"]).scale is None


def test_debug_shows_the_traceback():
    r = run_cli("--debug", "ops", "--op", "paged_attention", *PA8, "--set", "scale=abc")
    assert r.returncode != 0 and "Traceback" in r.stderr
    r = run_cli("ops", "--debug", "--op", "paged_attention", *PA8, "--set", "scale=abc")
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.parametrize("argv", [["tune", "--debug", "--db", "/etc/passwd/x.json", "--target", "cpu", "--preset",
                                    "default"],
                                   ["serve", "--debug", "--model", "/nonexistent.gguf"],
                                   ["bench", "--debug", "serve", "--debug", "--help"]])
def test_debug_is_accepted_after_every_subcommand(argv, capsys):
    from uacompile.cli import main

    if "--help" in argv:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        return
    with pytest.raises(Exception):  # --debug: the error itself, not one line
        main(argv)


@pytest.mark.parametrize("flag,value,needle", [
    ("--db", "README.md/tuning.json", "README.md is not a folder"),
    ("--db", "docs", "docs is a folder"),
    ("--report", "README.md", "README.md is not a folder"),
    ("--report", "README.md/sub/dir", "README.md is not a folder"),
])
def test_tune_output_paths_are_checked_before_tuning(capsys, flag, value, needle):
    from uacompile.cli import main

    assert main(["tune", flag, value, "--target", "cpu", "--preset", "default"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.count("\n") == 0 and err.startswith("uacompile: error:")


def test_serve_shutdown_timeout_is_checked_before_the_model_loads(capsys):
    from uacompile.cli import main

    assert main(["serve", "--model", "models/stories260K.gguf", "--port", "0", "--shutdown-timeout", "-1"]) == 2
    assert "--shutdown-timeout must be" in capsys.readouterr().err


def test_version_and_bare_command_list_the_commands(capsys):
    from uacompile import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"uacompile {__version__}"
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("build", "generate", "ops"):
        assert f"    {command} " in out, out


def test_ops_names_every_op(capsys):
    from uacompile.ir import OPS

    assert main(["ops"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(OPS)


def test_every_flag_has_help_and_presets_are_described():
    import argparse

    from uacompile.build import MODELS, PRESETS
    from uacompile.cli import make_parser

    parser = make_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in [("uacompile", parser), *subs.choices.items()]:
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.option_strings)
    for choice in subs._choices_actions:
        assert choice.help, choice.dest
    text = subs.choices["build"].format_help()
    for preset, models in PRESETS.items():
        assert f"{preset}: {', '.join(models)}" in text
    for m in MODELS.values():
        assert f"{m.name}: {m.num_q_heads} q heads, {m.num_kv_heads} kv heads, head_dim {m.head_dim}" in text


def test_serve_kv_cache_dtype_reaches_the_engine_options(monkeypatch, capsys):
    """--kv-cache-dtype offers the engine's values and arrives as serve's kv_cache_dtype (an EngineConfig field)."""
    import argparse

    import uacompile.runtime.server as server
    from uacompile.runtime.engine import KV_CACHE_DTYPES
    from uacompile.runtime.llm import ENGINE_OPTIONS

    seen = {}
    monkeypatch.setattr(server, "serve", lambda **kw: seen.update(kw))
    assert main(["serve", "--model", "m.gguf", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert seen["kv_cache_dtype"] == "fp8_e4m3" and "kv_cache_dtype" in ENGINE_OPTIONS
    seen.clear()
    assert main(["serve", "--model", "m.gguf"]) == 0 and "kv_cache_dtype" not in seen  # the engine's default: auto
    from uacompile.cli import make_parser

    subs = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = next(a for a in subs.choices["serve"]._actions if a.dest == "kv_cache_dtype")
    assert tuple(serve.choices) == KV_CACHE_DTYPES
    with pytest.raises(SystemExit):
        main(["serve", "--model", "m.gguf", "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_serve_cpu_offload_gb_arrives_as_cpu_offload_bytes(monkeypatch):
    import uacompile.runtime.server as server
    from uacompile.runtime.llm import ENGINE_OPTIONS

    seen = {}
    monkeypatch.setattr(server, "serve", lambda **kw: seen.update(kw))
    assert main(["serve", "--model", "m.gguf", "--cpu-offload-gb", "1.5", "--preemption", "offload"]) == 0
    assert seen["cpu_offload_bytes"] == 1_500_000_000 and seen["preemption"] == "offload"
    assert "cpu_offload_gb" not in seen and "cpu_offload_bytes" in ENGINE_OPTIONS


def test_generate_ascend_writes_the_ascendc_project(tmp_path, capsys):
    assert main(["generate", "--op", "paged_attention", "--target", "ascend", *PA8, "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "CMakeLists.txt" in names and any(n.endswith("_kernel.cpp") for n in names), names
    assert any(n.endswith("_host.cpp") for n in names) and any(n.endswith("_tiling.h") for n in names), names
    assert main(["generate", "--op", "paged_attention", "--target", "ascend", *PA8]) == 0
    out = capsys.readouterr().out
    assert "// ---- CMakeLists.txt" in out and "__aicore__" in out


def test_generate_prints_source_without_running_a_compiler(monkeypatch, capsys):
    import subprocess as sp

    def no_compiler(*a, **k):
        raise AssertionError(f"generate ran a program: {a}")

    monkeypatch.setattr(sp, "run", no_compiler)
    monkeypatch.setattr(sp, "Popen", no_compiler)
    args = ["generate", "--op", "paged_attention", "--target", "cuda", "--set", "num_q_heads=32",
            "--set", "num_kv_heads=8", "--set", "head_dim=128", "--set", "q_dtype=bf16", "--set", "kv_dtype=bf16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "__global__" in out and 'extern "C"' in out


def test_build_names_each_variant_it_did_not_build(tmp_path, monkeypatch, capsys):
    import uacompile.build as build

    def unbuilt(op, out_dir):
        return {"source": None, "library": None, "reason": "toolchain absent"}

    monkeypatch.setattr(build, "_lowering", lambda t, low: unbuilt)
    assert main(["build", "--preset", "tiny", "--target", "cpu", "--out", str(tmp_path), "--quiet"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "not built" in line]
    assert len(lines) == 6 and len(set(lines)) == 6, lines  # the split-KV variant differs from the plain one


def test_unwritable_cache_is_one_line(tmp_path):
    import os

    env = {**os.environ, "UACOMPILE_CACHE_DIR": "/sys/uacompile-cache"}
    r = subprocess.run([sys.executable, "-m", "uacompile.cli", "build", "--preset", "tiny", "--target", "cpu",
                        "--out", str(tmp_path), "--quiet"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "kernel cache /sys/uacompile-cache is not writable" in r.stderr and "UACOMPILE_CACHE_DIR" in r.stderr


def test_serve_names_a_missing_extra_before_loading(monkeypatch, capsys):
    import uacompile.runtime.server as server

    called = []
    monkeypatch.setattr(server, "serve", lambda **kw: called.append(kw))
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    assert main(["serve", "--model", "m.gguf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing: uvicorn" in err and "uacompile[serve]" in err, err
    assert not called


def test_serve_api_key_from_flag_file_or_env(monkeypatch, tmp_path, capsys):
    import uacompile.runtime.server as server
    from uacompile.cli import API_KEY_ENV

    seen = {}
    monkeypatch.setattr(server, "serve", lambda **kw: seen.update(kw))
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(["serve", "--model", "m.gguf"]) == 0 and "api_key" not in seen
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert main(["serve", "--model", "m.gguf"]) == 0 and seen["api_key"] == "from-env"
    key = tmp_path / "key"
    key.write_text("from-file\n")
    assert main(["serve", "--model", "m.gguf", "--api-key-file", str(key)]) == 0 and seen["api_key"] == "from-file"
    assert "api_key_file" not in seen
    assert main(["serve", "--model", "m.gguf", "--api-key", "from-flag"]) == 0 and seen["api_key"] == "from-flag"
    capsys.readouterr()
    for args, needle in ((["--api-key-file", str(tmp_path / "none")], "No such file"),
                         (["--api-key-file", str(key), "--api-key", "x"], "not both")):
        key.write_text("from-file\n")
        assert main(["serve", "--model", "m.gguf", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err
    key.write_text("two\nlines\n")
    assert main(["serve", "--model", "m.gguf", "--api-key-file", str(key)]) == 2
    assert "one line" in capsys.readouterr().err
