"""Split-KV with the fused merge (AttentionConfig.fused_merge) against the float64 reference.

The last split block of each (token, KV head) merges the partials in the same launch and
leaves its counter at zero. Outputs are poisoned with NaN; every case draws fresh inputs with
scattered page tables. The CPU tests at the bottom cover the kernel's parameters, the rendered
production schedule and the split rule.
"""
from __future__ import annotations


import numpy as np
import pytest
from cuda_helpers import base_op, cuda_api_with, pa_kernel

from uacompile import IRError, ir, reference, testing
from uacompile.targets.cuda import attention
from uacompile.targets.cuda.config import AttentionConfig
from uacompile.targets.cuda.layout import H200_SMS, layout
from uacompile.targets.cuda.plan import MAX_SPLITS, MIN_SPLIT_LEN, MANY_WAVES, WAVE_FILL_SLACK, choose_splits

torch = pytest.importorskip("torch")
from test_cuda_attention_gpu import check_close, device_inputs, to_dev  # noqa: E402

gpu = pytest.mark.gpu
PA = ir.PagedAttention

OPS = {  # GQA 4, 1 and 8
    "g4-bf16-d128-p16": PA(32, 8, 128, 16, "bf16", "bf16"),
    "g1-fp16-d64-p16": PA(8, 8, 64, 16, "fp16", "fp16"),
    "g8-bf16-d128-p32": PA(16, 2, 128, 32, "bf16", "bf16"),
}
SPLITS = (1, 2, 7, 32, 64)
# long and short sequences: with 64 splits the short ones leave most splits empty
DECODE_LENS = [5000, 1, 700, 64, 2900, 33]
WINDOWED = PA(8, 2, 128, 16, "bf16", "bf16", window=300, return_lse=True)
ALL_OPTIONS = PA(8, 4, 64, 16, "fp16", "int8", window=700, softcap=10.0, alibi=True, return_lse=True)
D256 = PA(8, 2, 256, 16, "bf16", "bf16", return_lse=True)  # the mma.sync path on Hopper too
MIXED = dict(kv_lens=[37, 3000, 129, 1, 640, 2515], q_lens=[1, 45, 1, 1, 64, 1])


def fused(op, splits):
    """op's kernel (an op: the default config; a kernel keeps its config) with `splits` splits merged in the
    same launch (one split: no merge)."""
    return pa_kernel(op, num_splits=splits, fused_merge=True) if splits > 1 else pa_kernel(op)


def _all_ops():
    ops = []
    for op in OPS.values():
        for lse in (False, True):
            ops += [fused(op.replace(return_lse=lse), s) for s in SPLITS]
    for op in (WINDOWED, ALL_OPTIONS, D256):
        ops += [fused(op, s) for s in (1, 3, 7, 32)]
    ops += [fused(OPS["g4-bf16-d128-p16"].replace(return_lse=True), s) for s in (3, 16)]
    return list(dict.fromkeys(ops))


@pytest.fixture(scope="module")
def api():
    return cuda_api_with(_all_ops())


def reference_of(op, inputs):
    """(out, lse) of the unsplit op (of an op or kernel): what any split count must produce."""
    op = base_op(op)
    names = {p.name for p in op.tensors() if p.role == "in"}
    return reference.paged_attention(op, **{k: v for k, v in inputs.items() if k in names})


def run_fused(api, op, splits, inputs, counters=None, kernel_of=None):
    """One launch of op's kernel (an op or kernel) with `splits` fused splits on poisoned outputs (kernel_of(kernel):
    the CudaKernel, default api.kernel)."""
    dev = device_inputs(op, inputs)
    T = inputs["num_tokens"]
    if counters is None:
        counters = torch.zeros((T, op.num_kv_heads), dtype=torch.int32, device="cuda")
    outs = {"out": torch.full_like(dev["q"], float("nan"))}
    if op.return_lse:
        outs["lse"] = torch.full((T, op.num_q_heads), float("nan"), device="cuda")
    if splits > 1:
        outs["o_partial"] = torch.full((splits, T, op.num_q_heads, op.head_dim), float("nan"), device="cuda")
        outs["lse_partial"] = torch.full((splits, T, op.num_q_heads), float("nan"), device="cuda")
        outs["split_counters"] = counters
    (kernel_of or api.kernel)(fused(op, splits))(**dev, **outs)
    torch.cuda.synchronize()
    return outs


def check_outputs(name, op, inputs, out, lse=None):
    ref_out, ref_lse = reference_of(op, inputs)
    tol = testing.tolerance(op.q_dtype, op.kv_dtype)
    check_close(f"{name}.out", out, ref_out, tol)
    if lse is not None:
        check_close(f"{name}.lse", lse, ref_lse, 2 * tol)


def replay_on_fresh_inputs(name, graph, op, dev, inputs, make_inputs, out, lse, workspace, replays=2):
    """A captured launch replayed on fresh q and KV (make_inputs(), on inputs' pages), outputs poisoned
    first: each replay against the reference, and the stream's workspace zero after it."""
    for _ in range(replays):
        fresh = make_inputs()
        fresh["page_table"], fresh["num_pages"] = inputs["page_table"], inputs["num_pages"]
        for k in ("q", "k_cache", "v_cache"):
            dev[k].copy_(to_dev(fresh[k]))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_outputs(name, op, fresh, out, lse)
        assert not workspace.any(), f"{name}: the stream's workspace must be zero after each replay"


def run_and_check(api, name, op, splits, inputs, counters=None):
    """One fused launch checked against the reference, its counters zero again afterwards."""
    outs = run_fused(api, op, splits, inputs, counters)
    check_outputs(name, op, inputs, outs["out"], outs.get("lse"))
    if splits > 1:
        assert not outs["split_counters"].any(), "the counters must be zero after the launch"
    return outs


@gpu
@pytest.mark.parametrize("lse", [False, True], ids=["no-lse", "lse"])
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("name", list(OPS))
def test_fused_decode_matches_reference(api, rng, name, splits, lse):
    op = OPS[name].replace(return_lse=lse)
    inputs = testing.attention_inputs(op, rng, DECODE_LENS)
    outs = run_and_check(api, f"{name}/s{splits}", op, splits, inputs)
    if splits > 1:
        ref_o, ref_l = reference.paged_attention(op, num_splits=splits, **{
            k: v for k, v in inputs.items() if k in {p.name for p in op.tensors() if p.role == "in"}})
        tol = testing.tolerance(op.q_dtype, op.kv_dtype)
        check_close("o_partial", outs["o_partial"], ref_o, tol)  # the partials keep their contract
        check_close("lse_partial", outs["lse_partial"], ref_l, 2 * tol)


@gpu
@pytest.mark.parametrize("splits", [1, 3, 7, 32])
@pytest.mark.parametrize("op", [WINDOWED, ALL_OPTIONS, D256], ids=["window", "int8-window-softcap-alibi", "d256"])
def test_fused_decode_with_window_and_options(api, rng, op, splits):
    inputs = testing.attention_inputs(op, rng, [2000, 299, 300, 301, 5, 900])
    run_and_check(api, f"s{splits}", op, splits, inputs)


@gpu
@pytest.mark.parametrize("splits", [3, 16])
def test_mixed_ubatch_with_splits(api, rng, splits):
    """Prefill chunks and decode tokens in one launch: prefill tiles merge through their own
    counter (their first non-isolated token's), decode tokens through theirs."""
    op = OPS["g4-bf16-d128-p16"].replace(return_lse=True)
    inputs = testing.attention_inputs(op, rng, **MIXED)
    counters = torch.zeros((inputs["num_tokens"], op.num_kv_heads), dtype=torch.int32, device="cuda")
    for _ in range(2):  # the second launch reuses the counters the first left at zero
        run_and_check(api, f"mixed/s{splits}", op, splits, inputs, counters)


@gpu
@pytest.mark.parametrize("splits", [3, 16])
def test_long_prefill_with_splits(api, rng, splits):
    """Long prompts with splits: hundreds of prefill blocks, each merging its tile's splits through
    the tile's counter, and a short sequence whose lone-token rows are decode items."""
    op = OPS["g4-bf16-d128-p16"].replace(return_lse=True)
    inputs = testing.attention_inputs(op, rng, kv_lens=[1500, 1200, 3], q_lens=[1500, 500, 3])
    run_and_check(api, f"long/s{splits}", op, splits, inputs)


@gpu
@pytest.mark.parametrize("splits", [3, 16])
def test_interleaved_tokens_with_splits(api, rng, splits):
    """Tokens of a sequence not side by side: decode blocks take several lone tokens each (one
    merge per token), and a run split across tile edges merges per tile."""
    op = OPS["g4-bf16-d128-p16"].replace(return_lse=True)
    inputs = testing.attention_inputs(op, rng, [900, 400, 1500], [3, 3, 70])
    perm = np.concatenate([[0, 3, 1, 4, 2, 5], 6 + np.arange(70)[::-1]])  # 6 lone tokens, then a reversed run
    for k in ("q", "token_seq", "token_kv_len"):
        inputs[k] = np.ascontiguousarray(inputs[k][perm])
    run_and_check(api, f"interleaved/s{splits}", op, splits, inputs)


@gpu
@pytest.mark.parametrize("splits", [7, 32])
def test_call_function_fused_and_two_launch_agree(api, rng, splits):
    op = OPS["g4-bf16-d128-p16"].replace(return_lse=True)
    inputs = testing.attention_inputs(op, rng, [4000, 33, 1500, 2])
    dev = device_inputs(op, inputs)
    for fused_merge in (True, False):
        out = torch.full_like(dev["q"], float("nan"))
        lse = torch.full(dev["q"].shape[:2], float("nan"), device="cuda")
        attention.paged_attention(op, **dev, out=out, lse=lse, num_splits=splits, fused_merge=fused_merge)
        torch.cuda.synchronize()
        check_outputs(f"call/s{splits}/fused={fused_merge}", op, inputs, out, lse)


@gpu
def test_graph_replays_find_the_counters_reset(api, rng):
    """A captured fused launch replayed twice on fresh data: each replay starts from the zeroed
    counters the previous one left behind (the warm-up on the capture stream grows the workspace, which
    allocates and zeroes them, so the graph holds no memset of its own)."""
    from uacompile.targets.cuda import api as cuda_api

    op = OPS["g4-bf16-d128-p16"].replace(return_lse=True)
    lens = [6000, 700, 3000]
    inputs = testing.attention_inputs(op, rng, lens)
    dev = device_inputs(op, inputs)
    splits = 32
    out = torch.empty_like(dev["q"])
    lse = torch.empty(dev["q"].shape[:2], device="cuda")
    stream = torch.cuda.Stream()  # warm-up (build, grow the workspace), then capture
    ws = attention.Workspace(dev["q"].device)
    graph = cuda_api.capture_graph([lambda: attention.paged_attention(op, **dev, out=out, lse=lse, num_splits=splits,
                                                                      workspace=ws)], stream=stream)
    counters = ws.counters(len(lens), op.num_kv_heads)
    replay_on_fresh_inputs("replay", graph, op, dev, inputs, lambda: testing.attention_inputs(op, rng, lens),
                           out, lse, counters)


# ---------------------------------------------------------------- launches sharing workspaces in a graph
G4 = OPS["g4-bf16-d128-p16"].replace(return_lse=True)


@gpu
def test_back_to_back_in_a_graph(api, rng):
    """Three launches captured back to back sharing the partial and counter workspaces (with pdl on Hopper,
    programmatic edges: each waits for the previous launch before touching memory), replayed twice."""
    splits = 32
    kern = api.kernel(fused(G4, splits))
    lens = [6000, 700, 3000]
    cases = [testing.attention_inputs(G4, rng, lens) for _ in range(3)]
    devs = [device_inputs(G4, c) for c in cases]
    T = len(lens)
    o_part = torch.empty((splits, T, G4.num_q_heads, G4.head_dim), device="cuda")
    lse_part = torch.empty((splits, T, G4.num_q_heads), device="cuda")
    counters = torch.zeros((T, G4.num_kv_heads), dtype=torch.int32, device="cuda")
    outs = [(torch.empty_like(d["q"]), torch.empty(d["q"].shape[:2], device="cuda")) for d in devs]
    launch = [lambda d=d, o=o: kern(**d, o_partial=o_part, lse_partial=lse_part, split_counters=counters,
                                    out=o[0], lse=o[1]) for d, o in zip(devs, outs)]
    from uacompile.targets.cuda import api as cuda_api

    graph = cuda_api.capture_graph(launch)
    for _ in range(2):
        for o, l in outs:
            o.fill_(float("nan")), l.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (c, (o, l)) in enumerate(zip(cases, outs)):
            check_outputs(f"graph/{i}", G4, c, o, l)
        assert not counters.any()


# ---------------------------------------------------------------- CPU: the IR parameter, the split rule
def test_fused_merge_params_signature_and_cdef():
    op = pa_kernel(PA(32, 8, 128, 16, "bf16", "bf16", return_lse=True), num_splits=4, fused_merge=True)
    params = {p.name: p for p in op.params()}
    assert params["split_counters"].shape == ("num_tokens", 8) and params["split_counters"].dtype == "int32"
    assert params["split_counters"].role == "inout"
    names = [p.name for p in op.tensors()]
    assert names[-5:] == ["o_partial", "lse_partial", "split_counters", "out", "lse"]
    assert "void* split_counters, void* out, void* lse" in ir.c_signature(op)
    assert "void* split_counters" in ir.cffi_cdef(op)
    assert "split_counters" not in ir.c_signature(pa_kernel(op, fused_merge=False))
    assert "out" not in [p.name for p in pa_kernel(op, fused_merge=False).tensors()]  # partials only
    with pytest.raises(IRError, match="fused_merge"):
        AttentionConfig(num_splits=1, fused_merge=True)
    with pytest.raises(IRError, match="fused_merge"):
        PA(32, 8, 128).params(num_splits=1, fused_merge=True)
    assert "split_counters" in ir.reference_doc()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_production_schedule_renders(arch):
    """Programmatic dependent launch (griddepcontrol) where the arch has it (sm_90), a plain launch elsewhere."""
    from uacompile.targets.cuda.render import render_op

    src = render_op(fused(G4, 7), arch)
    pdl = arch == "sm_90"
    assert ("cudaLaunchKernelEx" in src) == pdl and f"constexpr bool PDL = {'true' if pdl else 'false'};" in src


def test_fused_merge_renders_the_counter_arrival():
    from uacompile.targets.cuda.build import INCLUDE_DIR
    from uacompile.targets.cuda.render import render_op

    op = PA(32, 8, 128, 16, "bf16", "bf16")
    src = render_op(pa_kernel(op, num_splits=4, fused_merge=True))
    assert "constexpr bool FUSED_MERGE = true;" in src and '#include "uacompile/paged_attention.cuh"' in src
    assert "atom.acq_rel.gpu.global.add.s32" in (INCLUDE_DIR / "uacompile" / "paged_attention.cuh").read_text()
    assert "constexpr bool FUSED_MERGE = false;" in render_op(pa_kernel(op, num_splits=4))


# sm_80: an A100's 164 KB an SM hold one 102 KB block (Hopper: one block of two decode groups), half the slots
@pytest.mark.parametrize("arch, rows", [("sm_90", [32, 4, 1, 1, 1]), ("sm_80", [16, 2, 1, 1, 1])])
def test_split_rule_on_the_bench_rows(arch, rows):
    shapes = [(1, 32768), (8, 16384), (32, 4096), (128, 1024), (1, 300)]
    got = [choose_splits(PA(32, 8, 128, 16, "bf16", "bf16"), AttentionConfig(), T, T, L, arch=arch) for T, L in shapes]
    assert got == rows


# the fastest fused split count of each row of the H200 decode_sweep --extra table (mixed kernel)
@pytest.mark.parametrize("T, L, fastest", [(12, 16384, 8), (20, 8192, 8), (16, 8192, 2), (4, 16384, 8),
                                           (2, 32768, 16), (64, 2048, 1), (8, 16384, 4), (1, 32768, 32)])
def test_split_rule_takes_the_measured_fastest(T, L, fastest):
    assert choose_splits(PA(32, 8, 128, 16, "bf16", "bf16"), AttentionConfig(), T, T, L, arch="sm_90") == fastest


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])  # Hopper: 2 decode groups a block; else 2 blocks a SM
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 12, 16, 20, 24, 30, 48, 100])
@pytest.mark.parametrize("L", [1024, 4096, 16384, 65536])
def test_split_rule_fills_waves_and_keeps_splits_long(T, L, arch):
    op, config = PA(32, 8, 128, 16, "bf16", "bf16"), AttentionConfig()
    lay = layout(op, config, arch)
    slots = H200_SMS * lay.blocks_per_sm * lay.decode_groups  # decode groups the GPU holds
    items = T * op.num_kv_heads

    def fill(s):  # share of the waves' slots that (token, KV head, split) units take
        return items * s / (-(-items * s // slots) * slots)

    s = choose_splits(op, config, T, T, L, arch=arch)
    assert 1 <= s <= MAX_SPLITS and (s == 1 or L // s >= MIN_SPLIT_LEN)
    assert s == 1 or s % lay.decode_groups == 0  # no idle decode group
    if items >= MANY_WAVES * slots:
        assert s == 1
        return
    allowed = [c for c in range(1, min(MAX_SPLITS, L // MIN_SPLIT_LEN) + 1)
               if c == 1 or c % lay.decode_groups == 0]
    good = max(fill(c) for c in allowed) - WAVE_FILL_SLACK
    assert fill(s) >= good and all(fill(c) < good for c in allowed if c < s)  # near-best fill, fewest splits
