"""uacompile/tune_space.py without a GPU or TVM: the CUDA space by the shape's kind (prefill: the Hopper path's tiles
and stages, the cp.async producer's lanes, TMA instead; decode: splits, fused merge, decode-only), every candidate
fitting the template (layout.check, check_fits) with the built-in rule first; the order (fewest knobs changed
first); tvm-cuda's kernels from a folder of prebuilt libraries, and the one-line error where one is missing and TVM
is not here. The CPU tuner and the TVM spaces' use by tune() are tests/test_tune.py's."""
import importlib.util
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from uacompile import ir
from uacompile.lower.config import TVMConfig
from uacompile.targets.cuda import layout
from uacompile.targets.cuda.config import AttentionConfig
from uacompile.tune import trial_configs
from uacompile.tune_space import CUDASpace, changes, ordered, space, wg_tiles
from uacompile.tunedb import Shape

PREFILL, DECODE = Shape.parse("prefill:4x4096"), Shape.parse("decode:16x8192")
BASE = ir.PagedAttention(32, 8, 128, 16, "bf16", "bf16")
PAGE1 = ir.PagedAttention(32, 8, 128, 1, "bf16", "bf16")
D64_PAGE1 = ir.PagedAttention(32, 4, 64, 1, "bf16", "bf16")
D64_PAGE4 = ir.PagedAttention(32, 4, 64, 4, "bf16", "bf16")
D256 = ir.PagedAttention(16, 8, 256, 16, "bf16", "bf16")


def _fits_all(op, configs):
    for c in configs:
        layout.check(op, c)
        layout.check_fits(op, c, "sm_90")
    assert len(configs) == len(set(configs))


@pytest.mark.parametrize("op", [BASE, PAGE1, D64_PAGE1, D64_PAGE4, D256], ids=["base", "page1", "d64page1", "d64page4",
                                                                              "d256"])
def test_prefill_space_searches_tiles_and_producer_lanes_all_fitting_default_first(op):
    s = CUDASpace()
    cands = s.candidates(op, PREFILL)
    assert cands[0] == s.default(op, PREFILL) == AttentionConfig(item_queue=True)
    _fits_all(op, cands)
    assert not any(c.decode_only for c in cands) and {c.num_splits for c in cands} == {1}  # its tiles fill the GPU
    tiles = {c.wg_tile for c in cands} - {None}
    assert tiles == set(wg_tiles(op, "sm_90"))
    assert any(not c.item_queue for c in cands) and any(c.q_prefetch_min is not None for c in cands)
    small = op.page_size < layout.CP_PRODUCER_BELOW  # the rule copies these pages by cp.async
    lanes = {c.cp_row_lanes for c in cands} - {None}
    assert lanes == ({2, 4, 8} - {layout.cp_row_lanes(op.head_dim)} if small else set())
    assert ({c.cp_producer_below for c in cands} - {None}) == ({op.page_size} if small else set())
    # lanes only where cp.async copies the pages (TMA: they change nothing)
    assert not any(c.cp_row_lanes and op.page_size >= layout.cp_producer_below(c) for c in cands)
    # every one-knob change of the rule comes before any two-knob one
    base = vars(cands[0])
    assert [changes(c, base) for c in cands] == sorted(changes(c, base) for c in cands)


def test_a_prefill_whose_tiles_leave_sms_idle_tries_a_few_merged_splits():
    op = ir.PagedAttention(16, 2, 128, 16, "bf16", "bf16")
    shape = Shape.parse("prefill:1x512")  # 32 tiles x 2 KV heads on 132 SMs
    cands = CUDASpace().candidates(op, shape)
    assert cands[0] == CUDASpace().default(op, shape) and {c.num_splits for c in cands} == {1, 2}
    assert all(c.fused_merge for c in cands if c.num_splits > 1)
    _fits_all(op, cands)


def test_prefill_tiles_fit_shared_memory_registers_and_pages():
    assert wg_tiles(BASE, "sm_90") == [(64, 6)]  # (128, 3) is the rule's; 192 positions spill, 256 do not fit
    assert wg_tiles(D64_PAGE1, "sm_90") == [(64, 6), (128, 6)]  # (192, 4) the rule's; 256 a page-1 tile: 256 boxes
    assert wg_tiles(D256, "sm_90") == []  # (64, 2) is the only one that fits
    # pages of 4 do not tile D 64's 192 positions for the cp.async producer: the rule takes 128 x 6 there
    assert layout.layout(D64_PAGE4, AttentionConfig(), "sm_90").bn_wg == 128
    with pytest.raises(ir.IRError, match="wg_tile"):
        layout.check_fits(D64_PAGE4, AttentionConfig(wg_tile=(192, 4)), "sm_90")
    with pytest.raises(ir.IRError, match="wg_tile"):
        layout.check_fits(D64_PAGE1, AttentionConfig(wg_tile=(256, 3)), "sm_90")
    with pytest.raises(ir.IRError, match="wg_tile"):
        layout.check_fits(BASE, AttentionConfig(wg_tile=(128, 4)), "sm_90")  # 4 stages take 260 KB
    with pytest.raises(ir.IRError, match="2 TMA stages"):
        layout.check_fits(BASE, AttentionConfig(wg_tile=(64, 1)), "sm_90")
    with pytest.raises(ir.IRError, match="cp_row_lanes"):
        layout.check_fits(PAGE1, AttentionConfig(cp_row_lanes=1), "sm_90")
    layout.check_fits(BASE, AttentionConfig(cp_row_lanes=1), "sm_90")  # TMA copies pages of 16: lanes unused


def test_decode_space_searches_splits_merge_and_decode_only():
    s = CUDASpace()
    cands = s.candidates(BASE, DECODE)
    assert cands[0] == s.default(BASE, DECODE) and cands[0].decode_only
    _fits_all(BASE, cands)
    assert {c.decode_only for c in cands} == {False, True} and {c.fused_merge for c in cands} == {False, True}
    assert len({c.num_splits for c in cands}) > 5
    assert all(c.wg_tile is None and c.cp_row_lanes is None and not c.item_queue for c in cands)
    # a split count with its merge is one knob: every split count of the rule's merge comes before two-knob changes
    base = vars(cands[0])
    one = [c for c in cands if changes(c, base) == 1]
    assert {c.num_splits for c in one} >= {1, 8} and cands[1:len(one) + 1] == one


def test_a_cuda_candidate_builds_what_its_plan_loads(monkeypatch):
    """Unfused split partials take a merge_state kernel: built with the candidate (the bench's plan loads both)."""
    import uacompile.targets.cuda.build as cuda_build

    built = []
    monkeypatch.setattr(cuda_build, "build", lambda kernels, arch: built.extend(kernels))
    CUDASpace.build(ir.Kernel(BASE, AttentionConfig(num_splits=4, decode_only=True)))
    assert [k.kind for k in built] == ["paged_attention", "merge_state"] and built[1].op.num_splits == 4
    built.clear()
    CUDASpace.build(ir.Kernel(BASE, AttentionConfig(num_splits=4, fused_merge=True, decode_only=True)))
    assert [k.kind for k in built] == ["paged_attention"]


def test_ordered_is_seeded_and_default_first():
    d = TVMConfig()
    cs = [TVMConfig(lanes=4), TVMConfig(threads=256), TVMConfig(lanes=4, threads=256),
          TVMConfig(num_splits=4, fused_merge=True)]
    a, b = ordered(d, cs, "seed"), ordered(d, list(reversed(cs)), "seed")
    assert a == b and a[0] == d and a[-1] == TVMConfig(lanes=4, threads=256)


def test_tvm_cuda_space_searches_vector_loads_and_heads_a_block():
    """vec (elements a load) and heads (q heads a block, staged K/V) join lanes, threads and fused splits: every
    candidate passes TVMConfig.check, the default first, and 16 trials try every one-knob change (the new knobs'
    included) at a decode and a prefill shape of Llama-3-8B's attention."""
    s = space("tvm-cuda")
    for shape in (Shape.parse("decode:8x16384"), Shape.parse("prefill:1x4096")):
        cands = s.candidates(BASE, shape)
        assert cands[0] == TVMConfig() and len(cands) == len(set(cands))
        for c in cands:
            c.check(BASE)
            assert c.num_splits == 1 or c.fused_merge
        one = [c for c in cands if changes(c, asdict(TVMConfig())) == 1]
        assert {c.vec for c in one} == {1, 2, 4} and {c.heads for c in one} == {1, 2, 4}  # 4 lanes of D 128: vec <= 4
        assert set(one) <= set(trial_configs(s, BASE, shape, 16))
        assert any(c.vec == 8 and c.lanes == 16 for c in cands)
        assert any(c.heads == 4 and c.threads == 512 for c in cands)
    assert {c.heads for c in s.candidates(ir.PagedAttention(32, 32, 128, 16, "bf16", "bf16"), DECODE)} == {1}


# ---------------------------------------------------------------- tvm-cuda from a folder of prebuilt libraries
KERNEL = ir.Kernel(ir.PagedAttention(4, 2, 16, 16, "fp16", "fp16"), TVMConfig(threads=64))


def no_tvm(monkeypatch):
    """This process as on the GPU machine: TVM is not installed."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tvm" else find_spec(name, *a))


def test_a_prebuilt_kernel_is_found_by_symbol_without_tvm(tmp_path, monkeypatch):
    from uacompile.lower import tvm_cuda

    so = tmp_path / f"{KERNEL.symbol()}_sm_90.so"
    so.write_bytes(b"\x7fELF")
    assert tvm_cuda.prebuilt_name(KERNEL, "sm_90") == so.name
    no_tvm(monkeypatch)
    monkeypatch.setattr(tvm_cuda, "build_cuda_library", lambda *a, **k: pytest.fail("built, not found"))
    assert tvm_cuda.cuda_library(KERNEL, "sm_90", tmp_path) == so
    space("tvm-cuda", kernel_dir=tmp_path).build(KERNEL)


def test_a_missing_prebuilt_kernel_without_tvm_is_one_line_naming_it(tmp_path, monkeypatch):
    from uacompile.lower import tvm_cuda

    no_tvm(monkeypatch)
    for kernel_dir in (tmp_path, None):
        with pytest.raises(FileNotFoundError) as e:
            tvm_cuda.cuda_library(KERNEL, "sm_90", kernel_dir)
        assert KERNEL.symbol() in str(e.value) and "\n" not in str(e.value) and "prebuild_tvm_cuda.sh" in str(e.value)
    with pytest.raises(FileNotFoundError, match=KERNEL.symbol()):
        space("tvm-cuda", kernel_dir=tmp_path).build(KERNEL)
    with pytest.raises(ValueError, match="tvm-cuda"):
        space("cuda", kernel_dir=tmp_path)


def test_a_built_tiny_kernel_loads_from_the_folder_without_tvm(tmp_path, monkeypatch):
    """Built here with TVM and nvcc into a folder, then loaded from it (cffi, the launcher's signature) as on the
    GPU machine, where TVM is missing; the tuner's build step only finds it."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    pytest.importorskip("tvm")
    from uacompile.lower.tvm_cuda import build_cuda_library
    from uacompile.tune_space import tvm_cuda_kernel

    so = build_cuda_library(KERNEL, "sm_90", tmp_path)
    no_tvm(monkeypatch)
    monkeypatch.delitem(sys.modules, "tvm", raising=False)
    fn = tvm_cuda_kernel(KERNEL, tmp_path)
    assert Path(fn.library.path) == so and callable(fn)
    s = space("tvm-cuda", kernel_dir=tmp_path)
    s.build(KERNEL)
    with pytest.raises(FileNotFoundError, match=ir.Kernel(KERNEL.op, TVMConfig(threads=256)).symbol()):
        s.build(ir.Kernel(KERNEL.op, TVMConfig(threads=256)))


def test_tune_device_prebuilds_every_tvm_cuda_kernel_its_run_times(monkeypatch):
    """bench/tune_device.py --prebuild-tvm-cuda: the trial configs of each tvm-cuda shape (the same ones tune() takes)
    and the default config bench/tvm_cuda_bench.py runs, at the bench's shapes."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import tune_device
    import tvm_cuda_bench

    kernels = {k.symbol() for k in tune_device.tvm_cuda_kernels(5)}
    [(target, op, shapes)] = tune_device.tuning_jobs(["tvm-cuda"])
    assert target == "tvm-cuda" and op == tvm_cuda_bench.op_of()
    assert [(s.batch, s.length) for s in shapes if s.kind == "decode"] == tvm_cuda_bench.DECODE_SHAPES
    assert [(s.batch, s.length) for s in shapes if s.kind == "prefill"] == tvm_cuda_bench.PREFILL_SHAPES
    s = space("tvm-cuda")
    want = {s.kernel(op, c).symbol() for shape in shapes for c in trial_configs(s, op, shape, 5)}
    assert kernels == want | {k.symbol() for k in tvm_cuda_bench.build_kernels()}
    assert ir.Kernel(op, TVMConfig()).symbol() in kernels
