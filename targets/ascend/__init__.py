"""AscendC target: generated kernels, verified on the CPU through a clean-room emulator.

generate(op) renders the CANN 8.x sources (kernel, tiling, host launcher, CMake);
build.build_and_verify(op, out_dir) also builds them with g++ against the emulator and
checks them against the numpy reference. Nothing here has run on NPU hardware.
"""
from .generate import DEFAULT_SOC, SOCS, STATUS, generate, plan, roofline_estimate, soc_name

__all__ = ["DEFAULT_SOC", "SOCS", "STATUS", "generate", "plan", "roofline_estimate", "soc_name"]
