"""The tuning database: the winning config per (target, op, shape bucket, device, toolchain), one JSON file.

    db = TuningDB.open()                                   # default: <user cache dir>/tuning.json
    tuned = Tuned(db, "cuda", cuda_environment(0))         # a lookup view for one device + toolchain
    tuned.config(op, num_tokens, num_seqs, max_kv_len)     # the record's config, or None (the built-in rule)

A shape is `decode:BxL` (B sequences, one new token each, L positions of KV) or `prefill:BxL` (B prompts of L
tokens, causal). Its bucket rounds B and L up to powers of two, and a step (num_tokens, num_seqs, max_kv_len)
falls in the bucket of its kind (decode: at most one token a sequence). A record of another device or toolchain
is stale: lookups ignore it and log a note once. `uacompile tune` writes records (and, while it runs, the
samples of the candidates it has timed, so an interrupted run resumes); `uacompile tune --show` prints them.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import platform
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import IRError

log = logging.getLogger(__name__)
KINDS = ("decode", "prefill")
VERSION = 1
_SHAPE = re.compile(r"^(decode|prefill):(\d+)x(\d+)$")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class Shape:
    """One tuning shape: `decode:8x16384` (8 sequences decoding at 16384 positions) or `prefill:4x4096`."""

    kind: str
    batch: int
    length: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"shape kind must be one of {KINDS}, got {self.kind!r}")
        if self.batch < 1 or self.length < 1:
            raise ValueError(f"shape {self}: batch and length must be >= 1")

    @classmethod
    def parse(cls, text: str) -> "Shape":
        m = _SHAPE.match(text.strip())
        if not m:
            raise ValueError(f"shape {text!r}: expected decode:BxL or prefill:BxL (e.g. decode:8x16384)")
        return cls(m.group(1), int(m.group(2)), int(m.group(3)))

    def __str__(self) -> str:
        return f"{self.kind}:{self.batch}x{self.length}"

    @property
    def num_seqs(self) -> int:
        return self.batch

    @property
    def num_tokens(self) -> int:
        return self.batch if self.kind == "decode" else self.batch * self.length

    @property
    def max_kv_len(self) -> int:
        return self.length

    def kv_lens(self) -> list[int]:
        return [self.length] * self.batch

    def q_lens(self) -> list[int]:
        return [1 if self.kind == "decode" else self.length] * self.batch

    def bucket(self) -> str:
        return f"{self.kind}:{_pow2(self.batch)}x{_pow2(self.length)}"


def parse_shapes(text: str) -> list[Shape]:
    """`decode:8x16384,prefill:4x4096` -> Shapes."""
    shapes = [Shape.parse(s) for s in text.split(",") if s.strip()]
    if not shapes:
        raise ValueError("--shapes: no shape given")
    return shapes


def step_bucket(num_tokens: int, num_seqs: int, max_kv_len: int) -> str:
    """The bucket of a step: decode when it has at most one token a sequence, else prefill (its tokens spread
    over its sequences)."""
    if num_tokens <= num_seqs:
        return Shape("decode", max(1, num_tokens), max(1, max_kv_len)).bucket()
    return Shape("prefill", max(1, num_seqs), max(1, max_kv_len)).bucket()


# ------------------------------------------------------------------ environments
def cpu_environment() -> dict:
    """This CPU (as the OS describes it: model and feature flags, read without importing TVM) and the TVM that
    builds its kernels (its installed version)."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    from .lower.tvm_build import host_cpu

    info = host_cpu()
    name = info.get("model name") or info.get("processor") or info["machine"]
    flags = info.get("flags") or info.get("Features") or ""
    try:
        tvm_version = version("apache-tvm")
    except PackageNotFoundError:
        tvm_version = "absent"
    return {"device": f"{name} (features {hashlib.sha256(flags.encode()).hexdigest()[:8]})",
            "toolchain": {"tvm": tvm_version}}


def cuda_environment(device=0) -> dict:
    """A CUDA device's name and the driver, CUDA runtime and nvcc its kernels are built and run with."""
    import torch

    from . import nvcc

    toolchain = {"cuda": torch.version.cuda or "unknown", "driver": "unknown"}
    try:
        import pynvml

        pynvml.nvmlInit()
        drv = pynvml.nvmlSystemGetDriverVersion()
        toolchain["driver"] = drv.decode() if isinstance(drv, bytes) else str(drv)
    except Exception:  # noqa: BLE001 - no NVML: the CUDA runtime version stands in
        pass
    try:
        toolchain["nvcc"] = nvcc.toolchain().get(nvcc.nvcc_path(), "unknown")
    except nvcc.NvccNotFound:
        toolchain["nvcc"] = "absent"
    return {"device": torch.cuda.get_device_name(device), "toolchain": toolchain}


def environment(target: str, device=0) -> dict:
    return cpu_environment() if target == "cpu" else cuda_environment(device)


# ------------------------------------------------------------------ configs
def config_to_dict(config) -> dict:
    return {"config": type(config).__name__, **asdict(config)}


def config_from_dict(d: dict):
    """A config object from config_to_dict's form ({"config": "AttentionConfig", fields...})."""
    d = dict(d)
    name = d.pop("config", None)
    if name == "TVMConfig":
        from .lower.config import TVMConfig as cls
    elif name == "AttentionConfig":
        from .targets.cuda.config import AttentionConfig as cls
    elif name == "ReshapeConfig":
        from .targets.cuda.config import ReshapeConfig as cls
    elif name == "AscendConfig":
        from .targets.ascend.config import AscendConfig as cls
    else:
        raise IRError("record.config", f"unknown config class {name!r}")
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(d) - known)
    if unknown:
        raise IRError(f"{name}", f"record has fields this version does not know: {unknown}")
    return cls(**d)


# ------------------------------------------------------------------ records
@dataclass
class Record:
    """The winner of one (target, op, bucket) on one device + toolchain, with what it was measured against."""

    target: str
    op: dict  # op.to_dict()
    op_key: str
    bucket: str
    shape: str  # the shape it was timed at
    device: str
    toolchain: dict
    config: dict  # config_to_dict(winner)
    default_config: dict
    default_ms: float
    tuned_ms: float
    candidates: int = 0
    discarded: int = 0
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    @property
    def speedup(self) -> float:
        return self.default_ms / self.tuned_ms if self.tuned_ms > 0 else 0.0

    def key(self) -> str:
        return record_key(self.target, self.op_key, self.bucket, self.device, self.toolchain)

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": round(self.speedup, 4)}

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def record_key(target: str, op_key: str, bucket: str, device: str, toolchain: dict) -> str:
    return "|".join([target, op_key, bucket, device, json.dumps(toolchain, sort_keys=True)])


def default_db_path() -> Path:
    """<kernel cache dir>/tuning.json (UACOMPILE_CACHE_DIR, else the user cache dir)."""
    from .cache import cache_dir

    return cache_dir() / "tuning.json"


class TuningDB:
    """The JSON file: {"version", "records": {key: Record}, "partial": {key: {config json: [seconds]}}}.
    Written whole to a temporary file renamed into place (a reader never sees half a file)."""

    def __init__(self, path: Path, records: dict | None = None, partial: dict | None = None):
        self.path = Path(path)
        self.records: dict[str, Record] = records or {}
        self.partial: dict[str, dict] = partial or {}

    @classmethod
    def open(cls, path: str | Path | None = None) -> "TuningDB":
        path = Path(path) if path is not None else default_db_path()
        if not path.exists():
            return cls(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"tuning database {path} is not JSON: {e}") from None
        if data.get("version") != VERSION:
            raise ValueError(f"tuning database {path}: version {data.get('version')!r}, this build reads {VERSION}")
        records = {k: Record.from_dict(v) for k, v in data.get("records", {}).items()}
        return cls(path, records, data.get("partial", {}))

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"version": VERSION, "records": {k: r.to_dict() for k, r in sorted(self.records.items())},
                "partial": self.partial}
        fd, tmp = tempfile.mkstemp(prefix=".tuning-", suffix=".json", dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def put(self, record: Record) -> None:
        self.records[record.key()] = record
        self.partial.pop(record.key(), None)

    def get(self, target: str, op, bucket: str, env: dict) -> Record | None:
        """The record of (target, op, bucket) on env's device and toolchain; a record of the same (target, op,
        bucket) on another device or toolchain is stale: ignored, with a logged note."""
        op_key = op.key()
        rec = self.records.get(record_key(target, op_key, bucket, env["device"], env["toolchain"]))
        if rec is None:
            for r in self.records.values():
                if (r.target, r.op_key, r.bucket) == (target, op_key, bucket):
                    _note_stale(str(self.path), r.key(), r.device, json.dumps(r.toolchain, sort_keys=True),
                                env["device"], json.dumps(env["toolchain"], sort_keys=True))
        return rec

    def for_op(self, target: str, op, env: dict) -> list[Record]:
        """Every current (not stale) record of op on env's device and toolchain."""
        op_key = op.key()
        return [r for r in self.records.values() if (r.target, r.op_key, r.device) == (target, op_key, env["device"])
                and r.toolchain == env["toolchain"]]

    def table(self) -> str:
        """The records as a text table (`uacompile tune --show`)."""
        if not self.records:
            return f"{self.path}: no records"
        lines = [f"{self.path}: {len(self.records)} records",
                 f"{'target':7} {'op':16} {'op key':12} {'bucket':16} {'device':28} {'default ms':>10} "
                 f"{'tuned ms':>10} {'speedup':>7}  config"]
        for r in sorted(self.records.values(), key=lambda r: (r.target, r.op_key, r.bucket, r.device)):
            cfg = {k: v for k, v in r.config.items() if k != "config" and r.default_config.get(k) != v}
            lines.append(f"{r.target:7} {r.op.get('op', '?'):16} {r.op_key:12} {r.bucket:16} {r.device[:28]:28} "
                         f"{r.default_ms:10.4f} {r.tuned_ms:10.4f} {r.speedup:7.2f}  "
                         f"{r.config.get('config')} {json.dumps(cfg) if cfg else '(the default)'}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def _note_stale(path, key, device, toolchain, here_device, here_toolchain) -> None:  # once per record
    log.info("tuning database %s: record %s is for %s %s, not this %s %s: ignored (the built-in rule runs)",
             path, key.split("|")[2], device, toolchain, here_device, here_toolchain)


class Tuned:
    """A lookup view of a database for one target on one device + toolchain: config(op, step) is the record's
    config for the step's bucket, or None. Each (op, bucket) is looked up once and remembered, so a planner can
    ask every step."""

    def __init__(self, db: TuningDB, target: str, env: dict):
        self.db, self.target, self.env = db, target, env
        self._memo: dict = {}

    def config(self, op, num_tokens: int, num_seqs: int, max_kv_len: int):
        bucket = step_bucket(num_tokens, num_seqs, max_kv_len)
        key = (op, bucket)
        if key not in self._memo:
            rec = self.db.get(self.target, op, bucket, self.env)
            cfg = None
            if rec is not None:
                try:
                    cfg = config_from_dict(rec.config)
                except (IRError, TypeError) as e:
                    log.warning("tuning database %s: record for %s %s unreadable (%s): ignored", self.db.path,
                                op.kind, bucket, e)
            self._memo[key] = cfg
        return self._memo[key]

    def configs(self, op) -> list:
        """The configs of every current record of op (the kernels a server builds before it serves)."""
        out = []
        for r in self.db.for_op(self.target, op, self.env):
            try:
                out.append(config_from_dict(r.config))
            except (IRError, TypeError):
                continue
        return out


@functools.lru_cache(maxsize=None)
def default_tuned(target: str, device=0) -> Tuned | None:
    """The process's view of the default database for target on a device, read once (None: no database file).
    An unreadable database is logged and ignored: the built-in rules run."""
    path = default_db_path()
    if not path.exists():
        return None
    try:
        return Tuned(TuningDB.open(path), target, environment(target, device))
    except (ValueError, OSError) as e:
        log.warning("tuning database %s ignored: %s", path, e)
        return None


__all__ = ["Shape", "parse_shapes", "step_bucket", "cpu_environment", "cuda_environment", "environment",
           "config_to_dict", "config_from_dict", "Record", "TuningDB", "Tuned", "default_tuned", "default_db_path"]
