"""uacompile/tunedb.py: shapes and buckets, the JSON database's round trip, stale records, the lookup view."""
import json
import logging

import pytest

from uacompile import ir
from uacompile.lower.config import TVMConfig
from uacompile.targets.cuda.config import AttentionConfig, ReshapeConfig
from uacompile.tunedb import (Record, Shape, Tuned, TuningDB, config_from_dict, config_to_dict, parse_shapes,
                              step_bucket)

OP = ir.PagedAttention(8, 4, 8, 16, "fp32", "fp32")
ENV = {"device": "cpu-a", "toolchain": {"tvm": "1.0"}}


def record(bucket="decode:4x512", config=TVMConfig(grain=4), env=ENV, op=OP, target="cpu"):
    return Record(target, op.to_dict(), op.key(), bucket, bucket, env["device"], env["toolchain"],
                  config_to_dict(config), config_to_dict(TVMConfig()), 2.0, 1.0, 3, 0)


def test_shapes_parse_and_bucket():
    s = Shape.parse("decode:8x16384")
    assert (s.kind, s.batch, s.length, s.num_tokens, s.num_seqs, s.max_kv_len) == ("decode", 8, 16384, 8, 8, 16384)
    p = Shape.parse("prefill:3x1000")
    assert p.num_tokens == 3000 and p.q_lens() == [1000] * 3 and p.bucket() == "prefill:4x1024"
    assert [str(x) for x in parse_shapes("decode:8x16384, prefill:4x4096")] == ["decode:8x16384", "prefill:4x4096"]
    for bad in ("decode:8", "mixed:1x2", "decode:0x5", ""):
        with pytest.raises(ValueError):
            parse_shapes(bad)
    # a step falls in its kind's bucket
    assert step_bucket(8, 8, 16000) == "decode:8x16384" == Shape.parse("decode:5x9000").bucket()
    assert step_bucket(4 * 4096, 4, 4096) == "prefill:4x4096"


def test_config_dict_round_trip():
    for c in (TVMConfig(grain=4, unroll_dot=True), AttentionConfig(num_splits=4, fused_merge=True, decode_only=True),
              ReshapeConfig(rows=2, neox="reload")):
        assert config_from_dict(json.loads(json.dumps(config_to_dict(c)))) == c
    with pytest.raises(ir.IRError, match="unknown config class"):
        config_from_dict({"config": "Nope"})
    with pytest.raises(ir.IRError, match="does not know"):
        config_from_dict({"config": "TVMConfig", "warp_magic": 3})


def test_database_round_trips(tmp_path):
    db = TuningDB.open(tmp_path / "t.json")
    assert db.records == {}
    db.put(record())
    db.put(record("prefill:1x64", TVMConfig(dot_lanes=1)))
    db.partial["x"] = {"{}": [1.0]}
    db.save()
    again = TuningDB.open(tmp_path / "t.json")
    assert again.records.keys() == db.records.keys()
    r = again.get("cpu", OP, "decode:4x512", ENV)
    assert r.config == config_to_dict(TVMConfig(grain=4)) and r.speedup == 2.0 and again.partial == db.partial
    assert "TVMConfig" in again.table() and "decode:4x512" in again.table()
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        TuningDB.open(tmp_path / "bad.json")


def test_stale_records_are_ignored_with_a_note(tmp_path, caplog):
    db = TuningDB(tmp_path / "t.json")
    db.put(record(env={"device": "cpu-b", "toolchain": {"tvm": "1.0"}}))
    db.put(record("prefill:1x64", env={"device": "cpu-a", "toolchain": {"tvm": "0.9"}}))
    with caplog.at_level(logging.INFO, logger="uacompile.tunedb"):
        assert db.get("cpu", OP, "decode:4x512", ENV) is None
        assert db.get("cpu", OP, "prefill:1x64", ENV) is None
    notes = [r.getMessage() for r in caplog.records]
    assert any("cpu-b" in n and "ignored" in n for n in notes) and any("0.9" in n for n in notes)
    assert Tuned(db, "cpu", ENV).config(OP, 4, 4, 500) is None
    assert db.for_op("cpu", OP, ENV) == []


def test_tuned_view_looks_up_once_per_bucket(tmp_path, monkeypatch):
    db = TuningDB(tmp_path / "t.json")
    db.put(record())
    tuned = Tuned(db, "cpu", ENV)
    calls = []
    get = db.get
    monkeypatch.setattr(db, "get", lambda *a: calls.append(a) or get(*a))
    for L in (300, 400, 512):
        assert tuned.config(OP, 4, 4, L) == TVMConfig(grain=4)
    assert tuned.config(OP, 4, 4, 600) is None  # another bucket: the rule
    assert tuned.config(OP.replace(head_dim=16), 4, 4, 300) is None  # another op
    assert len(calls) == 3
    assert tuned.configs(OP) == [TVMConfig(grain=4)]
