"""Content-hash kernel cache.

Key = sha256 over everything that changes the artefact: the IR (op spec), the source or
template text, toolchain versions and flags. Artefacts live in
$UACOMPILE_CACHE_DIR (default: the user cache dir) under <kind>/<hash>/, written to a
temporary folder and renamed into place, so concurrent builders never see half a file.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable


class CacheError(OSError):
    """The cache folder cannot take a new artefact."""


def cache_dir() -> Path:
    env = os.environ.get("UACOMPILE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("uacompile"))


def content_hash(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, bytes):
            h.update(p)
        elif isinstance(p, str):
            h.update(p.encode())
        else:
            h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()


@functools.cache
def _tool_version(cmd: str) -> str:
    try:
        out = subprocess.run([cmd, "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.strip().splitlines()[-1] if out.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "absent"


def toolchain_versions(*tools: str) -> dict:
    """Versions of the named tools ('nvcc', 'g++', 'tvm') plus Python: part of every key."""
    v = {"python": sys.version.split()[0]}
    for t in tools:
        if t == "tvm":
            from importlib.metadata import version

            v[t] = version("apache-tvm")
        else:
            v[t] = _tool_version(t)
    return v


def cached_build(kind: str, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """Return (artefact folder, hit). On a miss, build(tmpdir) writes the artefacts into
    tmpdir, which then becomes <cache>/<kind>/<key> atomically."""
    final = cache_dir() / kind / key
    if (final / ".done").exists():
        return final, True
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=final.parent))
    except OSError as e:
        raise CacheError(f"kernel cache {cache_dir()} is not writable ({e.strerror or e}); "
                         "set UACOMPILE_CACHE_DIR to a writable folder") from None
    try:
        build(tmp)
        (tmp / ".done").write_text("")
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race; its artefact is equivalent
            if not (final / ".done").exists():
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, False


def clear(kind: str | None = None) -> None:
    shutil.rmtree(cache_dir() / kind if kind else cache_dir(), ignore_errors=True)
