"""Users import one package, uacompile: both a regular and an editable install expose
every subpackage (the folders of the design card are mapped into it by setup.cfg)."""
import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["uacompile", "uacompile.lower", "uacompile.runtime", "uacompile.targets", "uacompile.targets.cuda",
               "uacompile.targets.ascend", "uacompile.templates", "uacompile.models"]
PROBE = ("import importlib, json, sys; "
         f"mods = {SUBPACKAGES!r}; "
         "print(json.dumps({m: importlib.import_module(m).__file__ for m in mods}))")


def _import_all(cwd, env_path=None):
    env = {"PATH": "/usr/bin:/bin"}
    if env_path:
        env["PYTHONPATH"] = env_path
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {m: Path(f) for m, f in json.loads(out.stdout).items()}


def test_regular_install_imports_every_subpackage(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("uacompile-*.whl"))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    files = _import_all(tmp_path, str(site))
    for m, f in files.items():
        assert site in f.parents, (m, f)
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("uacompile/templates/cuda/") and n.endswith(".j2") for n in names), "CUDA templates missing"
    assert any(n.startswith("uacompile/templates/ascend/") and n.endswith(".j2") for n in names), "Ascend templates missing"
    assert "uacompile/targets/cuda/include/uacompile/common.cuh" in names, "CUDA kernel headers missing"
    assert any(n.startswith("uacompile/runtime/") for n in names)
    for page in ("index.html", "app.js", "style.css"):
        assert f"uacompile/runtime/static/{page}" in names, f"chat page {page} missing"
    assert "uacompile/models/stories260K.gguf" in names and "uacompile/models/README.md" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "uacompile = uacompile.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_editable_install_maps_folders_into_the_package(tmp_path):
    files = _import_all(tmp_path)  # the test environment is the editable install of .ci/run
    assert files["uacompile.runtime"] == ROOT / "runtime" / "__init__.py"
    assert files["uacompile.targets.cuda"] == ROOT / "targets" / "cuda" / "__init__.py"
    assert files["uacompile.targets.ascend"] == ROOT / "targets" / "ascend" / "__init__.py"
    assert files["uacompile.templates"] == ROOT / "templates" / "__init__.py"
    assert files["uacompile.models"] == ROOT / "models" / "__init__.py"


def test_shipped_model_is_the_one_models_readme_describes():
    import hashlib
    import re

    from uacompile.models import STORIES260K

    card = (ROOT / "models" / "README.md").read_text()
    sha = re.search(r"`([0-9a-f]{64})`", card).group(1)
    assert hashlib.sha256(STORIES260K.read_bytes()).hexdigest() == sha
    assert f"{STORIES260K.stat().st_size:,} bytes" in card and "MIT" in card
