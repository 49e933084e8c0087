"""Shared by the CUDA GPU test modules."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest


def cuda_api_with(ops):
    """The CUDA call API with every op of ops built (all nvcc runs at once); skips without a GPU."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from uacompile.targets.cuda import api

    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        list(pool.map(api.kernel, ops))
    return api
