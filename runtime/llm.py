"""The offline API: LLM(model=PATH, device=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from .engine import CompletionOutput, Engine, EngineConfig, RequestOutput
from .sequence import SamplingParams
from .structured import Guide

ENGINE_OPTIONS = {f.name for f in fields(EngineConfig)}


class LLM:
    """Generate from a GGUF file or a Hugging Face directory.

    Engine options: device ("cpu" | "cuda"), dtype (default, engine.default_dtype: float32 on the CPU; on CUDA
    the checkpoint's 16-bit type where the CUDA templates cover the model, else float32, the dtype of the
    TVM-CUDA kernels `uacompile build` makes for it, as for stories260K), kernel_backend ("auto" | "tvm-cpu" |
    "cuda" | "tvm-cuda" | "reference"), kernel_dir (prebuilt TVM-CUDA kernels: a `uacompile build --target cuda`
    folder), kv_cache_bytes, kv_cache_dtype ("auto": the model's dtype | "bf16" | "fp16": the model's too | "fp8_e4m3"
    | "int8": 8-bit pages with float32 scales, about twice the pages for the same kv_cache_bytes or GPU budget),
    cpu_offload_bytes (a CPU offload tier of KV pages in host memory, runtime/offload.py), seed,
    cpu_threads, log_stats_interval, gpu_memory_utilization, cuda_graphs,
    async_scheduling, progress, attention_variant. Everything else goes to SchedulerConfig (page_size, num_pages, num_cpu_pages,
    max_num_seqs, max_num_batched_tokens, max_prefill_chunk, policy, preemption, enable_prefix_caching,
    max_model_len, num_offload_pages, offload_watermark, offload_pages_per_step, compact_threshold,
    compact_min_holes).
    """

    def __init__(self, model: str | Path, device: str = "cpu", **kwargs):
        if not isinstance(model, (str, Path)):
            raise TypeError(f"model must be a path (str or pathlib.Path), got {type(model).__name__}")
        engine_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in ENGINE_OPTIONS}
        self.engine = Engine(model, EngineConfig(device=device, **engine_kw), **kwargs)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priorities: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. Returns one RequestOutput per
        prompt, in order; all prompts are batched together (continuous batching)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty string, token-id list, or list of them")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priorities is None else list(priorities)
        if len(priorities) != len(prompts):
            raise ValueError(f"priorities has {len(priorities)} entries for {len(prompts)} prompts")
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in priorities):
            raise ValueError(f"priorities must be ints (lower = more important), got {priorities!r}")
        engine = self.engine
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                ids.append(engine.add_request(prompt, p, prio))
            engine.run_until_done()
        except BaseException:
            for rid in ids:  # leave the engine clean for the next call
                engine.abort(rid)
                engine.release(rid)
            raise
        outs = [engine.output(rid) for rid in ids]
        for rid in ids:
            engine.release(rid)
        return outs


__all__ = ["LLM", "SamplingParams", "Guide", "RequestOutput", "CompletionOutput"]
