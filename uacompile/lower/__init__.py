"""Lowerings of the IR: TVM (LLVM CPU + CUDA source). Nothing here imports tvm until used.

- tvm_kernels.prim_func(op, "cpu" | "cuda"): the TIR of any op (params = op.params()), from the
  generators tvm_attention, tvm_cache_ops, tvm_layer_ops and tvm_quant (CPU only) and their shared helpers tvm_tir
- tvm_build.cpu_kernel(op): cached LLVM build -> callable(**tensors_and_sizes)
- tvm_cuda.cuda_source(op, arch) / build_cuda_library(op, arch, out_dir): CUDA + extern "C" launcher
"""
