"""Check a topology file and print how to launch on it.

    hetero-run topology check TOPOLOGY.yaml [--hostfile HOSTS] [--json]

validates the file (and the hostfile against it), then prints every node's derived
environment (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, UCX_NET_DEVICES, OMPI_MCA_btl_tcp_if_include,
GLOO_SOCKET_IFNAME, MASTER_ADDR/PORT) and the exact mpirun command line to launch with.

With --live, run it on the nodes themselves:

    mpirun -np 2 --hostfile HOSTS --map-by ppr:1:node .venv/bin/hetero-run topology check T.yaml --live

Each node then checks that its interfaces exist, are up with a carrier, carry the configured
addresses and MTU, that its RDMA devices sit on the configured netdevs, and that the nodes
reach each other over the configured link: the kernel routes each peer address out of the
configured interface, and a TCP connection between the configured addresses gets through.
Without mpirun, --live checks this host only. A failed check exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket

NAME = "topology"
HELP = "validate a topology YAML, print the derived environment and mpirun command; --live checks the nodes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("check",), help="what to do (check)")
    parser.add_argument("file", nargs="?", metavar="TOPOLOGY.yaml", help="the topology (or --topology)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--live", action="store_true",
                        help="check the nodes themselves (run under mpirun to check every node and the link)")
    parser.add_argument("--write-hostfile", metavar="HOSTS",
                        help="write the topology's OpenMPI hostfile to HOSTS and use it in the command")
    parser.add_argument("--command", default="doctor", metavar="'CMD ARGS'",
                        help="the hetero-run command to print the mpirun line for (default: doctor)")


def run(args: argparse.Namespace) -> int:
    from hetero_run.launch.settings import job_shape
    from hetero_run.topology.config import load_topology
    from hetero_run.topology.errors import ConfigError
    from hetero_run.topology.hostfile import check_hostfile, read_hostfile, write_hostfile

    path = _topology_path(args)
    topology = load_topology(path)
    hostfile = args.hostfile
    if hostfile is not None:
        if args.write_hostfile:
            raise ConfigError("give --hostfile (to check) or --write-hostfile (to create), not both",
                              field="--write-hostfile")
        check_hostfile(topology, read_hostfile(hostfile))
    rank, world_size = job_shape()
    if args.write_hostfile and rank == 0:
        hostfile = str(write_hostfile(args.write_hostfile, topology))
    report = _static_report(topology, path, hostfile, shlex.split(args.command))
    if not args.live:
        if rank == 0:
            _emit(report, args.json)
        return 0
    if world_size == 1:
        report["live"] = _local_live(topology)
    else:
        args.topology, args.hostfile = path, hostfile
        report["live"] = _distributed_live(topology, args)
    failed = [c for c in report["live"] if c["status"] == "fail"]
    report["ok"] = not failed
    if rank != 0:
        return 2 if failed else 0  # rank 0 reports for every node
    _emit(report, args.json)
    if failed:
        first = failed[0]
        more = f" (and {len(failed) - 1} more failed check(s) above)" if len(failed) > 1 else ""
        message = f"node {first['node']}: {first['check']}: {first['detail']}{more}"
        if first["field"]:
            raise topology.error(first["field"], message)
        raise ConfigError(message, file=topology.source)
    return 0


def _topology_path(args) -> str:
    from hetero_run.topology.errors import ConfigError

    if args.file and args.topology and args.file != args.topology:
        raise ConfigError(f"two topologies given: {args.file} and --topology {args.topology}", field="TOPOLOGY")
    path = args.file or args.topology
    if not path:
        raise ConfigError("give the topology file: hetero-run topology check TOPOLOGY.yaml", field="TOPOLOGY")
    return path


def _static_report(topology, path, hostfile, command) -> dict:
    from hetero_run.topology.environment import all_environments
    from hetero_run.topology.fallback import fallback_decision
    from hetero_run.topology.launch_command import format_command, mpirun_command

    argv = mpirun_command(topology, path, command or ["doctor"], hostfile)
    multi = topology.tensor_parallel_size > 1
    envs = all_environments(topology) if multi else [{} for _ in topology.nodes]
    _, single = fallback_decision(topology, topology.tensor_parallel_size)
    if topology.tensor_parallel_size > 1:
        one_rank = ("runs at TP=1 on one node, with a warning" if topology.fallback == "single-node"
                    else "is refused (exit 2)")
    else:
        one_rank = "is the normal case"
    return {
        "topology": topology.source,
        "tensor_parallel_size": topology.tensor_parallel_size,
        "drafter_rank": topology.drafter_rank,
        "rendezvous": f"{topology.master_addr}:{topology.rendezvous_port}" if multi else None,
        "link": {"bandwidth_gbps": topology.link.bandwidth_gbps, "mtu": topology.link.mtu},
        "fallback": {"policy": topology.fallback, "single_node": single, "one_rank": one_rank},
        "nodes": [
            {"rank": i, "host": n.host, "memory_gib": n.memory_gib, "capacity_bytes": n.capacity_bytes,
             "gpus": n.gpus, "interfaces": [{"name": f.name, "address": str(f.address), "rdma": f.rdma}
                                            for f in n.interfaces],
             "environment": env}
            for i, (n, env) in enumerate(zip(topology.nodes, envs, strict=True))
        ],
        "hostfile": hostfile,
        "mpirun": argv,
        "command": format_command(argv),
        "live": None,
        "ok": True,
    }


def _local_live(topology) -> list[dict]:
    """--live without mpirun: this host against the node it is (by name, else by address)."""
    from hetero_run.topology.checks import node_checks
    from hetero_run.topology.errors import ConfigError
    from hetero_run.topology.interfaces import interface_states

    states = interface_states()
    index = _this_node(topology, states)
    if index is None:
        here = sorted({str(a.ip) for s in states.values() for a in s.addresses})
        raise ConfigError(
            f"this host ({socket.gethostname()}, addresses {', '.join(here) or 'none'}) is none of the "
            f"topology's nodes ({', '.join(topology.hosts)})", file=topology.source, field="nodes",
        )
    memory, gpus = _memory_and_gpus()
    return [c.to_dict() for c in node_checks(topology, index, states, memory_bytes=memory, gpu_count=gpus)]


def _this_node(topology, states) -> int | None:
    host = socket.gethostname().lower()
    for i, node in enumerate(topology.nodes):
        if node.host.lower() in (host, host.split(".")[0]):
            return i
    mine = {str(a.ip) for s in states.values() for a in s.addresses}
    for i, node in enumerate(topology.nodes):
        if set(node.addresses) & mine:
            return i
    return None


def _memory_and_gpus() -> tuple[int, int | None]:
    import psutil

    try:
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = None
    return psutil.virtual_memory().total, gpus


def _distributed_live(topology, args) -> list[dict]:
    """--live under mpirun: every node checks itself and the link; every rank gets every result."""
    import torch.distributed as tdist

    from hetero_run.launch.bootstrap import launched
    from hetero_run.launch.settings import launch_settings
    from hetero_run.topology.checks import node_checks
    from hetero_run.topology.reach import link_checks

    with launched(launch_settings(args)) as dist:
        def all_gather(obj) -> list:
            out = [None] * dist.world_size
            tdist.all_gather_object(out, obj, group=dist.group)
            return out

        memory, gpus = _memory_and_gpus()
        checks = node_checks(topology, dist.rank, memory_bytes=memory, gpu_count=gpus)
        checks += link_checks(topology, dist.rank, all_gather)
        everyone = all_gather([c.to_dict() for c in checks])
    return [c for per_rank in everyone for c in per_rank]


def _emit(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
        return
    from rich.table import Table
    from rich.text import Text

    from hetero_run.launch.log import console

    con = console()
    nodes = Table(title=f"{report['topology']}: tensor-parallel size {report['tensor_parallel_size']}")
    for col in ("rank", "host", "interfaces (netdev address rdma)", "memory GiB", "GPUs"):
        nodes.add_column(col)
    for n in report["nodes"]:
        ifaces = "\n".join(f"{f['name']} {f['address']} {f['rdma'] or '-'}" for f in n["interfaces"])
        role = " (driver, drafter)" if n["rank"] == report["drafter_rank"] else ""
        nodes.add_row(f"{n['rank']}{role}", Text(n["host"]), Text(ifaces), f"{n['memory_gib']:g}", str(n["gpus"]))
    con.print(nodes)
    link = report["link"]
    con.print(f"link: {link['bandwidth_gbps']:g} Gb/s, MTU {link['mtu']}; rendezvous {report['rendezvous'] or '-'}",
              markup=False)
    if report["tensor_parallel_size"] > 1:
        env = Table(title="environment each rank applies before its process group starts")
        env.add_column("variable")
        for n in report["nodes"]:
            env.add_column(f"rank {n['rank']} ({n['host']})")
        for name in report["nodes"][0]["environment"]:
            env.add_row(name, *[Text(n["environment"].get(name, "-")) for n in report["nodes"]])
        con.print(env)
    else:
        con.print("environment: none applied (a one-node run has no process group to bind)")
    fb = report["fallback"]
    if fb["single_node"]:
        con.print(Text("single node: ", style="bold yellow") + Text(fb["single_node"]))
    con.print(f"fallback: {fb['policy']} (a job launched with one rank {fb['one_rank']})", markup=False)
    con.print("launch with:" if len(report["nodes"]) > 1 else "run with (one node, no mpirun needed):")
    con.print(report["command"], soft_wrap=True, markup=False, highlight=False)
    if report["live"] is not None:
        live = Table(title="live checks")
        for col in ("node", "check", "status", "detail"):
            live.add_column(col)
        style = {"ok": "green", "warn": "yellow", "fail": "bold red"}
        for c in report["live"]:
            live.add_row(Text(c["node"]), Text(c["check"]), Text(c["status"], style=style[c["status"]]),
                         Text(c["detail"]))
        con.print(live)
