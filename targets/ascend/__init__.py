"""AscendC target: generated kernels, verified on the CPU through a clean-room emulator."""
