"""Tool calling in the Hermes / Qwen format: the model writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

ToolConfig.of(tools, tool_choice, parallel_tool_calls) checks OpenAI's request fields; prompt_messages() readies the
chat for the model's template (an assistant message's tool_calls with their arguments as objects, as transformers'
templates read them; a template that does not read `tools` gets them described in the system message, and its
tool calls and results written as text in this format); guide() is the grammar that holds the output to tool calls
(tool_choice "required" or a named function); ToolCallParser turns the output, whole or piece by piece, into content
and OpenAI tool_calls.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .structured import JSON_OPTIONS, Guide

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolConfig:
    """A request's tools (OpenAI's objects, as given), tool_choice ("none" | "auto" | "required") or the one named
    function it must call, and whether several calls may come in one reply."""

    tools: list[dict]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice, parallel: bool = True) -> "ToolConfig | None":
        """The request's tool config, None without tools; ValueError (one line) for a bad combination."""
        if tool_choice is not None and not tools:
            raise ValueError("tool_choice needs tools")
        if not tools:
            return None
        names = []
        for i, t in enumerate(tools):
            if t.get("type") != "function":
                raise ValueError(f"tools[{i}].type must be 'function', got {t.get('type')!r}")
            name = t["function"]["name"]
            if not NAME.match(name):
                raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
            params = t["function"].get("parameters")
            if params is not None and not isinstance(params, dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
            names.append(name)
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"tools name the function {dup!r} twice")
        function = None
        if isinstance(tool_choice, dict):
            if tool_choice.get("type") != "function":
                raise ValueError(f"tool_choice.type must be 'function', got {tool_choice.get('type')!r}")
            function = tool_choice["function"]["name"]
            if function not in names:
                raise ValueError(f"tool_choice names the function {function!r}, which is not in tools")
            choice = "required"
        else:
            choice = "auto" if tool_choice is None else tool_choice
            if choice not in CHOICES:
                raise ValueError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, "
                                 f"got {tool_choice!r}")
        return cls(list(tools), choice, function, parallel)

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls (not with tool_choice "none")."""
        return self.choice != "none"

    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools if self.function is None or t["function"]["name"] == self.function]

    def guide(self) -> Guide | None:
        """The grammar of "required" and a named function: one call (or, with parallel calls, several, one a line)
        of the allowed functions, each {"name": ..., "arguments": <its parameters' schema>}, and nothing else."""
        if self.choice != "required":
            return None
        schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                     "arguments": f.get("parameters") or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False} for f in self.functions()]
        call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        call = {**call, "x-guidance": dict(JSON_OPTIONS)}  # the separators structured output writes JSON with
        repeat = ' ("\\n" call)*' if self.parallel and self.function is None else ""
        return Guide.grammar(f"start: call{repeat}\n"
                             f'call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n'
                             f"body: %json {json.dumps(call)}")

    def system_text(self) -> str:
        """The tools described for a template that does not read them."""
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools)
        return ("You can call functions. Their signatures are within <tools></tools>:\n<tools>\n" + lines +
                "\n</tools>\nTo call one, reply with a JSON object of its name and arguments within "
                "<tool_call></tool_call> tags:\n" + OPEN + '\n{"name": <function name>, "arguments": <arguments '
                'object>}\n' + CLOSE)


def _arguments_object(arguments):
    """An assistant tool call's arguments as the template reads them: the JSON string parsed (kept where not JSON)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def call_text(call: dict) -> str:
    f = call.get("function") or {}
    return (OPEN + "\n" + json.dumps({"name": f.get("name"), "arguments": _arguments_object(f.get("arguments"))},
                                     ensure_ascii=False) + "\n" + CLOSE)


def prompt_messages(messages: list[dict], config: ToolConfig | None, template_names: frozenset) -> list[dict]:
    """The chat readied for the template. Assistant tool calls' arguments become objects. A template that reads
    `tools` (and so, by convention, each message's tool_calls) gets the messages so; one that does not gets the tools in the system message (one added when there is
    none), each assistant message's calls appended to its content and each tool result as <tool_response> text."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise ValueError(f"messages[{i}].tool_calls must be an assistant's list of "
                                 "{'id', 'type': 'function', 'function': {'name', 'arguments'}}")
            m["tool_calls"] = [{**c, "function": {**c["function"],
                                                  "arguments": _arguments_object(c["function"].get("arguments"))}}
                               for c in calls]
        out.append(m)
    if "tools" in template_names:
        return out
    for m in out:
        if m.get("tool_calls"):
            text = m.get("content") if isinstance(m.get("content"), str) else ""
            m["content"] = "\n".join([text] * bool(text) + [call_text(c) for c in m.pop("tool_calls")])
        elif m.get("role") == "tool" and isinstance(m.get("content"), str):
            m["content"] = "<tool_response>\n" + m["content"] + "\n</tool_response>"
    if config is not None:
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + config.system_text()}
        else:
            out.insert(0, {"role": "system", "content": config.system_text()})
    return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(body: str) -> dict | None:
    """OpenAI's tool call of a <tool_call> body: {"name", "arguments"} JSON (arguments an object or a JSON string)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _held_back(text: str) -> int:
    """How many characters at the end of text may begin an OPEN tag."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ToolCallParser:
    """One choice's output read for tool calls as it comes: feed(text) and finish() return (content, calls) to send
    now; content is what lies outside the calls (whitespace after a call dropped), a tag's possible start held back
    until it is known."""

    calls: list[dict] = field(default_factory=list)
    _buf: str = ""
    _in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        content, new = "", []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    break
                call = _call(self._buf[:end])
                if call is None:  # not a call after all: its text stays content
                    content += OPEN + self._buf[:end + len(CLOSE)]
                else:
                    new.append(call)
                self._buf, self._in_call = self._buf[end + len(CLOSE):], False
                continue
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _held_back(self._buf)
                content += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
            content += self._buf[:start]
            self._buf, self._in_call = self._buf[start + len(OPEN):], True
        self.calls.extend(new)
        if self.calls and not content.strip():
            content = ""
        return content, new

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end: an unclosed call whose JSON is whole counts; other text is content."""
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            call = _call(buf.strip())
            if call is not None:
                self.calls.append(call)
                return "", [call]
            buf = OPEN + buf
        return ("" if self.calls and not buf.strip() else buf), []


def parse(text: str) -> tuple[str | None, list[dict]]:
    """A whole output's content (None when only whitespace is left) and tool calls."""
    p = ToolCallParser()
    content, _ = p.feed(text)
    rest, _ = p.finish()
    content = (content + rest).strip()
    return (content or None), p.calls
