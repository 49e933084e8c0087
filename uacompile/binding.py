"""Check call arguments against an op's params() and bind its symbolic dims: one binder for all targets.

    binder = Binder(op, (NUMPY,))              # once per op: the checking plan
    tensors, sizes = binder(kwargs)            # every call: both in launcher order

A call passes keyword tensors named as in op.params(); sizes may be omitted (bound from the
shapes). Each tensor is checked for its array type, dtype, rank, fixed dims, symbolic dims
(bound consistently across tensors), C-contiguity and, for outputs, writeability; then each
given size against the dims the shapes bound. A wrong type or dtype is a TypeError, a wrong
shape, layout or value a ValueError; every message names the op and the argument
(`merge_state.out: ...`). An optional tensor that is not given binds as None.

Users: the TVM CPU kernels and the runtime's reference backend (host_binder: numpy arrays or
torch CPU tensors), the Ascend emulator (NUMPY), the CUDA kernels (TORCH, on any device). Each
target adds only its own checks after binding: devices and alignment, views, pointers.
"""
from __future__ import annotations

import numbers
from operator import attrgetter

import numpy as np

from .ir import OpSpec, numpy_dtype, torch_dtype

# the kernels read these as raw bytes and decode them, so the bytes may also come as uint8
RAW_BYTE_DTYPES = ("fp8_e4m3",)


class ArrayType:
    """How the binder reads one array library's tensors.

    The binder calls `owns` once per Python type and `accessors` once per binder; the accessors
    run on every tensor of every call, so they are plain (C-level where possible) callables."""

    label = "an array"  # for "expected <label>, got list"

    def owns(self, x) -> bool:
        raise NotImplementedError

    def dtypes(self, dtype: str) -> tuple:
        """The library's dtypes accepted for IR dtype `dtype`."""
        raise NotImplementedError

    def accessors(self) -> tuple:
        """(is_contiguous(x), is_writeable(x) or None, placement_error(x) or None); called after owns()."""
        raise NotImplementedError

    def strides(self, x) -> tuple:
        """Strides in elements (for messages)."""
        raise NotImplementedError


class NumpyArrays(ArrayType):
    label = "a numpy array"

    def owns(self, x) -> bool:
        return isinstance(x, np.ndarray)

    def dtypes(self, dtype: str) -> tuple:
        return (numpy_dtype(dtype),) + ((np.dtype(np.uint8),) if dtype in RAW_BYTE_DTYPES else ())

    def accessors(self) -> tuple:
        return attrgetter("flags.c_contiguous"), attrgetter("flags.writeable"), None

    def strides(self, x) -> tuple:
        return tuple(s // x.itemsize for s in x.strides)


class TorchTensors(ArrayType):
    """torch tensors on any device (the target checks placement), or with cpu_only on the CPU.

    torch is imported only when a torch tensor arrives: numpy-only callers never load it."""

    def __init__(self, cpu_only: bool = False):
        self.cpu_only = cpu_only
        self.label = "a torch CPU tensor" if cpu_only else "a torch.Tensor"

    def owns(self, x) -> bool:
        if not type(x).__module__.startswith("torch"):
            return False
        import torch

        return isinstance(x, torch.Tensor)

    def dtypes(self, dtype: str) -> tuple:
        import torch

        return (torch_dtype(dtype),) + ((torch.uint8,) if dtype in RAW_BYTE_DTYPES else ())

    def accessors(self) -> tuple:
        import torch

        return torch.Tensor.is_contiguous, None, _cpu_placement_error if self.cpu_only else None

    def strides(self, x) -> tuple:
        return x.stride()


def _cpu_placement_error(x) -> str | None:
    return None if x.device.type == "cpu" else f"must be on the CPU, got device {x.device}"


NUMPY = NumpyArrays()
TORCH = TorchTensors()
TORCH_CPU = TorchTensors(cpu_only=True)


def shape_str(shape) -> str:
    """[num_tokens, 8, 128]: a spec's shape as the messages and docs write it."""
    return "[" + ", ".join(map(str, shape)) + "]"


class Binder:
    """The per-op checking plan, computed once: its call runs on every launch (every layer, every step)."""

    def __init__(self, op: OpSpec, array_types: tuple[ArrayType, ...]):
        self.op, self.kind = op, op.kind
        params = op.params()
        self.names = [p.name for p in params]
        self.name_set = frozenset(self.names)
        self.tensor_specs = [p for p in params if not p.is_scalar]
        self.size_specs = [p for p in params if p.is_scalar]
        self.array_types = tuple(array_types)
        self.expected = " or ".join(a.label for a in self.array_types)
        self._owner: dict[type, int] = {}  # Python type -> index of the array type that owns it
        # per array type, filled on its first tensor: accepted dtypes per tensor, and its accessors
        self._accepted: list[list | None] = [None] * len(self.array_types)
        self._accessors: list[tuple | None] = [None] * len(self.array_types)

    def __call__(self, args: dict) -> tuple[list, list[int]]:
        kind = self.kind
        for name in args:
            if name not in self.name_set:
                raise TypeError(f"{kind}: unexpected argument {name!r}; parameters: {self.names}")
        dims: dict[str, int] = {}
        bound_by: dict[str, str] = {}  # dim -> the tensor that bound it
        tensors = []
        for i, p in enumerate(self.tensor_specs):
            x = args.get(p.name)
            if x is None:
                if p.optional:
                    tensors.append(None)
                    continue
                raise TypeError(f"{kind}: missing tensor argument {p.name!r} ({p.dtype} {shape_str(p.shape)})")
            j = self._owner.get(x.__class__)
            if j is None:
                j = self._owner_of(p, x)
            accepted = self._accepted[j]
            if accepted is None:  # accessors first: another thread may read them once accepted is set
                self._accessors[j] = self.array_types[j].accessors()
                accepted = self._accepted[j] = [self.array_types[j].dtypes(t.dtype) for t in self.tensor_specs]
            is_contiguous, is_writeable, placement_error = self._accessors[j]
            if x.dtype not in accepted[i]:
                want = " or ".join(str(d) for d in accepted[i])
                raise TypeError(f"{kind}.{p.name}: expected dtype {want}, got {x.dtype}")
            shape = x.shape
            if len(shape) != len(p.shape):
                raise ValueError(f"{kind}.{p.name}: expected {len(p.shape)} dims {shape_str(p.shape)}, "
                                 f"got shape {tuple(shape)}")
            for axis, (want, got) in enumerate(zip(p.shape, shape)):
                if want.__class__ is int:
                    if got != want:
                        raise ValueError(f"{kind}.{p.name}: dim {axis} must be {want} (shape {shape_str(p.shape)}), "
                                         f"got shape {tuple(shape)}")
                elif want not in dims:
                    dims[want], bound_by[want] = got, p.name
                elif dims[want] != got:
                    raise ValueError(f"{kind}.{p.name}: dim {axis} ({want}) is {got}, "
                                     f"but {want} = {dims[want]} from {bound_by[want]}")
            if not is_contiguous(x):
                raise ValueError(f"{kind}.{p.name}: must be C-contiguous "
                                 f"(strides {self.array_types[j].strides(x)} for shape {tuple(shape)})")
            if is_writeable is not None and p.role != "in" and not is_writeable(x):
                raise ValueError(f"{kind}.{p.name}: is an output ({p.role}) and must be writeable")
            if placement_error is not None:
                problem = placement_error(x)
                if problem:
                    raise ValueError(f"{kind}.{p.name}: {problem}")
            tensors.append(x)
        sizes = []
        for p in self.size_specs:
            v = args.get(p.name)
            if v is None:
                if p.name not in dims:
                    raise TypeError(f"{kind}.{p.name}: size not given and no tensor shape implies it")
                v = dims[p.name]
            else:
                if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                    raise TypeError(f"{kind}.{p.name}: must be an int, got {type(v).__name__}")
                v = int(v)
                if v < 0:
                    raise ValueError(f"{kind}.{p.name}: must be >= 0, got {v}")
                if p.name in dims and v != dims[p.name]:
                    raise ValueError(f"{kind}.{p.name}: given {v}, but {p.name} = {dims[p.name]} "
                                     f"from {bound_by[p.name]}")
            sizes.append(v)
        return tensors, sizes

    def _owner_of(self, p, x) -> int:
        for j, arrays in enumerate(self.array_types):
            if arrays.owns(x):
                self._owner[x.__class__] = j
                return j
        raise TypeError(f"{self.kind}.{p.name}: expected {self.expected}, got {type(x).__name__}")


def host_binder(op: OpSpec) -> Binder:
    """Numpy arrays or torch CPU tensors: the CPU targets (TVM-LLVM, the runtime's reference)."""
    return Binder(op, (NUMPY, TORCH_CPU))


__all__ = ["ArrayType", "NumpyArrays", "TorchTensors", "NUMPY", "TORCH", "TORCH_CPU", "RAW_BYTE_DTYPES",
           "Binder", "host_binder", "shape_str"]
