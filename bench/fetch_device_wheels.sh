#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the small wheels the device machine lacks, for Python 3.12 on
# x86_64: cffi + pycparser (the CUDA loader), gguf (GGUF models), pytest-xdist + execnet (GPU
# tests in parallel workers), nvidia-ml-py (NVML: power and clocks, bench/timing.py power_per_call), platformdirs (the kernel cache directory),
# the server's fastapi + uvicorn + prometheus_client with pydantic, the openai client and its httpx (bench/agent_gpu.py), llguidance (structured output) (and the typing-extensions they need; tests/runtime/test_tvm_cuda_backend_gpu.py's server test). The `run` tool carries .whl; bench/run_device.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
  cffi==2.0.0 pycparser==3.12 gguf==0.19.0 pytest-xdist==3.8.0 execnet==2.1.2 nvidia-ml-py==13.615.71 platformdirs==4.3.8 \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 \
  typing-inspection==0.4.2 uvicorn==0.54.0 opentelemetry-api==1.45.2 typing_extensions==4.16.0 \
  prometheus_client==0.26.0 openai==3.57.0 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 \
  idna==3.20 certifi==2026.5.20 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 tqdm==4.70.1  # run on the H200
# llguidance (structured output): its abi3 wheel is tagged manylinux_2_31
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --platform manylinux_2_31_x86_64 -d .whl \
  llguidance==1.9.1
ls .whl
