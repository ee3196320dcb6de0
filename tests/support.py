"""Helpers for tests that launch the console script, alone or under real `mpirun`."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
# The real CPU pair (`hetero-run fetch cpu-pair`); tests that need it skip where it is absent.
PAIR = Path(os.environ.get("HETERO_RUN_PAIR")
            or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero-run" / "cpu-pair")


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def env_for_tests(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", COLUMNS="200")
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra or {})
    return env


def mpirun_argv(np: int = 2, *extra: str) -> list[str]:
    mpirun = shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
    assert mpirun, "mpirun not found: install the `openmpi` package"
    return [mpirun, "-np", str(np), "--oversubscribe", "--bind-to", "none", *_cpu_ranks(), *extra]


def _cpu_ranks() -> list[str]:
    """The ranks of these tests see no CUDA device and run over gloo on the CPU, whatever the
    machine (their assertions are about the CPU path; one GPU could not hold two NCCL ranks)."""
    import torch

    return ["-x", "CUDA_VISIBLE_DEVICES="] if torch.cuda.is_available() else []


def hetero_run_argv() -> list[str]:
    return [str(BIN / "hetero-run")]


def rank_pids(parent_pid: int, rank: int) -> list[int]:
    """Pids of processes below `parent_pid` that mpirun started as `rank`."""
    import psutil

    found = []
    for child in psutil.Process(parent_pid).children(recursive=True):
        try:
            if child.environ().get("OMPI_COMM_WORLD_RANK") == str(rank):
                found.append(child.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(autouse=True)
def one_thread():
    """For tests of thousands of tiny tensor ops (import it into a conftest or test module): a
    second thread only adds wake-up latency, milliseconds per op when the other core is busy."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
