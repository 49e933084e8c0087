"""CUDA target: nvcc build of generated sources, cffi launchers on torch streams."""
