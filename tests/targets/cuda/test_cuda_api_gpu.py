"""GPU: the CUDA cache ops and merge_state against the numpy reference on fresh random
inputs (cache ops bit-exact, slot -1 included; outputs poisoned first), CUDA-graph capture
and replay, the current stream, and the call API's error messages. Run on the device:
`pytest -m gpu tests/targets/cuda/test_cuda_api_gpu.py`."""
from __future__ import annotations

import numpy as np
import pytest

from uacompile import ir, reference, testing
from uacompile.ir import numpy_dtype

from cuda_helpers import to_torch

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

R, C, S, M = ir.ReshapeAndCache, ir.CopyBlocks, ir.SwapBlocks, ir.MergeState
RESHAPE = [
    R(8, 128), R(8, 128, dtype="bf16", kv_dtype="bf16"), R(1, 64, page_size=1), R(2, 80, page_size=256),
    R(4, 96, dtype="bf16", kv_dtype="bf16", page_size=32), R(2, 256, page_size=8), R(4, 128, dtype="fp32", kv_dtype="fp32"),
    R(8, 128, kv_dtype="int8"), R(4, 80, dtype="bf16", kv_dtype="int8", page_size=64), R(2, 256, kv_dtype="int8", page_size=2),
    R(8, 128, kv_dtype="fp8_e4m3"), R(2, 96, dtype="bf16", kv_dtype="fp8_e4m3", page_size=128), R(1, 64, kv_dtype="fp8_e4m3", page_size=4),
    R(8, 8, kv_dtype="int8"), R(3, 7, kv_dtype="fp8_e4m3"),  # one lane per row (2 heads per lane group); odd sizes
]
RESHAPE_ROPE = [
    R(8, 128, rope=True), R(4, 80, dtype="bf16", kv_dtype="bf16", rope=True, rope_theta=1e6),
    R(2, 64, rope=True, rope_interleaved=True), R(4, 128, kv_dtype="int8", rope=True),
    R(2, 96, dtype="bf16", kv_dtype="fp8_e4m3", rope=True, rope_interleaved=True),
    # rotate-half without the paired-lane layout: 2 vectors per lane; 1-element vectors
    R(2, 256, dtype="fp32", kv_dtype="fp32", rope=True), R(2, 6, kv_dtype="int8", rope=True),
]
COPY = [C(8, 128), C(2, 80, page_size=256, kv_dtype="bf16"), C(1, 64, page_size=1, kv_dtype="int8"),
        C(4, 96, page_size=32, kv_dtype="fp8_e4m3"), C(2, 256, page_size=8, kv_dtype="fp32")]
SWAP = [S(8, 128), S(1, 64, page_size=1, kv_dtype="int8"), S(2, 96, page_size=128, kv_dtype="fp8_e4m3")]
MERGE = [M(32, 128, 2), M(8, 64, 16, out_dtype="bf16", return_lse=True), M(4, 80, 3, out_dtype="fp32", return_lse=True),
         M(16, 96, 7), M(2, 256, 33, return_lse=True)]


@pytest.fixture(scope="module", autouse=True)
def _built():
    """All variants of this file in one library per op kind (parallel nvcc runs)."""
    from uacompile.targets.cuda import api

    api.preload([*RESHAPE, *RESHAPE_ROPE, *COPY, *SWAP, *MERGE])


# ---------------------------------------------------------------- numpy <-> torch, bytes
def to_numpy(t, like: np.ndarray) -> np.ndarray:
    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy()
    return raw.view(like.dtype).reshape(like.shape)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str):
    g, w = np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8)
    bad = np.flatnonzero(g.reshape(-1) != w.reshape(-1))
    assert bad.size == 0, f"{what}: {bad.size} of {g.size} bytes differ (first at byte {bad[:5]})"


def poisoned(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device="cuda")
    t.view(torch.uint8).fill_(0xFF)  # NaN for floats: unwritten elements cannot pass
    return t


# ---------------------------------------------------------------- reshape_and_cache
def _run_reshape(op, rng, num_tokens, num_pages, skip_every=5):
    from uacompile.targets.cuda import api

    num_pages = max(num_pages, -(-2 * num_tokens // op.page_size))  # room for distinct slots
    inp = testing.reshape_and_cache_inputs(op, rng, num_tokens, num_pages, skip_every)
    want = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inp.items()}
    reference.reshape_and_cache(op, **{k: v for k, v in want.items() if not isinstance(v, int)})
    dev = {k: to_torch(v) for k, v in inp.items() if isinstance(v, np.ndarray)}
    api.kernel(op)(**dev)
    torch.cuda.synchronize()
    return inp, want, dev


def check_reshape(op, dev, want):
    """Whole caches compared (written slots match, every other slot untouched): bit for bit,
    except K with fused RoPE: device sin/cos may differ from libm in the last float64 bit,
    which very rarely flips a rounding of the stored dtype, so 1 row in 10^4 may differ."""
    names = ["v_cache"] + (["v_scale"] if op.quantized else [])
    if not op.rope:
        names += ["k_cache"] + (["k_scale"] if op.quantized else [])
    for name in names:
        assert_bits_equal(to_numpy(dev[name], want[name]), want[name], name)
    if not op.rope:
        return
    got_k = to_numpy(dev["k_cache"], want["k_cache"])
    rows = lambda a: a.view(np.uint8).reshape(*a.shape[:3], -1)  # noqa: E731
    rows_bad = np.any(rows(got_k) != rows(want["k_cache"]), axis=-1)
    assert rows_bad.mean() <= 1e-4, f"k_cache: {rows_bad.sum()} of {rows_bad.size} rows differ"
    if op.quantized:
        ks = to_numpy(dev["k_scale"], want["k_scale"])
        np.testing.assert_allclose(ks, want["k_scale"], rtol=1e-2)
        got, ref = reference.dequantize(got_k, ks), reference.dequantize(want["k_cache"], want["k_scale"])
    else:
        got, ref = reference.f64(got_k), reference.f64(want["k_cache"])
    np.testing.assert_allclose(got, ref, atol=testing.tolerance(op.dtype, op.kv_dtype) * 4)


@pytest.mark.parametrize("op", RESHAPE + RESHAPE_ROPE, ids=lambda o: f"{o.dtype}-{o.kv_dtype}-D{o.head_dim}-P{o.page_size}-H{o.num_kv_heads}{'-rope-' + ('gptj' if o.rope_interleaved else 'neox') if o.rope else ''}")
def test_reshape_and_cache(op, rng):
    inp, want, dev = _run_reshape(op, rng, num_tokens=257, num_pages=40)
    check_reshape(op, dev, want)


@pytest.mark.parametrize("op", [RESHAPE[0], RESHAPE[3], RESHAPE[7], RESHAPE[9], RESHAPE[11], RESHAPE[13], *RESHAPE_ROPE],
                         ids=lambda o: f"{o.dtype}-{o.kv_dtype}-D{o.head_dim}-H{o.num_kv_heads}{'-rope-' + ('gptj' if o.rope_interleaved else 'neox') if o.rope else ''}")
def test_reshape_and_cache_large_batch(op, rng):
    """Enough tokens for the launcher's big-task path (several heads per step, whole-token
    tasks with RoPE) and for several tasks per lane group (the load pipeline)."""
    inp, want, dev = _run_reshape(op, rng, num_tokens=8192, num_pages=8192 * 2 // op.page_size)
    check_reshape(op, dev, want)


def test_reshape_and_cache_all_padding_and_empty(rng):
    from uacompile.targets.cuda import api

    op = RESHAPE[0]
    inp = testing.reshape_and_cache_inputs(op, rng, 16, 8, skip_every=1)  # every slot -1
    dev = {k: to_torch(v) for k, v in inp.items() if isinstance(v, np.ndarray)}
    api.kernel(op)(**dev)
    empty = {k: (v[:0] if k in ("k", "v", "slot_mapping") else v) for k, v in dev.items()}
    api.kernel(op)(**empty)
    torch.cuda.synchronize()
    assert_bits_equal(to_numpy(dev["k_cache"], inp["k_cache"]), inp["k_cache"], "k_cache")


def test_reshape_and_cache_friendly_function(rng):
    from uacompile.targets.cuda import api

    op = RESHAPE[7]  # int8
    inp = testing.reshape_and_cache_inputs(op, rng, 64, 16)
    want = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inp.items()}
    reference.reshape_and_cache(op, **{k: v for k, v in want.items() if not isinstance(v, int)})
    d = {k: to_torch(v) for k, v in inp.items() if isinstance(v, np.ndarray)}
    api.reshape_and_cache(d["k"], d["v"], d["k_cache"], d["v_cache"], d["slot_mapping"], d["k_scale"], d["v_scale"])
    torch.cuda.synchronize()
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert_bits_equal(to_numpy(d[name], want[name]), want[name], name)


# ---------------------------------------------------------------- bench/reshape_sweep.py's design candidates
RESHAPE_LARGE = [RESHAPE[0], RESHAPE[3], RESHAPE[7], RESHAPE[9], RESHAPE[11], RESHAPE[13], *RESHAPE_ROPE]


def _sweep():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    import reshape_sweep

    return reshape_sweep


@pytest.fixture(scope="module")
def candidate_libraries():
    """{candidate: library of RESHAPE + RESHAPE_ROPE built with its knobs} (parallel nvcc, one process each)."""
    from uacompile.nvcc import default_arch

    sweep = _sweep()
    libs, failed = sweep.build_all([n for n in sweep.CANDIDATES if n != "default"], [*RESHAPE, *RESHAPE_ROPE], default_arch())
    assert not failed, failed
    return libs


@pytest.fixture(scope="module")
def reshape_references():
    """(op, tokens) -> inputs and the reference's outputs, computed once for all candidates."""
    rng = np.random.default_rng(20261130)
    refs = {}
    for op in RESHAPE + RESHAPE_ROPE:
        for tokens in (257, 8192) if op in RESHAPE_LARGE else (257,):
            num_pages = max(40 if tokens == 257 else 0, -(-2 * tokens // op.page_size))
            inp = testing.reshape_and_cache_inputs(op, rng, tokens, num_pages, 5)
            want = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inp.items()}
            reference.reshape_and_cache(op, **{k: v for k, v in want.items() if not isinstance(v, int)})
            refs[op, tokens] = inp, want
    return refs


@pytest.mark.parametrize("name", [n for n in _sweep().CANDIDATES if n != "default"])
def test_reshape_sweep_candidates_match_reference(candidate_libraries, reshape_references, name):
    """Every candidate of the sweep on the variant axes (dtypes, head sizes, pages, RoPE modes,
    slot -1), small and big-task batches, as the production kernel is checked above."""
    from uacompile.targets.cuda import api

    for (op, tokens), (inp, want) in reshape_references.items():
        dev = {k: to_torch(v) for k, v in inp.items() if isinstance(v, np.ndarray)}
        api.CudaKernel(_sweep().candidate_kernel(name, op), library=candidate_libraries[name])(**dev)
        torch.cuda.synchronize()
        try:
            check_reshape(op, dev, want)
        except AssertionError as e:
            raise AssertionError(f"{name} {op} T={tokens}: {e}") from None


# ---------------------------------------------------------------- copy_blocks / swap_blocks
@pytest.mark.parametrize("op", COPY, ids=lambda o: f"{o.kv_dtype}-D{o.head_dim}-P{o.page_size}-H{o.num_kv_heads}")
def test_copy_blocks_bit_exact(op, rng):
    from uacompile.targets.cuda import api

    inp = testing.copy_blocks_inputs(op, rng, num_layers=3, num_pages=32, num_pairs=11)
    want = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inp.items()}
    reference.copy_blocks(op, want["kv"], want["mapping"], want.get("scales"))
    dev = {k: to_torch(v) for k, v in inp.items() if isinstance(v, np.ndarray)}
    api.copy_blocks(dev["kv"], dev["mapping"], dev.get("scales"))
    torch.cuda.synchronize()
    for name in ("kv", "scales") if op.quantized else ("kv",):
        assert_bits_equal(to_numpy(dev[name], want[name]), want[name], name)


@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
@pytest.mark.parametrize("op", SWAP, ids=lambda o: f"{o.kv_dtype}-D{o.head_dim}-P{o.page_size}")
def test_swap_blocks_bit_exact(op, direction, rng):
    from uacompile.targets.cuda import api

    inp = testing.swap_blocks_inputs(op, rng, num_layers=2, num_src_pages=24, num_dst_pages=17, num_pairs=9)
    want = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inp.items()}
    reference.swap_blocks(op, want["src"], want["dst"], want["mapping"], want.get("src_scales"), want.get("dst_scales"))
    src_dev, dst_dev = direction[0] == "d", direction[2] == "d"
    dev = {}
    for k, v in inp.items():
        if isinstance(v, np.ndarray):
            on_dev = dst_dev if k.startswith("dst") else src_dev if k.startswith("src") else True
            dev[k] = to_torch(v, "cuda" if on_dev else "cpu", pinned=True)
    api.swap_blocks(dev["src"], dev["dst"], dev["mapping"], dev.get("src_scales"), dev.get("dst_scales"))
    torch.cuda.synchronize()
    for name in ("dst", "dst_scales") if op.quantized else ("dst",):
        assert_bits_equal(to_numpy(dev[name], want[name]), want[name], name)


# ---------------------------------------------------------------- merge_state
@pytest.mark.parametrize("op", MERGE, ids=lambda o: f"S{o.num_splits}-H{o.num_heads}-D{o.head_dim}-{o.out_dtype}")
def test_merge_state_matches_reference(op, rng):
    from uacompile.targets.cuda import api

    inp = testing.merge_state_inputs(op, rng, num_tokens=37, empty_fraction=0.3)
    inp["lse_partial"][:, 5] = -np.inf  # token 5: every split empty
    inp["o_partial"][:, 5] = 0
    ref_out, ref_lse = reference.merge_state(op, inp["o_partial"], inp["lse_partial"])
    tdt = ir.torch_dtype(op.out_dtype)
    out = poisoned((37, op.num_heads, op.head_dim), tdt)
    lse = poisoned((37, op.num_heads), torch.float32) if op.return_lse else None
    res = api.merge_state(to_torch(inp["o_partial"]), to_torch(inp["lse_partial"]), out, lse)
    torch.cuda.synchronize()
    got = (res[0] if op.return_lse else res).float().cpu().numpy()
    tol = testing.tolerance(op.out_dtype)
    np.testing.assert_allclose(got, ref_out, atol=tol * 2, rtol=tol)
    assert np.all(got[5] == 0)
    if op.return_lse:
        got_lse = lse.cpu().numpy()
        assert np.all(np.isneginf(got_lse[5])) and np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(got_lse[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- streams and CUDA graphs
def test_launches_on_current_stream(rng):
    from uacompile.targets.cuda import api

    op = COPY[0]
    inp = testing.copy_blocks_inputs(op, rng, num_layers=4, num_pages=64, num_pairs=30)
    want = inp["kv"].copy()
    reference.copy_blocks(op, want, inp["mapping"])
    kv, mapping = to_torch(inp["kv"]), to_torch(inp["mapping"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda._sleep(50_000_000)  # keep the default stream busy for ~25 ms
    with torch.cuda.stream(side):
        api.copy_blocks(kv, mapping)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()  # waits for side only: the copy must have been on it
    assert_bits_equal(to_numpy(kv, want), want, "kv")


def test_graph_capture_and_replay(rng):
    """Capture reshape_and_cache + copy_blocks + merge_state; refill the static inputs with fresh
    data; each replay must compute on the new data."""
    from uacompile.targets.cuda import api

    rop, cop, mop = RESHAPE[10], COPY[0], MERGE[1]
    T, pages = 48, 24
    r_in = testing.reshape_and_cache_inputs(rop, rng, T, pages)
    c_in = testing.copy_blocks_inputs(cop, rng, 2, 32, 7)
    m_in = testing.merge_state_inputs(mop, rng, 29)
    r = {k: to_torch(v) for k, v in r_in.items() if isinstance(v, np.ndarray)}
    c = {k: to_torch(v) for k, v in c_in.items() if isinstance(v, np.ndarray)}
    m = {k: to_torch(v) for k, v in m_in.items() if isinstance(v, np.ndarray)}
    out, lse = poisoned((29, mop.num_heads, mop.head_dim), torch.bfloat16), poisoned((29, mop.num_heads), torch.float32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (first launches load the modules) on a side stream, as torch recommends
        api.reshape_and_cache(r["k"], r["v"], r["k_cache"], r["v_cache"], r["slot_mapping"], r["k_scale"], r["v_scale"])
        api.copy_blocks(c["kv"], c["mapping"])
        api.merge_state(m["o_partial"], m["lse_partial"], out, lse)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        api.reshape_and_cache(r["k"], r["v"], r["k_cache"], r["v_cache"], r["slot_mapping"], r["k_scale"], r["v_scale"])
        api.copy_blocks(c["kv"], c["mapping"])
        api.merge_state(m["o_partial"], m["lse_partial"], out, lse)
    for _ in range(2):
        r_new = testing.reshape_and_cache_inputs(rop, rng, T, pages)
        c_new = testing.copy_blocks_inputs(cop, rng, 2, 32, 7)
        m_new = testing.merge_state_inputs(mop, rng, 29)
        c_new["mapping"] = c_in["mapping"]  # the page ids are captured by pointer too: keep them valid
        for src, dst in ((r_new, r), (c_new, c), (m_new, m)):
            for k, t in dst.items():
                t.copy_(to_torch(src[k]))
        out.view(torch.uint8).fill_(0xFF)
        graph.replay()
        torch.cuda.synchronize()
        want = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in r_new.items()}
        reference.reshape_and_cache(rop, **{k: v for k, v in want.items() if not isinstance(v, int)})
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            assert_bits_equal(to_numpy(r[name], want[name]), want[name], f"replay {name}")
        kv_want = c_new["kv"].copy()
        reference.copy_blocks(cop, kv_want, c_new["mapping"])
        assert_bits_equal(to_numpy(c["kv"], kv_want), kv_want, "replay kv")
        ref_out, _ = reference.merge_state(mop, m_new["o_partial"], m_new["lse_partial"])
        np.testing.assert_allclose(out.float().cpu().numpy(), ref_out, atol=3e-2, rtol=1.6e-2)


# ---------------------------------------------------------------- error messages on the device
def test_launch_errors_are_named():
    """A launcher's CUDA error code comes back with CUDA's name for it, not 'unknown'."""
    from uacompile.targets.cuda.api import _error_name

    assert "invalid argument" in _error_name(1).lower()
    assert "memory" in _error_name(2).lower()


def test_errors_name_the_argument():
    from uacompile.targets.cuda import api

    kern = api.kernel(MERGE[0])
    o, l = torch.zeros(2, 3, 32, 128, device="cuda"), torch.zeros(2, 3, 32, device="cuda")
    out = torch.empty(3, 32, 128, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match=r"merge_state\.out: must be a CUDA tensor, got device cpu"):
        kern(o_partial=o, lse_partial=l, out=out.cpu())
    with pytest.raises(TypeError, match=r"merge_state\.lse_partial: expected dtype torch\.float32, got torch\.float16"):
        kern(o_partial=o, lse_partial=l.half(), out=out)
    misaligned = torch.empty(3 * 32 * 128 + 1, dtype=torch.float16, device="cuda")[1:].view(3, 32, 128)
    with pytest.raises(ValueError, match=r"merge_state\.out: data must be 16-byte aligned"):
        kern(o_partial=o, lse_partial=l, out=misaligned)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match=r"merge_state\.out: on cuda:1"):
            kern(o_partial=o, lse_partial=l, out=out.to("cuda:1"))
    with pytest.raises(TypeError, match=r"copy_blocks: scales is required"):
        api.copy_blocks(torch.zeros(1, 2, 4, 16, 1, 64, dtype=torch.int8, device="cuda"),
                        torch.zeros(1, 2, dtype=torch.int64, device="cuda"))
    with pytest.raises(TypeError, match=r"swap_blocks\.dst: expected dtype torch\.float16, got torch\.bfloat16"):
        src = torch.zeros(1, 2, 4, 16, 8, 128, dtype=torch.float16, device="cuda")
        api.swap_blocks(src, src.bfloat16(), torch.zeros(1, 2, dtype=torch.int64, device="cuda"))
