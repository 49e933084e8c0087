#!/usr/bin/env bash
# Build the tiny preset's CUDA kernels (stories260K: TVM-CUDA .so/.cu for sm_90, and the templates' where they
# apply) with their manifest.json into .carry/tvm-cuda (git-ignored), on a machine with TVM and nvcc, for a GPU
# machine without TVM: the `run` tool carries ".carry/tvm-cuda"; there the runtime loads the kernels by symbol
# (LLM(..., device="cuda", kernel_dir=".carry/tvm-cuda"), fp32 by default: engine.default_dtype), and
# bench/run_device.sh points the GPU test tests/runtime/test_tvm_cuda_backend_gpu.py at it (UA_TVM_CUDA_KERNELS).
# With --tune N, also OUT/tune: every TVM-CUDA kernel that `bench/tune_device.py --only tvm-cuda --trials N` times and
# bench/tvm_cuda_bench.py runs, as <symbol>_sm_90.so (bench/tune_device.py --prebuild-tvm-cuda); on the device
# `--tvm-cuda-dir .carry/tvm-cuda/tune` (tune_device.py, kernels.py) finds them there by symbol. N must be the run's.
#   bash bench/prebuild_tvm_cuda.sh [OUT] [--tune N]    # OUT defaults to .carry/tvm-cuda
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.carry/tvm-cuda
TUNE=
while [ $# -gt 0 ]; do
  case "$1" in
    --tune) TUNE=${2:?--tune takes N, the --trials of the tuning run}; shift 2 ;;
    *) OUT=$1; shift ;;
  esac
done
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
rm -rf "$OUT"
"$PY" -m uacompile.cli build --preset tiny --target cuda --out "$OUT" --quiet
"$PY" - "$OUT" <<'PY'
import sys
from uacompile.build import load_manifest
built = {s: e for s, e in load_manifest(sys.argv[1], "cuda", "tvm").items() if e["library"]}
assert built, f"no TVM-CUDA library in {sys.argv[1]} (is nvcc on PATH?)"
print(f"{len(built)} TVM-CUDA kernels in {sys.argv[1]}: {', '.join(sorted(built))}")
PY
# the TVM-CUDA kernels tests/lower/test_tvm_cuda.py runs on the GPU (its VARIANTS), as <symbol>_sm_90.so in OUT/tests:
# run_device.sh points UA_TVM_CUDA_PREBUILT there
"$PY" - "$OUT/tests" <<'PY'
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("tvm_cuda_tests", Path("tests/lower/test_tvm_cuda.py"))
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
from uacompile.lower.tvm_cuda import build_cuda_library
for name, op in mod.VARIANTS.items():
    build_cuda_library(op, "sm_90", sys.argv[1])
print(f"{len(mod.VARIANTS)} TVM-CUDA test kernels in {sys.argv[1]}")
PY
if [ -n "$TUNE" ]; then
  "$PY" bench/tune_device.py --prebuild-tvm-cuda "$OUT/tune" --trials "$TUNE" --jobs "${UA_PREBUILD_JOBS:-2}"
fi
du -sh "$OUT"
