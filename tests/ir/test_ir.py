import cffi
import numpy as np
import pytest

from uacompile import IRError, reference as R, testing as U
from uacompile.ir import (DTYPES, OPS, CopyBlocks, Kernel, MergeState, PagedAttention, ReshapeAndCache, SwapBlocks,
                          TensorSpec, c_signature, cffi_cdef, describe, from_torch, itemsize, op_from_dict, torch_dtype)
from uacompile.lower.config import TVMConfig
from uacompile.program import Program, dead_op_elimination, run_reference, validate

EXAMPLES = [PagedAttention(32, 8, 128, 16, "bf16", "bf16"), PagedAttention(8, 4, 8, 16, "fp32", "fp32"),
            PagedAttention(8, 2, 64, 16, "fp16", "int8", alibi=True), PagedAttention(8, 2, 64, 16, "fp16", "fp16", return_lse=True),
            ReshapeAndCache(8, 128, 16, "bf16", "fp8_e4m3", rope=True), CopyBlocks(8, 128, 16, "int8"),
            SwapBlocks(8, 128, 16, "bf16"), MergeState(32, 128, 8, "bf16", return_lse=True)]


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_q_heads=32, num_kv_heads=5, head_dim=128), "paged_attention.num_q_heads"),
    (dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=12), "paged_attention.page_size"),
    (dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=512), "paged_attention.page_size"),
    (dict(num_q_heads=-1, num_kv_heads=8, head_dim=128), "paged_attention.num_q_heads"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=0), "paged_attention.head_dim"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=64, q_dtype="int8"), "paged_attention.q_dtype"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=64, q_dtype="fp16", kv_dtype="bf16"), "paged_attention.kv_dtype"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=64, window=-3), "paged_attention.window"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=64, softcap=float("nan")), "paged_attention.softcap"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=64, scale=0.0), "paged_attention.scale"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=64, variant="dense"), "paged_attention.variant"),
    (dict(num_q_heads=8, num_kv_heads=8, head_dim=64, alibi="False"), "paged_attention.alibi"),
])
def test_invalid_attention_names_field(kwargs, field):
    with pytest.raises(IRError) as e:
        PagedAttention(**kwargs)
    assert e.value.field == field and field in str(e.value)


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_splits=0), "TVMConfig.num_splits"), (dict(num_splits=True), "TVMConfig.num_splits"),
    (dict(fused_merge=True), "TVMConfig.fused_merge"), (dict(num_splits=2, fused_merge=1), "TVMConfig.fused_merge"),
])
def test_invalid_split_config_names_field(kwargs, field):
    with pytest.raises(IRError) as e:
        TVMConfig(**kwargs)
    assert e.value.field == field


def test_schedule_fields_are_not_the_ops():
    """How a kernel runs is its config: the op has no split fields, and the kernel hashes both halves."""
    with pytest.raises(TypeError):
        PagedAttention(8, 8, 64, num_splits=2)
    op = PagedAttention(8, 8, 64)
    one, split = Kernel(op, TVMConfig()), Kernel(op, TVMConfig(num_splits=2))
    assert len({op.symbol(), one.symbol(), split.symbol()}) == 3
    assert Kernel(op, TVMConfig(num_splits=2)).symbol() == split.symbol()
    assert split.head_dim == 64 and split.params() == op.params(num_splits=2)


def test_invalid_cache_ops_name_field():
    with pytest.raises(IRError, match=r"reshape_and_cache.head_dim.*even"):
        ReshapeAndCache(8, 7, 16, "fp16", "fp16", rope=True)
    with pytest.raises(IRError, match=r"reshape_and_cache.kv_dtype"):
        ReshapeAndCache(8, 64, 16, "fp16", "bf16")
    with pytest.raises(IRError, match=r"copy_blocks.kv_dtype"):
        CopyBlocks(8, 64, 16, "fp64")
    with pytest.raises(IRError, match=r"swap_blocks.page_size"):
        SwapBlocks(8, 64, 3)
    with pytest.raises(IRError, match=r"x.dtype"):
        TensorSpec("x", "float99", (1,))
    with pytest.raises(IRError, match=r"x.shape"):
        TensorSpec("x", "fp16", (-1,))


@pytest.mark.parametrize("op", EXAMPLES, ids=lambda o: o.kind)
def test_dict_roundtrip_key_and_abi(op):
    assert op_from_dict(op.to_dict()) == op
    assert op_from_dict(op.to_dict()).key() == op.key()
    assert op.symbol().startswith(f"ua_{op.kind}_")
    ffi = cffi.FFI()
    ffi.cdef(cffi_cdef(op))  # the declaration the loader uses parses
    sig = c_signature(op)
    assert sig.count("void*") == len(op.tensors()) and sig.count("int64_t") == len(op.sizes())
    assert sig.endswith("cudaStream_t stream)")
    assert f"`{op.params()[0].name}`" in describe(op)


def test_keys_differ_between_variants():
    keys = {op.key() for op in EXAMPLES}
    assert len(keys) == len(EXAMPLES)
    assert PagedAttention(8, 8, 64).key() != PagedAttention(8, 8, 64, window=4).key()


def test_op_from_dict_rejects_unknown():
    with pytest.raises(IRError, match="op"):
        op_from_dict({"op": "conv2d"})
    with pytest.raises(IRError, match="paged_attention.heads"):
        op_from_dict({"op": "paged_attention", "heads": 3})
    assert set(OPS) == {"paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks", "merge_state", "rms_norm",
                        "silu_and_mul", "rope", "qkv_rope_cache", "quant_matmul", "dequantize", "quantize_rows",
                        "gather_tokens", "kv_score"}


def test_params_follow_options():
    names = lambda op: [p.name for p in op.params()]  # noqa: E731
    assert "k_scale" in names(PagedAttention(8, 8, 64, kv_dtype="int8"))
    assert "k_scale" not in names(PagedAttention(8, 8, 64))
    assert "alibi_slopes" in names(PagedAttention(8, 8, 64, alibi=True))
    split = lambda **c: Kernel(PagedAttention(8, 8, 64), TVMConfig(**c))  # noqa: E731
    assert names(split(num_splits=2))[-6:-4] == ["o_partial", "lse_partial"]
    assert names(split(num_splits=2, fused_merge=True))[-7:-4] == ["lse_partial", "split_counters", "out"]
    assert "lse" in names(PagedAttention(8, 8, 64, return_lse=True))
    assert "positions" in names(ReshapeAndCache(8, 64, rope=True))


def attention_program(window=0):
    p = Program()
    for n, dt, s in [("q", "bf16", ("T", 32, 128)), ("kc", "bf16", ("N", 16, 8, 128)), ("vc", "bf16", ("N", 16, 8, 128)),
                     ("ts", "int32", ("T",)), ("pt", "int32", ("S", "M")), ("tl", "int32", ("T",))]:
        p.add_tensor(n, dt, s)
    p.add_tensor("o", "bf16", ("T", 32, 128))
    p.add_op(PagedAttention(32, 8, 128, 16, "bf16", "bf16", window=window), q="q", k_cache="kc", v_cache="vc",
             token_seq="ts", page_table="pt", token_kv_len="tl", out="o")
    return validate(p)


def test_validate_rejects_mismatches():
    p = attention_program()
    p.add_tensor("bad_q", "fp16", ("T", 32, 128))
    with pytest.raises(IRError, match=r"\.q\.dtype"):
        p.add_op(PagedAttention(32, 8, 128, 16, "bf16", "bf16"), q="bad_q", k_cache="kc", v_cache="vc",
                 token_seq="ts", page_table="pt", token_kv_len="tl")
        validate(p)
    p = attention_program()
    p.add_tensor("q2", "bf16", ("T", 16, 128))
    p.add_op(PagedAttention(32, 8, 128, 16, "bf16", "bf16"), q="q2", k_cache="kc", v_cache="vc",
             token_seq="ts", page_table="pt", token_kv_len="tl")
    with pytest.raises(IRError, match=r"\.q\.shape"):
        validate(p)
    with pytest.raises(IRError, match="not bound"):
        attention_program().add_op(MergeState(32, 128, 2), out="o")
    with pytest.raises(IRError, match="written by several ops"):
        p = attention_program()
        p.add_op(PagedAttention(32, 8, 128, 16, "bf16", "bf16"), q="q", k_cache="kc", v_cache="vc",
                 token_seq="ts", page_table="pt", token_kv_len="tl", out="o")
        validate(p)


def test_dead_op_elimination_drops_unused_ops():
    p = attention_program()
    p.add_tensor("kv", "fp16", ("L", 2, "N", 16, 8, 128))
    p.add_tensor("map", "int64", ("K", 2))
    p.add_op(CopyBlocks(8, 128, 16, "fp16"), kv="kv", mapping="map")
    dead_op_elimination(p, ["o"])
    assert [p.op(o).kind for o in p.ops()] == ["paged_attention"]


def test_in_place_updates_are_versions():
    """reshape_and_cache updates the caches in place, attention reads them: the program stays
    acyclic, the write is ordered first, dead-op elimination keeps it, and the reference run
    matches running the two ops by hand."""
    rng = np.random.default_rng(0)
    write = ReshapeAndCache(2, 8, page_size=4, dtype="fp32", kv_dtype="fp32")
    attend = PagedAttention(4, 2, 8, 4, "fp32", "fp32")
    d = U.attention_inputs(attend, rng, [13, 6], [13, 6])
    T = d["num_tokens"]
    p = Program()
    for n in ("q", "k_cache", "v_cache", "token_seq", "page_table", "token_kv_len"):
        p.add_tensor(n, "int32" if n in ("token_seq", "page_table", "token_kv_len") else "fp32", d[n].shape)
    for n, shape, dt in [("k", (T, 2, 8), "fp32"), ("v", (T, 2, 8), "fp32"), ("slots", (T,), "int64")]:
        p.add_tensor(n, dt, shape)
    p.add_op(write, k="k", v="v", slot_mapping="slots", k_cache="k_cache", v_cache="v_cache")
    p.add_op(attend, q="q", k_cache="k_cache", v_cache="v_cache", token_seq="token_seq", page_table="page_table",
             token_kv_len="token_kv_len")
    out = p.graph.nodes[p.ops()[-1]]["bind"]["out"]
    validate(p)
    assert [p.op(o).kind for o in p.ops()] == ["reshape_and_cache", "paged_attention"]
    assert p.latest("k_cache") == f"k_cache@{p.ops()[0]}"
    dead_op_elimination(p, [out])
    assert len(p.ops()) == 2  # the cache write feeds the attention
    table = d["page_table"]
    slots = np.array([table[s, j // 4] * 4 + j % 4 for s, L in enumerate([13, 6]) for j in range(L)], np.int64)
    arrays = {k: v for k, v in d.items() if isinstance(v, np.ndarray)}
    arrays.update(k=rng.standard_normal((T, 2, 8)).astype(np.float32), v=rng.standard_normal((T, 2, 8)).astype(np.float32),
                  slots=slots)
    by_hand = {k: v.copy() for k, v in arrays.items()}
    got = run_reference(p, {k: v.copy() for k, v in arrays.items()})[out]
    R.reshape_and_cache(write, by_hand["k"], by_hand["v"], by_hand["slots"], by_hand["k_cache"], by_hand["v_cache"])
    want = R.paged_attention(attend, by_hand["q"], by_hand["k_cache"], by_hand["v_cache"], by_hand["token_seq"],
                             by_hand["page_table"], by_hand["token_kv_len"])[0]
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_dtype_table_names_resolve_with_its_sizes():
    """ir.DTYPES is the one dtype table: each entry's numpy and torch dtypes exist and hold its
    itemsize (fp8 travels as bytes in C and TIR), and from_torch inverts torch_dtype."""
    torch = pytest.importorskip("torch")
    for name, d in DTYPES.items():
        assert d.name == name
        assert d.numpy_dtype().itemsize == d.itemsize == itemsize(name)
        assert torch.empty((), dtype=torch_dtype(name)).element_size() == d.itemsize
        assert from_torch(torch_dtype(name)) == name
        assert d.c and d.tir
    assert DTYPES["fp8_e4m3"].c == "uint8_t" and DTYPES["fp8_e4m3"].tir == "uint8"
    assert from_torch(torch.uint8) == "uint8" and from_torch(torch.complex64) is None


def test_ir_never_imports_torch():
    import subprocess
    import sys

    code = "import sys, uacompile.ir as ir; ir.DTYPES['bf16'].numpy_dtype(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_kv_score_and_gather_tokens_fields():
    from uacompile.ir import GatherTokens, KVScore

    op = KVScore(8, 2, 64, 16, "bf16", "bf16", method="value_norm")
    assert op.group_size == 4 and [p.name for p in op.tensors()][-1] == "scores"
    with pytest.raises(IRError, match="kv_score.method"):
        KVScore(8, 2, 64, method="h2o")
    with pytest.raises(IRError, match="kv_score.kv_dtype"):
        KVScore(8, 2, 64, kv_dtype="int8")
    with pytest.raises(IRError, match="kv_score.num_q_heads"):
        KVScore(6, 4, 64)
    assert "scales" in [p.name for p in GatherTokens(8, 128, 16, "int8").tensors()]
    assert "scales" not in [p.name for p in GatherTokens(8, 128, 16, "bf16").tensors()]
