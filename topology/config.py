"""Topology YAML -> `Topology`, with every error naming the file, the field, its line and value.

Schema (docs/topology.md has the full reference):

    tensor_parallel_size: 2          # required; = number of nodes
    drafter_rank: 0                  # the drafter runs beside the driver
    rendezvous_port: 29500
    fallback: single-node            # or: error
    link: {bandwidth_gbps: 200, mtu: 9000}
    nodes:                           # required; rank i runs on nodes[i]
      - host: spark-a                # required; the name mpirun reaches it by
        memory_gib: 119              # required
        gpus: 1
        interfaces:                  # required; the cabled port's netdevs, same order on every node
          - {name: enp1s0f1np1, address: 192.168.100.10/24, rdma: rocep1s0f1}
"""

from __future__ import annotations

import difflib
from pathlib import Path

from hetero_run.topology.errors import ConfigError
from hetero_run.topology.schema import Interface, Link, Node, Topology
from hetero_run.topology.yaml_source import KeyPath, YamlSource, load_yaml, parse_dotted, parse_yaml

# key -> (required, accepted types, description for messages)
_TOP = {
    "tensor_parallel_size": (True, int, "an integer"),
    "drafter_rank": (False, int, "an integer"),
    "rendezvous_port": (False, int, "a TCP port"),
    "fallback": (False, str, "single-node or error"),
    "link": (False, dict, "a mapping"),
    "nodes": (True, list, "a list of nodes"),
}
_LINK = {
    "bandwidth_gbps": (False, (int, float), "a number"),
    "mtu": (False, int, "an integer"),
}
_NODE = {
    "host": (True, str, "a host name"),
    "memory_gib": (True, (int, float), "a number"),
    "gpus": (False, int, "an integer"),
    "interfaces": (True, list, "a list of interfaces"),
}
_INTERFACE = {
    "name": (True, str, "a netdev name"),
    "address": (True, str, "an address with prefix length"),
    "rdma": (False, str, "an RDMA device name"),
}


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; raises `ConfigError` (file, field, line, value)."""
    return topology_from_source(load_yaml(path))


def parse_topology(text: str, file: str = "<topology>") -> Topology:
    return topology_from_source(parse_yaml(text, file))


def topology_from_source(src: YamlSource) -> Topology:
    top = _fields(src, (), src.data, _TOP, "the topology")
    link = _build(src, ("link",), Link, _fields(src, ("link",), top.pop("link", {}), _LINK, "link"))
    nodes = []
    for i, raw in enumerate(top.pop("nodes")):
        path = ("nodes", i)
        values = _fields(src, path, raw, _NODE, "a node")
        interfaces = []
        for k, raw_iface in enumerate(values.pop("interfaces")):
            ipath = path + ("interfaces", k)
            interfaces.append(_build(src, ipath, Interface, _fields(src, ipath, raw_iface, _INTERFACE, "an interface")))
        nodes.append(_build(src, path, Node, dict(values, interfaces=tuple(interfaces))))
    return _build(src, (), Topology, dict(top, nodes=tuple(nodes), link=link, source=src.file, lines=src.lines))


def _fields(src: YamlSource, path: KeyPath, raw, spec: dict, what: str) -> dict:
    """Check keys (unknown, missing) and value types of one mapping."""
    if not isinstance(raw, dict):
        raise src.error(path, f"expected {what} (a mapping), got {_show(raw)}")
    for key in raw:
        if key not in spec:
            near = difflib.get_close_matches(str(key), list(spec), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise src.error(path + (key,), f"unknown key ({hint}expected one of: {', '.join(spec)})")
    for key, (required, _, _) in spec.items():
        if required and key not in raw:
            raise src.error(path, f"missing required field {key!r}")
    for key, value in raw.items():
        _, types, desc = spec[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise src.error(path + (key,), f"expected {desc}, got {_show(value)}")
    return dict(raw)


def _build(src: YamlSource, path: KeyPath, cls, values: dict):
    """Construct `cls`; its own validation errors get the full field path, file and line."""
    try:
        return cls(**values)
    except ConfigError as exc:
        full = path + parse_dotted(exc.field) if exc.field else path
        raise src.error(full, exc.message) from None


def _show(value) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    return repr(value)
