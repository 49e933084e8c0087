"""Generated AscendC kernels, run on the clean-room emulator, against the numpy reference.

One emulator build per kernel variant (cached), many shapes through it. Attention within
the dtype tolerance; cache ops bit-exact over the whole cache (slot -1 and every
untouched page included). Not run on NPU hardware.
"""
from __future__ import annotations

import numpy as np
import pytest

from uacompile import reference, testing
from uacompile.ir import CopyBlocks, Kernel, PagedAttention, ReshapeAndCache, SwapBlocks
from uacompile.targets.ascend.build import load
from uacompile.targets.ascend.config import AscendConfig
from uacompile.targets.ascend.runner import EmulatorError
from uacompile.targets.ascend.verify import attention_error, bit_equal, run_attention, run_inplace

# ---------------------------------------------------------------- attention
ATTENTION = {
    "mha-fp16-p16": PagedAttention(4, 4, 64, 16),
    "gqa-fp16-p128": PagedAttention(8, 2, 128, 128),
    "gqa-bf16-p16-lse": PagedAttention(8, 2, 64, 16, q_dtype="bf16", kv_dtype="bf16", return_lse=True),
    "gqa-fp16-int8kv-window": PagedAttention(8, 2, 64, 16, kv_dtype="int8", window=40),
    "gqa-bf16-p128-window-lse": PagedAttention(4, 1, 64, 128, q_dtype="bf16", kv_dtype="bf16", window=200,
                                               return_lse=True),
    "fp16-softcap-alibi-splits": Kernel(PagedAttention(4, 2, 32, 16, softcap=20.0, alibi=True), AscendConfig(num_splits=3)),
}


def _check(op, inputs):
    err = attention_error(op, inputs, run_attention(load(op), inputs))
    assert err <= testing.tolerance(op.q_dtype, op.kv_dtype), err


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_decode_page_edges(name, rng):
    op = ATTENTION[name]
    P = op.page_size
    _check(op, testing.attention_inputs(op, rng, [1, P - 1, P, P + 1, 3 * P + 5]))


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_prefill_chunks_mixed_with_decode(name, rng):
    op = ATTENTION[name]
    P = op.page_size
    # a whole prompt, the last chunk of a longer one, and two decodes, in one launch
    _check(op, testing.attention_inputs(op, rng, [P + 9, 2 * P + 3, 1, 127], [P + 9, 7, 1, 1]))


def test_attention_context_lengths_1_127_128_129(rng):
    for op in (ATTENTION["mha-fp16-p16"], ATTENTION["gqa-fp16-p128"]):
        for L in (1, 127, 128, 129):
            _check(op, testing.attention_inputs(op, rng, [L, L // 2 + 1]))


def test_attention_many_sequences_more_units_than_cores(rng):
    op = ATTENTION["gqa-fp16-int8kv-window"]
    kv_lens = list(rng.integers(1, 80, size=30))  # 30 tokens x 2 kv heads = 60 units > 48 cores
    _check(op, testing.attention_inputs(op, rng, kv_lens))


def test_attention_never_reads_past_the_page_table(rng):
    """The emulator bounds every GM access; a page table of exactly the needed width is enough."""
    op = ATTENTION["mha-fp16-p16"]
    inputs = testing.attention_inputs(op, rng, [33, 5])
    assert inputs["page_table"].shape[1] == 3
    _check(op, inputs)


def test_attention_detects_a_wrong_result(rng):
    """The comparison can fail: a perturbed cache after the launch shows up as an error."""
    op = ATTENTION["mha-fp16-p16"]
    inputs = testing.attention_inputs(op, rng, [20, 9])
    outs = run_attention(load(op), inputs)
    inputs["v_cache"] = (inputs["v_cache"].astype(np.float32) + 0.5).astype(np.float16)
    assert attention_error(op, inputs, outs) > 0.1


# ---------------------------------------------------------------- cache ops
RESHAPE = {
    "fp16": ReshapeAndCache(4, 64, 16),
    "bf16-p128": ReshapeAndCache(2, 128, 128, dtype="bf16", kv_dtype="bf16"),
    "fp16-unaligned-row": ReshapeAndCache(3, 40, 16),  # 240 B rows: the DataCopyPad path
    "int8-from-fp16": ReshapeAndCache(4, 64, 16, kv_dtype="int8"),
    "int8-from-bf16": ReshapeAndCache(2, 128, 128, dtype="bf16", kv_dtype="int8"),
    "int8-from-fp32": ReshapeAndCache(3, 40, 16, dtype="fp32", kv_dtype="int8"),
}


@pytest.mark.parametrize("name", sorted(RESHAPE))
def test_reshape_and_cache_bit_exact(name, rng):
    op = RESHAPE[name]
    for T, pages in ((1, 2), (37, 6), (64, 8)):
        inputs = testing.reshape_and_cache_inputs(op, rng, T, pages)
        assert (inputs["slot_mapping"] == -1).any() or T == 1
        got, want = run_inplace(load(op), inputs)
        for k in got:
            assert bit_equal(got[k], want[k]), (name, T, k)


def test_reshape_and_cache_int8_zero_rows_get_scale_one(rng):
    op = RESHAPE["int8-from-fp16"]
    inputs = testing.reshape_and_cache_inputs(op, rng, 8, 2, skip_every=0)
    inputs["k"][3] = 0
    got, want = run_inplace(load(op), inputs)
    for k in got:
        assert bit_equal(got[k], want[k]), k
    page, off = divmod(int(inputs["slot_mapping"][3]), op.page_size)
    assert (got["k_scale"][page, off] == 1.0).all()


COPY = {"fp16": CopyBlocks(4, 64, 16), "int8": CopyBlocks(2, 128, 128, kv_dtype="int8"),
        "odd-page": CopyBlocks(1, 24, 1)}  # 48 B pages: the DataCopyPad path


@pytest.mark.parametrize("name", sorted(COPY))
def test_copy_blocks_bit_exact_all_layers(name, rng):
    op = COPY[name]
    for layers, pages, pairs in ((1, 4, 1), (3, 20, 7)):
        got, want = run_inplace(load(op), testing.copy_blocks_inputs(op, rng, layers, pages, pairs))
        for k in got:
            assert bit_equal(got[k], want[k]), (name, k)


SWAP = {"fp16": SwapBlocks(4, 64, 16), "int8": SwapBlocks(2, 64, 128, kv_dtype="int8")}


@pytest.mark.parametrize("name", sorted(SWAP))
def test_swap_blocks_bit_exact_both_directions(name, rng):
    op = SWAP[name]
    for src_pages, dst_pages in ((9, 30), (30, 9)):  # "out" to a bigger pool, "in" to a smaller one
        got, want = run_inplace(load(op), testing.swap_blocks_inputs(op, rng, 2, src_pages, dst_pages, 6))
        for k in got:
            assert bit_equal(got[k], want[k]), (name, k)


def test_swap_plan_merges_consecutive_pages_into_runs(rng):
    kernel = load(SWAP["fp16"])
    mapping = np.array([[10, 1], [3, 7], [5, 9], [4, 8], [11, 2], [20, 0]], np.int64)
    runs = kernel.swap_plan(mapping, 32, 32)
    np.testing.assert_array_equal(runs, [[3, 7, 3], [10, 1, 2], [20, 0, 1]])
    inputs = testing.swap_blocks_inputs(kernel.op, rng, 3, 32, 32, 6)
    inputs["mapping"] = mapping
    got, want = run_inplace(kernel, inputs)
    assert bit_equal(got["dst"], want["dst"])


def test_swap_rejects_bad_mappings(rng):
    kernel = load(SWAP["fp16"])
    with pytest.raises(ValueError, match="mapping"):
        kernel.swap_plan(np.array([[0, 40]]), 8, 8)
    with pytest.raises(ValueError, match="destination repeats"):
        kernel.swap_plan(np.array([[0, 1], [2, 1]]), 8, 8)
    inputs = testing.swap_blocks_inputs(kernel.op, rng, 1, 8, 8, 2)
    inputs["mapping"] = np.array([[0, 1], [9, 2]], np.int64)
    with pytest.raises(EmulatorError, match="returned 3"):
        kernel(**inputs)


# ---------------------------------------------------------------- argument checks
def test_launcher_arguments_are_checked_by_name(rng):
    op = ATTENTION["mha-fp16-p16"]
    kernel = load(op)
    inputs = testing.attention_inputs(op, rng, [5])
    out = np.zeros((1, 4, 64), np.float16)
    with pytest.raises(TypeError, match="paged_attention.q: expected dtype float16, got float32"):
        kernel(**dict(inputs, q=inputs["q"].astype(np.float32)), out=out)
    with pytest.raises(ValueError, match=r"paged_attention\.out: dim 0 \(num_tokens\) is 2, but num_tokens = 1 from q"):
        kernel(**inputs, out=np.zeros((2, 4, 64), np.float16))
    with pytest.raises(TypeError, match="num_seqs"):
        kernel(**dict(inputs, num_seqs=1.0), out=out)
    with pytest.raises(TypeError, match="unexpected"):
        kernel(**inputs, out=out, bogus=1)


def test_out_of_range_slot_is_caught_by_the_emulator(rng):
    op = RESHAPE["fp16"]
    inputs = testing.reshape_and_cache_inputs(op, rng, 4, 2, skip_every=0)
    inputs["slot_mapping"][2] = 2 * op.page_size  # one past the cache
    with pytest.raises(EmulatorError, match="GM access"):
        load(op)(**inputs)


def test_reference_agrees_with_itself_on_poisoned_outputs(rng):
    """Sanity of the harness: an untouched poisoned output is reported as a failure."""
    op = ATTENTION["mha-fp16-p16"]
    inputs = testing.attention_inputs(op, rng, [3])
    outs = {"out": np.full((1, 4, 64), np.nan, np.float16)}
    assert attention_error(op, inputs, outs) == float("inf")
    ref, _ = reference.paged_attention(op, **{k: v for k, v in inputs.items() if not isinstance(v, int)})
    assert np.isfinite(ref).all()
