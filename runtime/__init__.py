"""Serving runtime: KV manager, scheduler, Llama-family executor, offline API."""
from .sequence import SamplingParams
from .llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
