"""Run emulator builds against the numpy reference (used by build_and_verify and the tests).

Outputs are poisoned (NaN / 0xFF) before every launch; attention is compared within the
dtype tolerance of uacompile.testing, cache ops bit for bit (including untouched slots).
"""
from __future__ import annotations

import numpy as np

from uacompile import reference, testing
from uacompile.ir import OpSpec, numpy_dtype

from .runner import EmulatedKernel


def poisoned(dtype: str, shape) -> np.ndarray:
    a = np.empty(shape, numpy_dtype(dtype))
    a.view(np.uint8)[...] = 0xFF  # NaN for every float type, -1 for ints
    return a


def run_attention(kernel: EmulatedKernel, inputs: dict) -> dict:
    """Launch paged attention on inputs (testing.attention_inputs); returns the outputs."""
    outs = {p.name: poisoned(p.dtype, tuple(inputs[d] if isinstance(d, str) else d for d in p.shape))
            for p in kernel.op.tensors() if p.role == "out"}
    kernel(**inputs, **outs)
    return outs


def attention_error(op, inputs: dict, outs: dict) -> float:
    """Largest |kernel - reference| over out (and lse) or the split partials."""
    args = {k: v for k, v in inputs.items() if not isinstance(v, int)}
    ref_o, ref_lse = reference.run(op, **args)
    if "o_partial" in outs:
        got_o, got_lse = outs["o_partial"], outs["lse_partial"]
    else:
        got_o, got_lse = outs["out"], outs.get("lse")
    err = float(np.max(np.abs(reference.f64(got_o) - ref_o))) if got_o.size else 0.0
    if got_lse is not None:
        got, ref = reference.f64(got_lse), ref_lse
        if not np.array_equal(np.isneginf(got), np.isneginf(ref)):
            return float("inf")
        fin = np.isfinite(ref)
        if fin.any():
            err = max(err, float(np.max(np.abs(got[fin] - ref[fin]))))
    return err if np.all(np.isfinite(reference.f64(got_o))) else float("inf")


def aligned_copy(a: np.ndarray, align: int = 64) -> np.ndarray:
    """A copy of a whose data starts on an `align`-byte boundary (aclrtMemcpyAsync wants 64 B)."""
    raw = np.empty(a.nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def run_inplace(kernel: EmulatedKernel, inputs: dict) -> tuple[dict, dict]:
    """Cache ops work in place: run the kernel and the reference on separate copies (64-byte
    aligned, as device and pinned host memory are); returns (kernel arrays, reference arrays)
    of the in/out tensors."""
    op = kernel.op
    mine = {k: (aligned_copy(v) if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    theirs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    kernel(**mine)
    reference.run(op, **{k: v for k, v in theirs.items() if not isinstance(v, int)})
    inout = [p.name for p in op.tensors() if p.role == "inout"]
    return {k: mine[k] for k in inout}, {k: theirs[k] for k in inout}


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _cases(op: OpSpec, rng) -> list[tuple[str, dict]]:
    P = getattr(op, "page_size", 16)
    if op.kind == "paged_attention":
        decode = [1, P - 1, P, P + 1, 3 * P + 5]
        return [(f"decode kv_lens={decode}", testing.attention_inputs(op, rng, decode)),
                ("prefill chunks + decode", testing.attention_inputs(op, rng, [P + 9, 2 * P + 3, 7], [P + 9, 6, 1]))]
    if op.kind == "reshape_and_cache":
        return [("37 tokens, every 5th slot -1", testing.reshape_and_cache_inputs(op, rng, 37, 6))]
    if op.kind == "copy_blocks":
        return [("2 layers, 5 pairs", testing.copy_blocks_inputs(op, rng, 2, 12, 5))]
    if op.kind == "swap_blocks":
        return [("2 layers, 6 pairs", testing.swap_blocks_inputs(op, rng, 2, 9, 14, 6))]
    raise ValueError(f"op: no emulator cases for {op.kind}")


def verify(kernel: EmulatedKernel, seed: int = 0) -> list[dict]:
    """Run an emulator build on fresh random inputs; one record per case."""
    op = kernel.op
    rng = np.random.default_rng(seed)
    results = []
    for name, inputs in _cases(op, rng):
        if op.kind == "paged_attention":
            err = attention_error(op, inputs, run_attention(kernel, inputs))
            tol = testing.tolerance(op.q_dtype, op.kv_dtype)
            results.append({"case": name, "max_abs_err": err, "tolerance": tol, "ok": err <= tol})
        else:
            got, want = run_inplace(kernel, inputs)
            same = all(bit_equal(got[k], want[k]) for k in got)
            results.append({"case": name, "exact": same, "ok": same})
    return results
