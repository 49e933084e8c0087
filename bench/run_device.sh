#!/usr/bin/env bash
# On the device (the `run` tool, carry [".whl"] (bench/fetch_device_wheels.sh), ".peers" for FlashInfer rows and
# ".carry/tvm-cuda" (bench/prebuild_tvm_cuda.sh) for the tvm-cuda runtime test):
#   bash bench/run_device.sh                      # all GPU tests, then the whole benchmark
#   UA_GPU_TESTS=tests/targets/cuda/test_cuda_api_gpu.py UA_BENCH_ARGS="--only cache,swap,build" bash bench/run_device.sh
#   UA_GPU_TESTS=tests/targets/cuda/test_cuda_decode_gpu.py UA_BENCH_SCRIPT="bench/decode_sweep.py --extra" bash bench/run_device.sh
#   UA_SKIP_TESTS=1 UA_BENCH_SCRIPT="bench/variant_sweep.py" bash bench/run_device.sh   # head dims, GQA, pages (~30 s)
#   UA_SKIP_TESTS=1 UA_BENCH_SCRIPT='bench/serving_gpu.py --out $OUT' bash bench/run_device.sh   # the serving table
#   UA_GPU_TESTS="tests/test_tune.py tests/targets/cuda/test_cuda_plan_tuned.py" UA_BENCH_SCRIPT='bench/tune_device.py --out $OUT --only production' bash bench/run_device.sh   # uacompile tune's table
#   UA_SKIP_TESTS=1 UA_BENCH_SCRIPT='bench/tune_device.py --out $OUT --only variants --trials 8' bash bench/run_device.sh
#   UA_GPU_TESTS="tests/lower/test_tvm_cuda.py" UA_BENCH_SCRIPT='bench/tune_device.py --out $OUT --only tvm-cuda --trials 16 --tvm-cuda-dir .carry/tvm-cuda/tune; python3 bench/kernels.py --out $OUT --only tvm-cuda --tvm-cuda-dir .carry/tvm-cuda/tune' bash bench/run_device.sh
#     (TVM's kernels from bench/prebuild_tvm_cuda.sh --tune 16, carried in .carry/tvm-cuda: the device has no TVM; 16
#     trials try every one-knob change of TVMConfig's CUDA knobs at each tvm-cuda shape)
# Installs the carried wheels (cffi, pycparser, ...) and the package, runs `pytest -m gpu`, then bench/kernels.py; logs, JSON and table go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/device_setup.sh
# TVM-CUDA kernels built elsewhere (bench/prebuild_tvm_cuda.sh, carry ".carry/tvm-cuda"): the device has no TVM
if [ -d .carry/tvm-cuda ]; then export UA_TVM_CUDA_KERNELS=${UA_TVM_CUDA_KERNELS:-$PWD/.carry/tvm-cuda}; fi
if [ -d .carry/tvm-cuda/tests ]; then export UA_TVM_CUDA_PREBUILT=${UA_TVM_CUDA_PREBUILT:-$PWD/.carry/tvm-cuda/tests}; fi
# the test files with GPU tests (the others may import what the GPU machine lacks: TVM, the server's packages)
GPU_FILES=$(grep -rlE "pytest\.mark\.gpu|mark\.gpu\b" tests --include="test_*.py" | sort)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, uacompile.targets.cuda.api as a; print('torch', torch.__version__, 'api', a.__file__)" || exit 1
rc=0
# FlashInfer's JIT build (~96 s) runs inside the benchmark: a background build during the tests
# (sessions 4-5) never saved it, the benchmark's process built every module again.
if [ "${UA_SKIP_TESTS:-0}" != 1 ]; then
  # one worker per test file when pytest-xdist is carried (.whl, bench/fetch_device_wheels.sh):
  # the files' module fixtures build their kernels once, through the concurrency-safe cache
  # (UA_GPU_WORKERS=0: one process)
  workers=
  if [ "${UA_GPU_WORKERS:-5}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
    workers="-n ${UA_GPU_WORKERS:-5} --dist loadfile"
  fi
  python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors -rfE --durations=12 $workers \
    ${UA_GPU_TESTS:-$GPU_FILES} 2>&1 | tee "$OUT/pytest-gpu.log"
  rc=${PIPESTATUS[0]}
fi
if [ "${UA_SKIP_BENCH:-0}" != 1 ]; then
  if [ -n "${UA_BENCH_SCRIPT:-}" ]; then  # another bench script (with its arguments) instead of kernels.py
    eval python3 ${UA_BENCH_SCRIPT} 2>&1 | tee "$OUT/bench.log"
    rc=$(( rc || PIPESTATUS[0] ))
  else
    python3 bench/kernels.py --out "$OUT" ${UA_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
    rc=$(( rc || PIPESTATUS[0] ))
  fi
fi
exit $rc
