"""The serving loop: add requests, then step = schedule -> execute -> sample -> update -> stop checks.

step() returns the requests that finished in the step; run_step() also returns every sample's new
tokens (with log-probabilities when asked), which a streaming front end forwards as they come.

Stop conditions: max_tokens (the scheduler's), EOS unless ignore_eos, stop_token_ids, stop
strings (output text is cut where the stop string begins).
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, fields

import torch

from uacompile import ir

from .executor import Executor
from .kernels import KernelOps, make_backend
from .loader import LoadedModel, load
from .model import LlamaForCausalLM
from .sampling import Sampler, TokenLogprob
from .scheduler import Scheduler, SchedulerConfig
from .sequence import SamplingParams, Sequence
from .trace import NullTracer, TracedKernels

log = logging.getLogger("uacompile.runtime")
GPU_TOKEN_BUDGET = 8192  # CUDA default token budget of a step (and prefill chunk)
DTYPES = {ir.DTYPES[d].torch: ir.torch_dtype(d) for d in ir.FLOAT_DTYPES}  # EngineConfig.dtype: torch's names


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False


@dataclass
class Delta:
    """What one step added to sample `index` of a request."""

    request_id: int
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # set in the step the sample finishes


@dataclass
class StepOutput:
    deltas: list[Delta] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)  # requests whose samples all finished


@dataclass
class Request:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)  # sample i of n
    texts: dict[int, str] = field(default_factory=dict)  # seq_id -> final text


@dataclass
class EngineConfig:
    device: str = "cpu"
    dtype: str | None = None          # default: float32 on the CPU, the checkpoint's 16-bit type on CUDA
    kernel_backend: str = "auto"      # auto | tvm-cpu | cuda | tvm-cuda | reference
    kv_cache_bytes: int | None = None  # KV budget when num_pages is not given
    seed: int = 0                     # seeds of requests that bring none
    cpu_threads: int | None = None    # torch.set_num_threads (process-wide); None leaves torch's default
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU the engine takes (weights, activations, KV)
    cuda_graphs: bool = True          # CUDA: replay decode steps from graphs captured at start-up
    progress: bool = True             # progress bars at start-up (kernel builds, graph captures)
    attention_variant: str = "ua"     # ua | unified_masked (llama.cpp's unified KV buffer, a measured baseline)
    kernel_dir: str | None = None     # tvm-cuda: a `uacompile build --target cuda` folder of prebuilt kernels (no TVM here)


def _pick_dtype(ec: EngineConfig, checkpoint_dtype: str) -> torch.dtype:
    if ec.dtype is not None:
        if ec.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {ec.dtype!r}")
        return DTYPES[ec.dtype]
    if ec.device == "cpu":
        return torch.float32
    return torch.bfloat16 if checkpoint_dtype == "bfloat16" else torch.float16


class Engine:
    def __init__(self, model: "str | LoadedModel", engine_config: EngineConfig | None = None, **scheduler_kwargs):
        ec = self.engine_config = engine_config or EngineConfig()
        if ec.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {ec.device!r}")
        if ec.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA GPU")
        if ec.cpu_threads is not None:
            torch.set_num_threads(ec.cpu_threads)  # tiny models on a busy CPU run faster on one thread
        loaded = model if isinstance(model, LoadedModel) else load(model)
        cfg, self.tokenizer = loaded.config, loaded.tokenizer
        self.dtype = _pick_dtype(ec, cfg.torch_dtype)
        if loaded.weights is None:  # a config alone: random weights made on the device (benchmarks)
            self.model = LlamaForCausalLM.random(cfg, ec.device, self.dtype, ec.seed)
        else:
            self.model = LlamaForCausalLM.from_weights(cfg, loaded.weights, ec.device, self.dtype)
        del loaded
        sc = self._scheduler_config(cfg, scheduler_kwargs)
        self.scheduler = Scheduler(sc)
        ops = KernelOps.for_model(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, sc.page_size, self.dtype,
                                  cfg.sliding_window, ec.attention_variant)
        self.kernels = make_backend(ec.kernel_backend, ops, ec.device, ec.kernel_dir)
        self.model.use_kernels(self.kernels)  # the layer ops (norms, SiLU-and-mul, RoPE) on the backend's kernels
        built = self.kernels.prepare(sc.max_num_batched_tokens, sc.max_num_seqs, sc.max_model_len, ec.progress)
        if built["kernels"]:
            log.info("kernels: %d ready in %.1f s (%d libraries from the cache)", built["kernels"], built["seconds"],
                     built["cached"])
        self.executor = Executor(self.model, self.kernels, sc.num_pages, sc.num_cpu_pages, sc.page_size,
                                 ec.device, self.dtype)
        if ec.device == "cuda" and ec.cuda_graphs:
            self.executor.capture_graphs(sc.max_num_seqs, sc.max_model_len, ec.progress)
        self.sampler = Sampler(ec.seed)
        self.tracer = NullTracer()
        self.requests: dict[int, Request] = {}
        self._seq_request: dict[int, tuple[Request, int]] = {}  # seq_id -> (request, sample index)
        self._ids = itertools.count()

    # ---- construction ---------------------------------------------------------------------------
    def _scheduler_config(self, cfg, kw: dict) -> SchedulerConfig:
        names = {f.name for f in fields(SchedulerConfig)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; scheduler options are {sorted(names)}")
        kw = dict(kw)
        if self.engine_config.device == "cuda":  # a GPU step takes thousands of tokens at the matmul rate
            kw.setdefault("max_num_batched_tokens", GPU_TOKEN_BUDGET)
            kw.setdefault("max_prefill_chunk", kw["max_num_batched_tokens"])
        P = kw.setdefault("page_size", 16)
        if not isinstance(P, int) or isinstance(P, bool) or P < 1:
            raise ValueError(f"page_size must be an int >= 1, got {P!r}")
        max_len = min(kw.get("max_model_len") or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if kw.get("num_pages") is None:
            page_bytes = cfg.num_layers * 2 * P * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
            budget = self.engine_config.kv_cache_bytes or self._default_kv_budget(kw)
            want = kw.get("max_num_seqs", 32) * -(-max_len // P)  # every running sequence at full length
            if budget // page_bytes < -(-max_len // P) and self.engine_config.device == "cuda" \
                    and not self.engine_config.kv_cache_bytes:
                raise ValueError(f"the KV cache budget ({budget / 2**30:.2f} GiB: {self.memory.describe()}) "
                                 f"holds {max(0, budget // page_bytes)} pages, fewer than one sequence of "
                                 f"max_model_len={max_len} needs ({-(-max_len // P)}); lower max_model_len or "
                                 f"max_num_batched_tokens, or raise gpu_memory_utilization")
            kw["num_pages"] = max(1, min(want, budget // page_bytes))
        kw.setdefault("num_cpu_pages", kw["num_pages"] if kw.get("preemption") == "swap" else 0)
        kw["max_model_len"] = min(max_len, kw["num_pages"] * P)
        return SchedulerConfig(**kw)

    def _default_kv_budget(self, kw: dict) -> int:
        if self.engine_config.device == "cuda":
            from .memory import profile

            self.memory = profile(self.model, kw.get("max_num_batched_tokens", GPU_TOKEN_BUDGET),
                                  kw.get("max_num_seqs", 32), self.engine_config.gpu_memory_utilization)
            log.info("memory: %s", self.memory.describe())
            return max(0, self.memory.kv_budget)
        return 512 << 20

    def set_tracer(self, tracer) -> None:
        """Record steps, kernel calls and KV events into tracer (a trace.Tracer)."""
        self.tracer = tracer
        self.executor.kernels = TracedKernels(self.kernels, tracer)

    # ---- requests -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
        else:
            raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        V = self.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
        return text, ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0) -> int:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.encode_prompt(prompt)
        params.check_vocab(self.model.cfg.vocab_size)
        rid = next(self._ids)
        req = Request(rid, text, ids, params)
        seq = Sequence(rid, list(ids), len(ids), params, priority=priority)
        self.scheduler.add(seq)
        req.seqs = [seq] + (self.scheduler.fork(seq, params.n) if params.n > 1 else [])
        for i, s in enumerate(req.seqs):
            self._seq_request[s.seq_id] = (req, i)
        self.requests[rid] = req
        self.tracer.instant("add_request", "request", request_id=rid, prompt_tokens=len(ids), n=params.n)
        return rid

    def abort(self, request_id: int) -> None:
        req = self.requests.get(request_id)
        for seq in req.seqs if req else []:
            if not seq.is_finished:
                self.scheduler.abort(seq.seq_id)
                self._finalize(seq)
        if req is not None:
            self.tracer.instant("abort", "request", request_id=request_id)

    def release(self, request_id: int) -> None:
        """Forget a finished request's bookkeeping."""
        req = self.requests.pop(request_id)
        for seq in req.seqs:
            self._seq_request.pop(seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns the requests that finished in it."""
        return self.run_step().finished

    def run_step(self) -> StepOutput:
        """One scheduler step; returns each sample's new tokens and the requests that finished."""
        tr = self.tracer
        with tr.span("step", "scheduler"):
            with tr.span("schedule", "scheduler"):
                preemptions = self.scheduler.num_preemptions
                batch = self.scheduler.schedule()
            if batch.is_empty:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("scheduler made no progress with requests pending (KV cache too small?)")
                return StepOutput()
            if tr.enabled:
                self._trace_kv(batch, self.scheduler.num_preemptions - preemptions)
            with tr.span("execute", "scheduler", seqs=len(batch.seqs), tokens=batch.num_tokens):
                seqs, logits = self.executor.execute(batch)
            with tr.span("sample", "scheduler", seqs=len(seqs)):
                sampled = self.sampler.sample(seqs, logits)
            with tr.span("update", "scheduler"):
                self.scheduler.update(batch, sampled.tokens)
                return self._collect(seqs, sampled)

    def _collect(self, seqs: list[Sequence], sampled) -> StepOutput:
        out = StepOutput()
        for seq in seqs:
            reason = None if seq.is_finished else self._stop_reason(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            req, index = self._seq_request[seq.seq_id]
            lp = sampled.logprobs.get(seq.seq_id)
            if seq.is_finished:
                self._finalize(seq)
            out.deltas.append(Delta(req.request_id, index, [sampled.tokens[seq.seq_id]], [lp] if lp else [],
                                    seq.finish_reason if seq.is_finished else None))
            if seq.is_finished and all(s.is_finished for s in req.seqs):
                out.finished.append(self.output(req.request_id))
                self.tracer.instant("finish", "request", request_id=req.request_id)
        return out

    def _trace_kv(self, batch, num_preempted: int) -> None:
        tr, kv = self.tracer, self.scheduler.kv
        for name, pairs in (("swap_out", batch.swap_out), ("swap_in", batch.swap_in), ("copy", batch.copies)):
            if pairs:
                tr.instant(name, "kv", pages=len(pairs))
        if num_preempted:
            tr.instant("preempt", "kv", count=num_preempted)
        tr.counter("kv_pages", used=kv.num_pages - kv.num_free_pages, cached=len(kv.lru),
                   free=len(kv.free_pages))

    def _stop_reason(self, seq: Sequence) -> str | None:
        p, last = seq.params, seq.token_ids[-1]
        if not p.ignore_eos and last in self.model.cfg.eos_token_ids:
            return "stop"
        if p.stop_token_ids and last in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode_continuation(seq.prompt_token_ids, seq.output_token_ids)
            if any(s in text for s in p.stop):
                return "stop"
        return None

    def _finalize(self, seq: Sequence) -> None:
        """Final text: decoded output, cut at the first stop string."""
        self.sampler.release(seq)
        req, _ = self._seq_request[seq.seq_id]
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode_continuation(seq.prompt_token_ids, seq.output_token_ids)
            cuts = [text.find(s) for s in (seq.params.stop or []) if s in text]
            if cuts:
                text = text[:min(cuts)]
                seq.finish_reason = "stop"  # a stop string wins over max_tokens reached in the same step
        req.texts[seq.seq_id] = text

    def output(self, request_id: int) -> RequestOutput:
        req = self.requests[request_id]
        outs = [CompletionOutput(i, req.texts.get(s.seq_id, ""), list(s.output_token_ids), s.finish_reason)
                for i, s in enumerate(req.seqs)]
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outs,
                             all(s.is_finished for s in req.seqs))

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()
