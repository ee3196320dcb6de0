"""OpenMPI hostfiles: read, write, and check against a topology.

Format (OpenMPI 5 / PRRTE): one host per line, optionally `slots=N` and `max_slots=N`;
`#` starts a comment; blank lines are ignored.

    # QSFP-linked pair
    spark-a slots=1
    spark-b slots=1   # rank 1

With `--map-by ppr:1:node` rank i runs on the i-th host, so the hosts must be listed in the
topology's node order.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hetero_run.topology.errors import ConfigError
from hetero_run.topology.schema import Topology

_KEYS = {"slots": "slots", "count": "slots", "cpu": "slots", "max_slots": "max_slots", "max-slots": "max_slots"}
_PAIR = re.compile(r"([A-Za-z_-]+)\s*=\s*(\S*)")


@dataclass(frozen=True)
class HostEntry:
    host: str  # as written, e.g. spark-a or user@spark-a
    slots: int | None = None
    max_slots: int | None = None
    line: int | None = None

    @property
    def name(self) -> str:
        """The host without a `user@` prefix."""
        return self.host.rsplit("@", 1)[-1]

    def format(self) -> str:
        out = self.host
        if self.slots is not None:
            out += f" slots={self.slots}"
        if self.max_slots is not None:
            out += f" max_slots={self.max_slots}"
        return out


@dataclass(frozen=True)
class Hostfile:
    entries: tuple[HostEntry, ...]
    file: str | None = None

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def format(self, header: str | None = None) -> str:
        lines = [f"# {h}" for h in (header.splitlines() if header else [])]
        return "\n".join(lines + [e.format() for e in self.entries]) + "\n"


def read_hostfile(path: str | Path) -> Hostfile:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError("no such file", file=path, field="hostfile") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {exc}", file=path, field="hostfile") from None
    return parse_hostfile(text, str(path))


def parse_hostfile(text: str, file: str = "<hostfile>") -> Hostfile:
    entries: list[HostEntry] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, rest = line.replace("\t", " ").partition(" ")
        rest = rest.strip()
        values: dict[str, int] = {}
        consumed = _PAIR.sub("", rest).strip()
        if consumed:
            raise ConfigError(f"cannot read {consumed!r}: expected `host [slots=N] [max_slots=N]`",
                              file=file, line=number, field=host)
        for key, value in _PAIR.findall(rest):
            if key not in _KEYS:
                raise ConfigError(f"unknown option {key!r} (expected slots or max_slots)",
                                  file=file, line=number, field=host)
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{key} must be an integer >= 1, got {value!r}", file=file, line=number, field=host)
            values[_KEYS[key]] = int(value)
        entry = HostEntry(host, values.get("slots"), values.get("max_slots"), number)
        if entry.name.lower() in seen:
            raise ConfigError(f"duplicate host (also line {seen[entry.name.lower()]}); list each node once",
                              file=file, line=number, field=entry.name)
        seen[entry.name.lower()] = number
        entries.append(entry)
    if not entries:
        raise ConfigError("lists no hosts", file=file, field="hostfile")
    return Hostfile(tuple(entries), file)


def hostfile_for(topology: Topology) -> Hostfile:
    """One slot per node, in rank order."""
    return Hostfile(tuple(HostEntry(n.host, slots=1) for n in topology.nodes))


def write_hostfile(path: str | Path, topology: Topology) -> Path:
    """Write the topology's hostfile atomically (a temporary file renamed into place)."""
    path = Path(path)
    header = f"hosts of {topology.source or 'the topology'}, in rank order (rank i runs on line i)"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(hostfile_for(topology).format(header))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_hostfile(topology: Topology, hostfile: Hostfile) -> None:
    """The hostfile must list the topology's hosts, in node order, each with a free slot."""
    file = hostfile.file
    nodes = topology.hosts
    source = topology.source or "the topology"
    for i, entry in enumerate(hostfile.entries):
        if i >= len(nodes):
            raise ConfigError(
                f"lists {len(hostfile.entries)} hosts but {source} has {len(nodes)} node(s) "
                f"({', '.join(nodes)}); one line per node", file=file, line=entry.line, field=entry.name,
            )
        if entry.name.lower() == nodes[i].lower():
            continue
        other = topology.node_index(entry.name)
        if other is not None:
            raise ConfigError(
                f"is nodes[{other}] in {source} but line {i + 1} of the hosts; rank i runs on the "
                f"i-th host, so list the hosts in the topology's node order ({', '.join(nodes)})",
                file=file, line=entry.line, field=entry.name,
            )
        raise ConfigError(
            f"is not a node of {source} (nodes[{i}].host is {nodes[i]!r}); the hostfile and the "
            "topology must name the same hosts", file=file, line=entry.line, field=entry.name,
        )
    if len(hostfile.entries) < len(nodes):
        missing = nodes[len(hostfile.entries):]
        raise ConfigError(
            f"lists {len(hostfile.entries)} host(s) but {source} has {len(nodes)} node(s): "
            f"{', '.join(missing)} missing", file=file, field="hosts",
        )
