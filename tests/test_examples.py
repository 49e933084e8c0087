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
