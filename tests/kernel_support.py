"""Helpers for the compiled-kernel tests."""

import contextlib


@contextlib.contextmanager
def forced_dense_streaming(lib, mode: int):
    """The AVX-512 dense kernel streaming few rows of x one way (0: one row walked and the
    prefetch only for pairs of several pieces; 1: one row staged and every pair prefetching),
    whatever the CPU's vendor would pick; the CPU's choice restored afterwards."""
    before = lib.dense_streaming()
    lib.set_dense_streaming(mode)
    try:
        yield
    finally:
        lib.set_dense_streaming(before)
