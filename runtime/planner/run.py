"""Plan a run as an entry point will launch it: run config + topology + ranks launched.

Every entry point that loads weights calls this first, on every rank, before reading any
weight (it reads config files and safetensors / GGUF headers only):

    plan = check_before_load(RunConfig(target=..., topology=..., context=...), world_size)
    log.info("%s", plan.summary())

`check_before_load` raises `DoesNotFit` (a UserError, exit status 1) carrying the rendered
plan when it does not fit.

With a topology, its nodes and memory are used, and `fallback_decision` decides the
tensor-parallel size from the ranks launched (one rank on a two-node topology plans TP=1 on
the first node). Without one, the ranks share this machine.
"""

from __future__ import annotations

from pathlib import Path

from hetero_run.runtime.config import RunConfig
from hetero_run.runtime.planner.hardware import Hardware, hardware_preset
from hetero_run.runtime.planner.inventory import EAGLE3_PREFIX
from hetero_run.runtime.planner.memory import Node
from hetero_run.runtime.planner.plan import Plan, make_plan
from hetero_run.topology.errors import ConfigError


def topology_nodes(path: str, world_size: int | None = None, tp: int | None = None) -> tuple[list[Node], int]:
    """(nodes the run uses, tensor-parallel size) from a topology file."""
    from hetero_run.topology.config import load_topology
    from hetero_run.topology.fallback import fallback_decision

    topology = load_topology(path)
    if world_size is not None:
        tp, _ = fallback_decision(topology, world_size)
    elif tp is None:
        tp = topology.tensor_parallel_size
    if tp > len(topology.nodes) or (tp < len(topology.nodes) and tp != 1):
        raise ConfigError(f"TP={tp} on a topology of {len(topology.nodes)} node(s) (one rank per node; "
                          "TP=1 plans the single-node fallback)", file=path, field="tensor_parallel_size")
    return [Node(n.host, n.capacity_bytes) for n in topology.nodes[:tp]], tp


def plan_run(run: RunConfig, *, world_size: int | None = None, tp: int | None = None,
             hardware: Hardware | None = None, acceptance: float = 0.7) -> Plan:
    """The plan for `run`. `world_size`: the ranks actually launched (entry points); `tp`: a
    tensor-parallel size to plan instead (what-if); `hardware`: a profile to use instead of
    `run.hardware`."""
    run = relative_to_file(run)
    if run.topology is not None:
        nodes, tp = topology_nodes(run.topology, world_size, tp)
    else:
        nodes, tp = None, tp or world_size or 1
    if hardware is None:
        hardware = hardware_preset(run.hardware or ("dgx-spark" if run.topology else "cpu-host"))
    if nodes is None:
        nodes = [Node("this machine", hardware.node_memory_bytes())]
    return make_plan(run.target, drafter=run.drafter, nodes=nodes, tp=tp, context=run.context,
                     batching=run.batching, hardware=hardware, dtype=run.dtype, prefill_chunk=run.prefill_chunk,
                     draft_len=run.draft_len, acceptance=acceptance)


def relative_to_file(run: RunConfig) -> RunConfig:
    """Paths in a run config file are relative to the file's folder (preset names and paths
    that do not exist there are left as they are)."""
    if run.source is None:
        return run
    base = Path(run.source).parent

    def resolve(value: str | None) -> str | None:
        if value is None:
            return None
        prefix = EAGLE3_PREFIX if value.startswith(EAGLE3_PREFIX) else ""
        path = Path(value[len(prefix):]).expanduser()
        candidate = base / path
        return prefix + str(candidate) if not path.is_absolute() and candidate.exists() else value

    return run.with_overrides(target=resolve(run.target), drafter=resolve(run.drafter), topology=resolve(run.topology))


_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def check_before_load(run: RunConfig, world_size: int | None = None) -> Plan:
    """The plan for `run` with `world_size` ranks launched; raises `DoesNotFit` unless it fits
    (a one-line ConfigError when only `kv_cache_tokens` is too many)."""
    run = run.with_overrides(dtype=_DTYPE_NAMES.get(run.dtype, run.dtype))
    return plan_run(run, world_size=world_size).check()
