import os
import threading

from uacompile import cache


def test_cache_dir_is_overridable(tmp_path, monkeypatch):
    monkeypatch.setenv("UACOMPILE_CACHE_DIR", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("UACOMPILE_CACHE_DIR")
    assert "uacompile" in str(cache.cache_dir())


def test_second_build_is_a_hit_and_keys_change_with_content(tmp_path, monkeypatch):
    monkeypatch.setenv("UACOMPILE_CACHE_DIR", str(tmp_path))
    calls = []

    def build(d):
        calls.append(d)
        (d / "k.so").write_text("artefact")

    key = cache.content_hash({"op": "x"}, "template text", cache.toolchain_versions("g++"), ["-O3"])
    path, hit = cache.cached_build("test", key, build)
    assert not hit and (path / "k.so").read_text() == "artefact"
    path2, hit2 = cache.cached_build("test", key, build)
    assert hit2 and path2 == path and len(calls) == 1
    other = cache.content_hash({"op": "x"}, "template text!", cache.toolchain_versions("g++"), ["-O3"])
    assert other != key
    assert cache.content_hash({"b": 1, "a": 2}) == cache.content_hash({"a": 2, "b": 1})


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("UACOMPILE_CACHE_DIR", str(tmp_path))

    def broken(d):
        (d / "half").write_text("x")
        raise RuntimeError("compiler crashed")

    try:
        cache.cached_build("test", "k1", broken)
    except RuntimeError:
        pass
    assert not (tmp_path / "test" / "k1").exists()
    assert os.listdir(tmp_path / "test") == []


def test_concurrent_builders_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("UACOMPILE_CACHE_DIR", str(tmp_path))
    results = []

    def build(d):
        (d / "k").write_text("same")

    ts = [threading.Thread(target=lambda: results.append(cache.cached_build("test", "k2", build)[0])) for _ in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert len(set(results)) == 1 and (results[0] / "k").read_text() == "same"
