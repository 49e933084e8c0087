"""The README's one-command demo: a story from stories260K on the CPU."""
import subprocess
import sys
from pathlib import Path



ROOT = Path(__file__).resolve().parents[1]


def test_story_example_tells_the_model_cards_story():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "story.py"), "--max-tokens", "30"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time, there was a little girl named Lily."), r.stdout
    assert "kernels: tvm-cpu" in r.stderr  # the stats line goes to stderr


def test_story_example_answers_a_bad_value_with_one_line():
    for args, needle in ((["--max-tokens", "0"], "max_tokens must be an int >= 1, got 0"),
                         (["--temperature", "inf"], "temperature must be a finite number"),
                         (["--model", "/no/such.gguf"], "model path does not exist: /no/such.gguf")):
        r = subprocess.run([sys.executable, str(ROOT / "examples" / "story.py"), *args], capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 2 and r.stderr == f"story.py: error: {r.stderr.split(': ', 2)[2]}", r.stderr
        assert needle in r.stderr and r.stderr.count("\n") == 1, r.stderr
