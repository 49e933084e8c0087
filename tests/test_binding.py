"""The shared argument binder (uacompile.binding): symbolic dims, shape / dtype / layout checks, messages.

Every target binds through it: the TVM CPU kernels and the runtime's reference backend (numpy or
torch CPU), the CUDA kernels (torch tensors on any device; placement is the CUDA target's own) and
the Ascend emulator (numpy). The CUDA flavour runs here on CPU and meta tensors.
"""
import numpy as np
import pytest

from uacompile import testing
from uacompile.binding import NUMPY, TORCH, TORCH_CPU, Binder, host_binder
from uacompile.ir import (CopyBlocks, Kernel, MergeState, OpSpec, PagedAttention, ReshapeAndCache, SwapBlocks,
                          TensorSpec, numpy_dtype, size, torch_dtype)
from uacompile.lower.config import TVMConfig

CASES = {
    "attention": (PagedAttention(4, 2, 64), lambda op, rng: testing.attention_inputs(op, rng, [5, 17], [2, 3])),
    "attention-int8-alibi-splits": (Kernel(PagedAttention(8, 2, 64, 16, "bf16", "int8", alibi=True), TVMConfig(num_splits=3)),
                                    lambda op, rng: testing.attention_inputs(op, rng, [40, 9], [1, 4])),
    "attention-fp8-lse": (PagedAttention(4, 1, 32, 8, "fp16", "fp8_e4m3", return_lse=True),
                          lambda op, rng: testing.attention_inputs(op, rng, [3])),
    "reshape-fp8-rope": (ReshapeAndCache(2, 64, 16, "bf16", "fp8_e4m3", rope=True),
                         lambda op, rng: testing.reshape_and_cache_inputs(op, rng, 7, 4)),
    "copy-int8": (CopyBlocks(2, 64, 16, "int8"), lambda op, rng: testing.copy_blocks_inputs(op, rng, 2, 6, 2)),
    "swap": (SwapBlocks(2, 64, 16), lambda op, rng: testing.swap_blocks_inputs(op, rng, 2, 5, 9, 3)),
    "merge-lse": (MergeState(4, 64, 3, return_lse=True), lambda op, rng: testing.merge_state_inputs(op, rng, 6)),
}


def complete(op, inputs: dict) -> dict:
    """inputs plus every tensor the generator leaves to the caller (outputs), shaped from its sizes."""
    args = dict(inputs)
    for p in op.tensors():
        if p.name not in args:
            shape = [inputs[d] if isinstance(d, str) else d for d in p.shape]
            args[p.name] = np.zeros(shape, numpy_dtype(p.dtype))
    return args


def to_torch(x: np.ndarray, dtype: str):
    torch = pytest.importorskip("torch")
    want = torch_dtype(dtype)
    if dtype in ("bf16", "fp8_e4m3"):  # torch.from_numpy knows neither: go through the raw bytes
        return torch.from_numpy(x.view(f"u{x.itemsize}")).view(want)
    return torch.from_numpy(x)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_op_binds_with_sizes_inferred_or_given(case, rng):
    op, make = CASES[case]
    args = complete(op, make(op, rng))
    given = {p.name: args.pop(p.name) for p in op.sizes()}
    for binder in (host_binder(op), Binder(op, (NUMPY,))):
        tensors, sizes = binder(args)
        assert sizes == [given[p.name] for p in op.sizes()]
        assert all(t is args[p.name] for t, p in zip(tensors, op.tensors()))
        assert binder({**args, **given}) == (tensors, sizes)


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_tensors_bind_like_numpy(case, rng):
    op, make = CASES[case]
    args = complete(op, make(op, rng))
    _, want = Binder(op, (NUMPY,))({k: v for k, v in args.items() if isinstance(v, np.ndarray)})
    spec = {p.name: p for p in op.tensors()}
    targs = {k: to_torch(v, spec[k].dtype) for k, v in args.items() if k in spec}
    for binder in (host_binder(op), Binder(op, (TORCH,)), Binder(op, (TORCH_CPU,))):
        tensors, sizes = binder(targs)
        assert sizes == want and all(t is targs[p.name] for t, p in zip(tensors, op.tensors()))


# ---------------------------------------------------------------- messages, the same for every array type
def _numpy(shape, dtype):
    return np.zeros(shape, numpy_dtype(dtype))


def _torch(shape, dtype):
    torch = pytest.importorskip("torch")
    return torch.zeros(shape, dtype=torch_dtype(dtype))


# (make a tensor, binder, how the flavour names fp32 and fp16, what it expects)
FLAVOURS = {
    "numpy": (_numpy, lambda op: Binder(op, (NUMPY,)), ("float32", "float16"), "a numpy array"),
    "host": (_numpy, host_binder, ("float32", "float16"), "a numpy array or a torch CPU tensor"),
    "torch-cuda-flavour": (_torch, lambda op: Binder(op, (TORCH,)), ("torch.float32", "torch.float16"),
                           "a torch.Tensor"),
    "torch-host": (_torch, host_binder, ("torch.float32", "torch.float16"), "a numpy array or a torch CPU tensor"),
}
MERGE = MergeState(4, 64, 2)


def merge_args(new):
    return dict(o_partial=new((2, 3, 4, 64), "fp32"), lse_partial=new((2, 3, 4), "fp32"), out=new((3, 4, 64), "fp16"))


ERRORS = [  # (change to the arguments, exception, message with {fp32} {fp16} {expected} filled per flavour)
    (lambda a, new: a.update(bogus=1), TypeError,
     "merge_state: unexpected argument 'bogus'; parameters: ['o_partial', 'lse_partial', 'out', 'num_tokens']"),
    (lambda a, new: a.pop("out"), TypeError, "merge_state: missing tensor argument 'out' (fp16 [num_tokens, 4, 64])"),
    (lambda a, new: a.update(o_partial=[1, 2]), TypeError, "merge_state.o_partial: expected {expected}, got list"),
    (lambda a, new: a.update(out=new((3, 4, 64), "fp32")), TypeError,
     "merge_state.out: expected dtype {fp16}, got {fp32}"),
    (lambda a, new: a.update(out=new((3, 4, 64, 1), "fp16")), ValueError,
     "merge_state.out: expected 3 dims [num_tokens, 4, 64], got shape (3, 4, 64, 1)"),
    (lambda a, new: a.update(o_partial=new((3, 3, 4, 64), "fp32")), ValueError,
     "merge_state.o_partial: dim 0 must be 2 (shape [2, num_tokens, 4, 64]), got shape (3, 3, 4, 64)"),
    (lambda a, new: a.update(lse_partial=new((2, 4, 4), "fp32")), ValueError,
     "merge_state.lse_partial: dim 1 (num_tokens) is 4, but num_tokens = 3 from o_partial"),
    (lambda a, new: a.update(out=new((3, 64, 4), "fp16").swapaxes(1, 2)), ValueError,
     "merge_state.out: must be C-contiguous (strides (256, 1, 4) for shape (3, 4, 64))"),
    (lambda a, new: a.update(num_tokens=5), ValueError,
     "merge_state.num_tokens: given 5, but num_tokens = 3 from o_partial"),
    (lambda a, new: a.update(num_tokens=3.0), TypeError, "merge_state.num_tokens: must be an int, got float"),
    (lambda a, new: a.update(num_tokens=True), TypeError, "merge_state.num_tokens: must be an int, got bool"),
    (lambda a, new: a.update(num_tokens=-1), ValueError, "merge_state.num_tokens: must be >= 0, got -1"),
]


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("change, exc, message", ERRORS)
def test_errors_name_op_and_argument(flavour, change, exc, message):
    new, make_binder, (fp32, fp16), expected = FLAVOURS[flavour]
    args = merge_args(new)
    change(args, new)
    with pytest.raises(exc) as e:
        make_binder(MERGE)(args)
    assert str(e.value) == message.format(fp32=fp32, fp16=fp16, expected=expected)


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_sizes_may_be_any_int_and_come_back_as_python_ints(flavour):
    new, make_binder, *_ = FLAVOURS[flavour]
    tensors, sizes = make_binder(MERGE)({**merge_args(new), "num_tokens": np.int64(3)})
    assert sizes == [3] and type(sizes[0]) is int and len(tensors) == 3


def test_numpy_outputs_must_be_writeable_inputs_need_not():
    args = merge_args(_numpy)
    args["o_partial"].flags.writeable = False
    Binder(MERGE, (NUMPY,))(args)
    args["out"].flags.writeable = False
    with pytest.raises(ValueError) as e:
        Binder(MERGE, (NUMPY,))(args)
    assert str(e.value) == "merge_state.out: is an output (out) and must be writeable"


def test_fp8_also_binds_as_raw_bytes():
    import torch
    op = CopyBlocks(1, 32, 8, "fp8_e4m3")
    scales = np.zeros((1, 2, 3, 8, 1), np.float32)
    mapping = np.zeros((1, 2), np.int64)
    for kv in (np.zeros((1, 2, 3, 8, 1, 32), numpy_dtype("fp8_e4m3")), np.zeros((1, 2, 3, 8, 1, 32), np.uint8)):
        assert host_binder(op)(dict(kv=kv, scales=scales, mapping=mapping))[1] == [1, 3, 1]
    for dt in (torch.float8_e4m3fn, torch.uint8):
        kv = torch.zeros((1, 2, 3, 8, 1, 32), dtype=dt)
        args = dict(kv=kv, scales=torch.from_numpy(scales), mapping=torch.from_numpy(mapping))
        assert Binder(op, (TORCH,))(args)[1] == [1, 3, 1]
    with pytest.raises(TypeError) as e:
        host_binder(op)(dict(kv=np.zeros((1, 2, 3, 8, 1, 32), np.int8), scales=scales, mapping=mapping))
    assert str(e.value) == "copy_blocks.kv: expected dtype float8_e4m3fn or uint8, got int8"


def test_placement_is_left_to_the_target_except_on_the_host():
    import torch
    args = {k: v.to("meta") for k, v in merge_args(_torch).items()}
    tensors, sizes = Binder(MERGE, (TORCH,))(args)  # the CUDA flavour: placement is the CUDA target's check
    assert sizes == [3] and all(t.device.type == "meta" for t in tensors)
    with pytest.raises(ValueError) as e:
        host_binder(MERGE)(args)
    assert str(e.value) == "merge_state.o_partial: must be on the CPU, got device meta"
    mixed = {**merge_args(_numpy), "out": torch.zeros((3, 4, 64), dtype=torch.float16)}
    assert host_binder(MERGE)(mixed)[1] == [3]  # numpy and torch CPU in one call


class Toy(OpSpec):
    """An op with an optional tensor and a size no shape implies (no shipped op has either yet)."""

    kind = "toy"

    def params(self):
        return [TensorSpec("x", "fp32", ("n", 4)), TensorSpec("bias", "fp32", ("n",), optional=True),
                TensorSpec("y", "fp32", ("n", 4), "out"), size("n"), size("steps")]


def test_optional_tensors_bind_as_none_and_free_sizes_must_be_given():
    x, y = np.zeros((5, 4), np.float32), np.zeros((5, 4), np.float32)
    binder = Binder(Toy(), (NUMPY,))
    assert binder(dict(x=x, y=y, steps=2)) == ([x, None, y], [5, 2])
    bias = np.zeros(5, np.float32)
    assert binder(dict(x=x, bias=bias, y=y, steps=0)) == ([x, bias, y], [5, 0])
    with pytest.raises(ValueError, match=r"^toy\.bias: dim 0 \(n\) is 6, but n = 5 from x$"):
        binder(dict(x=x, bias=np.zeros(6, np.float32), y=y, steps=2))
    with pytest.raises(TypeError, match=r"^toy\.steps: size not given and no tensor shape implies it$"):
        binder(dict(x=x, y=y))
