"""Helpers for the compiled-kernel tests."""

import contextlib


@contextlib.contextmanager
def forced_dense_streaming(lib, mode: int):
    """The AVX-512 dense kernel streaming few rows of x one way (0: one row walked and the
    prefetch only for pairs of several pieces; 1: one row staged and every pair prefetching;
    2: weight rows read straight from memory), whatever the CPU would pick; the CPU's choice
    restored afterwards."""
    before = lib.dense_streaming()
    lib.set_dense_streaming(mode)
    try:
        yield
    finally:
        lib.set_dense_streaming(before)


# The vector widths of the compiled loops between the matrix products (attention, norms,
# activations, rotary, argmax; the drafter step's): each caps the features the kernels may use.
WIDTHS = ("avx512", "avx2", "plain")


@contextlib.contextmanager
def capped_width(lib, width: str):
    """The compiled kernels restricted to `width` (AVX-512 as self-tested, AVX2 alone, or plain
    loops), as a CPU without the wider sets runs them; the self-tested choice restored afterwards.
    Skips (with the reason) where this CPU cannot run that width."""
    import pytest

    from hetero_run.kernels import cpu_ext

    allowed = lib.cpu_features()
    masks = {"avx512": allowed, "avx2": allowed & cpu_ext.FEATURE_AVX2, "plain": 0}
    needs = {"avx512": cpu_ext.FEATURE_AVX512, "avx2": cpu_ext.FEATURE_AVX2, "plain": 0}[width]
    if needs and not allowed & needs:
        pytest.skip(f"this CPU does not run the {width} kernels (CPUID / self-test)")
    lib.set_cpu_features(masks[width])
    try:
        yield
    finally:
        lib.set_cpu_features(allowed)
