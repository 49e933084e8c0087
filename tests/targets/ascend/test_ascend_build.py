"""targets/ascend/build: the emulator builds of generated kernels. The launcher's CANN
CPU-debug branch (ICPU_RUN_KF over GmAlloc copies, a process per block) runs against the
reference like the NPU branch; and each contract rule the generated sources used to break
is shown to be caught: the current sources with the old pattern put back are rejected by
the emulator (or do not build)."""
from __future__ import annotations

import dataclasses

import pytest

from uacompile import testing
from uacompile.ir import Kernel, PagedAttention, ReshapeAndCache
from uacompile.targets.ascend.config import AscendConfig
from uacompile.targets.ascend import build
from uacompile.targets.ascend.generate import generate
from uacompile.targets.ascend.runner import EmulatedKernel, EmulatorError
from uacompile.targets.ascend.verify import attention_error, bit_equal, run_attention, run_inplace, verify

SOFTCAP = PagedAttention(4, 2, 32, 16, softcap=30.0, return_lse=True)
SPLITS = Kernel(PagedAttention(4, 2, 32, 16), AscendConfig(num_splits=3))
RESHAPE = ReshapeAndCache(4, 64, 16, kv_dtype="int8")


# ---------------------------------------------------------------- the CPU-debug launcher
@pytest.mark.parametrize("op", [SPLITS, RESHAPE], ids=lambda o: o.kind)
def test_cpu_debug_launcher_matches_the_reference(op):
    checks = verify(build.load(op, mode="cpu"), seed=1)
    assert checks and all(c["ok"] for c in checks), checks


def test_emulator_library_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        build.emulator_library(RESHAPE, mode="sim")


# ---------------------------------------------------------------- the old patterns are caught
def _edited(op, tmp_path, name: str, old: str, new: str, mode: str = "npu") -> EmulatedKernel:
    """op's generated sources with `old` replaced by `new` in file `name` (kernel / host),
    built against the emulator."""
    src = generate(op)
    fname = f"{src.symbol}_{name}.cpp"
    assert old in src.files[fname], old
    edited = dataclasses.replace(src, files=dict(src.files, **{fname: src.files[fname].replace(old, new)}))
    return EmulatedKernel(op, build.build_emulator(edited, tmp_path, mode))


def test_literal_event_ids_are_rejected(tmp_path, rng):
    kernel = _edited(RESHAPE, tmp_path, "kernel", "Sync<AscendC::HardEvent::V_S>();",
                     "AscendC::SetFlag<AscendC::HardEvent::V_S>(0);\nAscendC::WaitFlag<AscendC::HardEvent::V_S>(0);")
    with pytest.raises(EmulatorError, match="event ID not issued by the TPipe"):
        run_inplace(kernel, testing.reshape_and_cache_inputs(RESHAPE, rng, 5, 2))


def test_softcap_by_reciprocal_misses_the_tolerance(tmp_path, rng):
    kernel = _edited(SOFTCAP, tmp_path, "kernel", "AscendC::Div(work, red, work, n);",
                     "AscendC::Reciprocal(work, work, n);\nAscendC::PipeBarrier<PIPE_V>();\n"
                     "AscendC::Muls(work, work, -2.0f * SOFTCAP, n);")
    inputs = testing.attention_inputs(SOFTCAP, rng, [1, 17, 40])
    err = attention_error(SOFTCAP, inputs, run_attention(kernel, inputs))
    assert err > testing.tolerance("fp16"), err  # the lse moves by ~2 cap * 1e-4 / 2
    fixed = attention_error(SOFTCAP, inputs, run_attention(build.load(SOFTCAP), inputs))
    assert fixed <= testing.tolerance("fp16"), fixed


def test_ln_of_an_empty_split_is_rejected(tmp_path, rng):
    kernel = _edited(SPLITS, tmp_path, "kernel", "lse_l.SetValue(h, l[h] > 0.0f ? l[h] : 1.0f);",
                     "lse_l.SetValue(h, l[h]);")
    inputs = testing.attention_inputs(SPLITS, rng, [1, 20])  # kv_len 1: splits 1 and 2 are empty
    with pytest.raises(EmulatorError, match="Ln: .* undocumented on A2"):
        run_attention(kernel, inputs)


def test_tiling_slots_sizeof_apart_do_not_build(tmp_path):
    src = generate(SPLITS)
    old = "constexpr size_t kSlotBytes = (kSlotRoom + 63) / 64 * 64;"
    with pytest.raises(build.BuildError, match="tiling slots"):
        _edited(SPLITS, tmp_path, "host", old, f"constexpr size_t kSlotBytes = sizeof({src.symbol}_tiling);")


def test_tiling_slots_64_bytes_apart_are_rejected(tmp_path, rng):
    """A 40 B piece of an aclrtMalloc block needs ALIGN_UP(40, 32) + 32 = 96 B: 64 B slots are too small."""
    src = generate(SPLITS)
    old = f"constexpr size_t kSlotRoom = (sizeof({src.symbol}_tiling) + 31) / 32 * 32 + 32;"
    kernel = _edited(SPLITS, tmp_path, "host", old, f"constexpr size_t kSlotRoom = sizeof({src.symbol}_tiling);")
    with pytest.raises(EmulatorError, match=r"ALIGN_UP\(len, 32\) \+ 32 = 96 B"):
        run_attention(kernel, testing.attention_inputs(SPLITS, rng, [3]))


def test_a_second_device_gets_its_own_tiling_slots(tmp_path, rng):
    """Launches on device 1 after device 0 copy into device 1's memory; the old process-global
    slots handed device 1 the block made on device 0, which the emulator rejects."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef("int ua_emu_set_device(int32_t);")
    inputs = testing.attention_inputs(SPLITS, rng, [3, 9])
    fixed = build.load(SPLITS)
    old = "int32_t device = 0;\n    aclError rc = aclrtGetDevice(&device);"
    shared = _edited(SPLITS, tmp_path, "host", old, "int32_t device = 0;\n    aclError rc = ACL_SUCCESS;")
    for kernel, ok in ((fixed, True), (shared, False)):
        lib = ffi.dlopen(str(kernel.library))
        try:
            assert lib.ua_emu_set_device(0) == 0
            want = run_attention(kernel, inputs)
            assert lib.ua_emu_set_device(1) == 0
            if ok:
                got = run_attention(kernel, inputs)
                assert all(bit_equal(got[k], want[k]) for k in want)
            else:
                with pytest.raises(EmulatorError, match="memory of device 0, the current device is 1"):
                    run_attention(kernel, inputs)
        finally:
            lib.ua_emu_set_device(0)


def test_scalar_write_after_a_copy_out_is_rejected(tmp_path, rng):
    """int8 reshape_and_cache: SetValue on a VECOUT buffer right after AllocTensor, while the
    previous copy to GM may still read it (write-after-read, not ordered for the scalar unit)."""
    kernel = _edited(RESHAPE, tmp_path, "kernel", "Sync<AscendC::HardEvent::MTE3_S>();", "")
    with pytest.raises(EmulatorError, match="write-after-read"):
        run_inplace(kernel, testing.reshape_and_cache_inputs(RESHAPE, rng, 5, 2))


def test_exp_of_minus_infinity_on_the_first_tile_is_rejected(tmp_path, rng):
    """A running max started at -inf makes the first tile's rescale Exp(-inf)."""
    kernel = _edited(SPLITS, tmp_path, "kernel", "m[h] = MAX_FLOOR;", "m[h] = NEG_INF;")
    with pytest.raises(EmulatorError, match="Exp of an infinity"):
        run_attention(kernel, testing.attention_inputs(SPLITS, rng, [3]))


def test_icpu_run_kf_over_the_callers_buffers_is_rejected(tmp_path, rng):
    names = [t.name for t in RESHAPE.tensors()]
    old = "".join(f"{n}_gm, " for n in names)
    kernel = _edited(RESHAPE, tmp_path, "host", old, "".join(f"(GM_ADDR){n}, " for n in names), mode="cpu")
    with pytest.raises(EmulatorError, match="not GmAlloc memory"):
        run_inplace(kernel, testing.reshape_and_cache_inputs(RESHAPE, rng, 5, 2))


def test_ignoring_the_launch_status_does_not_build(tmp_path):
    src = generate(RESHAPE)
    with pytest.raises(build.BuildError, match="ignoring return value"):
        _edited(RESHAPE, tmp_path, "host", f"const uint32_t launched = ACLRT_LAUNCH_KERNEL({src.kernel})",
                f"ACLRT_LAUNCH_KERNEL({src.kernel})")


def test_the_fixed_kernels_pass_the_same_cases(rng):
    inputs = testing.attention_inputs(SPLITS, rng, [1, 20])
    assert attention_error(SPLITS, inputs, run_attention(build.load(SPLITS), inputs)) <= testing.tolerance("fp16")
    got, want = run_inplace(build.load(RESHAPE), testing.reshape_and_cache_inputs(RESHAPE, rng, 5, 2))
    assert all(bit_equal(got[k], want[k]) for k in got)
