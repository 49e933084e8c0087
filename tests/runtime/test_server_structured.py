"""The server's structured output and tool calls (runtime/server.py over runtime/structured.py and runtime/tools.py),
through the official openai SDK and by hand, on loopback: stories260K, and SmolLM2 for its chat template."""
import json
import re

import httpx
import pytest
from pydantic import BaseModel, Field

from uacompile.models import smollm2_path
from uacompile.runtime.engine import Engine, EngineConfig

from server_helpers import running_server, sse_events

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                  "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "Tell me about a person."}]


def check(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and len(obj["name"]) <= 10, text
    return obj


@pytest.fixture(scope="module")
def served():
    with running_server(max_num_seqs=16, page_size=8) as (url, app):
        yield url, app.state.aengine.engine


@pytest.fixture(scope="module")
def sdk(served):
    import openai
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def no_matchers_left(engine) -> bool:
    import time
    deadline = time.monotonic() + 10
    while engine.num_guided and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.num_guided == 0


def test_response_format_json_schema_whole_and_streamed(sdk, served):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    whole = sdk.chat.completions.create(model="stories260K", messages=CHAT, max_tokens=60, temperature=0.8, seed=4,
                                        n=2, response_format=rf)
    for c in whole.choices:
        assert c.finish_reason == "stop"
        check(c.message.content)
    text = "".join(ch.choices[0].delta.content or "" for ch in sdk.chat.completions.create(
        model="stories260K", messages=CHAT, max_tokens=60, temperature=0.8, seed=4, response_format=rf, stream=True))
    assert text == whole.choices[0].message.content  # the same seed, alone: the same draw
    assert no_matchers_left(served[1])


def test_response_format_json_object_and_the_sdk_parse_helper(sdk):
    out = sdk.chat.completions.create(model="stories260K", messages=CHAT, max_tokens=20, temperature=0,
                                      response_format={"type": "json_object"})
    assert out.choices[0].message.content.startswith("{")

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=99)

    parsed = sdk.chat.completions.parse(model="stories260K", messages=CHAT, max_tokens=60, temperature=0,
                                        response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and len(person.name) <= 10


def test_vllm_guided_fields_on_completions(sdk):
    out = sdk.completions.create(model="stories260K", prompt="Once", max_tokens=40, temperature=1, n=3, seed=2,
                                 extra_body={"guided_choice": ["cat", "dog", "bird"]})
    assert all(c.text in ("cat", "dog", "bird") and c.finish_reason == "stop" for c in out.choices)
    out = sdk.completions.create(model="stories260K", prompt=["Once", "One day"], max_tokens=40,
                                 extra_body={"guided_regex": r"[0-9]{2}:[0-9]{2}"})
    assert len(out.choices) == 2 and all(re.fullmatch(r"[0-9]{2}:[0-9]{2}", c.text) for c in out.choices)
    out = sdk.completions.create(model="stories260K", prompt="Once", max_tokens=60, temperature=0,
                                 extra_body={"guided_json": SCHEMA})
    check(out.choices[0].text)
    out = sdk.completions.create(model="stories260K", prompt="Once", max_tokens=40, temperature=0,
                                 extra_body={"guided_grammar": 'root ::= "It is " ("red" | "blue") "."'})
    assert out.choices[0].text in ("It is red.", "It is blue.")


def test_guided_output_with_stop_strings_streamed(served):
    url, engine = served
    body = {"prompt": "Once", "max_tokens": 40, "temperature": 0, "guided_regex": "[a-z]{3}-[a-z]{3}", "stop": ["-"],
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert re.fullmatch("[a-z]{3}", text) and events[-2]["choices"][0]["finish_reason"] == "stop", events
    assert no_matchers_left(engine)


def test_llama_cpp_grammar_and_json_schema(served):
    url, _ = served
    r = httpx.post(url + "/completion", json={"prompt": "Once", "n_predict": 20,
                                              "grammar": 'root ::= "A" [0-9] [0-9]'}, timeout=60)
    assert r.status_code == 200 and re.fullmatch("A[0-9]{2}", r.json()["content"]) and r.json()["stop_type"] != "limit"
    r = httpx.post(url + "/completion", json={"prompt": "Once", "n_predict": 60, "temperature": 0,
                                              "json_schema": SCHEMA, "stream": True}, timeout=60)
    events = sse_events(r.text.splitlines())
    check("".join(e["content"] for e in events))


@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/completions", {"guided_regex": "[0-9"}, "guided_regex", "cannot compile the regex"),
    ("/v1/completions", {"guided_json": {"type": "nonsense"}}, "guided_json", "cannot compile the json_schema"),
    ("/v1/completions", {"guided_json": "{not json"}, None, "not valid JSON"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, None, "give one of"),
    ("/v1/completions", {"guided_choice": []}, None, "non-empty list"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "must be 'text'"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
     "response_format", "cannot compile the json_schema"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice",
     "cannot be combined"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "not in tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
                              "tool_choice": "required"}, "tools", "cannot compile"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]},
     "tools.0.function.bogus", "unsupported field"),
    ("/completion", {"grammar": "root ::= (", "n_predict": 4}, "grammar", "cannot compile the grammar"),
    ("/completion", {"grammar": "root ::= \"a\"", "json_schema": {}, "n_predict": 4}, "grammar", "not both"),
])
def test_bad_guides_are_a_one_line_400(served, path, body, param, needle):
    base = {"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": "Once"}
    r = httpx.post(served[0] + path, json={**base, "max_tokens": 4, **body} if path != "/completion"
                   else {**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "\n" not in err["message"] and err["param"] == param, err


def test_tool_choice_required_whole_and_streamed(sdk, served):
    kw = dict(model="stories260K", messages=[{"role": "user", "content": "Weather in Paris? And 2 + 3?"}],
              tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False, max_tokens=120,
              temperature=0.7, seed=3)
    whole = sdk.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "add") and isinstance(json.loads(call.function.arguments), dict)
    calls, reasons, content = {}, [], ""
    for ch in sdk.chat.completions.create(**kw, stream=True):
        d = ch.choices[0].delta
        content += d.content or ""
        reasons.append(ch.choices[0].finish_reason)
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert content == "" and reasons[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert no_matchers_left(served[1])


def test_named_tool_choice_without_parallel_calls(sdk):
    out = sdk.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "2 + 3?"}],
                                      tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}},
                                      parallel_tool_calls=False, max_tokens=80, temperature=0.5, seed=1, n=2)
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        assert c.message.tool_calls[0].function.name == "add"
        assert set(json.loads(c.message.tool_calls[0].function.arguments)) == {"a", "b"}


def test_tool_choice_none_and_auto_without_a_call_answer_in_text(sdk):
    for choice in ("none", "auto"):
        out = sdk.chat.completions.create(model="stories260K", messages=CHAT, tools=[WEATHER], tool_choice=choice,
                                          max_tokens=8, temperature=0)
        c = out.choices[0]
        assert c.message.tool_calls is None and c.message.content and c.finish_reason in ("stop", "length")


def test_a_conversation_with_tool_results_is_rendered(served):
    url, _ = served
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tok = httpx.post(url + "/tokenize", json={"messages": messages, "return_token_strs": True}, timeout=60).json()
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > tok["count"]  # + the tools' system text
    rendered = "".join(tok["token_strs"])
    assert "<tool_response>" in rendered and "get_weather" in rendered and "sunny" in rendered


def test_disconnect_mid_stream_releases_the_matcher(served):
    url, engine = served
    body = {"prompt": "Once", "max_tokens": 200, "guided_json": {"type": "array", "items": {"type": "string"}},
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                break
    assert no_matchers_left(engine)


def test_smollm2_tools_through_its_template():
    import openai
    engine = Engine(str(smollm2_path()), EngineConfig(cpu_threads=2, progress=False))
    with running_server(engine) as (url, _):
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="stories260K", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                  tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                  temperature=0)
        whole = sdk.chat.completions.create(**kw)
        call = whole.choices[0].message.tool_calls[0]
        assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"].startswith("Paris")
        names = [tc.function.name for ch in sdk.chat.completions.create(**kw, stream=True)
                 for tc in (ch.choices[0].delta.tool_calls or [])]
        assert names == ["get_weather"]
