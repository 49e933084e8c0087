"""examples/story_agent end to end on the CPU: stories260K behind an in-process server, the agent's sessions
through the OpenAI client (short budgets), and its tools over the shipped index."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
sys.path.insert(0, str(ROOT / "examples" / "story_agent"))

from server_helpers import metric, running_server  # noqa: E402
import agent  # noqa: E402
from tools import StoryIndex  # noqa: E402


def test_tools_search_lookup_summarise_and_check():
    idx = StoryIndex.load()
    assert idx.search("brass key lighthouse")[0].startswith("Mr. Hale")  # the keeper's entry shares the most words
    assert "afraid of thunder" in idx.lookup("bolt")
    with pytest.raises(KeyError, match="no character or place named 'Zed'"):
        idx.lookup("Zed")
    assert idx.summarise(2).count("\n") == 1
    assert idx.continuity_check("Lily found a silver key.") == ["the key is brass, not silver (fact 2)"]
    assert idx.continuity_check("Lily found the brass key.") == []


def test_prompts_are_synthesised_to_the_budget():
    idx, g = StoryIndex.load(), agent.story_graph(2)
    assert list(__import__("networkx").topological_sort(g)) == ["outline", "characters", "scene_1", "scene_2",
                                                                  "revision"]
    p = agent.synthesise(idx, "outline", g.nodes["outline"]["tools"], {}, "Write.", 1000)
    assert 3900 <= len(p) <= 4000 and "Earlier chapters" in p and p.endswith("Write.\n")


def test_concurrent_sessions_stream_every_step_and_free_the_pages():
    with running_server(max_num_seqs=4) as (url, _):
        out = __import__("asyncio").run(agent.run_sessions(url, sessions=3, prompt_tokens=200, max_tokens=8,
                                                           scenes=1, quiet=True))
        assert len(out["steps"]) == 3 * 4
        for s in out["steps"]:
            assert 150 <= s["prompt_tokens"] <= 300 and 1 <= s["output_tokens"] <= 8 and s["ttft_s"] > 0
        assert out["summary"]["steps"] == 12 and out["summary"]["ttft_p99_s"] >= out["summary"]["ttft_p50_s"]
        assert metric(url, "uacompile:kv_pages_in_use") == 0


def test_the_command_line_prints_each_steps_ttft_and_rate():
    with running_server(max_num_seqs=4) as (url, _):
        r = subprocess.run([sys.executable, str(ROOT / "examples" / "story_agent" / "agent.py"), "--url", url,
                            "--sessions", "2", "--prompt-tokens", "128", "--max-tokens", "6", "--scenes", "1"],
                           capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sum(1 for ln in lines if ln.startswith("session ") and "TTFT" in ln and "tok/s" in ln) == 8, r.stdout
    assert lines[-1].startswith("8 steps, TTFT p50"), r.stdout


def test_a_server_that_is_down_is_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "story_agent" / "agent.py"), "--url",
                        "http://127.0.0.1:9", "--prompt-tokens", "64"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("agent.py: error: ") and r.stderr.count("\n") == 1, r.stderr


def test_twenty_agent_runs_at_eight_sessions_against_the_server():
    """The origin's integration test in shape: 20 agent runs, 8 at once, every step streamed to its end."""
    with running_server(max_num_seqs=8) as (url, _):
        out = __import__("asyncio").run(agent.run_sessions(url, sessions=8, prompt_tokens=384, max_tokens=16,
                                                           scenes=2, runs=20, quiet=True))
        assert len(out["steps"]) == 20 * 5 and len(out["stories"]) == 20
        assert all(s["output_tokens"] >= 1 and s["ttft_s"] > 0 for s in out["steps"])
        assert metric(url, "vllm:num_requests_running") == 0 and metric(url, "uacompile:kv_pages_in_use") == 0
        assert metric(url, "vllm:generation_tokens_total") >= 100
