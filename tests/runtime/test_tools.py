"""Tool calls (runtime/tools.py): OpenAI's request fields checked, the chat readied for the template (rendered as
transformers renders it), the Hermes <tool_call> format parsed whole and piece by piece, and required / named
choices held by the grammar on SmolLM2."""
import json
from types import SimpleNamespace

import pytest

from uacompile.models import smollm2_path
from uacompile.runtime import LLM, SamplingParams
from uacompile.runtime import chat
from uacompile.runtime.tools import ToolCallParser, ToolConfig, parse, prompt_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                                  "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]

# a Hermes-style template that reads tools, assistant tool_calls and tool results (as Qwen2.5's does)
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.mark.parametrize("tools,choice,needle", [
    (None, "auto", "tool_choice needs tools"),
    ([{"type": "retrieval", "function": {"name": "a"}}], None, "tools[0].type must be 'function'"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "'get_weather' twice"),
    (TOOLS, "sometimes", "tool_choice must be one of"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not in tools"),
])
def test_bad_tool_fields_are_one_line(tools, choice, needle):
    with pytest.raises(ValueError) as e:
        ToolConfig.of(tools, choice)
    assert needle in str(e.value) and "\n" not in str(e.value), e.value


def test_tool_choice_modes():
    assert ToolConfig.of(None, None) is None
    auto = ToolConfig.of(TOOLS, None)
    assert auto.choice == "auto" and auto.parses and auto.guide() is None
    assert not ToolConfig.of(TOOLS, "none").parses
    named = ToolConfig.of(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert named.choice == "required" and [f["name"] for f in named.functions()] == ["add"]
    assert "get_weather" not in named.guide().spec and "(\"\\n\" call)*" not in named.guide().spec
    assert "(\"\\n\" call)*" in ToolConfig.of(TOOLS, "required").guide().spec
    assert "(\"\\n\" call)*" not in ToolConfig.of(TOOLS, "required", parallel=False).guide().spec


def test_a_template_that_reads_tools_renders_as_transformers_does():
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = SimpleNamespace(chat_template=TOOL_TEMPLATE, bos_token="", eos_token="<|im_end|>")
    names = chat.template_names(tok)
    assert "tools" in names
    ready = prompt_messages(HISTORY, ToolConfig.of(TOOLS, None), names)
    assert ready[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object, as templates read it
    ours = chat.render(tok, ready, True, TOOLS)
    theirs = render_jinja_template([ready], tools=TOOLS, chat_template=TOOL_TEMPLATE, add_generation_prompt=True,
                                   bos_token="", eos_token="<|im_end|>")[0][0]
    assert ours == theirs
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in ours and "sunny, 21 C" in ours
    assert json.dumps(ADD) in ours


def test_a_template_without_tools_gets_them_in_the_system_message():
    from uacompile.runtime.loader import load

    tok = load(str(smollm2_path())).tokenizer
    names = chat.template_names(tok)
    assert "tools" not in names
    ready = prompt_messages(HISTORY, ToolConfig.of(TOOLS, None), names)
    assert ready[0]["role"] == "system" and "<tools>" in ready[0]["content"] and json.dumps(WEATHER) in ready[0]["content"]
    assert ready[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert ready[3]["content"] == "<tool_response>\nsunny, 21 C\n</tool_response>"
    text = chat.render(tok, ready, True)
    assert text.startswith("<|im_start|>system\nYou can call functions") and text.endswith("<|im_start|>assistant\n")
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    merged = prompt_messages(system, ToolConfig.of(TOOLS, None), names)
    assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.\n\nYou can call functions")
    with pytest.raises(ValueError, match="tool_calls must be an assistant's list"):
        prompt_messages([{"role": "user", "content": "x", "tool_calls": []}], None, names)


OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>\n')


def test_parse_finds_every_call_and_the_content():
    content, calls = parse(OUTPUT)
    assert content == "Let me check."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("function", "get_weather", {"city": "Paris"}), ("function", "add", {"a": 1, "b": 2})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert parse("no calls <tool_") == ("no calls <tool_", [])
    assert parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    content, calls = parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')  # unclosed at the end
    assert content is None and calls[0]["function"]["name"] == "add"


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_pieces_give_what_the_whole_gives(piece):
    p, content, calls = ToolCallParser(), "", []
    for i in range(0, len(OUTPUT), piece):
        c, new = p.feed(OUTPUT[i:i + piece])
        content += c
        calls += new
    c, new = p.finish()
    content, calls = content + c, calls + new
    whole_content, whole_calls = parse(OUTPUT)
    assert content.strip() == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    assert "<" not in content


@pytest.fixture(scope="module")
def smollm2():
    return LLM(str(smollm2_path()), cpu_threads=2, progress=False)


def _prompt(llm, config, question):
    names = chat.template_names(llm.tokenizer)
    ready = prompt_messages([{"role": "user", "content": question}], config, names)
    return chat.encode(llm.tokenizer, chat.render(llm.tokenizer, ready, True))


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                             ({"type": "function", "function": {"name": "add"}}, True)])
def test_required_and_named_choices_are_held_by_the_grammar(smollm2, choice, parallel):
    config = ToolConfig.of(TOOLS, choice, parallel)
    out = smollm2.generate(_prompt(smollm2, config, "What is 2 plus 3?"),
                           SamplingParams(temperature=0.7, seed=1, n=2, max_tokens=120, guided=config.guide()))[0]
    for c in out.outputs:
        content, calls = parse(c.text)
        assert c.finish_reason == "stop" and content is None and calls, c.text
        assert parallel or len(calls) == 1
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "add":
                assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
            else:
                assert call["function"]["name"] == "get_weather" and set(args) == {"city"}
            assert choice == "required" or call["function"]["name"] == "add"
