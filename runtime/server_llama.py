"""llama-server's routes beside the OpenAI ones: GET /props, GET /slots (read-only), POST /apply-template, and
the response pieces of its /completion (completion_probabilities for n_probs, stop_type and stopping_word).

The shapes follow llama-server's documentation: /props has default_generation_settings (n_ctx and the
/completion defaults), total_slots, model_path, chat_template, modalities and build_info; /slots lists one entry
a sequence slot (max_num_seqs of them), each with id, id_task (the request, -1 when idle), n_ctx, is_processing,
params and next_token; /apply-template answers {"prompt": the chat template's text}.
"""
from __future__ import annotations

import asyncio
from importlib import metadata

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from . import chat
from .sequence import SamplingParams, SequenceStatus

# /completion's defaults (llama-server's), the one place they are stated
COMPLETION_DEFAULTS = {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                       "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": -1,
                       "stop": [], "stream": False, "ignore_eos": False, "n_probs": 0}


class ApplyTemplateBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    messages: list[dict]
    add_generation_prompt: bool = True


def _version() -> str:
    try:
        return metadata.version("uacompile")
    except metadata.PackageNotFoundError:
        return "unknown"


def stop_type(finish_reason: str | None, last_token: int | None, eos_token_ids, ignore_eos: bool) -> str:
    """llama-server's stop_type: eos (an end-of-sequence token), word (a stop string), limit (n_predict or the
    context reached), none (not stopped: aborted or still generating)."""
    if finish_reason == "length":
        return "limit"
    if finish_reason == "stop":
        return "eos" if not ignore_eos and last_token in eos_token_ids else "word"
    return "none"


def stopping_word(full_text: str, shown: str, stops: list[str]) -> str:
    """The stop string that ended a completion: the one the text after what is shown starts with."""
    rest = full_text[len(shown):] if full_text.startswith(shown) else ""
    return next((s for s in stops if rest.startswith(s)), "")


def completion_probabilities(logprobs, text_of) -> list[dict]:
    """llama-server's completion_probabilities: a generated token's id, text, logprob and bytes, with its
    top_logprobs (at most n_probs entries of the same fields)."""
    def entry(tid: int, lp: float) -> dict:
        t = text_of(tid)
        return {"id": tid, "token": t, "logprob": lp, "bytes": list(t.encode())}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]


def _params_view(p: SamplingParams) -> dict:
    return {"n_predict": p.max_tokens, "seed": -1 if p.seed is None else p.seed, "temperature": p.temperature,
            "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "repeat_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "ignore_eos": p.ignore_eos, "n_probs": p.logprobs or 0, "stop": list(p.stop or [])}


def slots_snapshot(engine) -> list[dict]:
    """/slots: one entry per sequence slot; runs on the engine thread (AsyncEngine.inspect)."""
    sc = engine.scheduler.config
    busy = []
    for rid, req in engine.requests.items():
        for seq in req.seqs:
            if seq.status in (SequenceStatus.RUNNING, SequenceStatus.RESTORING):
                busy.append((rid, seq))
    slots = []
    for i in range(sc.max_num_seqs):
        if i < len(busy):
            rid, seq = busy[i]
            p = seq.params
            decoded = sum(1 for t in seq.token_ids[seq.num_prompt_tokens:] if t >= 0)
            slots.append({"id": i, "id_task": rid, "n_ctx": sc.max_model_len, "speculative": False,
                          "is_processing": True, "params": _params_view(p),
                          "next_token": {"has_next_token": True, "n_remain": p.max_tokens - decoded,
                                         "n_decoded": decoded}})
        else:
            slots.append({"id": i, "id_task": -1, "n_ctx": sc.max_model_len, "speculative": False,
                          "is_processing": False, "params": None,
                          "next_token": {"has_next_token": False, "n_remain": -1, "n_decoded": 0}})
    return slots


def _content_chars(message: dict) -> int:
    c = message.get("content")
    if isinstance(c, str):
        return len(c)
    if isinstance(c, list):
        return sum(len(p["text"]) for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def add_routes(app: FastAPI, served, cfg, protected: list, api_error) -> None:
    """Register /props, /slots and /apply-template on `app`. served: the server's shared handler logic (body
    parsing, caps); api_error(status, message, param=...) builds the error the app answers with."""
    engine = served.engine
    tokenizer = served.tokenizer

    @app.get("/props", dependencies=protected)
    async def props():
        return {"default_generation_settings": {"id": 0, "n_ctx": served.max_model_len, "model": cfg.model_name,
                                                "params": dict(COMPLETION_DEFAULTS)},
                "total_slots": engine.scheduler.config.max_num_seqs, "model_alias": cfg.model_name,
                "model_path": cfg.model_path or cfg.model_name,
                "chat_template": (tokenizer.chat_template or chat.FALLBACK_TEMPLATE) if tokenizer else "",
                "modalities": {"vision": False, "audio": False}, "build_info": f"uacompile {_version()}",
                "is_sleeping": False}

    @app.get("/slots", dependencies=protected)
    async def slots(fail_on_no_slot: int = 0):
        snap = await served.inspect(slots_snapshot)
        if fail_on_no_slot and all(s["is_processing"] for s in snap):
            raise api_error(503, "no slot available", type_="unavailable_error")
        return snap

    @app.post("/apply-template", dependencies=protected)
    async def apply_template(request: Request):
        body: ApplyTemplateBody = await served.body(request, ApplyTemplateBody)
        if tokenizer is None:
            raise api_error(400, "this model has no tokenizer")
        served.check_chars(sum(map(_content_chars, body.messages)), "messages")

        def render():
            try:
                return chat.render(tokenizer, body.messages, body.add_generation_prompt)
            except (ValueError, TypeError) as e:
                raise api_error(400, str(e), param="messages") from None

        return {"prompt": await asyncio.to_thread(render)}
