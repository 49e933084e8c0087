"""Chat prompts: the model's chat template (GGUF tokenizer.chat_template or the HF tokenizer config)
rendered with Jinja the way transformers' apply_chat_template does, or a plain fallback."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer import Tokenizer

# "System text, then 'User: ...' / 'Assistant: ...' lines, ending in 'Assistant:'"
FALLBACK_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")
ROLES = ("system", "user", "assistant", "tool", "developer")


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


@lru_cache(maxsize=8)
def _variables(source: str) -> frozenset:
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.exceptions.TemplateError:
        return frozenset()


def template_names(tokenizer: Tokenizer) -> frozenset:
    """The names the model's chat template reads from its context ("messages", "tools", ...)."""
    return _variables(tokenizer.chat_template or FALLBACK_TEMPLATE)


def message_text(content) -> str:
    """A message's content: a string, or OpenAI's list of parts (the text parts, joined)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise ValueError("messages: only text content parts ({'type': 'text', 'text': ...}) are supported")
        return "".join(p["text"] for p in content)
    raise ValueError(f"messages: content must be a string or a list of text parts, got {type(content).__name__}")


def render(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
           tools: list[dict] | None = None) -> str:
    """The prompt text for `messages` ([{'role': ..., 'content': ...}, ...]); tools (OpenAI's tool objects) go to the
    template as transformers passes them."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be an object with a role in {list(ROLES)}")
        clean.append({**m, "content": message_text(m.get("content"))})
    source = tokenizer.chat_template or FALLBACK_TEMPLATE
    try:
        return _compile(source).render(messages=clean, add_generation_prompt=add_generation_prompt,
                                       bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, tools=tools)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template: {e}") from None


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt: a leading BOS text becomes the BOS token (the SPM
    tokenizer does not parse special tokens inside text), once; the rest is encoded without adding
    BOS again. A tokenizer that adds no BOS of its own (SmolLM2: its BOS text <|im_start|> opens every
    turn) keeps that leading token too: the prompt's ids are the template's text, as llama.cpp and
    transformers tokenize it."""
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer.bos_token_id is not None:
        if tokenizer.add_bos:
            return tokenizer.encode(text[len(bos):], add_special_tokens=True)
        return [tokenizer.bos_token_id] + tokenizer.encode(text[len(bos):], add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)
