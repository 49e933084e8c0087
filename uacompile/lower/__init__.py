"""Lowerings of the IR: TVM (LLVM CPU + CUDA source)."""
