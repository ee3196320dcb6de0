"""How many tensor-parallel ranks this run uses, given the topology and the ranks launched.

    topology TP   ranks launched   result
    2             2                TP=2
    2             1                TP=1 on one node (fallback: single-node), else an error
    1             1                TP=1 (a one-node topology is always the fallback path)
    2             3 (or 1 vs 2)    error: -np must match the topology

Whoever plans memory calls `fallback_decision` too: at TP=1 a model sized for two nodes
must be stopped before anything loads.
"""

from __future__ import annotations

from hetero_run.topology.schema import Topology


def fallback_decision(topology: Topology, world_size: int) -> tuple[int, str | None]:
    """(tensor-parallel size of this run, why it is a single-node run or None).

    Raises `ConfigError` when the ranks launched do not match the topology, or when one rank
    was launched and the topology's fallback policy is `error`.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    tp = topology.tensor_parallel_size
    hosts = ", ".join(topology.hosts)
    if world_size == tp == 1:
        return 1, f"the topology has one node ({hosts}): running at TP=1, no tensor parallelism"
    if world_size == tp:
        return tp, None
    if world_size > 1:
        raise topology.error(
            "tensor_parallel_size",
            f"the job has {world_size} ranks (mpirun -np {world_size}) but the topology's tensor-parallel "
            f"size is {tp} ({hosts}): launch with mpirun -np {tp}",
        )
    if topology.fallback == "error":
        raise topology.error(
            "fallback",
            f"launched with one rank, the topology asks for TP={tp} ({hosts}) and its fallback policy is "
            f"'error': launch with mpirun -np {tp}, or set fallback: single-node",
        )
    return 1, (
        f"launched with one rank, but the topology asks for TP={tp} across {hosts}: running at TP=1 on "
        "this node alone (single-node fallback)"
    )


def banner(reason: str) -> str:
    """The loud one-line warning a single-node run logs."""
    return f"SINGLE-NODE RUN: {reason}"
