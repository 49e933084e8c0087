"""`uacompile bench serve`: the statistics on made-up results, the datasets, and a run against our own
server on loopback (JSON and plot written)."""
import json
import sys
from pathlib import Path

import pytest

from uacompile.bench_serve import Result, make_prompts, parse_slos, summarize
from uacompile.cli import main

sys.path.insert(0, str(Path(__file__).parent / "runtime"))  # the runtime tests' server helpers
from server_helpers import running_server  # noqa: E402


def test_summary_percentiles_throughput_and_goodput():
    rs = [Result(True, prompt_tokens=10, output_tokens=5, ttft=0.1 * (i + 1), e2e=0.1 * (i + 1) + 0.4,
                 itls=[0.1] * 4) for i in range(10)] + [Result(False, error="HTTP 503: busy")]
    s = summarize(rs, duration=2.0, slos={"ttft": 0.5, "tpot": 0.2})
    assert s["completed"] == 10 and s["failed"] == 1 and s["errors"] == ["HTTP 503: busy"]
    assert s["output_throughput"] == 25.0 and s["request_throughput"] == 5.0
    assert s["p50_ttft_ms"] == 500.0 and s["p99_ttft_ms"] == 1000.0
    assert s["p50_tpot_ms"] == pytest.approx(100.0) and s["p50_itl_ms"] == pytest.approx(100.0)
    assert s["goodput"] == 2.5  # 5 of 10 meet TTFT <= 500 ms


def test_datasets(tmp_path):
    r = make_prompts("random", 4, 20, seed=1)
    assert len(r) == 4 and all(len(p.split()) == 20 for p in r) and r == make_prompts("random", 4, 20, seed=1)
    s = make_prompts("shared-prefix", 3, 20)
    assert len({p.split()[:15].__repr__() for p in s}) == 1
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\n{"prompt": "c"}\n')
    assert make_prompts(str(f), 3, 1) == ["a b", "c", "a b"]
    with pytest.raises(ValueError, match="--dataset must be"):
        make_prompts("nope", 1, 1)
    with pytest.raises(ValueError, match="--goodput expects"):
        parse_slos(["latency:3"])


def test_bench_against_our_server(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    with running_server(max_num_seqs=8) as (url, _):
        code = main(["bench", "serve", "--url", url, "--concurrency", "1,4", "--dataset", "shared-prefix",
                     "--input-len", "12", "--output-len", "6", "--num-prompts", "8", "--out", str(out),
                     "--plot", str(png), "--goodput", "ttft:5000", "tpot:1000"])
        chat = main(["bench", "serve", "--url", url, "--endpoint", "chat", "--concurrency", "2", "--num-prompts", "2",
                     "--input-len", "4", "--output-len", "3", "--request-rate", "50", "--out", "", "--plot", ""])
    assert code == 0 and chat == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4] and report["model"] == "stories260K"
    for lv in report["levels"]:
        assert lv["completed"] == 8 and lv["failed"] == 0 and lv["total_output_tokens"] == 48
        assert lv["p50_ttft_ms"] > 0 and lv["p99_itl_ms"] >= lv["p50_itl_ms"] > 0 and lv["goodput"] > 0
    assert png.stat().st_size > 10_000


def test_bench_errors_are_one_line(capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--concurrency", "1"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert main(["bench", "serve", "--url", "http://x", "--concurrency", "0,2"]) == 2
    assert "--concurrency levels must be >= 1" in capsys.readouterr().err
