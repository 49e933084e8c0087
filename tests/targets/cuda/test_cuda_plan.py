"""targets/cuda/plan.py without a GPU: the split rule and the built-in config on the production shapes (an H200:
sm_90, 132 SMs; an A100-like sm_80 beside it), plan()'s argument checks, and the Workspace's buffers (on the CPU)."""
from __future__ import annotations

import pytest

from uacompile import IRError, ir
from uacompile.targets.cuda.config import AttentionConfig
from uacompile.targets.cuda.layout import H200_SMS, layout
from uacompile.targets.cuda.plan import Workspace, choose_config, choose_splits, plan

PA = ir.PagedAttention
LLAMA = PA(32, 8, 128, 16, "bf16", "bf16")  # Hq 32, Hkv 8, D 128, page 16: the benchmarks' shape


def config(T, S, L, op=LLAMA, arch="sm_90", **kw):
    return choose_config(op, T, S, L, H200_SMS, arch, **kw)


def test_decode_step_takes_the_decode_only_kernel_split_and_fused():
    """8 sequences x 16384 (a decode step): 4 splits merged in the same launch, decode-only, no item queue."""
    assert config(8, 8, 16384) == AttentionConfig(num_splits=4, fused_merge=True, decode_only=True)


def test_prefill_takes_one_split_and_the_item_queue_on_hopper():
    """4 prompts x 4096 (16384 tokens): enough tiles to fill the GPU, one split; the Hopper path's item queue."""
    assert config(4 * 4096, 4, 4096) == AttentionConfig(item_queue=True)
    assert config(4 * 4096, 4, 4096, arch="sm_80") == AttentionConfig()  # the mma.sync path: one item a block
    assert not config(4 * 4096, 4, 4096, op=LLAMA.replace(kv_dtype="int8")).item_queue  # 8-bit KV: mma.sync
    assert config(4 * 4096, 4, 4096, op=LLAMA.replace(page_size=1)).item_queue  # pages of any size: Hopper path


def test_one_long_sequence_takes_more_splits():
    one = config(1, 1, 32768)
    assert one.num_splits > config(8, 8, 16384).num_splits and one.fused_merge and one.decode_only
    assert one.num_splits % layout(LLAMA, AttentionConfig(decode_only=True)).decode_groups == 0


def test_unified_masked_runs_one_split():
    assert config(1, 1, 32768, op=LLAMA.replace(variant="unified_masked")).num_splits == 1
    assert choose_splits(LLAMA.replace(variant="unified_masked"), AttentionConfig(), 1, 1, 32768) == 1


def test_mixed_step_runs_the_mixed_kernel():
    """More tokens than sequences (a prefill chunk beside decode tokens): not decode-only, item queue on Hopper."""
    c = config(40, 4, 4096)
    assert not c.decode_only and c.item_queue and c.num_splits == choose_splits(LLAMA, AttentionConfig(), 40, 4, 4096)


def test_explicit_split_counts_and_the_two_launch_merge():
    assert config(8, 8, 16384, num_splits=7) == AttentionConfig(num_splits=7, fused_merge=True, decode_only=True)
    assert config(8, 8, 16384, num_splits=7, fused_merge=False) == AttentionConfig(num_splits=7, decode_only=True)
    assert config(8, 8, 16384, num_splits=1) == AttentionConfig(decode_only=True)  # one split: nothing to merge
    assert config(100, 4, 4096, num_splits=4, fused_merge=False) == AttentionConfig(num_splits=4, item_queue=True)
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="num_splits"):
            config(8, 8, 16384, num_splits=bad)


# sm_80: an A100's 164 KB an SM hold half of Hopper's decode slots
@pytest.mark.parametrize("arch, rows", [("sm_90", [32, 4, 1, 1, 1]), ("sm_80", [16, 2, 1, 1, 1])])
def test_decode_split_counts_on_the_bench_rows(arch, rows):
    shapes = [(1, 32768), (8, 16384), (32, 4096), (128, 1024), (1, 300)]
    assert [config(T, T, L, arch=arch).num_splits for T, L in shapes] == rows


def test_split_choice_fills_the_gpu():
    op, mixed = LLAMA, AttentionConfig()
    assert choose_splits(op, mixed, 1, 1, 32768) >= 16  # one long sequence: many splits
    assert choose_splits(op, mixed, 128, 128, 1024) == 1  # enough blocks already
    assert choose_splits(op, mixed, 8, 8, 16384) > 1
    assert choose_splits(op, mixed, 1, 1, 300) == 1  # too short to split
    assert choose_splits(op, mixed, 0, 0, 300) == 1  # an empty step
    for cfg in (mixed, AttentionConfig(decode_only=True)):
        lay = layout(op, cfg)
        slots = H200_SMS * lay.blocks_per_sm * lay.decode_groups
        for T, L in [(1, 32768), (8, 16384), (32, 4096)]:
            s = choose_splits(op, cfg, T, T, L)
            assert T * op.num_kv_heads * s <= 2 * slots


def test_window_caps_the_split_length():
    """A sliding window sees at most `window` positions: split like a sequence that long."""
    assert config(1, 1, 32768, op=LLAMA.replace(window=512)).num_splits == config(1, 1, 512).num_splits


def test_plan_checks_its_arguments_before_the_device():
    with pytest.raises(TypeError, match="PagedAttention"):
        plan(ir.MergeState(num_heads=8, head_dim=128, num_splits=2), 1, 1, 16)
    for name, args in (("num_tokens", (-1, 1, 16)), ("num_seqs", (1, 1.0, 16)), ("max_kv_len", (1, 1, True))):
        with pytest.raises(ValueError, match=name):
            plan(LLAMA, *args)
    with pytest.raises(IRError, match="head_dim"):
        plan(LLAMA.replace(head_dim=72), 1, 1, 16)
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="CUDA device"):
        plan(LLAMA, 1, 1, 16, device="cpu")


def test_workspace_grows_never_shrinks_and_zeroes_its_counters():
    """Plans carve their buffers from the front of one allocation each: a smaller request is a view of what a
    larger one allocated (plans sharing a Workspace share memory), a larger one reallocates."""
    torch = pytest.importorskip("torch")
    ws = Workspace("cpu")
    o, lse = ws.partials(4, 8, 32, 128)
    assert o.shape == (4, 8, 32, 128) and lse.shape == (4, 8, 32) and o.dtype == lse.dtype == torch.float32
    assert lse.data_ptr() == o.data_ptr() + o.numel() * 4  # lse right after o in the one buffer
    o2, _ = ws.partials(2, 3, 32, 128)
    assert o2.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()
    big, _ = ws.partials(8, 8, 32, 128)
    assert big.numel() == 8 * 8 * 32 * 128 and big.untyped_storage().data_ptr() != o.untyped_storage().data_ptr()
    c = ws.counters(16, 8)
    assert c.shape == (16, 8) and c.dtype == torch.int32 and not c.any()
    assert ws.counters(4, 8).data_ptr() == c.data_ptr()
    q = ws.item_queue()
    assert q.shape == (2,) and q.dtype == torch.int32 and not q.any() and ws.item_queue().data_ptr() == q.data_ptr()
