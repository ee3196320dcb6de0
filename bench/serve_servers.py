"""The servers bench/serve_load.py launches: one `hetero-run serve` per configuration on a free
loopback port (TP=1 as one process, TP=2 under `mpirun -np 2`), every rank's pid and peak
memory (/proc/PID/status VmHWM), what `hetero-run plan` gives each rank, and a stop that always
ends every process: SIGTERM to rank 0 (it drains, then stops the other ranks), then the whole
process group killed if it has not exited in time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

OFF, ADAPTIVE = "off", "adaptive"


def algorithm_of(config: str) -> str:
    """`off`: the target alone; `adaptive`: `auto` with the drafter; any other name: that
    algorithm with the drafter (slem, tli, ...: for comparison)."""
    return {OFF: "none", ADAPTIVE: "auto"}.get(config, config)



def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found next to {sys.executable} or on PATH")
    return found


def _env() -> dict:
    env = dict(os.environ)
    if os.geteuid() == 0:  # OpenMPI refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _children(pid: int) -> list[int]:
    """Every process below `pid`."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _status(pid: int, key: str) -> int | None:
    """A /proc/PID/status field in bytes (VmHWM: peak resident memory)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


@dataclass
class Launched:
    name: str
    argv: list[str]
    log_dir: Path
    tp: int
    proc: subprocess.Popen | None = None
    url: str = ""
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    load_s: float = 0.0
    exit_code: int | None = None

    def log(self, rank: int = 0) -> str:
        path = self.log_dir / f"rank{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout: float) -> None:
        begin = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(),
                                     start_new_session=True)
        end = begin + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.name} server exited ({self.proc.returncode}) before it was ready; "
                                   f"last log lines:\n{self._tail()}")
            if not self.url:
                found = re.search(r"listening on (http://127\.0\.0\.1:\d+) \(pid (\d+)\)", self.log())
                if found:
                    self.url, self.pids[0] = found.group(1), int(found.group(2))
            if self.url:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        self.load_s = round(time.monotonic() - begin, 1)
                        self._find_ranks()
                        return
            time.sleep(0.5)
        raise RuntimeError(f"the {self.name} server was not ready within {timeout:.0f} s; last log lines:\n"
                           f"{self._tail()}")

    def _find_ranks(self) -> None:
        if self.tp == 1:
            return
        for pid in _children(self.proc.pid):
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                for item in environ:
                    if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                        self.pids.setdefault(int(item.split(b"=")[1]), pid)

    def peak_memory(self) -> dict[int, int | None]:
        return {rank: _status(pid, "VmHWM") for rank, pid in sorted(self.pids.items())}

    def stop(self, timeout: float) -> None:
        """SIGTERM to rank 0 (it drains, then stops every rank), then wait; the whole group is
        killed if it has not exited in time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pids.get(0, self.proc.pid), signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        if self.proc.poll() is None:
            print(f"  {self.name}: no exit {timeout:.0f} s after SIGTERM; killing its process group", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.exit_code = self.proc.returncode
        for pid in self.pids.values():  # ranks that outlived mpirun
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 0)
                print(f"  {self.name}: rank pid {pid} still alive after exit; killing it", flush=True)
                os.kill(pid, signal.SIGKILL)

    def _tail(self, n: int = 15) -> str:
        return "\n".join(self.log().splitlines()[-n:])


def server_argv(args, name: str) -> list[str]:
    argv = [_bin("hetero-run"), "serve", "--target", args.launch, "--host", "127.0.0.1", "--port", "0",
            "--context", str(args.context), "--max-num-seqs", str(args.max_num_seqs),
            "--log-dir", str(args.log_dir / name), "--algorithm", algorithm_of(name)]
    if name != OFF:
        argv += ["--drafter", args.drafter]
    argv += [flag for extra in args.serve_arg for flag in extra.split()]
    if args.tp > 1:
        argv = [_bin("mpirun"), "-np", str(args.tp), "--oversubscribe", "--bind-to", "none", *argv]
    return argv


def planned_bytes(args, name: str) -> dict[int, int] | None:
    """Per rank, what `hetero-run plan` gives the process (its total less the OS reserve)."""
    argv = [_bin("hetero-run"), "plan", "--target", args.launch, "--context", str(args.context),
            "--max-num-seqs", str(args.max_num_seqs), "--tp", str(args.tp), "--json"]
    if name != OFF:
        argv += ["--drafter", args.drafter]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_env())
    if proc.returncode not in (0, 1):
        print(f"  hetero-run plan failed ({proc.returncode}): {proc.stderr.strip()[-500:]}", flush=True)
        return None
    plan = json.loads(proc.stdout)
    return {r["rank"]: r["total_bytes"] - r.get("reserved_bytes", 0) for r in plan["per_rank"]}
