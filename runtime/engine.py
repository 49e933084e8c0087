"""The serving loop: add requests, then step = schedule -> execute -> sample -> update -> stop checks.

step() returns the requests that finished in the step; run_step() also returns every sample's new
tokens (with log-probabilities when asked), which a streaming front end forwards as they come.

Stop conditions: max_tokens (the scheduler's), EOS unless ignore_eos, stop_token_ids, stop
strings (output text is cut where the stop string begins, or after it with include_stop_str_in_output);
none but max_tokens before min_tokens tokens (the sampler masks EOS and the stop tokens until then); a
guided request's grammar once it allows nothing more (finish reason "stop", whatever min_tokens says).
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field, fields

import torch

from uacompile import ir

from .executor import Executor
from .faults import StepFailed
from .kernels import KernelOps, cuda_template_gap, make_backend
from .loader import LoadedModel, load
from . import memory
from .model import LlamaForCausalLM, ModelConfig
from .quant import QUANTIZATIONS
from .sampling import PendingSample, Sampler, TokenLogprob
from .scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from .sequence import SamplingParams, Sequence
from .structured import Grammars, Guide, GuideStates
from .trace import NullTracer, TracedKernels

log = logging.getLogger("uacompile.runtime")
GPU_TOKEN_BUDGET = 8192  # CUDA default token budget of a step (and prefill chunk)
DTYPES = {ir.DTYPES[d].torch: ir.torch_dtype(d) for d in ir.FLOAT_DTYPES}  # EngineConfig.dtype: torch's names
SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed takes
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8_e4m3", "int8")  # EngineConfig.kv_cache_dtype (IR names)
BACKENDS = ("auto", "tvm-cpu", "cuda", "tvm-cuda", "reference")


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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs: None, then token 1's...


@dataclass
class Delta:
    """What one step added to sample `index` of a request."""

    request_id: int
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # set in the step the sample finishes
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on sample 0's first delta, when asked for


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
class InFlight:
    """A launched step whose sampled ids are on their way back: sample j of pending goes to
    seqs[j].token_ids[positions[j]] (where the scheduler put its code -1 - j)."""

    batch: ScheduledBatch
    pending: PendingSample
    seqs: list[Sequence] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    @property
    def needs_history(self) -> bool:
        """A sequence of it uses penalties (the next step's sampler reads its tokens on the host) or a grammar (its
        next mask follows from this step's token)."""
        return any(s.params.has_penalties or s.params.guided is not None for s in self.pending.seqs)


@dataclass
class EngineConfig:
    device: str = "cpu"
    dtype: str | None = None          # default (default_dtype): float32 on the CPU; on CUDA the checkpoint's 16-bit
    #                                   type where the CUDA templates cover the model, else float32 (TVM-CUDA kernels)
    kernel_backend: str = "auto"      # auto | tvm-cpu | cuda | tvm-cuda | reference
    kv_cache_bytes: int | None = None  # KV budget when num_pages is not given
    kv_cache_dtype: str = "auto"      # auto (the model's dtype) | bf16 | fp16 (must be the model's) | fp8_e4m3 | int8
    cpu_offload_bytes: int | None = None  # the CPU offload tier (host memory, pinned on CUDA) when num_offload_pages
    #                                   is not given; None: no tier
    seed: int = 0                     # seeds of requests that bring none
    cpu_threads: int | None = None    # torch.set_num_threads and tvm-cpu's pool (process-wide); None: the defaults
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU the engine takes (weights, activations, KV)
    cuda_graphs: bool = True          # CUDA: replay decode steps from graphs captured at start-up
    progress: bool = True             # progress bars at start-up (weight loading, kernel builds, graph captures)
    attention_variant: str = "ua"     # ua | unified_masked (llama.cpp's unified KV buffer, a measured baseline)
    kernel_dir: str | None = None     # tvm-cuda: a `uacompile build --target cuda` folder of prebuilt kernels (no TVM here)
    log_stats_interval: float = 10.0  # seconds between throughput lines at INFO (0 = none)
    async_scheduling: bool | None = None  # schedule step n + 1 while step n runs (default: on CUDA)
    quantization: str = "auto"        # auto: block-quantised GGUF weights stay packed where the backend runs them
    #                                   packed (else decoded); none: every weight decoded to dtype; q8_0 / fp8: the
    #                                   float weights quantised at load (fp8: e4m3 rows through torch._scaled_mm, CUDA)

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)} or None, got {self.dtype!r}")
        if self.kernel_backend not in BACKENDS:
            raise ValueError(f"kernel_backend must be one of {', '.join(BACKENDS)}, got {self.kernel_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_bytes is not None and (not is_int(self.kv_cache_bytes) or self.kv_cache_bytes < 1):
            raise ValueError(f"kv_cache_bytes must be an int >= 1 (bytes) or None, got {self.kv_cache_bytes!r}")
        if self.cpu_offload_bytes is not None and (not is_int(self.cpu_offload_bytes) or self.cpu_offload_bytes < 1):
            raise ValueError(f"cpu_offload_bytes must be an int >= 1 (bytes) or None, got {self.cpu_offload_bytes!r}")
        if not is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be an int in [0, 2**64 - 1], got {self.seed!r}")
        if self.cpu_threads is not None and (not is_int(self.cpu_threads) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be an int >= 1 or None, got {self.cpu_threads!r}")
        if isinstance(self.log_stats_interval, bool) or not isinstance(self.log_stats_interval, (int, float)) \
                or not 0 <= self.log_stats_interval < float("inf"):
            raise ValueError(f"log_stats_interval must be a finite number of seconds >= 0, got {self.log_stats_interval!r}")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        for name in ("cuda_graphs", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.attention_variant not in ("ua", "unified_masked"):
            raise ValueError(f"attention_variant must be 'ua' or 'unified_masked', got {self.attention_variant!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization == "fp8" and self.device != "cuda":
            raise ValueError("quantization='fp8' runs on CUDA (torch._scaled_mm); use device='cuda' or "
                             "quantization='q8_0' on the CPU")
        if self.kernel_dir is not None and not isinstance(self.kernel_dir, str):
            raise ValueError(f"kernel_dir must be a folder path (str) or None, got {self.kernel_dir!r}")


def kv_dtype_of(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """The KV cache's IR dtype for EngineConfig.kv_cache_dtype and the model's dtype: auto is the model's; a float
    cache must be the model's (the kernels read it as q's type); int8 / fp8_e4m3 take any. ValueError (one line,
    naming the values this model allows) for a float cache of another dtype."""
    model = ir.from_torch(dtype)
    if kv_cache_dtype == "auto":
        return model
    if kv_cache_dtype not in ir.QUANT_DTYPES and kv_cache_dtype != model:
        allowed = ["auto"] + [d for d in KV_CACHE_DTYPES[1:] if d == model or d in ir.QUANT_DTYPES]
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} does not match the model's dtype "
                         f"{str(dtype).removeprefix('torch.')}; a float KV cache is the model's dtype: use one of "
                         f"{', '.join(allowed)} (or run the model in that dtype)")
    return kv_cache_dtype


def default_dtype(cfg: ModelConfig, device: str) -> torch.dtype:
    """The dtype a model runs in when EngineConfig.dtype is None. CPU: float32. CUDA: the checkpoint's 16-bit type
    (bfloat16 for bf16 and Q8_0 checkpoints, float16 for the others) where the CUDA templates cover the model's
    attention in it; float32 where they do not (head_dim not a multiple of 16 in [16, 256], more than 16 query heads
    a KV head): such a model runs on TVM's CUDA kernels, which `uacompile build` makes in the dtype this rule gives
    (build.MODELS: stories260K, head_dim 8, in fp32)."""
    if device == "cpu":
        return torch.float32
    half = torch.bfloat16 if cfg.torch_dtype == "bfloat16" else torch.float16
    # the templates' coverage (targets/cuda/layout.check) does not depend on the page size or the window
    gap = cuda_template_gap(KernelOps.for_model(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, half))
    if gap is None:
        return half
    log.info("dtype float32: the CUDA templates do not run this model in %s (%s); it runs on TVM's CUDA kernels",
             str(half).removeprefix("torch."), gap)
    return torch.float32


class Engine:
    def __init__(self, model: "str | LoadedModel", engine_config: EngineConfig | None = None, **scheduler_kwargs):
        ec = self.engine_config = engine_config or EngineConfig()
        if not isinstance(ec, EngineConfig):
            raise TypeError(f"engine_config must be an EngineConfig, got {type(ec).__name__}")
        if ec.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA GPU")
        self._check_scheduler_kwargs(scheduler_kwargs, ec.cpu_offload_bytes is not None)
        if ec.cpu_threads is not None:
            torch.set_num_threads(ec.cpu_threads)  # tiny models on a busy CPU run faster on one thread
        t0 = time.perf_counter()
        loaded = model if isinstance(model, LoadedModel) else load(model)
        cfg, self.tokenizer = loaded.config, loaded.tokenizer
        self.dtype = DTYPES[ec.dtype] if ec.dtype is not None else default_dtype(cfg, ec.device)
        if ec.quantization == "fp8" and self.dtype == torch.float32:
            raise ValueError("quantization='fp8' needs a 16-bit dtype (bfloat16 or float16), got float32")
        self.kv_dtype = kv_dtype_of(ec.kv_cache_dtype, self.dtype)  # a bad pairing fails before the weights load
        page_size = scheduler_kwargs.get("page_size") or SchedulerConfig.page_size
        ops = KernelOps.for_model(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size, self.dtype,
                                  cfg.sliding_window, ec.attention_variant, self.kv_dtype,
                                  scheduler_kwargs.get("kv_evict_method") or SchedulerConfig.kv_evict_method)
        self.kernels = make_backend(ec.kernel_backend, ops, ec.device, ec.kernel_dir)
        if ec.cpu_threads is not None:
            self.kernels.set_threads(ec.cpu_threads)
        if loaded.weights is None:  # a config alone: random weights made on the device (benchmarks)
            self.model = LlamaForCausalLM.random(cfg, ec.device, self.dtype, ec.seed)
            self.model.quantize_(ec.quantization)
        else:
            packed = self.kernels.packed_formats if ec.quantization in ("auto", "q8_0") else frozenset()
            self.model = LlamaForCausalLM.from_weights(cfg, loaded.weights, ec.device, self.dtype, ec.progress,
                                                       packed, ec.quantization)
        del loaded
        log.info("model loaded in %.2f s: %s (%s, %d layers, %d/%d heads, head_dim %d, vocab %d), %s on %s, "
                 "weights %s (%.3g GB)", time.perf_counter() - t0,
                 "random weights" if isinstance(model, LoadedModel) else model, cfg.arch, cfg.num_layers,
                 cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, str(self.dtype).removeprefix("torch."),
                 ec.device, self.model.weight_formats(), self.model.weight_bytes() / 1e9)
        sc = self._scheduler_config(cfg, scheduler_kwargs)
        self.scheduler = Scheduler(sc)
        t0 = time.perf_counter()
        self.model.use_kernels(self.kernels)  # the layer ops (norms, SiLU-and-mul, RoPE) on the backend's kernels
        built = self.kernels.prepare(sc.max_num_batched_tokens, sc.max_num_seqs, sc.max_model_len, ec.progress)
        log.info("kernels ready in %.2f s (%s backend; %d prepared, %d libraries from the cache)",
                 time.perf_counter() - t0, self.kernels.name, built["kernels"], built["cached"])
        self.executor = Executor(self.model, self.kernels, sc.num_pages, sc.num_cpu_pages, sc.page_size, ec.device,
                                 sc.num_offload_pages, sc.kv_window, sc.kv_sink, sc.kv_recent)
        if sc.kv_budget is not None:
            self.check_eviction()
        page_bytes = self._page_bytes(cfg, sc.page_size)
        log.info("KV cache: %d pages of %d tokens (%d tokens) in %s%s, %.4g GB on %s; swap pool %d pages (%.4g GB); "
                 "offload tier %d pages (%.4g GB); max_model_len %d", sc.num_pages, sc.page_size,
                 sc.num_pages * sc.page_size, self.kv_dtype, " with float32 scales" if ops.quantized else "",
                 sc.num_pages * page_bytes / 1e9, ec.device, sc.num_cpu_pages, sc.num_cpu_pages * page_bytes / 1e9,
                 sc.num_offload_pages, sc.num_offload_pages * page_bytes / 1e9, sc.max_model_len)
        if ec.device == "cuda" and ec.cuda_graphs:
            self.executor.capture_graphs(sc.max_num_seqs, sc.max_model_len, ec.progress)
        self._stats = {"t": time.monotonic(), "prompt": 0, "generated": 0}
        self.sampler = Sampler(ec.seed, self.model.cfg.eos_token_ids)
        self.tracer = NullTracer()
        self.requests: dict[int, Request] = {}
        self._seq_request: dict[int, tuple[Request, int]] = {}  # seq_id -> (request, sample index)
        self._ids = itertools.count()
        self.async_scheduling = ec.device == "cuda" if ec.async_scheduling is None else ec.async_scheduling
        self._inflight: InFlight | None = None
        self.on_execute = None  # on_execute(batch): called before each batch runs (tests inject faults with it)
        # structured output: compiled guides and one matcher per guided sequence (llguidance loads on first use)
        all_cores = ec.device == "cpu" and torch.get_num_threads() >= (os.cpu_count() or 1)
        self._guides = GuideStates(Grammars(self.tokenizer, self.model.cfg.vocab_size, self.model.cfg.eos_token_ids),
                                   background=not all_cores, pinned=ec.device == "cuda")

    def check_eviction(self) -> None:
        """ValueError (one line) where KV eviction (a kv_budget) cannot run on this engine."""
        why = None
        if self.model.cfg.sliding_window:
            why = "the model has a sliding window (cache slots are not positions after eviction)"
        elif self.kernels.ops.score is None:
            why = f"the KV cache is {self.kernels.ops.kv_dtype} (kv_score reads a float cache)"
        elif self.kernels.name == "tvm-cuda":
            why = "the tvm-cuda backend has no kv_score kernel (use the cuda backend)"
        if why:
            raise ValueError(f"kv_budget: KV eviction is not available here: {why}")

    # ---- construction ---------------------------------------------------------------------------
    @staticmethod
    def _check_scheduler_kwargs(kw: dict, offload_bytes: bool = False) -> None:
        """Unknown names and bad values fail here, before the model loads (SchedulerConfig checks the rest)."""
        names = {f.name for f in fields(SchedulerConfig)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; engine options are {sorted(f.name for f in fields(EngineConfig))}, "
                            f"scheduler options are {sorted(names)}")
        v = kw.get("max_model_len")
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"max_model_len must be an int >= 1, got {v!r}")
        tier = {"num_offload_pages": 1} if offload_bytes and kw.get("num_offload_pages") is None else {}
        SchedulerConfig(**{**kw, "max_model_len": None, **tier})  # the other options' checks, before the model loads

    def _page_bytes(self, cfg, page_size: int) -> int:
        return memory.page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, self.kv_dtype)

    def _scheduler_config(self, cfg, kw: dict) -> SchedulerConfig:
        kw = dict(kw)
        if self.engine_config.device == "cuda":  # a GPU step takes thousands of tokens at the matmul rate
            kw.setdefault("max_num_batched_tokens", GPU_TOKEN_BUDGET)
            kw.setdefault("max_prefill_chunk", kw["max_num_batched_tokens"])
        P = kw.setdefault("page_size", SchedulerConfig.page_size)
        max_pos = cfg.max_position_embeddings
        asked = kw.get("max_model_len")
        if asked is not None and asked > max_pos:
            raise ValueError(f"max_model_len must be in [1, {max_pos}] (the model's max_position_embeddings), "
                             f"got {asked}")
        max_len = asked or max_pos
        page_bytes = self._page_bytes(cfg, P)
        if kw.get("num_pages") is None:
            budget = self.engine_config.kv_cache_bytes or self._default_kv_budget(kw)
            if budget < page_bytes and (self.engine_config.kv_cache_bytes or self.engine_config.device != "cuda"):
                raise ValueError(f"kv_cache_bytes={budget} holds no KV page: one page of {P} tokens takes "
                                 f"{page_bytes} bytes for this model (KV in {self.kv_dtype})")
            if budget // page_bytes < -(-max_len // P) and self.engine_config.device == "cuda" \
                    and not self.engine_config.kv_cache_bytes:
                raise ValueError(f"the KV cache budget ({budget / 2**30:.2f} GiB: {self.memory.describe()}) "
                                 f"holds {max(0, budget // page_bytes)} pages, fewer than one sequence of "
                                 f"max_model_len={max_len} needs ({-(-max_len // P)}); lower max_model_len or "
                                 f"max_num_batched_tokens, or raise gpu_memory_utilization")
            want = kw.get("max_num_seqs", 32) * -(-max_len // P)  # every running sequence at full length
            kw["num_pages"] = min(want, budget // page_bytes)
        kw.setdefault("num_cpu_pages", kw["num_pages"] if kw.get("preemption") == "swap" else 0)
        if kw.get("num_offload_pages") is None and self.engine_config.cpu_offload_bytes:
            kw["num_offload_pages"] = self.engine_config.cpu_offload_bytes // page_bytes
            if not kw["num_offload_pages"]:
                raise ValueError(f"cpu_offload_bytes={self.engine_config.cpu_offload_bytes} holds no KV page: one "
                                 f"page of {P} tokens takes {page_bytes} bytes for this model (KV in {self.kv_dtype})")
        capacity = kw["num_pages"] * P
        if asked is not None and asked > capacity:
            raise ValueError(f"max_model_len={asked} does not fit the KV cache: {kw['num_pages']} pages of {P} "
                             f"tokens hold {capacity} (raise kv_cache_bytes or num_pages, or lower max_model_len)")
        if asked is None and capacity < max_pos:
            log.warning("max_model_len = %d, what the KV cache's %d pages hold (the model allows %d; raise "
                        "kv_cache_bytes or num_pages for more)", capacity, kw["num_pages"], max_pos)
        kw["max_model_len"] = min(max_len, capacity)
        return SchedulerConfig(**kw)

    def _default_kv_budget(self, kw: dict) -> int:
        if self.engine_config.device == "cuda":
            self.memory = memory.profile(self.model, kw.get("max_num_batched_tokens", GPU_TOKEN_BUDGET),
                                  kw.get("max_num_seqs", 32), self.engine_config.gpu_memory_utilization)
            log.info("memory: %s", self.memory.describe())
            return max(0, self.memory.kv_budget)
        return 512 << 20

    def set_tracer(self, tracer) -> None:
        """Record steps, kernel calls and KV events into tracer (a trace.Tracer)."""
        self.tracer = tracer
        self.executor.kernels = TracedKernels(self.kernels, tracer)

    # ---- requests -------------------------------------------------------------------------------
    @property
    def grammars(self) -> Grammars:
        """The tokenizer's compiled structured-output guides."""
        return self._guides.grammars

    @property
    def num_guided(self) -> int:
        """Sequences holding a structured-output matcher (released when they finish or are aborted)."""
        return len(self._guides)

    def compile_guide(self, guide: Guide) -> None:
        """Compile a guide into the cache now (ValueError, one line, where it does not compile); thread-safe, so a
        server runs it off its event loop before add_request finds it compiled."""
        self.grammars.compile(guide)

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
        if params.kv_budget is not None:
            self.check_eviction()
        if params.guided is not None:
            self.compile_guide(params.guided)
        rid = next(self._ids)
        req = Request(rid, text, ids, params)
        seq = Sequence(rid, list(ids), len(ids), params, priority=priority)
        self.scheduler.add(seq)
        req.seqs = [seq] + (self.scheduler.fork(seq, params.n) if params.n > 1 else [])
        for i, s in enumerate(req.seqs):
            self._seq_request[s.seq_id] = (req, i)
            if params.guided is not None:
                self._guides.add(s.seq_id, params.guided)
        self.requests[rid] = req
        self.tracer.instant("add_request", "request", request_id=rid, prompt_tokens=len(ids), n=params.n)
        return rid

    def abort(self, request_id: int) -> None:
        req = self.requests.get(request_id)
        for seq in req.seqs if req else []:
            if seq.num_output_tokens and seq.token_ids[-1] < 0:  # its in-flight sample is dropped
                seq.token_ids.pop()
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
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns the requests that finished in it."""
        return self.run_step().finished

    def run_step(self) -> StepOutput:
        """One scheduler step; returns each sample's new tokens and the requests that finished (with async
        scheduling, those of the step launched by the previous call). A step that raises aborts the requests
        it held (the batch's and those of the step in flight), frees their pages and raises StepFailed naming
        them; the others go on as if it had not run."""
        held: list[Sequence] = []
        try:
            return self._run_step(held)
        except Exception as e:
            rids = sorted({self._seq_request[s.seq_id][0].request_id for s in held if s.seq_id in self._seq_request})
            self._inflight = None
            for rid in rids:
                self.abort(rid)
            raise StepFailed(e, rids) from e

    def _run_step(self, held: list) -> StepOutput:
        tr = self.tracer
        with tr.span("step", "scheduler"):
            prev, self._inflight = self._inflight, None
            if prev is not None:
                held.extend(prev.pending.seqs)
            out = StepOutput()
            if prev is not None and prev.needs_history:
                out, prev = self._commit(prev), None
            with tr.span("schedule", "scheduler"):
                preemptions = self.scheduler.num_preemptions
                batch = self.scheduler.schedule()
            if batch.is_empty and prev is None:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("scheduler made no progress with requests pending (KV cache too small?)")
                return out
            if tr.enabled:
                self._trace_kv(batch, self.scheduler.num_preemptions - preemptions)
            held.extend(batch.seqs)
            if batch.swap_out or batch.swap_in or batch.copies or batch.moves or batch.offload:
                # page copies of other sequences ride on this step: should it fail, their KV is unknown
                held.extend(s for r in self.requests.values() for s in r.seqs)
            launched = None
            if not batch.is_empty:
                if self.on_execute is not None:
                    self.on_execute(batch)
                masks = None  # the guided sequences' next-token masks, computed while the step runs
                if len(self._guides):
                    masks = self._guides.fill([s for s, smp in zip(batch.seqs, batch.sample) if smp])
                with tr.span("execute", "scheduler", seqs=len(batch.seqs), tokens=batch.num_tokens):
                    seqs, logits = self.executor.execute(batch, prev.pending.tokens if prev else None)
                with tr.span("sample", "scheduler", seqs=len(seqs)):
                    launched = InFlight(batch, self.sampler.launch(seqs, logits, masks))
            if prev is not None:
                out = self._commit(prev)
            if launched is not None:
                with tr.span("update", "scheduler"):
                    self._advance(launched)
                if self.async_scheduling:
                    self._inflight = launched
                else:
                    out = self._commit(launched)
            return out

    def _advance(self, f: InFlight) -> None:
        """Count the launched step in the scheduler, its samples coded -1 - j until they arrive."""
        seqs = f.pending.seqs
        codes = {s.seq_id: -1 - j for j, s in enumerate(seqs)}
        self.scheduler.update(f.batch, codes)
        for s in seqs:  # those the update appended to (not those that finished while it ran)
            if s.num_output_tokens and s.token_ids[-1] == codes[s.seq_id]:
                f.seqs.append(s)
                f.positions.append(s.num_tokens - 1)
        self._log_stats(f.batch, len(seqs))

    def _commit(self, f: InFlight) -> StepOutput:
        """Wait for a launched step's ids, write them into its sequences, apply the stop checks."""
        with self.tracer.span("wait", "scheduler"):
            sampled = f.pending.result()
        seqs = []
        for seq, pos in zip(f.seqs, f.positions):
            if pos < seq.num_tokens and seq.token_ids[pos] < 0:  # not aborted since (abort drops the code)
                seq.token_ids[pos] = sampled.tokens[seq.seq_id]
                seqs.append(seq)
        return self._collect(seqs, sampled)

    def _collect(self, seqs: list[Sequence], sampled) -> StepOutput:
        out, done = StepOutput(), {}
        for seq in seqs:
            # a guided sequence's matcher takes the token; a grammar that allows nothing more ends the output
            complete = self._guides.advance(seq.seq_id, sampled.tokens[seq.seq_id])
            reason = None if seq.is_finished else (self._stop_reason(seq) or ("stop" if complete else None))
            if reason is not None:
                self.scheduler.finish(seq, reason)
            req, index = self._seq_request[seq.seq_id]
            lp = sampled.logprobs.get(seq.seq_id)
            if seq.is_finished:
                self._finalize(seq)
            first = index == 0 and seq.num_output_tokens == 1 and seq.params.prompt_logprobs is not None
            out.deltas.append(Delta(req.request_id, index, [sampled.tokens[seq.seq_id]], [lp] if lp else [],
                                    seq.finish_reason if seq.is_finished else None,
                                    [None] + list(seq.prompt_logprobs) if first else None))
            if seq.is_finished and all(s.is_finished for s in req.seqs):
                done[req.request_id] = None  # once, after every sample of it this step is final
        for rid in done:
            out.finished.append(self.output(rid))
            self.tracer.instant("finish", "request", request_id=rid)
        return out

    def _trace_kv(self, batch, num_preempted: int) -> None:
        tr, kv = self.tracer, self.scheduler.kv
        for name, pairs in (("swap_out", batch.swap_out), ("swap_in", batch.swap_in), ("copy", batch.copies),
                            ("compact", batch.moves), ("offload_save", batch.offload.save),
                            ("offload_restore", batch.offload.restore)):
            if pairs:
                tr.instant(name, "kv", pages=len(pairs))
        if num_preempted:
            tr.instant("preempt", "kv", count=num_preempted)
        tr.counter("kv_pages", used=kv.num_pages - kv.num_free_pages, cached=len(kv.lru),
                   free=len(kv.free_pages))

    def _stop_reason(self, seq: Sequence) -> str | None:
        p, last = seq.params, seq.token_ids[-1]
        if seq.num_output_tokens < p.min_tokens:
            return None
        if not p.ignore_eos and last in self.model.cfg.eos_token_ids:
            return "stop"
        if p.stop_token_ids and last in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode_continuation(seq.prompt_token_ids, seq.output_token_ids)
            if p.stop_cut(text, self.stop_floor(seq)) is not None:
                return "stop"
        return None

    def stop_floor(self, seq: Sequence) -> int:
        """Characters of the output no stop string may end within: those of its first min_tokens - 1 tokens."""
        m = seq.params.min_tokens
        if m <= 1 or not seq.params.stop or self.tokenizer is None:
            return 0
        return len(self.tokenizer.decode_continuation(seq.prompt_token_ids, seq.output_token_ids[:m - 1]))

    def _finalize(self, seq: Sequence) -> None:
        """Final text: decoded output, cut at the first stop string."""
        self.sampler.release(seq)
        self._guides.release(seq.seq_id)
        req, _ = self._seq_request[seq.seq_id]
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode_continuation(seq.prompt_token_ids, seq.output_token_ids)
            cut = seq.params.stop_cut(text, self.stop_floor(seq))
            if cut is not None:
                text = text[:cut]
                seq.finish_reason = "stop"  # a stop string wins over max_tokens reached in the same step
        req.texts[seq.seq_id] = text

    def output(self, request_id: int) -> RequestOutput:
        req = self.requests[request_id]
        outs = [CompletionOutput(i, req.texts.get(s.seq_id, ""), [t for t in s.output_token_ids if t >= 0],
                                 s.finish_reason) for i, s in enumerate(req.seqs)]  # (< 0: on its way from the GPU)
        s0 = req.seqs[0]
        plp = [None] + list(s0.prompt_logprobs) if s0.params.prompt_logprobs is not None else None
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outs,
                             all(s.is_finished for s in req.seqs), plp)

    def _log_stats(self, batch, num_sampled: int) -> None:
        """Throughput at INFO every log_stats_interval seconds (counted whatever the log level)."""
        st = self._stats
        st["generated"] += num_sampled
        st["prompt"] += batch.num_tokens - num_sampled  # tokens computed that drew no sample
        interval = self.engine_config.log_stats_interval
        now = time.monotonic()
        if interval and now - st["t"] >= interval:
            dt = now - st["t"]
            s = self.scheduler.stats()
            log.info("throughput: %.1f prefill tok/s, %.1f generated tok/s; %d running, %d waiting, %d swapped; "
                     "KV usage %.0f%%; %d preemptions so far", st["prompt"] / dt, st["generated"] / dt,
                     s["num_running"], s["num_waiting"], s["num_swapped"], 100 * s["kv_usage"], s["num_preemptions"])
            st.update(t=now, prompt=0, generated=0)

    def run_until_done(self) -> None:
        while self.has_unfinished():
            self.step()
