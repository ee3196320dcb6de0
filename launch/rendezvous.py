"""Start-up exchange over MPI: who is where, and the address the process group meets at.

Every step waits with a deadline and names the rank that did not arrive: MPI calls cannot be
interrupted, so waits are polled, and blocking calls (MPI_Init, MPI_Finalize, forming the
process group) are guarded by a `Deadline`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

from hetero_run.topology.errors import ConfigError, PeerFailure

_INFO_BYTES = 4096  # fixed-size MPI buffers for the start-up exchange


class Deadline:
    """Ends this process with a message if the guarded block takes longer than `seconds`.

    A blocking MPI call can hold the GIL (MPI_Init waiting for a rank that never starts does),
    so no thread of this process could act; a tiny sentinel process does it instead: it sleeps,
    then prints the message on our stderr and kills us. Leaving the block in time kills it.
    """

    # SIGPIPE ignored: once mpirun has gone (it returns as soon as one rank fails, with
    # --enable-recovery) our stderr has no reader, and the message must not stop the kill.
    _SENTINEL = 'trap "" PIPE; sleep "$1"; kill -0 "$2" 2>/dev/null || exit 0; printf "%s\\n" "$3" >&2; kill -9 "$2"'

    def __init__(self, seconds: float, message: str):
        self.seconds = seconds
        self.message = f"{time.strftime('%H:%M:%S')} ERROR    [rank {_env_rank()}] {message}"

    def __enter__(self):
        self._sentinel = subprocess.Popen(
            ["/bin/sh", "-c", self._SENTINEL, "deadline", f"{self.seconds:g}", str(os.getpid()), self.message],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
        )
        return self

    def __exit__(self, *exc):
        # The whole session: a surviving `sleep` would hold our stderr open, and mpirun waits
        # for every rank's output to close before it exits.
        os.killpg(self._sentinel.pid, signal.SIGKILL)
        self._sentinel.wait()


def _env_rank() -> str:
    return os.environ.get("OMPI_COMM_WORLD_RANK", "0")


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def exchange(comm, rank: int, size: int, mine: dict, deadline_s: float) -> list[dict]:
    """Every rank's `mine` dict on every rank, naming any rank that does not arrive in time.

    Worked example, size 3: ranks 1 and 2 send to rank 0; rank 0 waits for both (polling, so
    it can name a missing one), then sends the full table of 3 entries back to each.
    """
    import numpy as np
    from mpi4py import MPI

    def encode(obj) -> "np.ndarray":
        raw = json.dumps(obj).encode()
        if len(raw) > _INFO_BYTES:
            raise ValueError("start-up record too large")
        buf = np.zeros(_INFO_BYTES, dtype=np.uint8)
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return buf

    def decode(buf) -> dict:
        return json.loads(bytes(buf).rstrip(b"\0").decode())

    def wait_all(requests: dict[int, "MPI.Request"], waiting_for: str) -> None:
        end = time.monotonic() + deadline_s
        while requests:
            for r, req in list(requests.items()):
                if req.Test():
                    del requests[r]
            if requests and time.monotonic() > end:
                missing = ", ".join(f"rank {r}" for r in sorted(requests))
                raise PeerFailure(
                    f"{missing} did not {waiting_for} within {deadline_s:g} s",
                    rank=min(requests),
                )
            time.sleep(0.005)

    tag = 7101
    if rank == 0:
        bufs = {r: np.zeros(_INFO_BYTES, dtype=np.uint8) for r in range(1, size)}
        wait_all({r: comm.Irecv(bufs[r], source=r, tag=tag) for r in bufs}, "arrive")
        table = [mine] + [decode(bufs[r]) for r in range(1, size)]
        out = encode(table) if len(json.dumps(table)) <= _INFO_BYTES else None
        if out is None:
            raise ValueError("start-up table too large")
        sends = [comm.Isend(out, dest=r, tag=tag + 1) for r in range(1, size)]
        MPI.Request.Waitall(sends)
        return table
    req = comm.Isend(encode(mine), dest=0, tag=tag)
    buf = np.zeros(_INFO_BYTES, dtype=np.uint8)
    wait_all({0: comm.Irecv(buf, source=0, tag=tag + 1)}, "answer")
    req.Wait()
    return decode(buf)


def rendezvous_addr(master_addr: str | None, hosts: list[str]) -> str:
    if master_addr:
        return master_addr
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    addr = socket.gethostbyname(socket.gethostname())
    if addr.startswith("127."):
        raise ConfigError(
            f"ranks run on several hosts ({', '.join(sorted(set(hosts)))}) but this host's name "
            f"resolves to {addr}; give a topology (--topology) or export MASTER_ADDR",
            field="master_addr",
        )
    return addr


