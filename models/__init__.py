"""Small models shipped inside the package (package data; models/README.md gives source, sha256, license).

    from uacompile.models import STORIES260K
    from uacompile.runtime import LLM
    llm = LLM(model=STORIES260K)
"""
from pathlib import Path

DIR = Path(__file__).resolve().parent
STORIES260K = DIR / "stories260K.gguf"

__all__ = ["DIR", "STORIES260K"]
