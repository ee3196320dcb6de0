"""Numeric kernels (NVFP4, sampling), each with a plain-PyTorch reference."""
