"""Command-line launch options -> `LaunchSettings`, with the topology applied to this rank.

Every multi-rank subcommand builds its settings here:

    with launched(launch_settings(args)) as dist: ...

With `--topology`, before anything else starts: the topology is validated, checked against
`--hostfile`, the job's size against its tensor-parallel size (`-np 3` for TP=2 is an error on
every rank; one rank is the single-node fallback, logged loudly), this host against the rank's
node (host name, interfaces up, addresses where the topology says), and the node's derived
environment (NCCL / UCX / OpenMPI / gloo interfaces, rendezvous address and port) is returned
for the bootstrap to apply before MPI and the process group start.
"""

from __future__ import annotations

import argparse
import os
import socket

from hetero_run.launch.bootstrap import LaunchSettings, under_mpi
from hetero_run.launch.log import get_logger
from hetero_run.topology.errors import ConfigError

log = get_logger(__name__)


def launch_settings(args: argparse.Namespace) -> LaunchSettings:
    base = dict(peer_timeout_s=args.peer_timeout, backend=getattr(args, "backend", "auto"))
    topology_path = getattr(args, "topology", None)
    hostfile_path = getattr(args, "hostfile", None)
    if topology_path is None:
        if hostfile_path is not None:
            raise ConfigError("is checked against a topology: give --topology too", field="--hostfile")
        return LaunchSettings(**base)
    env = topology_environment(topology_path, hostfile_path, *job_shape())
    if not env:
        return LaunchSettings(**base)
    return LaunchSettings(**base, master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]), env=env)


def job_shape() -> tuple[int, int]:
    """(rank, world size) as the launcher set them, before MPI starts; (0, 1) without one."""
    if not under_mpi():
        return 0, 1
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0"))
    size = os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))
    return int(rank), int(size)


def topology_environment(topology_path, hostfile_path, rank: int, world_size: int) -> dict[str, str]:
    """The environment this rank must run with; {} for a single-rank run (nothing to bind)."""
    from hetero_run.topology.checks import require_node_ready
    from hetero_run.topology.config import load_topology
    from hetero_run.topology.environment import conflicts, node_environment
    from hetero_run.topology.fallback import banner, fallback_decision
    from hetero_run.topology.hostfile import check_hostfile, read_hostfile

    topology = load_topology(topology_path)
    if hostfile_path is not None:
        check_hostfile(topology, read_hostfile(hostfile_path))
    tp, reason = fallback_decision(topology, world_size)
    if reason:
        log.warning("%s", banner(reason))
    if tp == 1:
        return {}
    node = topology.nodes[rank]
    require_node_ready(topology, rank, warn=log.warning)
    env = node_environment(topology, rank)
    clash = conflicts(_normalised(os.environ), _normalised(env))
    if clash:
        name, have, want = clash[0]
        raise ConfigError(
            f"{name}={os.environ[name]} is set in the environment, but the topology gives "
            f"{env[name]} for node {node.host} (rank {rank}); unset it (or drop its -x) and let the topology decide",
            file=topology.source, field=name,
        )
    if rank == 0:
        _check_port_free(topology)
    log.debug("rank %d is node %s; environment %s", rank, node.host, env)
    return env


def _normalised(env) -> dict[str, str]:
    # NCCL's "=name" means exactly "name"; a plain "name" set the NVIDIA-guide way is the same choice.
    return {k: v.lstrip("=") if k.startswith("NCCL_") else v for k, v in env.items()}


def _check_port_free(topology) -> None:
    """Rank 0 hosts the rendezvous: say clearly when its port is taken (before the group hangs on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", topology.rendezvous_port))
        except OSError as exc:
            raise topology.error(
                "rendezvous_port",
                f"port {topology.rendezvous_port} on {topology.nodes[0].host} is not free ({exc.strerror}); "
                "another job may hold it: pick another rendezvous_port",
            ) from None
