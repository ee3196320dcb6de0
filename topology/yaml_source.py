"""Read a YAML file into plain Python values and remember the line of every key and item.

Config errors must name the line, so the file is composed into YAML nodes (which carry their
marks) and converted by hand: `lines[("nodes", 1, "host")]` is the line of `host:` in the
second node. Duplicate keys, which PyYAML would silently overwrite, are an error here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hetero_run.topology.errors import ConfigError

KeyPath = tuple  # ("nodes", 1, "interfaces", 0, "address")


@dataclass
class YamlSource:
    """The parsed document and where each part of it came from."""

    data: object
    file: str
    lines: dict[KeyPath, int] = field(default_factory=dict)

    def line(self, path: KeyPath) -> int | None:
        """Line of `path`, or of its nearest enclosing key or item (a missing key's parent)."""
        while True:
            if path in self.lines:
                return self.lines[path]
            if not path:
                return None
            path = path[:-1]

    def error(self, path: KeyPath, message: str) -> ConfigError:
        return ConfigError(message, file=self.file, field=dotted(path) or None, line=self.line(path))


def dotted(path: KeyPath) -> str:
    """("nodes", 1, "host") -> "nodes[1].host"."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_dotted(text: str) -> KeyPath:
    """"nodes[1].host" -> ("nodes", 1, "host"); the inverse of `dotted`."""
    parts: list = []
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", text):
        parts.append(int(index) if index else name)
    return tuple(parts)


def load_yaml(path: str | Path) -> YamlSource:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("no such file", file=path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {exc}", file=path) from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, file: str) -> YamlSource:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"invalid YAML: {problem}", file=file, line=mark.line + 1 if mark else None
        ) from None
    source = YamlSource(data=None, file=file)
    if root is None:
        raise ConfigError("the file is empty", file=file)
    constructor = yaml.SafeLoader("")
    source.data = _convert(root, (), source, constructor)
    return source


def _convert(node: yaml.Node, path: KeyPath, source: YamlSource, constructor) -> object:
    source.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise source.error(path, "a key must be a plain name")
            key = constructor.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key == "<<":
                raise ConfigError("merge keys (<<) are not supported", file=source.file, line=line,
                                  field=dotted(path) or None)
            if key in out:
                raise ConfigError(
                    f"duplicate key {key!r} (first on line {source.lines[path + (key,)]})",
                    file=source.file, line=line, field=dotted(path + (key,)),
                )
            source.lines[path + (key,)] = line
            out[key] = _convert(value_node, path + (key,), source, constructor)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, path + (i,), source, constructor) for i, item in enumerate(node.value)]
    try:
        return constructor.construct_object(node)
    except yaml.YAMLError as exc:
        raise source.error(path, f"invalid value: {getattr(exc, 'problem', exc)}") from None
