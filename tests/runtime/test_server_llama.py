"""llama-server's routes on the server (runtime/server_llama.py), through real HTTP on loopback: /props,
/slots, /apply-template, and /completion's n_probs, n_predict and stop_type as llama-server reports them."""
import threading

import httpx
import pytest

from server_helpers import make_engine, running_server, sse_events
from uacompile.runtime import chat
from uacompile.runtime.server_llama import stop_type, stopping_word

PROMPT = "Once upon a time"
GREEDY = {"temperature": 0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


@pytest.fixture(scope="module")
def server():
    with running_server(max_num_seqs=4, page_size=8) as (url, app):
        yield url, app


def completion(url, **body):
    r = httpx.post(url + "/completion", json={"prompt": PROMPT, **GREEDY, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_props(server):
    url, app = server
    p = httpx.get(url + "/props").json()
    engine = app.state.aengine.engine
    assert p["total_slots"] == 4 and p["default_generation_settings"]["n_ctx"] == engine.scheduler.config.max_model_len
    params = p["default_generation_settings"]["params"]
    assert params["n_predict"] == -1 and params["temperature"] == 0.8 and params["top_k"] == 40
    assert p["chat_template"] == (engine.tokenizer.chat_template or chat.FALLBACK_TEMPLATE)
    assert p["modalities"] == {"vision": False, "audio": False} and p["build_info"].startswith("uacompile")


def test_slots_idle_and_busy(server):
    url, app = server
    idle = httpx.get(url + "/slots").json()
    assert [s["id"] for s in idle] == [0, 1, 2, 3] and not any(s["is_processing"] for s in idle)
    assert all(s["id_task"] == -1 and s["n_ctx"] > 0 for s in idle)
    seen, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            seen.append(httpx.get(url + "/slots").json())

    with httpx.stream("POST", url + "/completion", timeout=60,
                      json={"prompt": PROMPT, "n_predict": 200, "ignore_eos": True, "stream": True, **GREEDY}) as s:
        lines = s.iter_lines()
        for line in lines:  # the first token is out: the request holds a slot
            if line.startswith("data:"):
                break
        t = threading.Thread(target=poll)
        t.start()
        for _ in lines:
            pass
    stop.set()
    t.join()
    busy = [s for snap in seen for s in snap if s["is_processing"]]
    assert busy, "no snapshot saw the running request"
    b = busy[0]
    assert b["id_task"] >= 0 and b["params"]["n_predict"] == 200 and b["params"]["ignore_eos"] is True
    assert b["next_token"]["n_decoded"] + b["next_token"]["n_remain"] == 200
    r = httpx.get(url + "/slots", params={"fail_on_no_slot": 1})
    assert r.status_code == 200  # idle again


def test_apply_template(server):
    url, app = server
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = httpx.post(url + "/apply-template", json={"messages": msgs}).json()
    assert r["prompt"] == chat.render(app.state.aengine.engine.tokenizer, msgs, True)
    bad = httpx.post(url + "/apply-template", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]
    extra = httpx.post(url + "/apply-template", json={"messages": msgs, "jinja": True})
    assert extra.status_code == 400 and "jinja" in extra.json()["error"]["message"]


def test_n_probs_shape_and_values(server):
    url, _ = server
    r = completion(url, n_predict=6, n_probs=3, ignore_eos=True)
    probs = r["completion_probabilities"]
    assert len(probs) == 6 and r["tokens_predicted"] == 6
    ref = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                    "ignore_eos": True, "logprobs": 3}, timeout=60).json()
    ref_lp = ref["choices"][0]["logprobs"]
    assert "".join(p["token"] for p in probs) == "".join(ref_lp["tokens"])
    for p, lp in zip(probs, ref_lp["token_logprobs"]):
        assert set(p) == {"id", "token", "logprob", "bytes", "top_logprobs"}
        assert p["logprob"] == pytest.approx(lp, abs=1e-5) and p["bytes"] == list(p["token"].encode())
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]  # greedy: the argmax
        assert [t["logprob"] for t in p["top_logprobs"]] == sorted((t["logprob"] for t in p["top_logprobs"]),
                                                                   reverse=True)
    assert "completion_probabilities" not in completion(url, n_predict=2)
    with httpx.stream("POST", url + "/completion", timeout=60,
                      json={"prompt": PROMPT, "n_predict": 6, "n_probs": 2, "ignore_eos": True, "stream": True,
                            **GREEDY}) as s:
        events = sse_events(s.iter_lines())
    streamed = [p for e in events[:-1] for p in e["completion_probabilities"]]
    assert [p["id"] for p in streamed] == [p["id"] for p in probs]


def test_n_predict_semantics(server):
    url, app = server
    zero = completion(url, n_predict=0)
    assert zero["content"] == "" and zero["tokens_predicted"] == 0 and zero["stop_type"] == "limit"
    assert zero["tokens_evaluated"] > 0
    with httpx.stream("POST", url + "/completion", timeout=60,
                      json={"prompt": PROMPT, "n_predict": 0, "stream": True, **GREEDY}) as s:
        events = sse_events(s.iter_lines())
    assert len(events) == 1 and events[0]["stop"] is True and events[0]["tokens_predicted"] == 0
    # -1: until EOS or the context is full
    room = app.state.aengine.engine.scheduler.config.max_model_len - zero["tokens_evaluated"]
    whole = completion(url, n_predict=-1, ignore_eos=True)
    assert whole["tokens_predicted"] == room and whole["stop_type"] == "limit"
    bad = httpx.post(url + "/completion", json={"prompt": PROMPT, "n_predict": -2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n_predict"


def test_stop_type_word_and_limit(server):
    url, _ = server
    long = completion(url, n_predict=40)
    assert long["stop_type"] == "limit" and long["stopping_word"] == ""
    word = " " + long["content"].split()[3]
    stopped = completion(url, n_predict=40, stop=[word])
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == long["content"][:long["content"].index(word)]


def test_stop_type_eos():
    """stories260K's greedy text meets no EOS in its context: an engine whose EOS is a token that text has."""
    engine = make_engine(max_num_seqs=2)
    ids = engine.encode_prompt(PROMPT)[1]
    with running_server(engine) as (url, _):
        with httpx.stream("POST", url + "/completion", timeout=60,
                          json={"prompt": ids, "n_predict": 8, "stream": True, **GREEDY}) as s:
            tokens = [t for e in sse_events(s.iter_lines())[:-1] for t in e["tokens"]]
        eos = tokens[4]
        engine.model.cfg.eos_token_ids = (eos,)
        r = completion(url, n_predict=-1)
        assert r["stop_type"] == "eos" and r["stopping_word"] == "" and r["tokens_predicted"] == tokens.index(eos) + 1
        r = completion(url, n_predict=-1, ignore_eos=True, stop=["zzzz"])
        assert r["stop_type"] == "limit"


def test_stop_type_values():
    assert stop_type("length", 5, (2,), False) == "limit"
    assert stop_type("stop", 2, (2,), False) == "eos"
    assert stop_type("stop", 7, (2,), False) == "word"
    assert stop_type("stop", 2, (2,), True) == "word"
    assert stop_type(None, None, (2,), False) == "none" and stop_type("abort", 3, (2,), False) == "none"
    assert stopping_word("hello world, bye", "hello", [" bye", " world"]) == " world"
