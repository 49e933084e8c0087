"""Generator-time checks of the AscendC target: UB budget, alignment, blockDim, clear
IRErrors for what it cannot build, g++ -fsyntax-only -Wall -Werror on every generated
source, the CMake project, and what the metadata claims."""
from __future__ import annotations

import json

import pytest

from uacompile.errors import IRError
from uacompile.ir import CopyBlocks, Kernel, PagedAttention, ReshapeAndCache, SwapBlocks
from uacompile.lower.config import TVMConfig
from uacompile.targets.ascend.config import AscendConfig
from uacompile.targets.cuda.config import AttentionConfig
from uacompile.targets.ascend import build
from uacompile.targets.ascend.generate import (ALIGN, MAX_QUEUE_BUFFERS_PER_POSITION, SOCS, UB_BUDGET, UB_BYTES,
                                               UB_SCRATCH_RESERVE, Plan, generate, plan, roofline_estimate, soc_name)

VARIANTS = [
    PagedAttention(4, 4, 64, 16),
    PagedAttention(32, 8, 128, 128),
    PagedAttention(8, 2, 128, 128, q_dtype="bf16", kv_dtype="bf16", window=4096, return_lse=True),
    Kernel(PagedAttention(8, 1, 64, 16, kv_dtype="int8", softcap=30.0, alibi=True), AscendConfig(num_splits=4)),
    PagedAttention(4, 2, 256, 64, q_dtype="fp32", kv_dtype="fp32"),
    ReshapeAndCache(8, 128, 128),
    ReshapeAndCache(3, 40, 16, dtype="bf16", kv_dtype="bf16"),
    ReshapeAndCache(8, 128, 16, kv_dtype="int8"),
    CopyBlocks(8, 128, 128),
    CopyBlocks(8, 128, 16, kv_dtype="int8"),
    SwapBlocks(8, 128, 128),
    SwapBlocks(8, 128, 16, kv_dtype="int8"),
]


@pytest.mark.parametrize("op", VARIANTS, ids=lambda o: o.symbol())
@pytest.mark.parametrize("soc", sorted(SOCS))
def test_plan_fits_the_910b(op, soc):
    p = plan(op, soc)
    assert p.ub_bytes <= UB_BUDGET == UB_BYTES - UB_SCRATCH_RESERVE
    assert all(n <= MAX_QUEUE_BUFFERS_PER_POSITION for n in p.queue_buffers().values())
    assert all(b.bytes % ALIGN == 0 and b.num >= 1 for b in p.buffers.values())
    assert 1 <= p.max_block_dim <= SOCS[soc][0] <= 48
    if soc in ("Ascend910B3", "Ascend910B4") and op.kind != "swap_blocks":
        assert p.max_block_dim == 40


def test_attention_tile_is_the_largest_that_fits():
    assert plan(PagedAttention(8, 2, 128, 16)).consts["TILE"] == 16  # the page bounds it
    big = plan(PagedAttention(32, 8, 128, 128))
    assert big.consts["TILE"] == 64  # 128 positions of fp16 K/V + fp32 copies would overflow UB
    assert big.ub_bytes <= UB_BYTES


@pytest.mark.parametrize("op,field", [
    (lambda: PagedAttention(4, 4, 40, 16), "head_dim"),  # 80 B rows: DataCopy needs 32 B multiples
    (lambda: PagedAttention(4, 4, 48, 16, kv_dtype="int8"), "head_dim"),
    (lambda: PagedAttention(4, 4, 64, 16, kv_dtype="fp8_e4m3"), "kv_dtype"),
    (lambda: PagedAttention(4, 4, 64, 16, variant="unified_masked"), "variant"),
    (lambda: Kernel(PagedAttention(4, 4, 64, 16), TVMConfig(num_splits=2, fused_merge=True)), "fused_merge"),
    (lambda: Kernel(PagedAttention(4, 4, 64, 16), AttentionConfig(item_queue=True)), "item_queue"),
    (lambda: PagedAttention(64, 1, 2048, 16, q_dtype="fp32", kv_dtype="fp32"), "head_dim"),  # over the UB
    (lambda: ReshapeAndCache(4, 64, 16, rope=True), "rope"),
    (lambda: ReshapeAndCache(4, 20, 16, kv_dtype="int8"), "head_dim"),
    (lambda: ReshapeAndCache(4, 64, 16, kv_dtype="fp8_e4m3"), "kv_dtype"),
])
def test_unsupported_variants_raise_irerror_naming_the_field(op, field):
    with pytest.raises(IRError) as e:
        plan(op())
    assert field in e.value.field


def test_unknown_soc_is_rejected():
    with pytest.raises(IRError, match="soc"):
        plan(PagedAttention(4, 4, 64, 16), "Ascend310P")


@pytest.mark.parametrize("given,name,cores", [("ascend910b2c", "Ascend910B2C", 48), ("ascend910b4-1", "Ascend910B4-1", 40),
                                              ("ASCEND910B3", "Ascend910B3", 40), ("Ascend910B1", "Ascend910B1", 48)])
def test_soc_names_are_cann_soc_versions_in_any_case(given, name, cores):
    assert soc_name(given) == name
    p = plan(PagedAttention(8, 2, 64, 16), given)
    assert p.soc == name and p.max_block_dim == cores
    assert f'SOC_VERSION "{name}"' in generate(PagedAttention(8, 2, 64, 16), given).files["CMakeLists.txt"]


# ---------------------------------------------------------------- Plan.check: the emulator's limits
def test_int8_attention_stays_within_eight_vecin_buffers():
    p = plan(Kernel(PagedAttention(8, 1, 64, 16, kv_dtype="int8", softcap=30.0, alibi=True), AscendConfig(num_splits=4)))
    assert p.queue_buffers() == {"VECIN": 7, "VECOUT": 4}  # q 1, k 2, v 2, scales 2 | out 2, lse 2
    assert p.buffers["scale"].bytes == 2 * p.consts["TILE"] * ALIGN


def test_plan_check_rejects_the_old_int8_queue_layout():
    """The layout the int8 attention had (separate K and V scale queues) is refused by name."""
    p = plan(PagedAttention(8, 1, 64, 16, kv_dtype="int8"))
    del p.buffers["scale"]
    p.add("k_scale", 16 * ALIGN, 2, "VECIN")
    p.add("v_scale", 16 * ALIGN, 2, "VECIN")
    with pytest.raises(IRError, match=r"buffers per position: 9 queue buffers on VECIN \(q 1, k 2, v 2, k_scale 2, "
                                      r"v_scale 2\), over the 8 event IDs"):
        p.check()


def test_plan_check_names_the_ub_budget_with_its_scratch_reserve():
    p = Plan(CopyBlocks(8, 128, 16), "Ascend910B1", 48)
    p.add("big", UB_BUDGET - 32)
    p.add("small", 64)  # fits the 192 KB, not the budget
    assert p.ub_bytes <= UB_BYTES
    with pytest.raises(IRError, match=f"UB budget: .* over the {UB_BUDGET} B .* {UB_SCRATCH_RESERVE} B scratch reserve"):
        p.check()


def test_plan_check_names_the_buffers_per_kernel_limit():
    p = Plan(CopyBlocks(8, 128, 16), "Ascend910B1", 48)
    for i in range(65):
        p.add(f"b{i}", 32)
    with pytest.raises(IRError, match="buffers per kernel: 65"):
        p.check()


def test_swap_pages_must_keep_the_64_byte_memcpy_alignment():
    with pytest.raises(IRError, match="64 B alignment"):
        plan(SwapBlocks(1, 24, 1))  # 48 B pages


def test_launcher_uses_sub_allocated_tiling_slots_per_device_checks_the_launch_and_gmalloc_copies():
    src = generate(PagedAttention(8, 2, 64, 16))
    host = src.files[f"{src.symbol}_host.cpp"]
    assert "kSlotRoom = (sizeof(" in host and "+ 31) / 32 * 32 + 32" in host and "(kSlotRoom + 63) / 64 * 64" in host
    assert "aclrtGetDevice(&device)" in host and "by_device[device]" in host
    assert "aclrtSynchronizeEvent(g.done[slot])" in host and "aclrtRecordEvent(slots->done[slot]" in host
    assert "const uint32_t launched = ACLRT_LAUNCH_KERNEL(" in host and "if (launched != 0) return" in host
    assert "ICPU_RUN_KF(" in host and "q_gm, k_cache_gm" in host and "gm_copy_out(out, out_gm" in host


def test_kernels_take_event_ids_from_the_pipe_and_avoid_reciprocal_and_ln_zero():
    for op in (Kernel(PagedAttention(8, 1, 64, 16, kv_dtype="int8", softcap=30.0, alibi=True), AscendConfig(num_splits=4)),
               ReshapeAndCache(8, 128, 16, kv_dtype="int8")):
        src = generate(op)
        kernel = src.files[f"{src.symbol}_kernel.cpp"]
        assert "FetchEventID" in kernel
        assert "SetFlag<AscendC::HardEvent::V_S>(0)" not in kernel and "Flag<" not in kernel.replace("Flag<E>", "")
        assert "AscendC::Reciprocal(" not in kernel
        if op.kind == "paged_attention":  # Ln sees 1 for an empty range, whose lse is -inf written on the scalar unit
            assert "lse_l.SetValue(h, l[h] > 0.0f ? l[h] : 1.0f)" in kernel and "lo.SetValue(h, NEG_INF)" in kernel


def test_blockdim_cap_reaches_the_launcher():
    src = generate(PagedAttention(8, 2, 64, 16), "Ascend910B3")
    host = src.files[f"{src.symbol}_host.cpp"]
    assert f"{src.symbol}_max_block_dim = 40" in host
    assert "std::min<int64_t>(t.num_units" in host


def test_every_generated_source_passes_gxx_wall_werror(tmp_path):
    for i, op in enumerate(VARIANTS):
        src = generate(op)
        d = tmp_path / str(i)
        src.write(d)
        cmds = build.syntax_check(d, [n for n in src.files if n.endswith(".cpp")])
        assert all("-Wall -Werror" in c for c in cmds)


def test_syntax_check_fails_on_bad_code(tmp_path):
    (tmp_path / "bad_host.cpp").write_text("int f() { int unused = 1; return 0; }\n")
    with pytest.raises(build.BuildError, match="unused"):
        build.syntax_check(tmp_path, ["bad_host.cpp"])


def test_cmake_project_and_metadata_say_what_is_verified():
    op = PagedAttention(8, 2, 128, 128)
    src = generate(op)
    cmake = src.files["CMakeLists.txt"]
    for needle in ("ascendc_library(", "RUN_MODE", "cpu / sim / npu", "tikicpulib", "ascendc.cmake", "ascendcl"):
        assert needle in cmake
    assert f"ascendc_library({src.symbol}_kernels SHARED" in cmake and "STATIC" not in cmake
    kernel = src.files[f"{src.symbol}_kernel.cpp"]
    assert '#include "kernel_operator.h"' in kernel
    assert f'extern "C" __global__ __aicore__ void {src.kernel}(' in kernel
    meta = json.loads(src.files[f"{src.symbol}.json"])
    assert "not run on NPU hardware" in meta["status"]
    assert meta["verified"] == "no"  # until build_and_verify ran it
    assert "roofline" in meta["speed"] and meta["plan"]["ub_bytes"] <= UB_BYTES
    for name, text in src.files.items():
        if name.endswith((".cpp", ".h", ".txt")):
            assert "not run on NPU hardware" in text, name


def test_build_and_verify_records_the_emulator_result(tmp_path):
    op = ReshapeAndCache(4, 64, 16, kv_dtype="int8")
    entry = build.build_and_verify(op, tmp_path)
    assert entry["verified"] == "emulator", entry
    assert entry["checks"] and all(c["ok"] for c in entry["checks"])
    assert (tmp_path / "CMakeLists.txt").exists() and entry["library"].endswith(".so")
    meta = json.loads((tmp_path / f"{op.symbol()}.json").read_text())
    assert meta["verified"] == "emulator"
    unsupported = build.build_and_verify(PagedAttention(4, 4, 64, 16, kv_dtype="fp8_e4m3"), tmp_path / "x")
    assert unsupported["verified"].startswith("unsupported:") and "kv_dtype" in unsupported["verified"]


def test_roofline_is_an_estimate_from_910b_figures():
    op = PagedAttention(32, 8, 128, 128)
    r = roofline_estimate(op, num_tokens=32, kv_len=4096)
    kv_bytes = 32 * 8 * 4096 * 2 * 128 * 2
    assert r["measured"] is False and r["bytes"] >= kv_bytes
    assert r["seconds"] == pytest.approx(r["bytes"] / 1.6e12)
