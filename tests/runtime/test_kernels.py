"""kernels.py's four KV calls on an 8-bit cache (KernelOps.for_model(kv_dtype=...)), on the CPU backends through the
runtime's torch tensors: K/V written with their scales read back within the quantisation step, tvm-cpu and the
reference backend agree bit for bit, attention over the quantised cache is attention over what it holds, and
copy_blocks / swap_blocks move the scales with the pages."""
import numpy as np
import pytest
import torch

from uacompile import ir, reference
from uacompile.runtime.kernels import KernelOps, make_backend

L, Hq, Hkv, D, P, N = 2, 8, 4, 8, 4, 12  # stories260K's attention shape, pages of 4
QUANT = ["int8", "fp8_e4m3"]


def ops(kv: str | None, dtype=torch.float32) -> KernelOps:
    return KernelOps.for_model(Hq, Hkv, D, P, dtype, kv_dtype=kv)


def caches(kv: str):
    dt = ir.torch_dtype(kv)
    return torch.zeros((L, 2, N, P, Hkv, D), dtype=dt), torch.zeros((L, 2, N, P, Hkv), dtype=torch.float32)


def dequant(kv: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return kv.float() * scales[..., None]


def test_for_model_builds_the_quantised_variants():
    o = ops("int8")
    assert o.quantized and o.kv_dtype == "int8"
    assert {op.kv_dtype for op in (o.attention, o.cache_write, o.copy, o.swap)} == {"int8"}
    assert o.attention.q_dtype == o.cache_write.dtype == "fp32"
    plain = ops(None, torch.float16)
    assert not plain.quantized and plain.kv_dtype == "fp16"


@pytest.mark.parametrize("kv", QUANT)
def test_written_kv_reads_back_within_the_quantisation_step(kv, rng):
    T = 10
    k = torch.from_numpy(rng.standard_normal((T, Hkv, D)).astype(np.float32)) * 3
    v = torch.from_numpy(rng.standard_normal((T, Hkv, D)).astype(np.float32))
    slots = torch.from_numpy(rng.permutation(N * P)[:T].astype(np.int64))
    got = {}
    for name in ("tvm-cpu", "reference"):
        backend = make_backend(name, ops(kv), "cpu")
        cache, scales = caches(kv)
        backend.reshape_and_cache(k=k, v=v, slot_mapping=slots, k_cache=cache[1, 0], v_cache=cache[1, 1],
                                  k_scale=scales[1, 0], v_scale=scales[1, 1])
        got[name] = cache, scales
    (c, s), (rc, rs) = got["tvm-cpu"], got["reference"]
    assert torch.equal(c.view(torch.uint8), rc.view(torch.uint8)) and torch.equal(s, rs)
    assert not c[0].view(torch.uint8).any() and not s[0].any()  # layer 0 untouched
    pages, offs = slots // P, slots % P
    for i, x in enumerate((k, v)):
        back = dequant(c[1, i], s[1, i])[pages, offs]
        amax = x.abs().amax(-1)
        assert torch.allclose(s[1, i][pages, offs], amax / ir.QMAX[kv])
        step = s[1, i][pages, offs][..., None] * (0.5 if kv == "int8" else 1.0)  # int8: half a unit; fp8: 2^-4 rel.
        bound = step if kv == "int8" else torch.maximum(x.abs() * 2.0 ** -4, step * 2.0 ** -9)
        assert ((back - x).abs() <= bound * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("kv", QUANT)
def test_attention_reads_the_quantised_cache(kv, rng):
    """Two sequences on scattered pages: attention on tvm-cpu and the reference backend matches float64
    attention over the dequantised cache, and stays near attention over the unquantised K/V."""
    lens, T = [7, 11], 18
    pages = rng.permutation(N)[:2 * 3].reshape(2, 3).astype(np.int32)
    table = torch.from_numpy(pages)
    k = torch.from_numpy(rng.standard_normal((T, Hkv, D)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((T, Hkv, D)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((T, Hq, D)).astype(np.float32))
    seq = torch.tensor([0] * lens[0] + [1] * lens[1], dtype=torch.int32)
    pos = torch.tensor(list(range(lens[0])) + list(range(lens[1])), dtype=torch.int64)
    slots = table[seq.long(), pos // P].long() * P + pos % P
    kv_len = (pos + 1).int()
    outs = {}
    for name in ("tvm-cpu", "reference"):
        backend = make_backend(name, ops(kv), "cpu")
        cache, scales = caches(kv)
        kc, vc, ks, vs = cache[0, 0], cache[0, 1], scales[0, 0], scales[0, 1]
        backend.reshape_and_cache(k=k, v=v, slot_mapping=slots, k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs)
        out = torch.empty_like(q)
        backend.paged_attention(q=q, k_cache=kc, v_cache=vc, token_seq=seq, page_table=table, token_kv_len=kv_len,
                                out=out, k_scale=ks, v_scale=vs)
        outs[name] = out
    plain = ops("fp32").attention
    want, _ = reference.paged_attention(plain, q.numpy(), dequant(kc, ks).numpy(), dequant(vc, vs).numpy(),
                                        seq.numpy(), pages, kv_len.numpy())
    exact = torch.zeros((N, P, Hkv, D)), torch.zeros((N, P, Hkv, D))
    exact[0][slots // P, slots % P], exact[1][slots // P, slots % P] = k, v
    unquant, _ = reference.paged_attention(plain, q.numpy(), exact[0].numpy(), exact[1].numpy(), seq.numpy(), pages,
                                           kv_len.numpy())
    for out in outs.values():
        np.testing.assert_allclose(out.numpy(), want, atol=2e-5)
        np.testing.assert_allclose(out.numpy(), unquant, atol=0.02 if kv == "int8" else 0.15)


@pytest.mark.parametrize("backend_name", ["tvm-cpu", "reference"])
@pytest.mark.parametrize("kv", QUANT)
def test_copy_and_swap_move_the_scales_with_the_pages(kv, backend_name, rng):
    backend = make_backend(backend_name, ops(kv), "cpu")
    cache, scales = caches(kv)
    cache.view(torch.uint8).copy_(torch.from_numpy(rng.integers(0, 120, cache.shape, dtype=np.uint8)))
    scales.copy_(torch.from_numpy(rng.random(scales.shape, dtype=np.float32)))
    src, dst = [3, 7], [5, 0]
    mapping = torch.tensor(list(zip(src, dst)), dtype=torch.int64)
    before_kv, before_s = cache.clone(), scales.clone()
    backend.copy_blocks(kv=cache, mapping=mapping, scales=scales)
    assert torch.equal(cache[:, :, dst].view(torch.uint8), before_kv[:, :, src].view(torch.uint8))
    assert torch.equal(scales[:, :, dst], before_s[:, :, src])
    host, host_s = torch.zeros((L, 2, 4, P, Hkv, D), dtype=cache.dtype), torch.zeros((L, 2, 4, P, Hkv))
    out = torch.tensor([[5, 2], [1, 0]], dtype=torch.int64)
    backend.swap_blocks(src=cache, dst=host, mapping=out, src_scales=scales, dst_scales=host_s)
    assert torch.equal(host[:, :, [2, 0]].view(torch.uint8), cache[:, :, [5, 1]].view(torch.uint8))
    assert torch.equal(host_s[:, :, [2, 0]], scales[:, :, [5, 1]])
    back = torch.tensor([[2, 9]], dtype=torch.int64)
    backend.swap_blocks(src=host, dst=cache, mapping=back, src_scales=host_s, dst_scales=scales)
    assert torch.equal(scales[:, :, 9], host_s[:, :, 2]) and torch.equal(scales[:, :, 9], before_s[:, :, 3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_quantize_rows_is_the_reference(dtype, rng):
    """TorchLayerOps.quantize_rows (FP8 weights' activations where no kernel runs them) gives ir.QuantizeRows'
    reference bytes and scales: ordinary, tiny and huge rows, a zero row, a row holding a NaN."""
    from uacompile.runtime.kernels import TorchLayerOps

    x = torch.from_numpy(rng.standard_normal((6, 96)).astype(np.float32))
    x *= torch.tensor([1.0, 1e-6, 3e4, 0.0, 1.0, 2.0])[:, None]
    x[4, 5] = float("nan")
    x = x.to(dtype)
    q, s = TorchLayerOps().quantize_rows(x)
    want_q, want_s = reference.run(ir.QuantizeRows(96, ir.from_torch(dtype)), x=x.float().numpy())
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (6,)
    assert np.array_equal(s.numpy(), want_s)
    got, want = q.view(torch.uint8).numpy(), np.asarray(want_q).view(np.uint8)
    nan = np.isnan(np.asarray(want_q).astype(np.float32))
    assert np.array_equal(got[~nan], want[~nan]) and np.isnan(q.float().numpy()[nan]).all() and nan.sum() == 1
