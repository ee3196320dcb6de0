"""Check every rank and measure the link between them.

Run it as `mpirun -np 2 --hostfile HOSTS hetero-run doctor`. Rank 0 prints one row per rank
(host, pid, torch / CUDA / NCCL versions, backend, device, memory), which compiled CPU kernels
run there (the instruction sets that passed their self-test, kernels/cpu_isa.py) and, with two
or more ranks, the figures that matter for tensor-parallel decoding over the link:

  latency    broadcast and all-reduce of 8 KiB: each decode step of a TP=2 model does two
             small all-reduces per layer, so this bounds tokens per second;
  bandwidth  broadcast and all-reduce of 64 MiB: how fast weights or long prompts move.

Bandwidth is bus bandwidth as nccl-tests reports it (all-reduce: size * 2(n-1)/n / time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time

NAME = "doctor"
HELP = "check every rank (versions, devices, memory) and measure link latency and bandwidth"

MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--latency-bytes", type=int, default=8 << 10, metavar="B",
                        help="message size for the latency figures (default 8192)")
    parser.add_argument("--bandwidth-bytes", type=int, default=64 * MiB, metavar="B",
                        help="message size for the bandwidth figures (default 64 MiB)")
    parser.add_argument("--iters", type=int, default=50, metavar="N",
                        help="timed repetitions per latency figure (bandwidth: N/5, at least 3)")
    parser.add_argument("--duration", type=float, default=0.0, metavar="S",
                        help="keep measuring for at least S seconds (soak the link)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")


def run(args: argparse.Namespace) -> int:
    from hetero_run.launch.bootstrap import launched
    from hetero_run.launch.log import console
    from hetero_run.launch.settings import launch_settings
    from hetero_run.topology.errors import ConfigError

    for name in ("latency_bytes", "bandwidth_bytes", "iters"):
        if getattr(args, name) < 1:
            raise ConfigError(f"must be >= 1, got {getattr(args, name)}", field="--" + name.replace("_", "-"))

    with launched(launch_settings(args)) as dist:
        ranks = _gather(dist, _rank_info(dist))
        link = _measure_link(dist, args) if dist.world_size > 1 else None
        if dist.is_driver:
            report = {"world_size": dist.world_size, "backend": dist.backend, "ranks": ranks, "link": link}
            if args.json:
                print(json.dumps(report))
            else:
                _print_report(console(), report)
    return 0


def _rank_info(dist) -> dict:
    import psutil
    import torch

    from hetero_run.kernels import cpu_ext

    vm = psutil.virtual_memory()
    info = {
        "rank": dist.rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "backend": dist.backend,
        "device": str(dist.device),
        "device_name": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "mem_total_bytes": vm.total,
        "mem_available_bytes": vm.available,
        "device_mem_total_bytes": None,
        "device_mem_free_bytes": None,
        "cpu_kernels": cpu_ext.describe(),
    }
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    if dist.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(dist.device)
        info.update(device_name=torch.cuda.get_device_name(dist.device),
                    device_mem_total_bytes=total, device_mem_free_bytes=free)
    return info


def _gather(dist, obj) -> list:
    if dist.world_size == 1:
        return [obj]
    import torch.distributed as tdist

    out = [None] * dist.world_size
    tdist.all_gather_object(out, obj, group=dist.group)
    return out


def _timed(dist, op, iters: int) -> list[float]:
    """Seconds per iteration, the slowest rank's time for each (an op ends when all finish)."""
    import torch
    import torch.distributed as tdist

    sync = torch.cuda.synchronize if dist.device.type == "cuda" else (lambda: None)
    op()
    sync()
    tdist.barrier(group=dist.group)
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        start = time.perf_counter()
        op()
        sync()
        times[i] = time.perf_counter() - start
    tdist.all_reduce(times, op=tdist.ReduceOp.MAX, group=dist.group)  # gloo: CPU tensor is fine
    return times.tolist()


def _measure_link(dist, args) -> dict:
    import torch
    import torch.distributed as tdist

    n = dist.world_size
    small = torch.ones(args.latency_bytes // 4, dtype=torch.float32, device=dist.device)
    big = torch.ones(args.bandwidth_bytes // 4, dtype=torch.float32, device=dist.device)
    cases = {
        "broadcast_latency": (lambda: tdist.broadcast(small, 0, group=dist.group), args.iters),
        "all_reduce_latency": (lambda: tdist.all_reduce(small, group=dist.group), args.iters),
        "broadcast_bandwidth": (lambda: tdist.broadcast(big, 0, group=dist.group), max(3, args.iters // 5)),
        "all_reduce_bandwidth": (lambda: tdist.all_reduce(big, group=dist.group), max(3, args.iters // 5)),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    end = time.monotonic() + args.duration
    while True:
        for name, (op, iters) in cases.items():
            samples[name] += _timed(dist, op, iters)
        go_on = torch.tensor([1 if time.monotonic() < end else 0], dtype=torch.int32)
        tdist.broadcast(go_on, 0, group=dist.group)  # rank 0 decides, so all run the same ops
        if not go_on.item():
            break

    bus = {"broadcast": 1.0, "all_reduce": 2.0 * (n - 1) / n}
    result = {}
    for name, times in samples.items():
        op = name.rsplit("_", 1)[0]
        nbytes = small.numel() * 4 if name.endswith("latency") else big.numel() * 4
        median = statistics.median(times)
        result[name] = {
            "bytes": nbytes,
            "samples": len(times),
            "median_us": median * 1e6,
            "p90_us": _quantile(times, 0.9) * 1e6,
            "bus_gbps": nbytes * bus[op] / median / 1e9,
        }
    return result


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _gib(n) -> str:
    return "-" if n is None else f"{n / (1 << 30):.1f}"


def _print_report(con, report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"hetero-run doctor: {report['world_size']} rank(s), backend {report['backend']}")
    for col in ("rank", "host", "pid", "torch", "CUDA", "NCCL", "device", "threads",
                "RAM avail/total GiB", "GPU free/total GiB"):
        table.add_column(col)
    for r in report["ranks"]:
        device = r["device"] if r["device"] == r["device_name"] else f"{r['device']} ({r['device_name']})"
        table.add_row(
            str(r["rank"]), r["host"], str(r["pid"]), r["torch"], r["cuda"] or "-", r["nccl"] or "-",
            device, str(r["threads"]),
            f"{_gib(r['mem_available_bytes'])}/{_gib(r['mem_total_bytes'])}",
            f"{_gib(r['device_mem_free_bytes'])}/{_gib(r['device_mem_total_bytes'])}",
        )
    con.print(table)
    for r in report["ranks"]:
        con.print(f"rank {r['rank']} CPU kernels: {r['cpu_kernels']}")
    link = report["link"]
    if link is None:
        con.print("single rank: no link to measure (launch with mpirun -np 2 to measure it)")
        return
    lt = Table(title="link")
    for col in ("collective", "size", "median", "p90", "bus bandwidth", "samples"):
        lt.add_column(col, justify="right")
    for name, f in link.items():
        size = f"{f['bytes'] / 1024:.0f} KiB" if f["bytes"] < MiB else f"{f['bytes'] / MiB:.0f} MiB"
        lt.add_row(name.replace("_", " "), size, f"{f['median_us']:.1f} us", f"{f['p90_us']:.1f} us",
                   f"{f['bus_gbps']:.2f} GB/s", str(f["samples"]))
    con.print(lt)
