"""The AscendC emulator's own semantics: documented edge cases against numpy, and the
rule violations it must reject (see targets/ascend/emulator/selftest.cpp). Each contract
rule of targets/ascend/README.md has a small kernel here that breaks it and is rejected;
where the generated kernels used to break a rule, that kernel is the old pattern."""
from __future__ import annotations

import subprocess

import cffi
import ml_dtypes
import numpy as np
import pytest

from uacompile.cache import cached_build, content_hash, toolchain_versions
from uacompile.targets.ascend import build
from uacompile.targets.ascend.generate import EMULATOR_DIR

CDEF = """
const char* st_last_error(void);
int st_datacopy_half(uint16_t*, uint16_t*, int64_t, uint32_t);
int st_datacopy_params(float*, int64_t, float*, int64_t, uint16_t, uint16_t, uint16_t, uint16_t);
int st_datacopy_pad_in(float*, int64_t, float*, int64_t, uint16_t, uint32_t, uint32_t, uint32_t, int, int, int, float);
int st_datacopy_pad_out(float*, int64_t, float*, int64_t, uint16_t, uint32_t, uint32_t, uint32_t);
int st_reduce(int, float*, int64_t, float*);
int st_cast_f32_f16(float*, uint16_t*, int64_t, int);
int st_cast_f32_bf16(float*, uint16_t*, int64_t, int);
int st_cast_f32_i32(float*, int32_t*, int64_t, int);
int st_block_ids(int64_t*, int64_t);
int st_negative(const char*);
int st_queue_limits(const char*);
int st_softcap(int, float*, float*, int64_t, float);
int st_tiling_slot(int64_t, int64_t);
int st_icpu_run(int64_t*, int64_t, int);
"""
MODES = ["none", "rint", "floor", "ceil", "round", "trunc", "odd"]  # RoundMode order
POISON_F32 = np.uint32(0xFFFFFFFF)


@pytest.fixture(scope="module")
def emu():
    src = (EMULATOR_DIR / "selftest.cpp").read_text()
    key = content_hash("ascend-selftest", src, build.emulator_text(), toolchain_versions(build.CXX))

    def make(tmp):
        build.run_compiler([build.CXX, *build.STD, "-O1", "-fPIC", "-shared", "-pthread", "-Wall", "-Werror",
                    f"-I{EMULATOR_DIR}", str(EMULATOR_DIR / "selftest.cpp"), "-o", "libselftest.so"], cwd=tmp)

    folder, _ = cached_build("ascend-selftest", key, make)
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    return ffi, ffi.dlopen(str(folder / "libselftest.so"))


def ptr(ffi, a, ctype):
    return ffi.cast(ctype, a.ctypes.data)


def call(emu, name, *args):
    ffi, lib = emu
    rc = getattr(lib, name)(*args)
    return rc, ffi.string(lib.st_last_error()).decode() if rc else ""


# ---------------------------------------------------------------- DataCopy
def test_datacopy_whole_blocks_copies_exactly(emu, rng):
    ffi, _ = emu
    x = rng.standard_normal(64).astype(np.float16)
    out = np.zeros(64, np.float16)
    rc, msg = call(emu, "st_datacopy_half", ptr(ffi, x.view(np.uint16), "uint16_t*"),
                   ptr(ffi, out.view(np.uint16), "uint16_t*"), 64, 48)
    assert rc == 0, msg
    np.testing.assert_array_equal(out[:48], x[:48])
    assert not out[48:].any()


def test_datacopy_rejects_count_the_hardware_would_round_down(emu, rng):
    ffi, _ = emu
    x, out = np.ones(64, np.float16), np.zeros(64, np.float16)
    rc, msg = call(emu, "st_datacopy_half", ptr(ffi, x.view(np.uint16), "uint16_t*"),
                   ptr(ffi, out.view(np.uint16), "uint16_t*"), 64, 20)  # 40 B
    assert rc == 1 and "not a multiple of 32" in msg and "DataCopyPad" in msg
    assert not out.any()


@pytest.mark.parametrize("count,blen,sgap,dgap", [(3, 1, 2, 0), (4, 2, 0, 1), (2, 3, 5, 2)])
def test_datacopy_params_blocks_and_gaps(emu, rng, count, blen, sgap, dgap):
    ffi, _ = emu
    x = rng.standard_normal(512).astype(np.float32)
    ub = np.full(256, np.nan, np.float32)
    rc, msg = call(emu, "st_datacopy_params", ptr(ffi, x, "float*"), 512, ptr(ffi, ub, "float*"), 256, count, blen,
                   sgap, dgap)
    assert rc == 0, msg
    want = np.zeros(256, np.float32)
    for r in range(count):  # blocks of 8 floats, gaps in blocks on each side
        want[r * (blen + dgap) * 8:][:blen * 8] = x[r * (blen + sgap) * 8:][:blen * 8]
    np.testing.assert_array_equal(ub, want)


@pytest.mark.parametrize("count,blen,sgap,dgap,is_pad,left,right,value", [
    (3, 20, 8, 0, 0, 0, 0, 0.0),    # rows of 5 floats: 3 undefined floats per 32 B row
    (2, 12, 4, 1, 1, 2, 3, -2.5),   # 2 left + 3 floats + 3 right = 8 floats, padded rows, 1 block gap
    (4, 32, 0, 0, 0, 0, 0, 0.0),    # whole blocks, contiguous
    (1, 36, 0, 0, 1, 0, 7, 9.0),    # 9 floats + 7 right padding = 16 floats
])
def test_datacopy_pad_in_layout(emu, rng, count, blen, sgap, dgap, is_pad, left, right, value):
    ffi, _ = emu
    x = rng.standard_normal(256).astype(np.float32)
    ub = np.zeros(128, np.float32)
    rc, msg = call(emu, "st_datacopy_pad_in", ptr(ffi, x, "float*"), 256, ptr(ffi, ub, "float*"), 128, count, blen,
                   sgap, dgap, is_pad, left, right, value)
    assert rc == 0, msg
    want = np.full(128, 7.0, np.float32).view(np.uint32)  # UB before the copy
    n = blen // 4
    row = -(-(left + n + right) // 8) * 8
    for r in range(count):
        seg = np.full(row, POISON_F32, np.uint32)  # undefined bytes are 0xFF
        if is_pad:
            seg[:] = np.float32(value).view(np.uint32)
        seg[left:left + n] = x[r * (n + sgap // 4):][:n].view(np.uint32)
        want[r * (row + dgap * 8):][:row] = seg
    np.testing.assert_array_equal(ub.view(np.uint32), want)


@pytest.mark.parametrize("count,blen,sgap,dgap", [(3, 20, 0, 4), (2, 12, 1, 0), (2, 64, 0, 8)])
def test_datacopy_pad_out_writes_exact_bytes(emu, rng, count, blen, sgap, dgap):
    ffi, _ = emu
    ub = rng.standard_normal(128).astype(np.float32)
    gm = np.full(256, -1.0, np.float32)
    rc, msg = call(emu, "st_datacopy_pad_out", ptr(ffi, ub, "float*"), 128, ptr(ffi, gm, "float*"), 256, count, blen,
                   sgap, dgap)
    assert rc == 0, msg
    want = np.full(256, -1.0, np.float32)
    n, row = blen // 4, -(-blen // 32) * 8
    for r in range(count):
        want[r * (n + dgap // 4):][:n] = ub[r * (row + sgap * 8):][:n]
    np.testing.assert_array_equal(gm, want)


# ---------------------------------------------------------------- reductions
def test_reduce_max_ties_give_the_smallest_index(emu, rng):
    ffi, _ = emu
    x = rng.standard_normal(100).astype(np.float32)
    top = x.max() + 1
    for i in (17, 42, 99):
        x[i] = top
    out = np.zeros(2, np.float32)
    rc, msg = call(emu, "st_reduce", 0, ptr(ffi, x, "float*"), 100, ptr(ffi, out, "float*"))
    assert rc == 0, msg
    assert out[0] == top and out[1] == 17


def test_reduce_sum_matches_float64(emu, rng):
    ffi, _ = emu
    x = rng.standard_normal(1000).astype(np.float32)
    out = np.zeros(2, np.float32)
    rc, msg = call(emu, "st_reduce", 1, ptr(ffi, x, "float*"), 1000, ptr(ffi, out, "float*"))
    assert rc == 0, msg
    assert abs(out[0] - x.astype(np.float64).sum()) < 1e-4


# ---------------------------------------------------------------- Cast
def _neighbours(x: np.ndarray, dtype):
    """For each float32 x: the nearest representable values below and above in dtype."""
    y = x.astype(dtype)  # round to nearest even
    y64 = y.astype(np.float64)
    with np.errstate(over="ignore"):
        lo = np.where(y64 <= x, y, np.nextafter(y, dtype(-np.inf)))
        hi = np.where(y64 >= x, y, np.nextafter(y, dtype(np.inf)))
    return lo, hi


def _expected_f16(x: np.ndarray, mode: str) -> np.ndarray:
    x64 = x.astype(np.float64)
    if mode in ("none", "rint"):
        return x.astype(np.float16)
    lo, hi = _neighbours(x, np.float16)
    lo64, hi64 = lo.astype(np.float64), hi.astype(np.float64)
    if mode == "floor":
        return lo
    if mode == "ceil":
        return hi
    if mode == "trunc":
        return np.where(x64 >= 0, lo, hi)
    if mode == "round":  # nearest, ties away from zero
        dlo, dhi = x64 - lo64, hi64 - x64
        away = np.where(x64 >= 0, hi, lo)
        return np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, away))
    # odd: exact stays, otherwise the neighbour whose last significand bit is 1
    odd_lo = (lo.view(np.uint16) & 1) == 1
    return np.where(lo64 == x64, lo, np.where(odd_lo, lo, hi))


def _cast_inputs(rng):
    x = np.concatenate([
        rng.standard_normal(200) * 10,
        np.array([0.5, 1.5, 2.5, -0.5, -2.5, 1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 65504, -65504, 0.0, -0.0]),
        rng.standard_normal(40) * 1e-6,  # half subnormals
        (rng.integers(-2000, 2000, 36) / 8.0),  # exact halves and ties
    ]).astype(np.float32)
    return x


@pytest.mark.parametrize("mode", MODES)
def test_cast_f32_to_f16_rounding_modes(emu, rng, mode):
    ffi, _ = emu
    x = _cast_inputs(rng)
    out = np.zeros(len(x), np.float16)
    rc, msg = call(emu, "st_cast_f32_f16", ptr(ffi, x, "float*"), ptr(ffi, out.view(np.uint16), "uint16_t*"), len(x),
                   MODES.index(mode))
    assert rc == 0, msg
    np.testing.assert_array_equal(out.view(np.uint16), _expected_f16(x, mode).view(np.uint16))


def test_cast_f32_to_bf16_is_round_to_nearest_even(emu, rng):
    ffi, _ = emu
    x = np.concatenate([rng.standard_normal(250), [1 + 2 ** -8, 1 + 3 * 2 ** -8, 3e38, -3e38, 1e-40, 0.0]]).astype(np.float32)
    x = x[:256]
    out = np.zeros(len(x), np.uint16)
    rc, msg = call(emu, "st_cast_f32_bf16", ptr(ffi, x, "float*"), ptr(ffi, out, "uint16_t*"), len(x), 1)
    assert rc == 0, msg
    np.testing.assert_array_equal(out, x.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("mode", ["rint", "floor", "ceil", "round", "trunc"])
def test_cast_f32_to_i32_modes_and_saturation(emu, rng, mode):
    ffi, _ = emu
    x = np.concatenate([rng.standard_normal(120) * 100, [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3e9, -3e9]]).astype(np.float32)
    out = np.zeros(len(x), np.int32)
    rc, msg = call(emu, "st_cast_f32_i32", ptr(ffi, x, "float*"), ptr(ffi, out, "int32_t*"), len(x), MODES.index(mode))
    assert rc == 0, msg
    x64 = x.astype(np.float64)
    f = {"rint": np.rint, "floor": np.floor, "ceil": np.ceil, "trunc": np.trunc,
         "round": lambda v: np.sign(v) * np.floor(np.abs(v) + 0.5)}[mode]
    want = np.clip(f(x64), -2 ** 31, 2 ** 31 - 1).astype(np.int64)
    np.testing.assert_array_equal(out, want)


# ---------------------------------------------------------------- the block runner
def test_every_block_runs_with_its_index(emu):
    ffi, _ = emu
    out = np.full(2 * 7, -1, np.int64)
    rc, msg = call(emu, "st_block_ids", ptr(ffi, out, "int64_t*"), 7)
    assert rc == 0, msg
    np.testing.assert_array_equal(out[0::2], np.arange(7))
    np.testing.assert_array_equal(out[1::2], np.full(7, 7))


# ---------------------------------------------------------------- rejections
NEGATIVE = {
    "datacopy_count": "not a multiple of 32",
    "misaligned_ub": "not 32 B aligned",
    "gm_out_of_bounds": "past the GlobalTensor",
    "gm_unregistered": "outside every registered GM buffer",
    "block_count": "blockCount 4096",
    "pad_undefined": "must be a multiple of 32",
    "ub_overflow": "UB overflow",
    "deque_empty": "DeQue on an empty queue",
    "alloc_beyond": "all 1 buffers are in use",
    "enque_beyond_depth": "beyond the queue depth",
    "double_free": "double free",
    "free_queued": "still queued",
    "leak": "leaked at kernel exit",
    "waitflag_unset": "without a matching SetFlag",
    "reduce_tmp_small": "exceeds tmp",
    "hazard_v_v": "PipeBarrier<PIPE_V>",
    "hazard_v_s": "WaitFlag<HardEvent::V_S>",
    "hazard_s_v": "WaitFlag<HardEvent::S_V>",
    "hazard_mte2_v": "VECIN queue",
    "hazard_v_mte3": "VECOUT queue",
    "partial_overlap": "partially overlap",
    # the documented contract (README.md, "Rules the emulator enforces")
    "ub_scratch_reserve": "stay free as API scratch",
    "event_id_literal": "not issued by the TPipe",
    "event_id_literal_after_fetch": "not issued by the TPipe",
    "scalar_war_mte3": "write-after-read",
    "event_id_reserved": "reserved",
    "setflag_twice": "twice without a WaitFlag",
    "setflag_unwaited": "without a WaitFlag before the kernel ends",
    "cast_bf16_none": "CAST_NONE is not in the A2 Cast table",
    "cast_i32_none": "CAST_NONE is not in the A2 Cast table",
    "cast_i32_half_no_deqscale": "needs SetDeqScale",
    "ln_zero": "undocumented on A2",
}


@pytest.mark.parametrize("case", sorted(NEGATIVE))
def test_rule_violations_are_rejected(emu, case):
    rc, msg = call(emu, "st_negative", case.encode())
    assert rc == 1, f"{case} was accepted"
    assert NEGATIVE[case] in msg, msg


@pytest.mark.parametrize("case", ["ok", "cast_i32_half_deqscale", "scalar_war_mte3_synced"])
def test_the_synchronised_control_programs_pass(emu, case):
    rc, msg = call(emu, "st_negative", case.encode())
    assert rc == 0, msg


# ---------------------------------------------------------------- queue and buffer limits
def test_nine_vecin_buffers_of_the_old_int8_attention_are_rejected(emu):
    """q 1 + k 2 + v 2 + k_scale 2 + v_scale 2 = 9 buffers on VECIN: one more than A2's 8 event IDs."""
    rc, msg = call(emu, "st_queue_limits", b"attention_int8_queues")
    assert rc == 1 and "9 queue buffers on one TPosition" in msg, msg
    rc, msg = call(emu, "st_queue_limits", b"attention_int8_queues_fixed")
    assert rc == 0, msg


def test_a_freed_buffer_holds_its_event_id_until_reallocated(emu):
    rc, msg = call(emu, "st_queue_limits", b"event_id_held_until_alloc")
    assert rc == 1 and "no free event ID" in msg, msg
    rc, msg = call(emu, "st_queue_limits", b"event_id_freed_on_alloc")
    assert rc == 0, msg


def test_more_than_64_buffers_per_kernel_are_rejected(emu):
    rc, msg = call(emu, "st_queue_limits", b"buffers_per_kernel")
    assert rc == 1 and "65 buffers in one kernel" in msg, msg


# ---------------------------------------------------------------- Reciprocal accuracy
def test_reciprocal_softcap_misses_the_fp16_tolerance_and_div_meets_it(emu, rng):
    """The old soft-cap took 1/(e+1) by Reciprocal; at its documented error (1e-4 relative for
    float) times 2 cap = 60 the scores move by ~6e-3, beyond the fp16 tolerance."""
    ffi, _ = emu
    cap = 30.0
    x = (rng.standard_normal(256) * 20).astype(np.float32)
    want = cap * np.tanh(x.astype(np.float64) / cap)
    errs = []
    for which in (0, 1):
        out = np.zeros_like(x)
        rc, msg = call(emu, "st_softcap", which, ptr(ffi, x, "float*"), ptr(ffi, out, "float*"), len(x), cap)
        assert rc == 0, msg
        errs.append(float(np.max(np.abs(out - want))))
    assert errs[0] > 2e-3 and errs[1] < 1e-4, errs


# ---------------------------------------------------------------- aclrtMemcpyAsync alignment
def test_tiling_slots_sizeof_apart_break_the_64_byte_memcpy_rule(emu):
    """Slot 1 of a 40 B tiling struct 40 B in is not 64-byte aligned: rejected."""
    rc, msg = call(emu, "st_tiling_slot", 40, 1)
    assert rc == 1 and "64-byte aligned" in msg, msg


@pytest.mark.parametrize("slot", [0, 1])
def test_tiling_slots_64_bytes_apart_break_the_sub_allocation_rule(emu, slot):
    """A 40 B piece of an aclrtMalloc block takes ALIGN_UP(40, 32) + 32 = 96 B, 128 B apart: the
    old launcher's 64 B slots are rejected, 128 B slots pass."""
    rc, msg = call(emu, "st_tiling_slot", 64, slot)
    assert rc == 1 and "ALIGN_UP(len, 32) + 32 = 96 B" in msg, msg
    rc, msg = call(emu, "st_tiling_slot", 128, slot)
    assert rc == 0, msg


# ---------------------------------------------------------------- ICPU_RUN_KF
def test_icpu_run_kf_rejects_caller_memory_the_old_cpu_launcher_passed(emu):
    ffi, _ = emu
    out = np.full(5, -1, np.int64)
    rc, msg = call(emu, "st_icpu_run", ptr(ffi, out, "int64_t*"), 5, 0)
    assert rc == 1 and "not GmAlloc memory" in msg, msg
    assert (out == -1).all()


def test_icpu_run_kf_runs_a_process_per_block_over_gmalloc_memory(emu):
    """Every block's GM write comes back; a block's write to a global stays in its process."""
    ffi, _ = emu
    out = np.full(5, -1, np.int64)
    rc, msg = call(emu, "st_icpu_run", ptr(ffi, out, "int64_t*"), 5, 1)
    assert rc == 0, msg
    np.testing.assert_array_equal(out, np.arange(5))


# ---------------------------------------------------------------- compile-time rules
def _compile(tmp_path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "t.cpp").write_text('#include "acl/acl.h"\n#include "kernel_operator.h"\nusing namespace AscendC;\n' + body)
    return subprocess.run([build.CXX, *build.STD, "-fsyntax-only", "-Wall", "-Werror", f"-I{EMULATOR_DIR}", "t.cpp"],
                          cwd=tmp_path, capture_output=True, text=True)


def test_a_cast_pair_outside_the_a2_table_does_not_build(tmp_path):
    bad = _compile(tmp_path, "void f(LocalTensor<half> d, LocalTensor<bfloat16_t> s) { Cast(d, s, RoundMode::CAST_RINT, 64); }\n")
    assert bad.returncode != 0 and "not in the Atlas A2 Cast table" in bad.stderr
    ok = _compile(tmp_path, "void f(LocalTensor<half> d, LocalTensor<float> s) { Cast(d, s, RoundMode::CAST_RINT, 64); }\n")
    assert ok.returncode == 0, ok.stderr


def test_ignoring_the_launch_status_does_not_build(tmp_path):
    """The old launcher dropped ACLRT_LAUNCH_KERNEL's status; with -Werror that no longer builds."""
    kernel = "extern \"C\" __global__ __aicore__ void k(GM_ADDR x) { (void)x; }\n"
    bad = _compile(tmp_path, kernel + "void f(uint8_t* x) { ACLRT_LAUNCH_KERNEL(k)(1, nullptr, x); }\n")
    assert bad.returncode != 0 and "ignoring return value" in bad.stderr, bad.stderr
    ok = _compile(tmp_path, kernel + "int f(uint8_t* x) { return (int)ACLRT_LAUNCH_KERNEL(k)(1, nullptr, x); }\n")
    assert ok.returncode == 0, ok.stderr
