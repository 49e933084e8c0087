"""stories260K (head_dim 8: no CUDA template covers it) on device="cuda" through the tvm-cuda backend, with kernels
from a `uacompile build --preset tiny --target cuda` folder and no dtype given (the default on CUDA for a model the
templates do not cover is fp32, the preset's): the greedy tokens of the CPU run (the numpy reference backend), with
decode graphs on and off, and under swap preemption.

The folder: built here when TVM and nvcc are present, else $UA_TVM_CUDA_KERNELS (the GPU machine has no TVM:
bench/prebuild_tvm_cuda.sh builds it into .carry/tvm-cuda elsewhere)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from uacompile.runtime import LLM, SamplingParams  # noqa: E402
from uacompile.runtime.loader import models_dir  # noqa: E402

pytestmark = pytest.mark.gpu
PROMPTS = ["Once upon a time", "The little dog saw a big red ball"]
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def stories():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    path = models_dir() / "stories260K.gguf"
    assert path.exists(), f"{path} not found (set UACOMPILE_MODELS_DIR to the folder holding stories260K.gguf)"
    return str(path)


@pytest.fixture(scope="module")
def kernel_dir(stories, tmp_path_factory):
    if importlib.util.find_spec("tvm") is not None and shutil.which("nvcc"):
        out = tmp_path_factory.mktemp("tvm-cuda")
        r = subprocess.run([sys.executable, "-m", "uacompile.cli", "build", "--preset", "tiny", "--target", "cuda",
                            "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, r.stderr
        return str(out)
    prebuilt = os.environ.get("UA_TVM_CUDA_KERNELS")
    assert prebuilt and (Path(prebuilt) / "manifest.json").exists(), (
        "no TVM here: set UA_TVM_CUDA_KERNELS to a folder made by bench/prebuild_tvm_cuda.sh "
        f"(`uacompile build --preset tiny --target cuda`), got {prebuilt!r}")
    return prebuilt


@pytest.fixture(scope="module")
def cpu_tokens(stories):
    llm = LLM(stories, device="cpu", kernel_backend="reference")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_stories260k_on_cuda_gives_the_cpu_greedy_tokens(stories, kernel_dir, cpu_tokens, graphs):
    llm = LLM(stories, device="cuda", kernel_dir=kernel_dir, cuda_graphs=graphs)
    ex = llm.engine.executor
    assert llm.engine.kernels.name == "tvm-cuda" and llm.engine.dtype == torch.float32
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert [len(t) for t in got] == [32, 32]
    assert got == cpu_tokens
    if graphs:
        assert ex.graphs is not None and ex.graphs.replays > 0  # decode steps replayed the captured TVM launches
    else:
        assert ex.graphs is None


def test_stories260k_on_cuda_survives_swap_preemption(stories, kernel_dir, cpu_tokens):
    """swap_blocks (device <-> pinned host pool) and the re-run of swapped sequences through the TVM kernels."""
    llm = LLM(stories, device="cuda", kernel_dir=kernel_dir, page_size=16, num_pages=5,
              num_cpu_pages=16, preemption="swap", max_model_len=64)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == cpu_tokens


def test_the_backends_attention_matches_the_reference_eager_and_replayed_from_a_graph(kernel_dir, rng):
    """stories260K's attention kernel through the backend's paged_attention (plan None): against the numpy reference
    on a mixed prefill / decode batch, then captured in a CUDA graph and replayed over new query data."""
    import numpy as np

    from uacompile import reference, testing
    from uacompile.runtime.kernels import KernelOps, TVMCUDABackend
    from uacompile.targets.cuda import api

    ops = KernelOps.for_model(8, 4, 8, 16, torch.float32)
    backend = TVMCUDABackend(ops, kernel_dir)
    backend.prepare()
    op = ops.attention
    inp = testing.attention_inputs(op, rng, [1, 16, 17, 300, 45], [1, 16, 3, 1, 20])
    dev = {k: torch.from_numpy(np.ascontiguousarray(v)).cuda() for k, v in inp.items() if isinstance(v, np.ndarray)}
    out = torch.full_like(dev["q"], float("nan"))
    assert backend.plan_step(len(inp["q"]), 5, inp["max_pages"] * 16) is None

    def call():
        backend.paged_attention(out=out, plan=None, **dev)

    call()
    want, _ = reference.paged_attention(op, **{k: v for k, v in inp.items() if isinstance(v, np.ndarray)})
    tol = testing.tolerance("fp32")
    np.testing.assert_allclose(out.cpu().numpy(), want, atol=tol, rtol=0)

    graph = api.capture_graph([call])
    q2 = testing.random_floats(rng, inp["q"].shape, "fp32")
    dev["q"].copy_(torch.from_numpy(q2))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want2, _ = reference.paged_attention(op, **{**{k: v for k, v in inp.items() if isinstance(v, np.ndarray)}, "q": q2})
    np.testing.assert_allclose(out.cpu().numpy(), want2, atol=tol, rtol=0)


def test_the_server_on_cuda_answers_with_the_cpu_greedy_text(stories, kernel_dir, cpu_tokens):
    """`uacompile serve --device cuda`'s app (FastAPI + uvicorn) over a CUDA engine: a whole completion and a
    streamed one carry the CPU run's greedy text; /health and /metrics answer."""
    import httpx
    from server_helpers import running_server

    from uacompile.runtime.engine import Engine, EngineConfig

    cpu = LLM(stories, device="cpu", kernel_backend="reference").generate(PROMPTS, PARAMS)
    texts = [o.outputs[0].text for o in cpu]
    assert [o.outputs[0].token_ids for o in cpu] == cpu_tokens
    engine = Engine(stories, EngineConfig(device="cuda", kernel_dir=kernel_dir))
    assert engine.async_scheduling and engine.kernels.name == "tvm-cuda"
    body = {"max_tokens": PARAMS.max_tokens, "temperature": 0, "ignore_eos": True}
    with running_server(engine) as (url, _):
        assert httpx.get(url + "/health").json()["status"] == "ok"
        whole = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], **body}, timeout=120).json()
        assert whole["choices"][0]["text"] == texts[0] and whole["usage"]["completion_tokens"] == 32
        streamed = []
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": PROMPTS[1], "stream": True, **body},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed += [c["text"] for c in json.loads(line[6:])["choices"]]
        assert "".join(streamed) == texts[1]
        assert "vllm:generation_tokens_total" in httpx.get(url + "/metrics").text
