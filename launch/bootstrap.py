"""Turn the MPI world into a torch process group, and take it down again on every exit path.

Under `mpirun -np N` rank and size come from MPI. Rank 0 picks the rendezvous address and a
free port and sends them through MPI; then `torch.distributed` starts (nccl when every rank
has a CUDA device, gloo otherwise) together with a heartbeat that ends the job when a peer
dies or goes silent. Without a launcher the process is world size 1: no MPI, no process
group, and every collective in the project is skipped.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from hetero_run.launch.log import get_logger
from hetero_run.launch.rendezvous import Deadline, exchange, free_port, rendezvous_addr
from hetero_run.launch.signals import unwind_on_signals
from hetero_run.launch.watchdog import Heartbeat, short_reason
from hetero_run.topology.errors import ConfigError, PeerFailure

log = get_logger(__name__)

_LAUNCHER_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")


def under_mpi() -> bool:
    """True when an MPI launcher (OpenMPI's mpirun) started this process."""
    return any(name in os.environ for name in _LAUNCHER_ENV)


@dataclass(frozen=True)
class LaunchSettings:
    """How the ranks meet and how long they wait for each other."""

    peer_timeout_s: float = 60.0  # a peer silent this long (or never arriving) ends the job
    heartbeat_interval_s: float = 1.0
    collective_timeout_s: float = 1800.0  # upper bound for one collective in the main group
    backend: str = "auto"  # auto | gloo | nccl
    master_addr: str | None = None  # default: 127.0.0.1 on one host, else rank 0's address
    master_port: int | None = None  # default: a free port picked by rank 0
    env: Mapping[str, str] = field(default_factory=dict)  # applied before the group starts
    signal_grace_s: float | None = None  # SIGINT/SIGTERM: how long unwinding may take (default min(peer timeout, 30))

    def __post_init__(self):
        if not self.peer_timeout_s > 0:
            raise ConfigError(f"must be > 0, got {self.peer_timeout_s}", field="peer_timeout")
        if not 0 < self.heartbeat_interval_s < self.peer_timeout_s:
            raise ConfigError(
                f"must be > 0 and below the peer timeout, got {self.heartbeat_interval_s}",
                field="heartbeat_interval",
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"expected auto, gloo or nccl, got {self.backend!r}", field="backend")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"not a TCP port: {self.master_port}", field="master_port")


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int
    has_cuda: bool
    gpus: int = 0  # CUDA devices this rank sees

    def __str__(self) -> str:
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"


@dataclass
class Dist:
    """The small handle every entry point receives: who am I, who are the others."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str  # "gloo" | "nccl" | "none" (world size 1)
    device: "torch.device"  # noqa: F821
    group: object | None  # torch ProcessGroup; None at world size 1
    peers: tuple[Peer, ...]
    master_addr: str | None = None
    master_port: int | None = None
    heartbeat: Heartbeat | None = None
    _mpi: object | None = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def peer(self, rank: int) -> Peer:
        return self.peers[rank]

    def failure(self, exc: BaseException) -> PeerFailure:
        """Name the peer behind a failed collective, for the one-line error message."""
        others = [p for p in self.peers if p.rank != self.rank]
        left = self.heartbeat.departed() if self.heartbeat else set()
        if left:
            rank = min(left)
            why = "left the job after an error (its own log says why)"
        elif len(others) == 1:
            rank, why = others[0].rank, "stopped responding"
        else:
            rank, why = None, "stopped responding"
        who = str(self.peers[rank]) if rank is not None else "a peer rank"
        return PeerFailure(f"{who} {why}: {short_reason(exc)}", rank=rank)


def _share_cores(local_world_size: int) -> None:
    """Split this host's cores between its ranks unless the user chose (OMP_NUM_THREADS)."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // max(1, local_world_size)))


def choose_backend(requested: str, peers: tuple[Peer, ...]) -> str:
    """The process group's backend for `requested` (auto, gloo, nccl), decided from the table
    every rank received, so that all ranks agree or all refuse with the same error: nccl (auto's
    choice when every rank has CUDA) needs a CUDA device on every rank and one device per rank
    on each host (NCCL refuses two ranks on one GPU)."""
    backend = requested
    if backend == "auto":
        backend = "nccl" if all(p.has_cuda for p in peers) else "gloo"
    if backend != "nccl":
        return backend
    lacking = [p for p in peers if not p.has_cuda]
    if lacking:
        raise ConfigError(f"needs a CUDA device on every rank; {lacking[0]} has none", field="backend nccl")
    for host in dict.fromkeys(p.host for p in peers):
        ranks = [p for p in peers if p.host == host]
        gpus = min(p.gpus for p in ranks)
        if len(ranks) > gpus:
            raise ConfigError(
                f"needs one CUDA device per rank, and host {host} runs {len(ranks)} ranks on {gpus}: start at most "
                f"{gpus} rank(s) there (one rank alone is the single-node fallback), or choose --backend gloo",
                field="backend nccl" if requested == "nccl" else "backend auto (nccl: every rank has CUDA)",
            )
    return backend


def start(settings: LaunchSettings | None = None) -> Dist:
    """Bring up MPI (when launched by mpirun) and the torch process group; return the handle."""
    import torch

    settings = settings or LaunchSettings()
    for key, value in settings.env.items():
        os.environ[key] = str(value)
    has_cuda = torch.cuda.is_available()
    me = {"host": socket.gethostname(), "pid": os.getpid(), "cuda": has_cuda,
          "gpus": torch.cuda.device_count() if has_cuda else 0}

    if not under_mpi():
        device = torch.device("cuda", 0) if has_cuda else torch.device("cpu")
        peer = Peer(0, me["host"], me["pid"], has_cuda, me["gpus"])
        _share_cores(1)
        return Dist(0, 1, 0, 1, "none", device, None, (peer,))

    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    my_rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    others = [r for r in range(int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))) if r != my_rank]
    missing = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
    with Deadline(
        settings.peer_timeout_s,
        f"MPI start-up did not complete within {settings.peer_timeout_s:g} s: {missing} never "
        "started (stuck or failed before start-up); ending the job",
    ):
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != int(os.environ.get("OMPI_COMM_WORLD_SIZE", size)):
        # mpirun exits at once when a rank fails before MPI_Init (with --enable-recovery it
        # leaves the others running), and MPI_Init then comes up as a one-rank singleton.
        raise PeerFailure(
            f"mpirun launched {os.environ['OMPI_COMM_WORLD_SIZE']} ranks but MPI started with {size}: "
            "mpirun is gone because another rank ended before start-up (its own message says why)"
        )
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    _share_cores(local_size)

    try:
        table = exchange(comm, rank, size, me, settings.peer_timeout_s)
        peers = tuple(Peer(r, t["host"], t["pid"], t["cuda"], t["gpus"]) for r, t in enumerate(table))
        if rank == 0:
            addr = rendezvous_addr(settings.master_addr, [p.host for p in peers])
            port = settings.master_port or int(os.environ.get("MASTER_PORT", "0")) or free_port(addr)
            endpoint = {"addr": addr, "port": port}
        else:
            endpoint = None
        endpoint = comm.bcast(endpoint, root=0)
    except BaseException:
        MPI.Finalize()
        raise

    try:
        backend = choose_backend(settings.backend, peers)
    except ConfigError:
        MPI.Finalize()
        raise
    device = (
        torch.device("cuda", local_rank)  # choose_backend: a device per rank on each host
        if backend == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)

    import torch.distributed as tdist

    init_method = f"tcp://{endpoint['addr']}:{endpoint['port']}"
    with Deadline(
        settings.peer_timeout_s,
        f"process group at {init_method} did not form within "
        f"{settings.peer_timeout_s:g} s (a peer is missing or cannot reach that address)",
    ):
        tdist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=settings.collective_timeout_s),
            **({"device_id": device} if backend == "nccl" else {}),
        )
        group = tdist.group.WORLD
        heartbeat_group = tdist.new_group(backend="gloo")
    dist = Dist(
        rank, size, local_rank, local_size, backend, device, group, peers,
        endpoint["addr"], endpoint["port"], _mpi=MPI,
    )
    dist.heartbeat = Heartbeat(
        heartbeat_group, rank, size, peers,
        interval_s=settings.heartbeat_interval_s, timeout_s=settings.peer_timeout_s,
    )
    dist.heartbeat.start()
    log.debug("process group up: %s backend, %d ranks, rendezvous %s", backend, size, init_method)
    return dist


def stop(dist: Dist, timeout_s: float = 60.0, peer_failed: bool = False, aborting: bool = False) -> None:
    """Stop the heartbeat, destroy the process group, finalize MPI; bounded in time.

    After a peer failure MPI is not finalized: MPI_Finalize synchronises with every rank and
    would wait for the dead one. When this rank leaves after an error or signal (`aborting`),
    its peers may not follow, so MPI_Finalize gets only a short deadline.
    """
    if dist.heartbeat is not None:
        dist.heartbeat.stop(aborting=aborting or peer_failed)
    if dist.group is not None:
        import torch.distributed as tdist

        with Deadline(timeout_s, "process group shutdown hung; exiting"):
            if tdist.is_initialized():
                tdist.destroy_process_group()
        dist.group = None
        log.debug("process group destroyed")
    if dist._mpi is not None and not peer_failed:
        MPI = dist._mpi
        with Deadline(min(timeout_s, 5.0) if aborting else timeout_s,
                      "MPI shutdown did not complete (a peer is gone or still busy); exiting"):
            if MPI.Is_initialized() and not MPI.Is_finalized():
                MPI.Finalize()
        dist._mpi = None
    log.debug("shut down cleanly")


@contextlib.contextmanager
def launched(settings: LaunchSettings | None = None) -> Iterator[Dist]:
    """`with launched(settings) as dist:` — the one way entry points get a process group.

    Teardown runs on normal exit, on exceptions and on SIGINT/SIGTERM. A failed collective is
    re-raised as `PeerFailure` naming the peer.
    """
    import torch.distributed as tdist

    settings = settings or LaunchSettings()
    grace_s = settings.signal_grace_s if settings.signal_grace_s is not None else min(settings.peer_timeout_s, 30.0)
    with unwind_on_signals(grace_s=grace_s):
        dist = start(settings)
        peer_failed = aborting = False
        try:
            yield dist
        except RuntimeError as exc:
            if dist.world_size == 1 or not (
                isinstance(exc, tdist.DistBackendError) or _looks_like_transport_error(exc)
            ):
                aborting = True
                raise
            peer_failed = True
            failure = dist.failure(exc)
            # Said now, before teardown: a launcher may kill this process any moment.
            log.error("%s; ending the job", failure)
            failure.reported = True
            raise failure from exc
        except PeerFailure:
            peer_failed = True
            raise
        except BaseException:
            aborting = True
            raise
        finally:
            stop(dist, timeout_s=settings.peer_timeout_s, peer_failed=peer_failed, aborting=aborting)
            sys.stdout.flush()


def _looks_like_transport_error(exc: BaseException) -> bool:
    text = str(exc)
    return any(s in text for s in ("gloo", "Connection reset", "Connection closed", "Timed out", "NCCL"))
