"""What the roofline and the memory budget assume about a node: bandwidth, link latency,
memory the OS keeps and memory the runtime itself needs.

Profiles are presets (`runtime/presets/*.json` with `"kind": "hardware"`): `dgx-spark`
(figures from the two-Spark deployment) and `cpu-host` (this kind of development machine).
Any figure can be overridden, and `measure_bandwidth()` measures this machine's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from hetero_run.topology.errors import ConfigError

GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bandwidth_gbps: float  # GB/s (1e9 bytes) a node streams from memory; its ranks share it
    link_latency_us: float  # one small (8 KiB) all-reduce between the ranks
    reserved_gib: float  # per node: OS, drivers, desktop; on a Spark CPU and GPU share memory
    runtime_overhead_gib: float  # per rank: CUDA context or torch/Python, NCCL/gloo buffers, allocator slack
    memory_gib: float | None = None  # per node when no topology gives it; None: this machine's RAM
    description: str = ""
    measured: bool = False

    def __post_init__(self):
        for name in ("memory_bandwidth_gbps",):
            if not getattr(self, name) > 0:
                raise ConfigError(f"must be > 0, got {getattr(self, name)}", field=name)
        for name in ("link_latency_us", "reserved_gib", "runtime_overhead_gib"):
            if getattr(self, name) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, name)}", field=name)
        if self.memory_gib is not None and not self.memory_gib > 0:
            raise ConfigError(f"must be > 0, got {self.memory_gib}", field="memory_gib")

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_gbps * 1e9

    @property
    def link_latency_s(self) -> float:
        return self.link_latency_us * 1e-6

    def node_memory_bytes(self) -> int:
        if self.memory_gib is not None:
            return int(self.memory_gib * GiB)
        import psutil

        return psutil.virtual_memory().total

    def with_(self, **changes) -> Hardware:
        """A copy with some figures replaced (None values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def hardware_preset(name: str) -> Hardware:
    from hetero_run.runtime.planner.inventory import read_preset

    data = read_preset(name, "hardware")
    fields = {f.name for f in dataclasses.fields(Hardware)}
    return Hardware(name=name, **{k: v for k, v in data.items() if k in fields and k != "name"})


def measure_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """This machine's read bandwidth in GB/s: the best of `repeats` sums over `nbytes` of float32
    with torch's threads (the way a decode step streams weights)."""
    import torch

    data = torch.ones(nbytes // 4, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9
