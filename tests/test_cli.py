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
    ([], "the following arguments are required: command"),
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


def test_readme_python_example_runs():
    import re

    code = re.search(r"## In Python\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_build_ascend_records_emulator_verification(tmp_path):
    r = run_cli("build", "--preset", "tiny", "--target", "ascend", "--out", str(tmp_path), "--quiet")
    assert r.returncode == 0, r.stderr
    kernels = json.loads((tmp_path / "manifest.json").read_text())["kernels"]
    verified = {e["op"]: e.get("verified") for e in kernels}
    for op in ("paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks"):
        assert verified[op] == "emulator", kernels
    merge = next(e for e in kernels if e["op"] == "merge_state")
    assert merge["library"] is None and "no lowering for merge_state" in merge["reason"]


def test_default_build_has_every_op_for_cpu_and_cuda(tmp_path):
    import shutil

    r = run_cli("build", "--out", str(tmp_path), "--quiet")
    assert r.returncode == 0, r.stderr
    kernels = json.loads((tmp_path / "manifest.json").read_text())["kernels"]
    all_ops = {"paged_attention", "merge_state", "reshape_and_cache", "copy_blocks", "swap_blocks"}
    for target in ("cpu", "cuda"):
        built = {e["op"] for e in kernels if e["target"] == target and e["library"]}
        if target == "cuda" and not shutil.which("nvcc"):
            built = {e["op"] for e in kernels if e["target"] == target and e["source"]}
        assert built == all_ops, (target, built)
    shapes = {(e["params"].get("num_q_heads"), e["params"].get("head_dim")) for e in kernels if e["op"] == "paged_attention"}
    assert shapes == {(32, 128), (8, 8)}  # Llama-3-8B / Qwen3-8B and stories260K
    for e in kernels:
        assert e["library"] is not None or e["reason"], e
