"""lm-evaluation-harness as a client of the server (runtime/server.py): its `local-completions` model scores
multiple choice by loglikelihood (it reads /tokenizer_info, tokenises through /tokenize, asks /v1/completions for
echo + logprobs), its `local-chat-completions` model generates through /v1/chat/completions. SmolLM2-135M-Instruct
on the CPU, a slice of bench/lm_eval_server.py's tasks."""
import importlib
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from model_helpers import prompt_logprobs
from server_helpers import running_server
from uacompile.models import smollm2_path
from uacompile.runtime.engine import Engine, EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
lm_eval_server = importlib.import_module("lm_eval_server")


@pytest.fixture(scope="module")
def smollm2_server():
    engine = Engine(str(smollm2_path()), EngineConfig(device="cpu", cpu_threads=2), max_num_seqs=8)
    with running_server(engine) as (url, _):
        yield url, engine


def test_tokenizer_info_is_what_the_remote_tokenizer_reads(smollm2_server):
    url, engine = smollm2_server
    info = httpx.get(url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert "<|im_start|>" in info["chat_template"] and info["model_max_length"] == 8192
    from lm_eval.utils import check_remote_tokenizer_support

    assert check_remote_tokenizer_support(url + "/v1/completions")


def test_local_completions_loglikelihoods_are_the_models(smollm2_server, tmp_path):
    """Each choice's loglikelihood lm-eval sums from the echoed logprobs equals the model's own (its forward over
    context + choice, summed over the choice's tokens), and SmolLM2 knows most capitals (chance is 25%)."""
    url, engine = smollm2_server
    res = lm_eval_server.evaluate(url, "capitals_mc", tmp_path, limit=6, num_concurrent=2)
    samples = res["samples"]["capitals_mc"]
    assert len(samples) == 6
    tok = engine.tokenizer
    for s in samples:
        for (context, choice), [(ll, _)] in zip(s["arguments"], s["resps"]):
            ctx = tok.encode(context, add_special_tokens=False)
            whole = tok.encode(context + choice, add_special_tokens=False)
            assert whole[:len(ctx)] == ctx
            lps = prompt_logprobs(engine.executor, whole, kv=engine.scheduler.kv)
            assert ll == pytest.approx(float(np.sum(lps[len(ctx) - 1:])), abs=2e-3), (context, choice)
    assert lm_eval_server.scores(res, "capitals_mc")["acc"] >= 0.5


def test_local_chat_completions_generates_through_the_chat_template(smollm2_server, tmp_path):
    url, _ = smollm2_server
    res = lm_eval_server.evaluate(url, "capitals_gen", tmp_path, limit=4, num_concurrent=2)
    samples = res["samples"]["capitals_gen"]
    assert len(samples) == 4 and all(s["resps"][0][0].strip() for s in samples)
    assert not any("<|im_" in s["resps"][0][0] for s in samples)  # the template's tokens stay out of the reply
    assert lm_eval_server.scores(res, "capitals_gen")["exact_match"] >= 0.5
