"""Back ends that turn generated sources into callable kernels."""
