"""uacompile: a kernel compiler for the paged-attention family, and a runtime that serves on it."""
from .errors import IRError
from .ir import (CopyBlocks, MergeState, OpSpec, PagedAttention, ReshapeAndCache, SwapBlocks, TensorSpec,
                 op_from_dict)
from .program import Program

__version__ = "0.1.0"
__all__ = ["IRError", "OpSpec", "TensorSpec", "PagedAttention", "ReshapeAndCache", "CopyBlocks", "SwapBlocks",
           "MergeState", "Program", "op_from_dict", "__version__"]
