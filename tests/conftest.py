"""Shared fixtures: launching real `mpirun -np N` jobs and running the console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# `python -m pytest` in the repository root puts the root on sys.path, where the `kernels/` folder
# would shadow the `kernels` package that transformers imports; this project is imported as
# `hetero_run.*` (its editable install maps the folders), never from the root.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]

import pytest  # noqa: E402
from support import Completed, env_for_tests, hetero_run_argv, mpirun_argv  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with `make test-slow` (pytest --run-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_cli():
    """`run_cli(*args, np=None, timeout=..)`: the console script, under mpirun when np is set."""

    def run(*args: str, np: int | None = None, timeout: float = 300, env: dict | None = None,
            mpirun_flags: tuple[str, ...] = (), cwd: str | None = None) -> Completed:
        argv = hetero_run_argv() + [str(a) for a in args]
        if np is not None:
            argv = mpirun_argv(np, *mpirun_flags) + argv
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env_for_tests(env), cwd=cwd)
        return Completed(proc.returncode, proc.stdout, proc.stderr)

    return run


@pytest.fixture
def popen_cli():
    """Start the console script under mpirun and return the Popen (for kill/signal tests)."""
    procs = []

    def start(*args: str, np: int = 2, env: dict | None = None, mpirun_flags: tuple[str, ...] = ()):
        argv = mpirun_argv(np, *mpirun_flags) + hetero_run_argv() + [str(a) for a in args]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env_for_tests(env), start_new_session=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


