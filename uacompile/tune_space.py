"""What `uacompile tune` searches: each target's config space, and how one candidate is built, checked and timed.

A Space gives, for an op at a shape, the default config (the built-in rule's choice) and the candidate configs
(the default first), builds a candidate's kernel (through the kernel cache: `build` runs in a worker process),
and makes a Bench of it: `check()` compares the kernel with the float64 reference on a small input of the same
kind (raises on a mismatch), `sample(calls)` returns seconds per call. Spaces:

  cpu       TVMConfig schedule knobs on the LLVM target (paged_attention, reshape_and_cache); CPU timers
  cuda      AttentionConfig and ReshapeConfig, on the Jinja kernels, by the shape's kind: decode the split count,
            fused merge and decode-only; prefill the Hopper path's wgmma tile and stages, item queue, Q prefetch and
            (small pages) the cp.async producer's lanes a row or TMA instead; CUDA events
  tvm-cuda  TVMConfig's CUDA knobs (lanes a row, threads a block, splits, vector loads, q heads sharing shared-memory
            K/V tiles) on TVM's CUDA source; CUDA events; the libraries from a folder of prebuilt ones (kernel_dir)
            where the GPU machine has no TVM
  ascend    AscendConfig's tile and blockDim cap on the CPU emulator: checked against the reference, never timed

A config field added to a target joins the search by an entry in that space's axes(): field -> the values to try.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import time
import zlib

import numpy as np

from . import ir, reference, testing
from .errors import IRError
from .tunedb import Shape

SPACES = ("cpu", "cuda", "tvm-cuda", "ascend")


def _tensors(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, np.ndarray)}


def check_shape(shape: Shape) -> Shape:
    """The small input a candidate is checked on: the same kind, few sequences, long enough for several splits
    and pages."""
    if shape.kind == "decode":
        return Shape("decode", min(shape.batch, 3), min(shape.length, 1100))
    return Shape("prefill", min(shape.batch, 2), min(shape.length, 96))


def changes(config, base: dict) -> int:
    """How many knobs config turns away from base (a config's asdict): its fields that differ, fused_merge not
    counted where the split count goes to or from 1 (one split has nothing to merge: the merge comes with the
    splits, no knob of its own then)."""
    now = dataclasses.asdict(config)
    diff = {k for k, v in now.items() if v != base[k]}
    if "num_splits" in diff and (now["num_splits"] == 1) != (base["num_splits"] == 1):
        diff.discard("fused_merge")
    return len(diff)


def ordered(default, candidates, seed: str) -> list:
    """default first, then the other candidates nearest it first (fewest knobs changed), in an order fixed by
    seed within each distance: --trials N tries every one-knob change of the rule before any two-knob one."""
    rng = random.Random(zlib.crc32(seed.encode()))
    rest = sorted({c for c in candidates if c != default}, key=repr)
    rng.shuffle(rest)
    base = dataclasses.asdict(default)
    return [default, *sorted(rest, key=lambda c: changes(c, base))]


def product(axes: dict, base):
    """Every config of base's class with the axes' values (invalid combinations dropped)."""
    names = list(axes)
    for values in itertools.product(*(axes[n] for n in names)):
        try:
            yield dataclasses.replace(base, **dict(zip(names, values)))
        except IRError:
            continue


# ------------------------------------------------------------------ CPU (TVM, LLVM)
class CPUSpace:
    target = "cpu"
    timer = "cpu"

    def ops(self) -> tuple[str, ...]:
        return ("paged_attention", "reshape_and_cache")

    def default(self, op, shape: Shape):
        from .lower.config import TVMConfig

        return TVMConfig()

    def axes(self, op) -> dict:
        if op.kind == "reshape_and_cache":
            return {"grain": (1, 2, 4, 8, 16, 32)}
        D, Hq = op.head_dim, op.num_q_heads
        return {"grain": sorted({1, 2, 4, 8, Hq}),
                "dot_lanes": [v for v in (0, 1, 4, 8, 16) if v == 0 or D % v == 0],
                "acc_vec": [v for v in (0, 4, 8, 16) if v == 0 or (D % v == 0 and v < D)],
                "page_group": (1, 2, 4),
                "unroll_dot": (False, True)}

    def candidates(self, op, shape: Shape) -> list:
        default = self.default(op, shape)
        return ordered(default, product(self.axes(op), default), f"{op.key()}|{shape}")

    def kernel(self, op, config) -> ir.Kernel:
        config.check(op)
        return ir.Kernel(op, config)

    @staticmethod
    def build(kernel: ir.Kernel) -> None:
        """Build into the kernel cache (a worker process runs this)."""
        from .cache import cached_build
        from .lower.tvm_build import CACHE_KIND, build_cpu_library, cpu_cache_key

        cached_build(CACHE_KIND, cpu_cache_key(kernel), lambda d: build_cpu_library(kernel, d))

    def bench(self, kernel: ir.Kernel, shape: Shape, seed: int = 0):
        from .lower.tvm_build import cpu_kernel

        fn = cpu_kernel(kernel)
        return (CPUAttentionBench if kernel.kind == "paged_attention" else CPUReshapeBench)(fn, kernel.op, shape, seed)


class CPUAttentionBench:
    """A CPU attention kernel at a shape: inputs in ROTATE copies (so the caches do not hold one set), poisoned
    outputs, and the check against the reference."""

    ROTATE = 2

    def __init__(self, fn, op, shape: Shape, seed: int = 0):
        self.fn, self.op, self.shape = fn, op, shape
        rng = np.random.default_rng(seed)
        self.inputs = [self._inputs(rng, shape) for _ in range(self.ROTATE)]
        self.rng = rng
        self.i = 0

    def _inputs(self, rng, shape: Shape) -> dict:
        inp = _tensors(testing.attention_inputs(self.op, rng, shape.kv_lens(), shape.q_lens()))
        inp["out"] = np.full(inp["q"].shape, np.nan, dtype=inp["q"].dtype)
        return inp

    def call(self, inp: dict) -> None:
        self.fn(**inp)

    def check(self) -> None:
        inp = self._inputs(self.rng, check_shape(self.shape))
        self.call(inp)
        ref, _ = reference.run(self.op, **{k: v for k, v in inp.items() if k != "out"})
        got = inp["out"].astype(np.float64)
        tol = testing.tolerance(self.op.q_dtype, self.op.kv_dtype)
        err = np.abs(got - ref).max() if np.isfinite(got).all() else np.inf
        if not err <= tol:
            raise AssertionError(f"max |out - reference| = {err:.3g} > {tol:g}")

    def sample(self, calls: int = 1) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            self.call(self.inputs[self.i % self.ROTATE])
            self.i += 1
        return (time.perf_counter() - t0) / calls


class CPUReshapeBench(CPUAttentionBench):
    def _inputs(self, rng, shape: Shape) -> dict:
        T = shape.num_tokens
        return _tensors(testing.reshape_and_cache_inputs(self.op, rng, T, -(-T // self.op.page_size) + 4))

    def check(self) -> None:
        inp = self._inputs(self.rng, check_shape(self.shape))
        ref = {k: v.copy() for k, v in inp.items()}
        reference.run(self.op, **ref)
        self.call(inp)
        bad = [k for k in inp if not np.array_equal(inp[k], ref[k], equal_nan=True)]
        if bad:
            raise AssertionError(f"{bad} differ from the reference")


# ------------------------------------------------------------------ CUDA (Jinja templates)
def to_device(arrays: dict, device) -> dict:
    """numpy inputs as torch tensors on a CUDA device, bit for bit (bf16 and fp8 through their raw bytes)."""
    import torch

    out = {}
    for k, a in arrays.items():
        if a.dtype in (ir.numpy_dtype("bf16"), ir.numpy_dtype("fp8_e4m3")):
            name = "bf16" if a.dtype.itemsize == 2 else "fp8_e4m3"
            t = torch.from_numpy(a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8).copy())
            t = t.view(ir.torch_dtype(name))
        else:
            t = torch.from_numpy(np.ascontiguousarray(a))
        out[k] = t.to(device)
    return out


def device_inputs(op, rng, shape: Shape, device) -> dict:
    """A timing input set of an attention shape as torch tensors on a CUDA device: the page table and token arrays
    as testing.attention_inputs makes them, q / K / V drawn on the device (the production shapes' KV takes tens of
    seconds to draw with numpy). Quantised KV (values and scales): testing.attention_inputs, copied over. Only
    timed, never checked: a check draws its own numpy inputs for the reference."""
    import torch

    if op.quantized:
        return to_device(_tensors(testing.attention_inputs(op, rng, shape.kv_lens(), shape.q_lens())), device)
    kv_lens, q_lens = shape.kv_lens(), shape.q_lens()
    token_seq, token_kv_len = testing.ubatch(kv_lens, q_lens)
    table, num_pages = testing.scattered_page_table(rng, kv_lens, op.page_size)
    gen = torch.Generator(device=device)
    gen.manual_seed(int(rng.integers(1 << 62)))

    def normal(shape_, dtype):
        return torch.randn(shape_, generator=gen, device=device).to(ir.torch_dtype(dtype))

    cache = (num_pages, op.page_size, op.num_kv_heads, op.head_dim)
    out = dict(q=normal((len(token_seq), op.num_q_heads, op.head_dim), op.q_dtype), k_cache=normal(cache, op.kv_dtype),
               v_cache=normal(cache, op.kv_dtype))
    arrays = dict(token_seq=token_seq, page_table=table, token_kv_len=token_kv_len)
    if op.alibi:
        arrays["alibi_slopes"] = testing.alibi_slopes(op.num_q_heads)
    return {**out, **to_device(arrays, device)}


class CUDASpace:
    target = "cuda"
    timer = "cuda"

    def __init__(self, device=0):
        self.device = device

    def __getstate__(self) -> dict:
        """What a build worker gets (tune's process pool): not the benches' input sets on the GPU."""
        return {k: v for k, v in self.__dict__.items() if k != "_inputs_of"}

    def ops(self) -> tuple[str, ...]:
        return ("paged_attention", "reshape_and_cache")

    def _arch_sms(self) -> tuple[str, int]:
        from .targets.cuda import plan

        try:
            return plan.device_arch(self.device), plan.device_sms(self.device)
        except (RuntimeError, AssertionError):  # no GPU here: the space of the H200 the project targets
            return "sm_90", plan.H200_SMS

    def default(self, op, shape: Shape):
        from .targets.cuda import plan
        from .targets.cuda.config import ReshapeConfig

        if op.kind == "reshape_and_cache":
            return ReshapeConfig()
        arch, sms = self._arch_sms()
        return plan.choose_config(op, shape.num_tokens, shape.num_seqs, shape.max_kv_len, sms, arch)

    def axes(self, op, shape: Shape) -> dict:
        """AttentionConfig / ReshapeConfig field -> the values tried, by the shape's kind. Decode: split count, fused
        merge, decode-only. Prefill: 2 or 4 splits only where its tiles leave SMs idle (plan.choose_splits' FULL_WAVE
        test); on the Hopper path the wgmma tile and its stages (wg_tiles), the item queue, the Q prefetch, and where
        the rule copies pages by cp.async (pages under layout.CP_PRODUCER_BELOW positions) the producer's lanes a
        row and TMA instead (cp_producer_below = the page size). None is the built-in rule's value; a value the rule
        already takes is not listed again."""
        from .targets.cuda import layout
        from .targets.cuda.config import AttentionConfig
        from .targets.cuda.plan import FULL_WAVE, MAX_SPLITS, MIN_SPLIT_LEN

        if op.kind == "reshape_and_cache":
            return {"rows": (None, 1, 2, 4, 8), "threads": (None, 64, 128, 256), "waves": (None, 0, 1, 2, 4),
                    "stages": (None, 0, 2), "prefetch": (None, 0, 4)}
        if shape.kind == "decode":
            limit = min(MAX_SPLITS, max(1, shape.max_kv_len // (MIN_SPLIT_LEN // 2)))
            return {"num_splits": [s for s in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64) if s <= limit],
                    "fused_merge": (False, True), "decode_only": (False, True)}
        arch, sms = self._arch_sms()
        rule = AttentionConfig()
        lay = layout.layout(op, rule, arch)
        fills = layout.prefill_items(op, rule, shape.num_tokens, arch) >= FULL_WAVE * sms * lay.blocks_per_sm
        axes = {"num_splits": (1,) if fills else [s for s in (1, 2, 4) if s == 1 or shape.max_kv_len >= MIN_SPLIT_LEN * s],
                "fused_merge": (False, True)}
        if not layout.uses_wgmma(op, rule, arch):
            return axes
        G, D, P = op.group_size, op.head_dim, op.page_size
        axes.update(item_queue=(False, True), wg_tile=(None, *wg_tiles(op, arch)),
                    q_prefetch_min=(None, 0 if G * D * 2 < layout.q_prefetch_min() else 1 << 20))
        if P < layout.cp_producer_below():
            axes.update(cp_row_lanes=(None, *(n for n in (2, 4, 8) if n != layout.cp_row_lanes(D))),
                        cp_producer_below=(None, P))
        return axes

    def candidates(self, op, shape: Shape) -> list:
        """The default (the built-in rule's config) first, then the axes' other configs that the template builds and
        that run differently: each passes layout.check and check_fits; the item queue only on the Hopper path;
        prefill splits only merged in the launch; producer lanes only where pages are copied by cp.async."""
        from .targets.cuda import layout

        default = self.default(op, shape)
        arch, _ = self._arch_sms()
        out = []
        for c in product(self.axes(op, shape), default):
            if op.kind == "paged_attention":
                if c.item_queue and not layout.uses_wgmma(op, c, arch):
                    continue
                if shape.kind == "prefill" and c.num_splits > 1 and not c.fused_merge:
                    continue
                if c.cp_row_lanes is not None and op.page_size >= layout.cp_producer_below(c):
                    continue  # TMA copies the pages: the lanes change nothing
                try:
                    layout.check(op, c)
                    layout.check_fits(op, c, arch)
                except IRError:
                    continue
            out.append(c)
        return ordered(default, out, f"{op.key()}|{shape}")

    def kernel(self, op, config) -> ir.Kernel:
        return ir.Kernel(op, config)

    @staticmethod
    def build(kernel: ir.Kernel) -> None:
        """The kernels a bench of kernel loads, each as the planner builds it: an attention config's launched
        kernels (plan.launched_kernels: with unfused splits, merge_state too)."""
        from .targets.cuda.build import build
        from .targets.cuda.plan import launched_kernels

        for k in launched_kernels(kernel.op, kernel.config) if kernel.kind == "paged_attention" else (kernel,):
            if k is not None:
                build([k], None)

    def bench(self, kernel: ir.Kernel, shape: Shape, seed: int = 0):
        from .targets.cuda import api

        if kernel.kind == "reshape_and_cache":
            return CUDAReshapeBench(api.kernel(kernel), kernel.op, shape, seed)
        return self._shared(CUDAAttentionBench, kernel, shape, seed)

    def _shared(self, cls, kernel: ir.Kernel, shape: Shape, seed: int, **kw):
        """A bench (cls(..., **kw)) over the input sets of the last bench of the same (op, shape, seed): made once a
        shape, the previous shape's freed."""
        key = (kernel.op, shape, seed)
        held = getattr(self, "_inputs_of", None)
        bench = cls(kernel, shape, seed, self.device, inputs=held[1] if held and held[0] == key else None, **kw)
        self._inputs_of = (key, bench.inputs)
        return bench


def wg_tiles(op, arch: str) -> list[tuple[int, int]]:
    """The Hopper prefill tiles (K/V positions, TMA stages) worth timing for op besides the rule's: each width of
    64, 128, 192 or 256 positions at the most stages (<= 6) whose shared memory fits a block (layout.check_fits),
    where the template builds it for op's pages (layout.wgmma_tile_error), leaving out widths whose fp32
    accumulators alone, O (padded width / 2 a thread) and two S tiles in flight (width / 2 each), exceed a
    consumer's registers."""
    from .targets.cuda import layout
    from .targets.cuda.config import AttentionConfig

    rule = layout.layout(op, AttentionConfig(), arch)
    out = []
    for bn in (64, 128, 192, 256):
        if layout.wgmma_width(op.head_dim) // 2 + bn > layout.CONSUMER_REGS:
            continue
        for stages in range(6, 1, -1):
            c = AttentionConfig(wg_tile=(bn, stages))
            try:
                layout.check_fits(op, c, arch)
            except IRError:
                continue
            if (bn, stages) != (rule.bn_wg, rule.stages_wg):
                out.append((bn, stages))
            break
    return out


class CUDAEventTimed:
    """sample(): the next calls of self.call over the rotated self.inputs, timed with CUDA events (seconds a call)."""

    def sample(self, calls: int = 1) -> float:
        torch = self.torch
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            self.call(self.inputs[self.i % len(self.inputs)])
            self.i += 1
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / calls


class CUDAAttentionBench(CUDAEventTimed):
    """A planned CUDA attention launch at a shape, timed with CUDA events. Its inputs are rotated through enough
    copies that their KV exceeds L2 twice over, so no sample reads a cache left warm by the one before."""

    L2_BYTES = 64 << 20

    def __init__(self, kernel: ir.Kernel, shape: Shape, seed: int = 0, device=0, inputs: list | None = None):
        """inputs: the rotated input sets of another bench of the same op and shape (shared, not copied)."""
        import torch

        self.torch = torch
        self.kernel, self.op, self.shape = kernel, kernel.op, shape
        self.device = torch.device("cuda", device if isinstance(device, int) else torch.cuda.current_device())
        self.rng = np.random.default_rng(seed)
        if inputs is None:
            first = self._inputs(shape)
            kv_bytes = first["k_cache"].numel() * first["k_cache"].element_size() * 2
            copies = min(8, -(-2 * self.L2_BYTES // kv_bytes))
            inputs = [first] + [self._inputs(shape) for _ in range(copies - 1)]
        self.inputs = inputs
        self.plan = self._plan(shape)
        self.i = 0

    def _plan(self, shape: Shape):
        from .targets.cuda import plan

        return plan.plan(self.op, shape.num_tokens, shape.num_seqs, shape.max_kv_len, self.device,
                         config=self.kernel.config, tuned=False)

    def _inputs(self, shape: Shape, arrays: dict | None = None) -> dict:
        """arrays (numpy) on the device; without them, a timing input set of shape drawn there (device_inputs)."""
        out = to_device(arrays, self.device) if arrays else device_inputs(self.op, self.rng, shape, self.device)
        out["out"] = self.torch.empty_like(out["q"])
        return out

    def call(self, inp: dict, plan=None) -> None:
        from .targets.cuda import attention

        extra = {k: inp[k] for k in ("k_scale", "v_scale", "alibi_slopes") if k in inp}
        attention.run(plan or self.plan, inp["q"], inp["k_cache"], inp["v_cache"], inp["token_seq"],
                      inp["page_table"], inp["token_kv_len"], out=inp["out"], **extra)

    def check(self) -> None:
        shape = check_shape(self.shape)
        arrays = _tensors(testing.attention_inputs(self.op, self.rng, shape.kv_lens(), shape.q_lens()))
        inp = self._inputs(shape, arrays)
        inp["out"].fill_(float("nan"))
        self.call(inp, self._plan(shape))
        self.torch.cuda.synchronize(self.device)
        ref, _ = reference.run(self.op, **arrays)
        got = inp["out"].float().cpu().numpy().astype(np.float64)
        tol = testing.tolerance(self.op.q_dtype, self.op.kv_dtype)
        err = np.abs(got - ref).max() if np.isfinite(got).all() else np.inf
        if not err <= tol:
            raise AssertionError(f"max |out - reference| = {err:.3g} > {tol:g}")


class CUDAReshapeBench(CUDAEventTimed):
    """reshape_and_cache on CUDA, bit-exact against the reference, timed with CUDA events."""

    def __init__(self, fn, op, shape: Shape, seed: int = 0):
        import torch

        self.torch, self.fn, self.op, self.shape = torch, fn, op, shape
        self.rng = np.random.default_rng(seed)
        self.inputs = [self._inputs(shape) for _ in range(2)]
        self.i = 0

    def _arrays(self, shape: Shape) -> dict:
        T = shape.num_tokens
        return _tensors(testing.reshape_and_cache_inputs(self.op, self.rng, T, -(-T // self.op.page_size) + 4))

    def _inputs(self, shape: Shape, arrays=None) -> dict:
        return to_device(arrays or self._arrays(shape), "cuda")

    def call(self, inp: dict) -> None:
        self.fn(**inp)

    def check(self) -> None:
        arrays = self._arrays(check_shape(self.shape))
        ref = {k: v.copy() for k, v in arrays.items()}
        reference.run(self.op, **ref)
        inp = self._inputs(self.shape, arrays)
        self.call(inp)
        self.torch.cuda.synchronize()
        for k in ("k_cache", "v_cache", "k_scale", "v_scale"):
            if k in inp:
                got = inp[k].cpu()
                got = got.view(self.torch.uint8 if got.element_size() == 1 else self.torch.int16 if
                               got.element_size() == 2 else self.torch.int32).numpy()
                want = ref[k].view(got.dtype)
                if not np.array_equal(got, want):
                    raise AssertionError(f"{k} differs from the reference")


# ------------------------------------------------------------------ CUDA (TVM lowering)
class TVMCUDASpace(CUDASpace):
    """TVM's CUDA kernels: lanes a row and threads a block (the thread binding and the split of the position
    loop over lane groups), split-KV merged in the same launch, vector loads (vec elements a load) and q heads a
    block sharing K/V tiles staged in shared memory (heads); combinations TVMConfig.check refuses are left out.
    kernel_dir: a folder of prebuilt libraries (<symbol>_<arch>.so, bench/prebuild_tvm_cuda.sh) where a GPU machine
    has no TVM; a kernel not there is built with TVM, or refused in one line where TVM is not installed either
    (lower.tvm_cuda.cuda_library)."""

    target = "tvm-cuda"

    def __init__(self, device=0, kernel_dir=None):
        super().__init__(device)
        self.kernel_dir = kernel_dir

    def ops(self) -> tuple[str, ...]:
        return ("paged_attention",)

    def default(self, op, shape: Shape):
        from .lower.config import TVMConfig

        return TVMConfig()

    def axes(self, op, shape: Shape) -> dict:
        splits = [s for s in (1, 2, 4, 8, 16) if s == 1 or shape.max_kv_len >= 256 * s]
        return {"lanes": [v for v in (0, 4, 8, 16, 32) if v == 0 or op.head_dim % v == 0],
                "threads": (64, 128, 256, 512), "num_splits": splits, "fused_merge": (False, True),
                "vec": (1, 2, 4, 8, 16), "heads": [h for h in (1, 2, 4, 8) if op.group_size % h == 0]}

    def candidates(self, op, shape: Shape) -> list:
        default = self.default(op, shape)
        out = []
        for c in product(self.axes(op, shape), default):
            if c.num_splits > 1 and not c.fused_merge:
                continue  # the TVM kernels merge in the same launch only when fused
            if c.lanes and c.lanes == default.row_lanes(op.head_dim):
                continue  # the rule's own lanes (lanes=0): the same kernel under another name
            try:
                c.check(op)
            except IRError:
                continue
            out.append(c)
        return ordered(default, out, f"{op.key()}|{shape}")

    def build(self, kernel: ir.Kernel) -> None:
        """The kernel's library: found in kernel_dir, else built with TVM (through the cache)."""
        from .lower.tvm_cuda import cuda_library
        from .nvcc import default_arch

        cuda_library(kernel, default_arch(), self.kernel_dir)

    def bench(self, kernel: ir.Kernel, shape: Shape, seed: int = 0):
        return self._shared(TVMCUDAAttentionBench, kernel, shape, seed, kernel_dir=self.kernel_dir)


class TVMCUDAAttentionBench(CUDAAttentionBench):
    """TVM's CUDA attention kernel called directly (its own split partials; the merge is in the launch)."""

    def __init__(self, kernel: ir.Kernel, shape: Shape, seed: int = 0, device=0, inputs: list | None = None,
                 kernel_dir=None):
        self.kernel_dir = kernel_dir
        super().__init__(kernel, shape, seed, device, inputs)

    def _plan(self, shape: Shape):
        return tvm_cuda_plan(self.kernel, shape.num_tokens, self.device, self.kernel_dir)

    def call(self, inp: dict, plan=None) -> None:
        fn, ws = plan or self.plan
        fn(**inp, **ws)


def tvm_cuda_plan(kernel: ir.Kernel, num_tokens: int, device, kernel_dir=None):
    """(TVM's CUDA attention kernel, its workspaces for num_tokens tokens): call fn(**tensors, **workspaces).
    kernel_dir: a folder of prebuilt TVM-CUDA libraries (tvm_cuda_kernel)."""
    import torch

    op, cfg = kernel.op, kernel.config
    S, ws = cfg.num_splits, {}
    if S > 1:
        ws["o_partial"] = torch.empty((S, num_tokens, op.num_q_heads, op.head_dim), dtype=torch.float32, device=device)
        ws["lse_partial"] = torch.empty((S, num_tokens, op.num_q_heads), dtype=torch.float32, device=device)
    if cfg.fused_merge:
        ws["split_counters"] = torch.zeros((num_tokens, op.num_kv_heads), dtype=torch.int32, device=device)
    if op.return_lse:
        ws["lse"] = torch.empty((num_tokens, op.num_q_heads), dtype=torch.float32, device=device)
    return tvm_cuda_kernel(kernel, kernel_dir), ws


def tvm_cuda_kernel(kernel: ir.Kernel, kernel_dir=None):
    """An api.CudaKernel over TVM's CUDA library of kernel (the same launcher ABI as the Jinja kernels), so the
    planner can run it. Kernels without a TVMConfig (merge_state) take the default one. kernel_dir: a folder of
    prebuilt libraries, <symbol>_<arch>.so (bench/prebuild_tvm_cuda.sh), for a machine without TVM; a kernel not
    there is built with TVM, or refused in one line naming its symbol where TVM is not here
    (lower.tvm_cuda.cuda_library)."""
    from .lower.config import TVMConfig
    from .lower.tvm_cuda import cuda_library
    from .nvcc import default_arch
    from .targets.cuda import api
    from .targets.cuda.loader import load_library

    if not isinstance(kernel.config, TVMConfig):
        sig = kernel.signature()
        kernel = ir.Kernel(kernel.op, TVMConfig(num_splits=sig.get("num_splits", 1),
                                                fused_merge=sig.get("fused_merge", False)))
    path = cuda_library(kernel, default_arch(), kernel_dir)
    return api.CudaKernel(kernel, library=load_library(path, [kernel]))


# ------------------------------------------------------------------ AscendC (the CPU emulator: correctness only)
class AscendSpace:
    """AscendConfig's tile and blockDim cap. The emulator says nothing of the NPU's speed: every candidate is
    built and checked against the reference, none is timed and nothing is recorded (tune() with timer None)."""

    target = "ascend"
    timer = None

    def ops(self) -> tuple[str, ...]:
        return ("paged_attention", "reshape_and_cache")

    def default(self, op, shape: Shape):
        from .targets.ascend.config import AscendConfig

        return AscendConfig()

    def axes(self, op, shape: Shape) -> dict:
        from .targets.ascend.config import TILES

        tiles = [0] + [t for t in TILES if t <= op.page_size] if op.kind == "paged_attention" else [0]
        return {"tile": tiles, "block_dim": (0, 1, 7, 24)}

    def candidates(self, op, shape: Shape) -> list:
        default = self.default(op, shape)
        return ordered(default, product(self.axes(op, shape), default), f"{op.key()}|{shape}")

    def kernel(self, op, config) -> ir.Kernel:
        from .targets.ascend.generate import plan

        k = ir.Kernel(op, config)
        plan(k)  # IRError where the UB or the part cannot take it
        return k

    @staticmethod
    def build(kernel: ir.Kernel) -> None:
        from .targets.ascend.build import emulator_library

        emulator_library(kernel)

    def bench(self, kernel: ir.Kernel, shape: Shape, seed: int = 0):
        return AscendCheck(kernel, shape, seed)


class AscendCheck:
    """An emulator build of a kernel, checked against the reference at the shape's check size; never timed."""

    def __init__(self, kernel: ir.Kernel, shape: Shape, seed: int = 0):
        from .targets.ascend.build import load

        self.kernel, self.shape, self.fn = kernel, shape, load(kernel)
        self.rng = np.random.default_rng(seed)

    def check(self) -> None:
        from .targets.ascend import verify

        shape, op = check_shape(self.shape), self.kernel.op
        if op.kind == "paged_attention":
            inputs = testing.attention_inputs(op, self.rng, shape.kv_lens(), shape.q_lens())
            err = verify.attention_error(self.kernel, inputs, verify.run_attention(self.fn, inputs))
            tol = testing.tolerance(op.q_dtype, op.kv_dtype)
            if not err <= tol:
                raise AssertionError(f"max |out - reference| = {err:.3g} > {tol:g}")
            return
        T = shape.num_tokens
        got, want = verify.run_inplace(self.fn, testing.reshape_and_cache_inputs(op, self.rng, T,
                                                                                  -(-T // op.page_size) + 4))
        bad = [k for k in got if not np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8))]
        if bad:
            raise AssertionError(f"{bad} differ from the reference")

    def sample(self, calls: int = 1) -> float:
        raise NotImplementedError("the AscendC emulator is not timed: its speed says nothing of the NPU's")


def space(target: str, device=0, kernel_dir=None):
    """The space of target on a CUDA device (the cuda spaces'); kernel_dir: tvm-cuda's folder of prebuilt
    libraries (TVMCUDASpace), for a GPU machine without TVM."""
    if kernel_dir is not None and target != "tvm-cuda":
        raise ValueError(f"kernel_dir is a folder of prebuilt TVM-CUDA kernels: target tvm-cuda, not {target!r}")
    if target == "ascend":
        return AscendSpace()
    if target == "cpu":
        return CPUSpace()
    if target == "cuda":
        return CUDASpace(device)
    if target == "tvm-cuda":
        return TVMCUDASpace(device, kernel_dir)
    raise ValueError(f"target must be one of {SPACES}, got {target!r}")


__all__ = ["SPACES", "CPUSpace", "CUDASpace", "TVMCUDASpace", "AscendSpace", "space", "check_shape", "tvm_cuda_kernel", "tvm_cuda_plan"]
