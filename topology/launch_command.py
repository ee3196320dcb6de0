"""The exact `mpirun` command line that launches a hetero-run command on a topology.

    .venv/bin/mpirun -np 2 --hostfile HOSTS --map-by ppr:1:node --bind-to none --enable-recovery \
        -x NCCL_SOCKET_IFNAME==enp1s0f1np1 ... \
        .venv/bin/hetero-run doctor --topology TOPOLOGY.yaml --hostfile HOSTS

Paths are absolute (mpirun starts the same path on every node). Variables whose value is the
same on every node go on the command line with `-x`; each rank applies its own node's full
environment from `--topology` anyway, so per-node interface names work too.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from hetero_run.topology.environment import shared_environment
from hetero_run.topology.schema import Topology

MPIRUN_FLAGS = ("--map-by", "ppr:1:node", "--bind-to", "none", "--enable-recovery")


def venv_bin() -> Path:
    """The directory of this interpreter's scripts (`.venv/bin`), absolute, symlinks kept."""
    return Path(sys.executable).absolute().parent


def mpirun_command(
    topology: Topology,
    topology_path: str | Path,
    command: Sequence[str] = ("doctor",),
    hostfile_path: str | Path | None = None,
    bin_dir: Path | None = None,
) -> list[str]:
    """argv for `command` on every node; a one-node topology needs no mpirun."""
    bin_dir = bin_dir or venv_bin()
    hetero = [str(bin_dir / "hetero-run"), *command, "--topology", str(Path(topology_path).absolute())]
    if hostfile_path is not None:
        hetero += ["--hostfile", str(Path(hostfile_path).absolute())]
    if topology.tensor_parallel_size == 1:
        return hetero
    mpirun = bin_dir / "mpirun"
    argv = [str(mpirun) if mpirun.exists() else (shutil.which("mpirun") or "mpirun"),
            "-np", str(topology.tensor_parallel_size)]
    if hostfile_path is not None:
        argv += ["--hostfile", str(Path(hostfile_path).absolute())]
    else:
        argv += ["--host", ",".join(f"{host}:1" for host in topology.hosts)]
    argv += MPIRUN_FLAGS
    for name, value in shared_environment(topology).items():
        argv += ["-x", f"{name}={value}"]
    return argv + hetero


def format_command(argv: Sequence[str]) -> str:
    """Shell form, one option group per line: `mpirun ... \\` / `    -x A=1 \\` / `    hetero-run ...`."""
    if not argv:
        return ""
    lines, current = [], [shlex.quote(argv[0])]
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-x":
            lines.append(current)
            current = ["-x", shlex.quote(argv[i + 1])]
            i += 2
            continue
        if Path(arg).name == "hetero-run":
            lines.append(current)
            current = []
        current.append(shlex.quote(arg))
        i += 1
    lines.append(current)
    # consecutive -x groups share a line, two per line
    merged: list[list[str]] = []
    for group in lines:
        if merged and group[0] == "-x" and merged[-1][0] == "-x" and len(merged[-1]) < 4:
            merged[-1] += group
        else:
            merged.append(group)
    return " \\\n    ".join(" ".join(g) for g in merged if g)
