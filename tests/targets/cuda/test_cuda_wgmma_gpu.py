"""The Hopper prefill path (wgmma + TMA, targets/cuda/include/uacompile/paged_attention.cuh) against the
float64 reference on the GPU, over the shapes that stress it: long prompts (many tiles, the TMA
stages wrap around), chunks that start mid-sequence, many short sequences sharing one 64-row
tile (the stage barriers' phases carry across runs), and mixed ubatches. With item_queue (the
dynamic schedule, docs/attention-rationale.md, "The dynamic tile queue") min(items, SMs) persistent prefill blocks take
(tile, KV head, split group) items from an atomic queue behind every decode block of a 1-D grid;
further cases make every block take several items (the token-window ring and the stage tickets
carry across items), a very uneven ubatch (one 16K prompt and many short ones), split-KV with the
fused merge per item, mixed ubatches whose decode blocks fill several waves, graph replays and two
streams; each checks that the queue is zero again after the launch, and the big cases that the
dynamic schedule gives bit for bit what the static one (one item a block) does. Kernels are ops with their
AttentionConfig (ir.Kernel; cuda_helpers.pa_kernel). CPU tests below check which variants take the path and
that both archs render what they should.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from cuda_helpers import base_op, config_of, cuda_api_with, pa_kernel

from uacompile import ir, testing
from uacompile.targets.cuda import attention
from uacompile.targets.cuda.config import AttentionConfig
from uacompile.targets.cuda.layout import H200_SMS, dynamic_prefill, layout, prefill_items, uses_wgmma
from uacompile.targets.cuda.plan import choose_splits
from uacompile.targets.cuda.render import SM90A_MARKER, render_op

from test_cuda_attention_gpu import MIXED, check_close, device_inputs, reference_of, run_kernel, tol_of
from test_cuda_decode_gpu import fused, replay_on_fresh_inputs

torch = pytest.importorskip("torch")

PA = ir.PagedAttention
WG_CASES = {
    "bf16-d128-g4-p16": PA(32, 8, 128, 16, "bf16", "bf16"),
    "fp16-d64-g4-p16": PA(16, 4, 64, 16, "fp16", "fp16"),
    "bf16-d128-g1-p8": PA(4, 4, 128, 8, "bf16", "bf16"),
    "fp16-d128-g3-p32-lse": PA(12, 4, 128, 32, "fp16", "fp16", return_lse=True),
    "bf16-d128-g16-p256": PA(16, 1, 128, 256, "bf16", "bf16"),
    "bf16-d64-g8-p128-window-softcap": PA(16, 2, 64, 128, "bf16", "bf16", window=300, softcap=15.0),
    "fp16-d128-alibi-split3": pa_kernel(PA(8, 2, 128, 16, "fp16", "fp16", alibi=True), num_splits=3),
    # D 256: 64-position tiles, 2 TMA stages, one cp.async stage a decode group (Gemma-2's soft-cap and window)
    "bf16-d256-g2-p16": PA(16, 8, 256, 16, "bf16", "bf16"),
    "fp16-d256-g2-p32-window-softcap-split3": pa_kernel(PA(8, 4, 256, 32, "fp16", "fp16", window=300, softcap=50.0),
                                                        num_splits=3),
    # D 80 and 96: rows padded to 128 columns in shared memory (TMA zero-fills them; S reads D columns)
    "bf16-d96-g1-p16": PA(8, 8, 96, 16, "bf16", "bf16"),
    "fp16-d80-g4-p32-window-softcap-split3": pa_kernel(PA(16, 4, 80, 32, "fp16", "fp16", window=300, softcap=30.0),
                                                       num_splits=3),
    # pages under 8 positions: the cp.async producer (two warps each for K and V; 1 and 2: several pages a lane)
    "bf16-d128-g4-p1": PA(32, 8, 128, 1, "bf16", "bf16"),
    "fp16-d64-g2-p2-window-softcap-split3": pa_kernel(PA(8, 4, 64, 2, "fp16", "fp16", window=300, softcap=20.0),
                                                      num_splits=3),
    "bf16-d256-g2-p4": PA(8, 4, 256, 4, "bf16", "bf16"),
    "fp16-d96-g1-p1-lse": PA(4, 4, 96, 1, "fp16", "fp16", return_lse=True),
}
SHAPES = {
    "long": dict(kv_lens=[700, 1100], q_lens=[700, 1100]),
    "chunks": dict(kv_lens=[700, 1300, 90], q_lens=[200, 77, 90]),
    "many-short": dict(kv_lens=[3, 5, 2, 7, 11, 40, 1, 9, 33], q_lens=[3, 5, 2, 7, 11, 40, 1, 9, 33]),
    "mixed": MIXED,
}


# the dynamic schedule: ops (with lse) for the many-item, split-KV and mixed cases; D 128 runs 3 TMA stages,
# D 64 six; G 3 makes 42-token tiles, G 1 128-token ones (the largest token windows). The mixed, graph and
# stream cases take D 64 (a quarter of the reference's work).
DYNAMIC = {
    "bf16-d128-g4-p16": WG_CASES["bf16-d128-g4-p16"].replace(return_lse=True),
    "fp16-d64-g4-p16": WG_CASES["fp16-d64-g4-p16"].replace(return_lse=True),
    "fp16-d128-g3-p32": WG_CASES["fp16-d128-g3-p32-lse"],
    "bf16-d128-g1-p8": WG_CASES["bf16-d128-g1-p8"].replace(return_lse=True),
    "bf16-d256-g2-p16": WG_CASES["bf16-d256-g2-p16"].replace(return_lse=True),
    "bf16-d96-g1-p16": WG_CASES["bf16-d96-g1-p16"].replace(return_lse=True),
    "bf16-d128-g4-p1": WG_CASES["bf16-d128-g4-p1"].replace(return_lse=True),
}
DYNAMIC_SPLITS = (3, 16)  # 3: a split group of one split (odd count); 16: 8 split groups an item
SMALL = DYNAMIC["fp16-d64-g4-p16"]
PRODUCTION = DYNAMIC["bf16-d128-g4-p16"]  # the benchmarks' shape: also built static, for bit-for-bit comparisons


def dyn(op):
    """op's kernel (an op or kernel) with the item queue."""
    return pa_kernel(op, item_queue=True)


def items(op, num_tokens: int) -> int:
    """Prefill work items of a launch of op's kernel (an op: the default config) on sm_90."""
    kernel = pa_kernel(op)
    return prefill_items(kernel.op, kernel.config, num_tokens)


def _all_ops():
    """Every kernel the module launches (paged_attention() included), built at once: 10 beside WG_CASES."""
    ops = list(WG_CASES.values()) + [dyn(op) for op in DYNAMIC.values()] + [PRODUCTION, fused(PRODUCTION, 3)]
    ops += [dyn(fused(op, s)) for op in (PRODUCTION, SMALL) for s in DYNAMIC_SPLITS]
    return list(dict.fromkeys(map(pa_kernel, ops)))


@pytest.fixture(scope="module")
def api():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma path is for sm_90")
    return cuda_api_with(_all_ops())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(WG_CASES))
def test_wgmma_prefill_matches_reference(api, rng, name, shape):
    op = WG_CASES[name]
    assert uses_wgmma(base_op(op), config_of(pa_kernel(op)))
    inputs, outs = run_kernel(api, op, rng, **SHAPES[shape])
    ref_out, ref_lse = reference_of(op, inputs)
    tol = tol_of(op)
    if config_of(pa_kernel(op)).num_splits > 1:
        check_close(f"{name}.o_partial", outs["o_partial"], ref_out, tol)
        check_close(f"{name}.lse_partial", outs["lse_partial"], ref_lse, 2 * tol)
        return
    check_close(f"{name}.out", outs["out"], ref_out, tol)
    if op.return_lse:
        check_close(f"{name}.lse", outs["lse"], ref_lse, 2 * tol)


# ---------------------------------------------------------------- the dynamic schedule (item_queue)
def num_sms():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


_cases: dict = {}


def cached_case(key, op, make_lens, reference_of_all=True):
    """(inputs, reference (out, lse) or None) of one shape, drawn once per module (fixed seed): the
    split counts of a case share its unsplit reference, the slow part."""
    if key not in _cases:
        rng = np.random.default_rng(zlib.crc32(key.encode()))
        inputs = testing.attention_inputs(op, rng, *make_lens(rng))
        ref = reference_of(base_op(op), inputs) if reference_of_all else None
        _cases[key] = inputs, ref
    return _cases[key]


def launch(api, op, inputs, queue=None, counters=None):
    """One launch of op's kernel (an op: the default config) on poisoned outputs (out and lse, or the partials):
    {name: tensor}, with the item queue and split counters it ran on (fresh zeros unless given)."""
    op = pa_kernel(op)
    dev = device_inputs(op, inputs)
    T = inputs["num_tokens"]
    outs = {p.name: torch.full([T if d == "num_tokens" else d for d in p.shape], float("nan"),
                               dtype=torch.float32 if p.dtype == "fp32" else dev["q"].dtype, device="cuda")
            for p in op.tensors() if p.role == "out"}
    if op.config.item_queue:
        outs["item_queue"] = torch.zeros(2, dtype=torch.int32, device="cuda") if queue is None else queue
    if op.config.fused_merge:
        outs["split_counters"] = (torch.zeros((T, op.num_kv_heads), dtype=torch.int32, device="cuda")
                                  if counters is None else counters)
    api.kernel(op)(**dev, **outs)
    torch.cuda.synchronize()
    assert not outs.get("item_queue", torch.zeros(1)).any(), "the item queue must be zero after the launch"
    assert not outs.get("split_counters", torch.zeros(1)).any(), "the split counters must be zero after the launch"
    return outs


def check_case(name, op, outs, ref):
    tol = tol_of(op)
    check_close(f"{name}.out", outs["out"], ref[0], tol)
    if "lse" in outs:
        check_close(f"{name}.lse", outs["lse"], ref[1], 2 * tol)


def assert_same(name, got, want):
    """Bit for bit: an item computes the same whichever block takes it, and the merge reads the
    splits in one order."""
    for k in want:
        if k not in ("item_queue", "split_counters"):
            assert torch.equal(got[k].view(torch.int32 if got[k].element_size() == 4 else torch.int16),
                               want[k].view(torch.int32 if want[k].element_size() == 4 else torch.int16)), f"{name}.{k} differs"


def prompts_for_items(op, blocks_items: int):
    """kv_lens, q_lens of short whole prompts and a last chunk (the end of a longer sequence) with
    enough tokens that the launch has blocks_items prefill items a persistent block."""
    def make(rng):
        kv_lens, q_lens = [], []
        while items(op, sum(q_lens)) < blocks_items * num_sms():
            n = int(rng.integers(20, 200))
            kv_lens.append(n), q_lens.append(n)
        kv_lens[-1] += 150
        return kv_lens, q_lens
    return make


def many_decodes_mixed(decodes: int, prompts=(300, 64), chunk=(500, 150)):
    """`decodes` lone tokens (kv 1..600) around whole prompts and a chunk (kv, q): kv_lens, q_lens."""
    def make(rng):
        kv = rng.integers(1, 600, size=decodes).tolist()
        half = decodes // 2
        return (kv[:half] + [*prompts, chunk[0]] + kv[half:],
                [1] * half + [*prompts, chunk[1]] + [1] * (decodes - half))
    return make


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(DYNAMIC))
def test_dynamic_blocks_take_several_items(api, name):
    """At least 3 items a block: each block reuses both token-window slots, and its producers' tile
    tickets (and the stages' barrier phases) run on across items and runs; the same bits as one
    item a block."""
    op = DYNAMIC[name]
    inputs, ref = cached_case(f"items/{name}", op, prompts_for_items(op, 3))
    assert items(op, inputs["num_tokens"]) >= 3 * num_sms()
    outs = launch(api, dyn(op), inputs)
    check_case(name, op, outs, ref)
    if op == PRODUCTION:
        assert_same(name, outs, launch(api, op, inputs))


def sample_reference(op, inputs, tokens):
    """The float64 reference of some tokens only (each token's attention depends on its own row)."""
    idx = np.asarray(tokens)
    sub = dict(inputs, q=inputs["q"][idx], token_seq=inputs["token_seq"][idx], token_kv_len=inputs["token_kv_len"][idx])
    return reference_of(base_op(op), sub)


def one_long_among_short(rng):
    """Whole prompts: 60 of 20-300 tokens with one of 16384 in their middle (kv_lens = q_lens)."""
    lens = rng.integers(20, 300, size=60).tolist()
    lens = lens[:30] + [16384] + lens[30:]
    return lens, lens


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_dynamic_uneven_prompts(api, splits):
    """One 16K prompt among 60 short ones (the static schedule's worst case): bit for bit what one
    item a block gives, and the float64 reference on sampled rows (the long prompt's first, middle
    and heaviest tokens, short prompts)."""
    op = fused(PRODUCTION, splits)
    inputs, _ = cached_case("uneven", PRODUCTION, one_long_among_short, reference_of_all=False)
    outs = launch(api, dyn(op), inputs)
    assert_same(f"uneven/s{splits}", outs, launch(api, op, inputs))
    T = inputs["num_tokens"]
    long_start = int(np.argmax(inputs["token_kv_len"] == 16384)) - 16383
    tokens = sorted({0, 5, long_start, long_start + 1, long_start + 8191, *range(long_start + 16380, long_start + 16384), T - 1})
    ref = sample_reference(op, inputs, tokens)
    sub = {k: outs[k][tokens] for k in ("out", "lse")}
    check_case(f"uneven/s{splits}", op, sub, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", DYNAMIC_SPLITS)
@pytest.mark.parametrize("name", ["bf16-d128-g4-p16", "fp16-d64-g4-p16"])  # PRODUCTION and SMALL
def test_dynamic_split_kv_with_fused_merge(api, name, splits):
    """Long prompts with split-KV: every block takes several (tile, head, split group) items and
    merges each item's splits (its own and other blocks') once they are stored; a short sequence's
    lone tokens are decode items. Launched twice on the queue and counters the first launch leaves
    at zero."""
    op = DYNAMIC[name]
    inputs, ref = cached_case(f"splits/{name}", op, lambda rng: ([900, 800, 3], [900, 300, 3]))
    assert items(fused(op, splits), inputs["num_tokens"]) >= 2 * num_sms()
    queue = torch.zeros(2, dtype=torch.int32, device="cuda")
    counters = torch.zeros((inputs["num_tokens"], op.num_kv_heads), dtype=torch.int32, device="cuda")
    for _ in range(2):
        check_case(f"{name}/s{splits}", op, launch(api, dyn(fused(op, splits)), inputs, queue, counters), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", (1, *DYNAMIC_SPLITS))
def test_dynamic_mixed_ubatch_with_many_decode_tokens(api, splits):
    """Hundreds of decode blocks (several waves) go first in the grid; the persistent prefill blocks
    start as they drain, tiles of lone tokens only are skipped a tile at a time, and with splits
    both kinds merge."""
    inputs, ref = cached_case("many-decodes", SMALL, many_decodes_mixed(300))
    check_case(f"many-decodes/s{splits}", SMALL, launch(api, dyn(fused(SMALL, splits)), inputs), ref)


@pytest.mark.gpu
def test_dynamic_pure_decode_launch(api):
    """Every tile holds lone tokens only: the first block to take an item skips its tile, the queue
    empties at once, and the last block still zeroes it."""
    inputs, ref = cached_case("pure-decode", SMALL, lambda rng: (rng.integers(1, 900, size=97).tolist(), [1] * 97))
    for splits in (1, 16):
        check_case(f"pure-decode/s{splits}", SMALL, launch(api, dyn(fused(SMALL, splits)), inputs), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_dynamic_graph_replay_of_a_mixed_ubatch(api, rng, splits):
    """A captured paged_attention() (the plan takes the item queue on Hopper; the launcher reads the SM count
    while capturing) replayed twice on fresh q and KV: the workspace's item queue (and split counters) are zero
    after each replay."""
    from uacompile.targets.cuda import api as cuda_api

    op = SMALL
    kv_lens, q_lens = many_decodes_mixed(40, prompts=(1200, 64), chunk=(900, 400))(rng)
    inputs = testing.attention_inputs(op, rng, kv_lens, q_lens)
    dev = device_inputs(op, inputs)
    out = torch.empty_like(dev["q"])
    lse = torch.empty(dev["q"].shape[:2], device="cuda")
    ws = attention.Workspace(dev["q"].device)  # one for the capture stream, grown by the warm-up
    p = attention.plan(op, inputs["num_tokens"], len(kv_lens), dev["page_table"].shape[1] * op.page_size,
                       num_splits=splits, workspace=ws)
    assert p.config.item_queue and p.num_splits == splits
    stream = torch.cuda.Stream()  # warm-up (build), then capture
    graph = cuda_api.capture_graph([lambda: attention.paged_attention(op, **dev, out=out, lse=lse, num_splits=splits,
                                                                      workspace=ws)], stream=stream)
    queue = ws.item_queue()
    replay_on_fresh_inputs(f"replay/s{splits}", graph, op, dev, inputs,
                           lambda: testing.attention_inputs(op, rng, kv_lens, q_lens), out, lse, queue)


@pytest.mark.gpu
def test_dynamic_two_streams(api):
    """Two streams launch the dynamic schedule at once, each on its own item queue (a Workspace a stream);
    five launches each, interleaved, then both outputs and queues are checked."""
    op = SMALL
    cases = [cached_case(f"streams/{i}", op, prompts_for_items(op, 2)) for i in range(2)]
    streams = [torch.cuda.Stream() for _ in cases]
    workspaces = [attention.Workspace("cuda") for _ in cases]
    devs, outs = [], []
    for (inputs, _), stream in zip(cases, streams):
        dev = device_inputs(op, inputs)
        devs.append(dev)
        outs.append((torch.full_like(dev["q"], float("nan")), torch.full(dev["q"].shape[:2], float("nan"), device="cuda")))
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(5):
        for dev, (out, lse), stream, ws in zip(devs, outs, streams, workspaces):
            with torch.cuda.stream(stream):
                p = attention.plan(op, dev["q"].shape[0], dev["page_table"].shape[0],
                                   dev["page_table"].shape[1] * op.page_size, num_splits=1, workspace=ws)
                assert p.config.item_queue
                attention.run(p, **dev, out=out, lse=lse)
    torch.cuda.synchronize()
    queues = [ws.item_queue() for ws in workspaces]
    assert queues[0].data_ptr() != queues[1].data_ptr()
    for i, ((inputs, ref), (out, lse), queue) in enumerate(zip(cases, outs, queues)):
        check_case(f"stream{i}", op, {"out": out, "lse": lse}, ref)
        assert not queue.any(), f"stream {i}'s item queue must be zero after its launches"



# ---------------------------------------------------------------- CPU
@pytest.mark.parametrize("op, hopper", [
    (PA(32, 8, 128, 16, "bf16", "bf16"), True),
    (pa_kernel(PA(8, 2, 64, 8, "fp16", "fp16", window=9, softcap=5.0, alibi=True), num_splits=2), True),
    (PA(8, 2, 128, 4, "bf16", "bf16"), True),  # pages under 8 positions: the cp.async producer
    (PA(8, 8, 64, 1, "fp16", "fp16"), True),
    (PA(8, 2, 96, 16, "bf16", "bf16"), True),  # rows padded to 2 halves (128 columns)
    (PA(8, 2, 256, 16, "bf16", "bf16"), True),  # 4 halves a row, 64-position tiles
    (PA(8, 2, 80, 16, "bf16", "bf16"), True),
    (PA(8, 2, 112, 16, "bf16", "bf16"), False),  # not in layout.WG_HEAD_DIMS
    (PA(8, 2, 128, 16, "bf16", "fp8_e4m3"), False),  # quantised KV is dequantised through smem
    (PA(8, 2, 128, 16, "bf16", "bf16", variant="unified_masked"), False),
    (pa_kernel(PA(32, 8, 128, 16, "bf16", "bf16"), decode_only=True), False),  # no prefill tiles
])
def test_which_variants_take_the_hopper_path(op, hopper):
    k = pa_kernel(op)
    assert uses_wgmma(k.op, k.config, "sm_90") is hopper
    assert uses_wgmma(k.op, k.config, "sm_80") is False
    assert (SM90A_MARKER in render_op(k, "sm_90")) is hopper
    assert SM90A_MARKER not in render_op(k, "sm_80")
    lay = layout(k.op, k.config, "sm_90")
    assert lay.warps == (8 if hopper else 4)
    assert lay.prefill_rows == 16 * lay.warps * (1 if hopper else lay.mt_prefill)
    if hopper:  # one 8-warp block a SM: 227 KB a block at most; the static smem (ptxas: 0.3-1.3 KB, the dynamic
        # schedule's G 1 token windows the most) fits in the rest
        assert lay.smem_bytes + 2048 <= 227 * 1024 and lay.blocks_per_sm == 1


def test_prefill_items_count_tiles_heads_and_split_groups():
    op = PA(32, 8, 128, 16, "bf16", "bf16")  # G = 4: 32-token tiles; 2 decode groups: split groups of 2
    one, three, sixteen = AttentionConfig(), AttentionConfig(num_splits=3), AttentionConfig(num_splits=16)
    assert prefill_items(op, one, 1) == 8
    assert prefill_items(op, one, 33) == 2 * 8
    assert prefill_items(op, three, 64) == 2 * 8 * 2
    assert prefill_items(op, sixteen, 64) == 2 * 8 * 8
    assert prefill_items(op, three, 64, arch="sm_80") == 2 * 8 * 3  # 4-warp blocks: a split each


def test_dynamic_schedule_renders_only_with_the_queue_on_hopper():
    """item_queue: the launcher sizes a 1-D grid of decode blocks and min(items, SMs) persistent
    prefill blocks; without it, and on the mma.sync path, one item a block (the queue unused)."""
    op = pa_kernel(PA(32, 8, 128, 16, "bf16", "bf16"), num_splits=3, fused_merge=True)
    src = render_op(dyn(op))
    assert dynamic_prefill(op.op, dyn(op).config) and not dynamic_prefill(op.op, op.config)
    assert "constexpr bool DYNAMIC = true;" in src and "cudaDevAttrMultiProcessorCount" in src
    assert "prm.item_queue = (int32_t*)item_queue;" in src and "void* item_queue" in src
    for other in (render_op(op), render_op(dyn(op), "sm_80")):
        assert "constexpr bool DYNAMIC = false;" in other and "cudaDevAttrMultiProcessorCount" not in other
    assert not dynamic_prefill(op.op, dyn(op).config, "sm_80")
    assert "void* item_queue" in render_op(dyn(op), "sm_80")  # the IR's signature: the queue is taken, not used


def test_item_queue_param_signature_and_cdef():
    op = pa_kernel(PA(32, 8, 128, 16, "bf16", "bf16"), num_splits=4, fused_merge=True, item_queue=True)
    params = {p.name: p for p in op.params()}
    assert params["item_queue"].shape == (2,) and params["item_queue"].dtype == "int32"
    assert params["item_queue"].role == "inout"
    assert "void* split_counters, void* item_queue, void* out" in ir.c_signature(op)
    assert "void* item_queue" in ir.cffi_cdef(op)
    assert "item_queue" not in ir.c_signature(pa_kernel(op, item_queue=False))
    with pytest.raises(ir.IRError):
        AttentionConfig(item_queue=1)
    with pytest.raises(ir.IRError, match="decode_only"):
        AttentionConfig(decode_only=True, item_queue=True)  # no prefill blocks to take items


def test_split_choice_counts_hopper_blocks():
    """Hopper variants run one 8-warp block a SM of two decode groups; on sm_80 (an A100's 164 KB an SM) the
    4-warp block's 102 KB leave room for one, so the split choice sees half of Hopper's decode slots."""
    op, config = PA(32, 8, 128, 16, "bf16", "bf16"), AttentionConfig()
    hopper, ampere = layout(op, config, "sm_90"), layout(op, config, "sm_80")
    assert (hopper.blocks_per_sm, ampere.blocks_per_sm) == (1, 1)
    assert (hopper.decode_groups, ampere.decode_groups) == (2, 1)
    for T, L in [(1, 32768), (8, 16384), (64, 8192)]:
        s90 = choose_splits(op, config, T, T, L, arch="sm_90")
        s80 = choose_splits(op, config, T, T, L, arch="sm_80")
        assert 1 <= s80 <= s90, (T, L, s90, s80)
        assert s90 == 1 or T * op.num_kv_heads * s90 <= 2 * H200_SMS * hopper.decode_groups  # 2 waves
