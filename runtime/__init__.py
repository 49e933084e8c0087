"""Serving runtime: KV manager, scheduler, Llama-family executor, offline API.

Logs through `logging` under "uacompile" (this package: "uacompile.runtime.*"): model loaded,
kernels ready, KV pool size (INFO); kernels built (INFO) or loaded from the cache (DEBUG);
preemptions and swaps (INFO); throughput every EngineConfig.log_stats_interval seconds (INFO).
Warnings (a clamp that stays, e.g. max_model_len cut to what the KV cache holds) reach stderr
with no set-up; for the rest set a level, e.g. logging.basicConfig(level=logging.INFO), or
logging.getLogger("uacompile").setLevel(logging.DEBUG) beside a handler of your own.
"""
from .sequence import SamplingParams
from .structured import Guide
from .llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "Guide", "RequestOutput", "CompletionOutput"]
