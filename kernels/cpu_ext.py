"""The compiled CPU kernels (`csrc/*.cpp`): built on first use, cached, never required.

`ops()` returns `torch.ops.hetero_run` with `nvfp4_linear`, `nvfp4_dequant`, `dense_linear`,
`decode_attention`, `paged_attention`, `rms_norm`, the drafter's `DraftStep`, the target's
`TargetLayer` (decoder_layer.py) and the `cpu_features` family, or None when the library cannot
be built or loaded here (no compiler, no headers, unusual platform): callers then use the
plain-PyTorch paths, after one warning. Before it is returned, the instruction sets its
kernels may use are settled (cpu_isa.py: CPUID, then a self-test in a child process).

The build takes a few seconds with gcc and is cached under
`$XDG_CACHE_HOME/hetero-run/torch-extensions/` (default `~/.cache`), one folder per torch
version and per hash of the sources and flags, so checkouts with different sources on one
machine never overwrite each other's library. A library built from the same sources and flags
(the hash kept beside it) loads directly; otherwise torch's extension builder builds it.
Set `HETERO_RUN_CPU_KERNELS=0` to skip it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from hetero_run.kernels.cpu_isa import CHILD_ENV, FEATURE_AMX, FEATURE_AVX2, FEATURE_AVX512, FEATURE_AVX512_BF16

__all__ = ["FEATURE_AMX", "FEATURE_AVX2", "FEATURE_AVX512", "FEATURE_AVX512_BF16", "cache_dir", "enabled", "features",
           "ops", "release_thread_pool", "supported_features"]

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / f"{name}.cpp" for name in ("cpu_linear", "nvfp4_avx512", "dense_avx512", "avx2", "amx", "portable",
                                              "nvfp4_int8", "decode_ops", "drafter_step", "decoder_layer")]
NAME = "hetero_run_cpu_linear"
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []  # the libgomp torch itself uses

log = logging.getLogger("hetero_run.kernels.cpu_ext")
_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    """Where the library built from these sources lives."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    version = torch.__version__.replace("+", "_")
    tag = f"torch{version}-py{sys.version_info[0]}{sys.version_info[1]}"
    return base / "hetero-run" / "torch-extensions" / tag / build_key()[:16]


def enabled() -> bool:
    return os.environ.get("HETERO_RUN_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def ops():
    """`torch.ops.hetero_run` with the compiled kernels loaded, or None (see module doc)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load() if enabled() else None
    return _state["ops"]


def features() -> int:
    """The instruction sets the kernels may use here (FEATURE_* bits: supported by the CPU, passed
    the self-test, within HETERO_RUN_CPU_ISA); 0 without the library."""
    lib = ops()
    return int(lib.cpu_features()) if lib is not None else 0


def supported_features() -> int:
    """What CPUID and the OS offer (FEATURE_* bits), tested or not; 0 without the library."""
    lib = ops()
    return int(lib.cpu_supported_features()) if lib is not None else 0


def describe() -> str:
    """One line for logs and `hetero-run doctor`: which kernels run bf16 and float32 activations."""
    from hetero_run.kernels import cpu_isa

    lib = ops()
    if lib is None:
        return "compiled CPU kernels unavailable: PyTorch paths"
    return cpu_isa.summary(int(lib.cpu_supported_features()), int(lib.cpu_features()))


def release_thread_pool() -> bool:
    """Hand back the calling thread's OpenMP worker threads (libgomp's `omp_pause_resource_all`);
    True if it did. Call it on a thread that is done with compute when another takes over, as
    the server's main thread is once the model is loaded and the engine's thread runs it.

    libgomp keeps one pool of workers per thread that ever ran a parallel region. When the
    pools' threads outnumber the CPUs it stops spinning at its barriers: a worker sleeps after
    every parallel region and is woken by the next, two context switches per region. On the
    2-core development machine that made each NVFP4 product of a one-row decode on the engine's
    thread 1.4-2x slower than the same product on a thread with the only pool. A thread that
    runs a parallel region again gets a new pool."""
    import ctypes

    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # the one torch loaded (the same soname resolves to it)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):  # another OpenMP runtime, or none: nothing to hand back
        return False
    return pause(1) == 0  # omp_pause_soft


def _reason(exc: Exception) -> str:
    """The compiler's first error line if there is one, else the exception's first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and not ln.startswith(("[", "FAILED"))]
    return (errors or lines or [type(exc).__name__])[0][:300]


CFLAGS = ["-O3", "-fno-math-errno", f"-I{CSRC}", *OPENMP]  # -fopenmp: at::parallel_for is inline OpenMP


def build_key() -> str:
    """What the built library was built from: sources, header, flags, torch and Python."""
    digest = hashlib.sha256()
    for path in [*SOURCES, *sorted(CSRC.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(repr((CFLAGS, torch.__version__, sys.version_info[:2])).encode())
    return digest.hexdigest()


def _load():
    if hasattr(torch.ops.hetero_run, "nvfp4_linear"):  # already registered in this process
        return torch.ops.hetero_run
    try:
        build = cache_dir()
        library, stamp = build / f"{NAME}.so", build / f"{NAME}.key"
        key = build_key()
        if library.is_file() and stamp.is_file() and stamp.read_text() == key:
            # built from exactly these sources: load it without torch's build machinery, which
            # imports setuptools (a few MiB in every rank) and re-checks the build with ninja
            torch.ops.load_library(str(library))
        else:
            _build(build)
            fresh = stamp.with_name(f"{stamp.name}.{os.getpid()}")
            fresh.write_text(key)
            os.replace(fresh, stamp)  # ranks building at once write the same key
        lib = torch.ops.hetero_run
        log.debug("CPU kernels loaded from %s (supported features %d)", build, int(lib.cpu_supported_features()))
    except Exception as exc:  # any build or load failure means: use the PyTorch paths
        log.warning("compiled CPU kernels unavailable (%s); using the slower PyTorch paths", _reason(exc))
        return None
    if os.environ.get(CHILD_ENV) != "child":  # the self-test's child runs what it is told
        from hetero_run.kernels import cpu_isa

        lib.set_cpu_features(cpu_isa.verify(lib))
    return lib


def _build(build: Path) -> None:
    from torch.utils.cpp_extension import load

    build.mkdir(parents=True, exist_ok=True)
    load(name=NAME, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS, extra_ldflags=OPENMP,
         build_directory=str(build), is_python_module=False, verbose=False)
