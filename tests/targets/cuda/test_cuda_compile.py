"""CPU: every CUDA template renders and compiles with nvcc (sm_80 and sm_90) over a
representative set of variants; launchers match the IR ABI; builds are cached; the call
API rejects bad arguments with messages naming them (checked before any device work)."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from uacompile import ir
from uacompile.targets.cuda import layout, plan
from uacompile.targets.cuda.config import AttentionConfig, ReshapeConfig

from cuda_helpers import assert_renders_with_launcher

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

R, C, S, M = ir.ReshapeAndCache, ir.CopyBlocks, ir.SwapBlocks, ir.MergeState
CACHE_OP_VARIANTS = {
    "reshape_and_cache": [
        R(8, 128), R(8, 128, dtype="bf16", kv_dtype="bf16", page_size=256), R(1, 64, page_size=1),
        R(4, 80, kv_dtype="int8"), R(2, 96, dtype="bf16", kv_dtype="fp8_e4m3", page_size=32),
        R(8, 256, kv_dtype="fp8_e4m3"), R(8, 128, rope=True), R(4, 80, dtype="bf16", kv_dtype="bf16", rope=True, rope_theta=1e6),
        R(2, 64, kv_dtype="int8", rope=True, rope_interleaved=True), R(8, 96, kv_dtype="fp8_e4m3", rope=True),
        R(4, 128, dtype="fp32", kv_dtype="fp32"), R(2, 256, dtype="fp32", kv_dtype="fp32", rope=True),
        R(2, 6, kv_dtype="int8", rope=True), R(8, 8, kv_dtype="int8"),
    ],
    "copy_blocks": [C(8, 128), C(1, 64, page_size=1, kv_dtype="int8"), C(2, 256, page_size=256, kv_dtype="fp8_e4m3"),
                    C(4, 80, kv_dtype="bf16")],
    "swap_blocks": [S(8, 128), S(1, 64, page_size=1, kv_dtype="int8"), S(2, 96, page_size=128, kv_dtype="fp8_e4m3")],
    "merge_state": [M(32, 128, 2), M(8, 64, 16, out_dtype="bf16", return_lse=True), M(4, 80, 3, out_dtype="fp32"),
                    M(16, 96, 7, return_lse=True), M(2, 256, 32)],
}


def PA(*args, num_splits: int = 1, fused_merge: bool = False, item_queue: bool = False, decode_only: bool = False,
       **fields) -> ir.Kernel:
    """An attention kernel: the op of these fields in the AttentionConfig of the others."""
    return ir.Kernel(ir.PagedAttention(*args, **fields),
                     AttentionConfig(num_splits=num_splits, fused_merge=fused_merge, item_queue=item_queue,
                                     decode_only=decode_only))


def lay(k: ir.Kernel, arch: str = "sm_90"):
    return layout.layout(k.op, k.config, arch)


def launched(k: ir.Kernel, splits: int, decode_only: bool = False, arch: str = "sm_90") -> ir.Kernel:
    """The kernel plan() launches for k's op at `splits` (fused merge; the item queue on the Hopper path)."""
    cfg = AttentionConfig(num_splits=splits, fused_merge=splits > 1, decode_only=decode_only)
    return ir.Kernel(k.op, cfg.replace(item_queue=layout.uses_wgmma(k.op, cfg, arch)))


# a representative set of attention kernels
ATTENTION_VARIANTS = [
    PA(32, 8, 128, 16, "bf16", "bf16"), PA(32, 8, 128, 16, "fp16", "fp16", num_splits=4),
    PA(32, 8, 128, 16, "bf16", "bf16", num_splits=5, fused_merge=True, return_lse=True),
    PA(16, 2, 64, 8, "fp16", "int8", window=64, num_splits=3, fused_merge=True),
    PA(16, 1, 64, 1, "fp16", "int8"), PA(8, 8, 80, 256, "bf16", "fp8_e4m3", window=128),
    PA(24, 2, 96, 32, "fp16", "fp16", softcap=30.0, alibi=True, return_lse=True), PA(16, 2, 256, 64, "bf16", "bf16"),
    PA(32, 8, 128, 16, "bf16", "bf16", variant="unified_masked"),
    PA(16, 4, 64, 8, "fp16", "fp16", window=32, return_lse=True),  # sm_90: the wgmma path with head_dim 64
    PA(8, 8, 96, 2, "bf16", "bf16", return_lse=True),  # sm_90: the cp.async producer, padded columns, 2 pages a lane
    # sm_90: the dynamic prefill schedule with the fused merge and G 1 (its largest token windows); sm_80 ignores the queue
    PA(8, 8, 128, 16, "bf16", "bf16", num_splits=3, fused_merge=True, return_lse=True, item_queue=True),
    # decode-only kernels: the one-trip merge at 32 splits, quantised KV on the raw stage (3 blocks an SM), the
    # dequantising pass (D 80), D 256
    PA(32, 8, 128, 16, "bf16", "bf16", num_splits=32, fused_merge=True, decode_only=True),
    PA(32, 8, 128, 16, "bf16", "int8", num_splits=4, fused_merge=True, decode_only=True),
    PA(16, 2, 80, 16, "fp16", "int8", window=64, decode_only=True),
    PA(8, 4, 256, 16, "bf16", "fp8_e4m3", return_lse=True, decode_only=True),
]


def _variants(kind):
    return ATTENTION_VARIANTS if kind == "paged_attention" else CACHE_OP_VARIANTS[kind]


KINDS = [*CACHE_OP_VARIANTS, "paged_attention"]


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def test_render_has_the_ir_launcher(kind):
    assert_renders_with_launcher(_variants(kind))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_variants_compile_and_export_launchers(kind, arch):
    """One nvcc run per kind and arch (all its variants in one library); every launcher is found by cffi."""
    from uacompile.targets.cuda.build import build
    from uacompile.targets.cuda.loader import load_library

    ops = _variants(kind)
    res = build(ops, arch)
    assert res.path.exists() and res.arch == arch
    lib = load_library(res.path, ops, res)
    for op in ops:
        assert lib.function(op) is not None
    # a variant listed twice (two shapes that launch the same op) is declared once, not refused by cffi
    twice = load_library(res.path, [*ops, ops[0]], res)
    assert twice.function(ops[0]) is not None
    again = build(ops, arch)
    assert again.hit and again.path == res.path and again.seconds < 0.5


def _sweep_candidates() -> dict:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    import reshape_sweep

    return reshape_sweep.CANDIDATES


@pytest.mark.parametrize("name", [n for n, d in _sweep_candidates().items() if d])
def test_reshape_sweep_candidates_compile(name):
    """Every design candidate of bench/reshape_sweep.py (a ReshapeConfig) over the reshape_and_cache variant axes
    (sm_90: the arch the sweep runs on)."""
    from uacompile.targets.cuda.build import build

    cfg = ReshapeConfig.parse(_sweep_candidates()[name])
    assert build([ir.Kernel(op, cfg) for op in CACHE_OP_VARIANTS["reshape_and_cache"]], "sm_90").path.exists()


def test_reshape_config_is_checked_and_changes_the_kernel():
    from uacompile.targets.cuda.render import render_op

    op = R(8, 128, kv_dtype="int8")
    assert render_op(ir.Kernel(op, ReshapeConfig())).replace(ir.Kernel(op, ReshapeConfig()).symbol(), "S") == \
        render_op(op).replace(op.symbol(), "S")
    assert "constexpr int ROWS" not in render_op(op) or render_op(ir.Kernel(op, ReshapeConfig(rows=1))) != render_op(op)
    with pytest.raises(ir.IRError, match="ReshapeConfig.quant"):
        ReshapeConfig(quant="fast")
    with pytest.raises(ir.IRError, match="ReshapeConfig.no_such_knob"):
        ReshapeConfig.parse("no_such_knob=1")


def test_cache_key_follows_variant_and_arch():
    from uacompile.targets.cuda.build import build

    a = build(R(8, 128), "sm_90")
    assert build(R(8, 128), "sm_90").key == a.key
    assert build(R(8, 128), "sm_80").key != a.key
    assert build(R(8, 64), "sm_90").key != a.key


def test_sm90a_marker_selects_arch_specific_target():
    from uacompile.nvcc import arch_flags
    from uacompile.targets.cuda.build import build_arch
    from uacompile.targets.cuda.render import SM90A_MARKER

    assert arch_flags(build_arch("sm_90", "int x;")) == ["-arch=sm_90"]
    assert arch_flags(build_arch("sm_90", SM90A_MARKER + "\n")) == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert arch_flags(build_arch("sm_80", SM90A_MARKER + "\n")) == ["-arch=sm_80"]
    with pytest.raises(ValueError, match="arch"):
        build_arch("ampere", "")
    with pytest.raises(ValueError, match="arch"):
        arch_flags("sm90")


def test_build_error_names_ops_and_keeps_source(monkeypatch):
    from uacompile.nvcc import NvccError
    from uacompile.targets.cuda import build as build_mod

    monkeypatch.setattr(build_mod, "render_op", lambda op, arch: "this is not C++;\n")
    with pytest.raises(NvccError, match="nvcc failed for .*ua_copy_blocks_.*source kept at"):
        build_mod.build(C(8, 16), "sm_90")


def test_unknown_op_kind_is_an_ir_error():
    from uacompile.targets.cuda.render import render_op

    class Bogus(ir.OpSpec):
        kind = "bogus"

    with pytest.raises(ir.IRError, match="no CUDA template"):
        render_op(Bogus())


# ---------------------------------------------------------------- argument checks (no GPU needed)
import torch  # noqa: E402


def _merge_args(T=3, S_=2, H=4, D=64, out_dtype=torch.float16):
    return dict(o_partial=torch.zeros(S_, T, H, D), lse_partial=torch.zeros(S_, T, H),
                out=torch.empty(T, H, D, dtype=out_dtype))


@pytest.mark.parametrize("mutate, exc, pattern", [
    (lambda a: a.update(out=a["out"].float()), TypeError, r"merge_state\.out: expected dtype torch\.float16, got torch\.float32"),
    (lambda a: a.update(lse_partial=torch.zeros(2, 4, 4)), ValueError, r"merge_state\.lse_partial: dim 1 \(num_tokens\) is 4, but num_tokens = 3 from o_partial"),
    (lambda a: a.update(o_partial=torch.zeros(3, 3, 4, 64)), ValueError, r"merge_state\.o_partial: dim 0 must be 2"),
    (lambda a: a.update(out=torch.empty(3, 4, 64, 1, dtype=torch.float16)), ValueError, r"merge_state\.out: expected 3 dims"),
    (lambda a: a.update(out=torch.empty(3, 64, 4, dtype=torch.float16).transpose(1, 2)), ValueError, r"merge_state\.out: must be C-contiguous \(strides \(256, 1, 4\) for shape \(3, 4, 64\)\)"),
    (lambda a: a.update(o_partial=[1, 2]), TypeError, r"merge_state\.o_partial: expected a torch\.Tensor, got list"),
    (lambda a: a.pop("out"), TypeError, r"merge_state: missing tensor argument 'out'"),
    (lambda a: a.update(bogus=1), TypeError, r"merge_state: unexpected argument 'bogus'"),
    (lambda a: a.update(num_tokens=5), ValueError, r"merge_state\.num_tokens: given 5, but num_tokens = 3 from o_partial"),
    (lambda a: None, ValueError, r"merge_state\.o_partial: must be a CUDA tensor, got device cpu"),
])
def test_call_api_rejects_bad_arguments(mutate, exc, pattern):
    from uacompile.targets.cuda.api import CudaKernel

    kern = CudaKernel(M(4, 64, 2), arch="sm_90")
    args = _merge_args()
    mutate(args)
    with pytest.raises(exc, match=pattern):
        kern(**args)


def test_swap_blocks_host_side_must_be_pinned():
    from uacompile.targets.cuda.api import CudaKernel

    kern = CudaKernel(S(2, 64, 16), arch="sm_90")
    src = torch.zeros(1, 2, 4, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"swap_blocks\.src: a host tensor must be pinned"):
        kern(src=src, dst=src.clone(), mapping=torch.zeros(1, 2, dtype=torch.int64))


def test_friendly_functions_check_layout_and_scales():
    from uacompile.targets.cuda import api

    k = torch.zeros(4, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"k_cache: expected 4 dims"):
        api.reshape_and_cache(k, k, torch.zeros(8, 16, 2 * 64, dtype=torch.float16), None, None)
    with pytest.raises(TypeError, match=r"k_scale is required"):
        cache = torch.zeros(8, 16, 2, 64, dtype=torch.int8)
        api.reshape_and_cache(k, k, cache, cache, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ir.IRError, match=r"page_size"):
        api.copy_blocks(torch.zeros(1, 2, 4, 3, 2, 64, dtype=torch.float16), torch.zeros(1, 2, dtype=torch.int64))


def test_an_ir_error_pickles_with_its_field_and_rule():
    """An IRError raised in a worker process (the tuner's, a sweep's) comes back with its field and rule."""
    import pickle

    err = pickle.loads(pickle.dumps(ir.IRError("AttentionConfig.num_splits", "must be >= 1")))
    assert (err.field, err.rule, str(err)) == ("AttentionConfig.num_splits", "must be >= 1",
                                               "AttentionConfig.num_splits: must be >= 1")
    with pytest.raises(ir.IRError, match="unified_masked is built with num_splits=1"):
        layout.check(ir.PagedAttention(8, 2, 128, 16, "bf16", "bf16", variant="unified_masked"),
                     AttentionConfig(num_splits=7, fused_merge=True))


def test_build_record_keeps_ptxas_performance_notes():
    """nvcc 13's ptxas reports serialised wgmma as an info line without the word "warning" (this one is from a
    real build of the fp16 D 64 item-queue op): build.json must keep it, or the guard below passes blindly."""
    from uacompile.nvcc import compiler_warnings

    c7511 = ("ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
             "insufficient register resources for the wgmma pipeline in the function '_ZN3ua6kernelE'")
    output = "\n".join(["ptxas info    : Used 168 registers", c7511,
                        "kernels.cu(328): warning #177-D: variable \"X\" was declared but never referenced"])
    kept = compiler_warnings(output)
    assert kept[0] == c7511 and len(kept) == 2 and "wgmma" in kept[0]


# Launched Hopper ops that ptxas once serialised (C7511) while the half-wide last tile's scores aliased the first
# half of s: the benchmarks' config at 1, 8 and 24 splits and a GPU-test config (D 64, fp16) at one split; with
# the benchmarks' 4-split op
WGMMA_GUARDED = [(PA(32, 8, 128, 16, "bf16", "bf16"), 1), (PA(32, 8, 128, 16, "bf16", "bf16"), 4),
                 (PA(32, 8, 128, 16, "bf16", "bf16"), 8), (PA(32, 8, 128, 16, "bf16", "bf16"), 24),
                 (PA(16, 4, 64, 16, "fp16", "fp16"), 1)]


def test_launched_hopper_ops_keep_wgmma_unserialised(tmp_path, monkeypatch):
    """ptxas serialises wgmma (C7511 / C7520) when the consumer's registers run short or accumulators alias, which
    costs the Hopper path its GEMM overlap without any error: the ops paged_attention() launches for these configs
    (item queue, one split and the fused split-KV merge) must build without it. build.json keeps ptxas' notes and
    the serialised symbols."""
    from uacompile.targets.cuda.build import build

    monkeypatch.setenv("UACOMPILE_CACHE_DIR", str(tmp_path))  # a fresh compile, whose warnings are recorded
    ops = [launched(op, s) for op, s in WGMMA_GUARDED]
    assert all(o.config.item_queue for o in ops)
    rec = json.loads((build(ops, "sm_90").path.parent / "build.json").read_text())
    assert not [w for w in rec["warnings"] if "wgmma" in w] and rec["serialised"] == [], rec["warnings"]


def test_serialised_kernels_names_the_ops():
    """ptxas' C7511 note names the kernel by its mangled name; build() maps it to the op's symbol (this
    line is from a real build of the 4-split item-queue op)."""
    from uacompile.targets.cuda.build import serialised_kernels

    note = ("ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "insufficient register resources for the wgmma pipeline in the function "
            "'_ZN36ua_paged_attention_2c7522e2833b_impl22paged_attention_kernelENS_6ParamsE14CUtensorMap_stS1_'")
    assert serialised_kernels([note, "kernels.cu(3): warning #177-D: variable \"X\" was declared"]) == {
        "ua_paged_attention_2c7522e2833b"}
    assert serialised_kernels(["ptxas info    : Used 168 registers"]) == set()


DECODE_BENCH_OPS = [  # the decode-only ops the benchmarks' decode rows launch (bf16 1 / 4 / 32 splits; int8, fp8)
    PA(32, 8, 128, 16, "bf16", "bf16", decode_only=True),
    PA(32, 8, 128, 16, "bf16", "bf16", num_splits=4, fused_merge=True, decode_only=True),
    PA(32, 8, 128, 16, "bf16", "bf16", num_splits=32, fused_merge=True, decode_only=True),
    PA(32, 8, 128, 16, "bf16", "int8", num_splits=4, fused_merge=True, decode_only=True),
    PA(32, 8, 128, 16, "bf16", "fp8_e4m3", num_splits=4, fused_merge=True, decode_only=True),
    # bench/variant_sweep.py's D 64 and D 80 rows: as many blocks as shared memory holds (4 and 3)
    PA(32, 4, 64, 16, "bf16", "bf16", num_splits=8, fused_merge=True, decode_only=True),
    PA(32, 8, 80, 16, "bf16", "bf16", num_splits=3, fused_merge=True, decode_only=True),
]


def test_decode_only_kernels_fit_their_register_budget_without_spills(tmp_path, monkeypatch):
    """A decode-only kernel's layout asks ptxas for 2 (16-bit KV; up to 4 where shared memory holds them) or 3
    (quantised) blocks an SM; a spill to local memory would cost more than the extra block gains. ptxas'
    -warn-spills lines (build.py's BASE_FLAGS) land in build.json."""
    from uacompile.targets.cuda.build import build

    monkeypatch.setenv("UACOMPILE_CACHE_DIR", str(tmp_path))
    assert [lay(op).blocks_per_sm for op in DECODE_BENCH_OPS] == [2, 2, 2, 3, 3, 4, 3]
    res = build(DECODE_BENCH_OPS, "sm_90")
    warnings = json.loads((res.path.parent / "build.json").read_text())["warnings"]
    assert not [w for w in warnings if "spill" in w.lower()], warnings


def test_decode_steps_launch_the_decode_only_op():
    """plan()'s choice by shapes: at most one token a sequence takes decode_only (no item queue, no wgmma), more
    tokens the mixed kernel with the Hopper item queue."""
    op = PA(32, 8, 128, 16, "bf16", "bf16").op
    for T, S in ((8, 8), (3, 8)):
        cfg = plan.choose_config(op, T, S, 16384)
        assert cfg.decode_only and cfg.fused_merge and not cfg.item_queue and not layout.uses_wgmma(op, cfg)
    assert not plan.choose_config(op, 9, 8, 16384).decode_only
    assert plan.choose_config(op, 4 * 4096, 4, 4096).item_queue  # the mixed kernel's dynamic prefill
    with pytest.raises(ir.IRError, match="decode_only"):
        AttentionConfig(decode_only=True, item_queue=True)
    # the decode-only layout: 16-bit KV keeps 2 blocks of one group an SM (the mixed kernel: 1 block of 2
    # groups); quantised KV drops the converted tiles for a third block
    only, quant = PA(32, 8, 128, 16, "bf16", "bf16", decode_only=True), PA(32, 8, 128, 16, "bf16", "int8", decode_only=True)
    assert (lay(only).blocks_per_sm, lay(only).decode_groups) == (2, 1)
    assert lay(quant).blocks_per_sm == 3
    assert lay(PA(32, 8, 128, 16, "bf16", "int8")).blocks_per_sm == 2
    # the split rule fills the layout's slots: 8 x 8 items take 6 splits of 396 slots (4 of the mixed kernel's 264)
    assert plan.choose_splits(quant.op, quant.config, 8, 8, 16384) == 6
    assert plan.choose_splits(quant.op, AttentionConfig(), 8, 8, 16384) == 4


def _launched_ptx(op, tmp_path) -> str:
    """The sm_90a PTX nvcc emits for the one-split op paged_attention() launches for op."""
    import subprocess

    from uacompile.nvcc import nvcc_path
    from uacompile.targets.cuda.build import nvcc_flags
    from uacompile.targets.cuda.render import render_op

    src = render_op(launched(op, 1), "sm_90")
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    flags = [f for f in nvcc_flags("sm_90", src) if f != "-shared" and not f.startswith("-gencode")]
    subprocess.run([nvcc_path(), *flags, "-arch=sm_90a", "-ptx", "-o", str(tmp_path / "k.ptx"), str(cu)],
                   check=True, capture_output=True)
    return (tmp_path / "k.ptx").read_text()


def test_q_l2_prefetch_only_for_rows_of_a_kilobyte(tmp_path):
    """The Hopper V producer prefetches an item's Q rows into L2 (cp.async.bulk.prefetch.L2, one a token) only where
    a token's G heads take >= layout.Q_PREFETCH_MIN (1024) bytes: MHA's 128 prefetches of 256 B an item delayed
    the V tiles behind them. Checked in the PTX nvcc emits."""
    def prefetches(op) -> int:
        return _launched_ptx(op, tmp_path).count("cp.async.bulk.prefetch.L2")

    assert prefetches(PA(32, 8, 128, 16, "bf16", "bf16")) > 0  # G 4 x D 128 x 2 B = 1 KB a token
    assert prefetches(PA(32, 32, 128, 16, "bf16", "bf16")) == 0  # MHA: 256 B


def test_small_pages_take_the_cp_async_producer_unserialised(tmp_path, monkeypatch):
    """Pages under 8 positions run the Hopper path with a cp.async producer (TMA boxes of 1-4 rows are correct but
    cost ~20-30 cycles each). In the PTX: each producer lane arrives on the stage's full barrier after its copies,
    the consumers fence the generic-proxy writes before wgmma reads them, and no K/V tensor copy is left; page 16
    keeps TMA.
    The launched page-1 ops (one split, fused split-KV) build without serialised wgmma."""
    from uacompile.targets.cuda.build import build

    def ptx(op) -> str:
        return _launched_ptx(op, tmp_path)

    page1 = PA(32, 8, 128, 1, "bf16", "bf16")
    assert layout.uses_wgmma(page1.op, page1.config)
    text = ptx(page1)
    assert "cp.async.mbarrier.arrive.noinc" in text and "fence.proxy.async.shared::cta" in text
    assert "cp.async.bulk.tensor" not in text
    text = ptx(page1.replace(page_size=16))
    assert "cp.async.bulk.tensor" in text and "cp.async.mbarrier.arrive.noinc" not in text

    monkeypatch.setenv("UACOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    ops = [launched(page1, s) for s in (1, 4)]
    res = build(ops, "sm_90")
    warnings = json.loads((res.path.parent / "build.json").read_text())["warnings"]
    assert not [w for w in warnings if "wgmma" in w], warnings


def test_blocks_an_sm_follow_the_arch_shared_memory():
    """The split rule counts the blocks an SM holds from the arch's shared memory (layout.smem_per_sm): a 16-bit
    decode-only kernel asks for as many blocks as fit, up to 4. D 64 (54 KB): 4 on sm_90's 228 KB, 2 on an A100's
    164 KB; D 128 (102 KB): 2 and 1."""

    d64, d128 = (PA(32, 8, d, 16, "bf16", "bf16", decode_only=True) for d in (64, 128))
    assert layout.smem_per_sm("sm_90") == 228 * 1024 and layout.smem_per_sm("sm_80") == 164 * 1024
    assert [(lay(op, a).min_blocks, lay(op, a).blocks_per_sm)
            for op in (d64, d128) for a in ("sm_90", "sm_80")] == [(4, 4), (2, 2), (2, 2), (2, 1)]


def test_a_variant_beyond_the_arch_block_smem_is_refused_clearly():
    """paged_attention() refuses, before launching, a variant whose blocks need more shared memory than the device's
    arch gives one block even at one cp.async stage (CUDA would fail the launch with a bare error): D 256 on GA10x /
    Ada (99 KB a block) takes 99 KB of tiles and Q plus the static variables. Hopper and the A100 hold it."""
    from uacompile.errors import IRError

    d256, d128 = (PA(16, 8, d, 16, "bf16", "bf16") for d in (256, 128))
    with pytest.raises(IRError, match="99 KB of shared memory; an sm_86 block at most 98 KB"):
        layout.check_fits(d256.op, d256.config, "sm_86")
    for op, arch in ((d256, "sm_90"), (d256, "sm_80"), (d128, "sm_80"), (d128, "sm_86")):
        layout.check_fits(op.op, op.config, arch)


SMALL_SMEM_OPS = {  # arch: ops whose two-stage layout exceeds its block (tests/targets/cuda/test_cuda_small_smem_gpu.py runs them)
    "sm_80": [PA(8, 2, 256, 16, "bf16", "bf16", return_lse=True), PA(8, 4, 256, 16, "fp16", "int8", window=900),
              PA(8, 2, 256, 16, "bf16", "bf16", return_lse=True, decode_only=True)],
    "sm_86": [PA(16, 4, 128, 16, "bf16", "bf16", return_lse=True), PA(16, 4, 128, 8, "fp16", "fp8_e4m3", softcap=20.0)],
}


@pytest.mark.parametrize("arch", list(SMALL_SMEM_OPS))
def test_smaller_gpus_take_fewer_stages_and_fit(arch, tmp_path):
    """layout.layout drops cp.async stages until a block fits the arch (A100: D 256, 165 KB at two stages;
    GA10x / Ada: D 128, 102 KB), where Hopper's layouts keep theirs; ptxas' static shared memory of the built
    kernels stays within the STATIC_SMEM the layout leaves for it."""
    import re
    import subprocess

    from uacompile.nvcc import nvcc_path
    from uacompile.targets.cuda.build import nvcc_flags
    from uacompile.targets.cuda.render import render_op

    ops = SMALL_SMEM_OPS[arch]
    for op in ops:
        got, two = lay(op, arch), layout.layout_at(op.op, op.config, arch, 2)
        assert got.stages < two.stages and two.smem_bytes > layout.block_smem(arch) >= got.smem_bytes, (op, got)
    assert [lay(op, "sm_90").stages for op in ops] == ([1, 2, 2] if arch == "sm_80" else [2, 2])
    cu = tmp_path / "k.cu"
    src = "\n".join(render_op(op, arch) for op in ops)
    cu.write_text(src)
    flags = [f for f in nvcc_flags(arch, src) if f != "-shared"]
    res = subprocess.run([nvcc_path(), *flags, "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(cu)],
                         check=True, capture_output=True, text=True)
    used = [line for line in (res.stdout + res.stderr).splitlines() if re.search(r"Used \d+ registers", line)]
    static = [int(m[1]) if (m := re.search(r"(\d+) bytes smem", line)) else 0 for line in used]
    assert len(static) == len(ops) and max(static) <= layout.STATIC_SMEM, used
