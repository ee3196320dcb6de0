"""Hugging Face safetensors checkpoints: index, quantisation config, per-rank sliced reads.

A checkpoint is a directory with `config.json` and either `model.safetensors` or
`model.safetensors.index.json` plus its shards. Only headers are read on open; tensors are
read on demand, and `read(..., dim=, part=)` reads just one rank's slice through safetensors'
`get_slice`, so a rank of a TP=2 job reads about half the bytes.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hetero_run.topology.errors import UserError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


# Quantisation schemes whose tensors runtime/weights.py reads (same layout; W4A16 has no input_scale).
SUPPORTED_QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4")
SUPPORTED_GROUP_SIZE = 16


class CheckpointError(UserError):
    """A checkpoint file is missing, unreadable or does not hold what the model needs."""


@dataclass(frozen=True)
class QuantConfig:
    """Pre-quantised weights as NVIDIA ModelOpt exports them (`hf_quant_config.json`)."""

    algo: str  # "NVFP4"
    group_size: int
    exclude_modules: tuple[str, ...] = ()
    kv_cache_algo: str | None = None
    source: str = ""  # the file it was read from, for error messages

    def __post_init__(self):
        if self.algo not in SUPPORTED_QUANT_ALGOS:
            raise CheckpointError(
                f"unsupported quant_algo {self.algo!r}; supported: {', '.join(SUPPORTED_QUANT_ALGOS)}",
                file=self.source or None, field="quant_algo",
            )
        if self.group_size != SUPPORTED_GROUP_SIZE:
            raise CheckpointError(
                f"unsupported group_size {self.group_size}; NVFP4 uses blocks of {SUPPORTED_GROUP_SIZE}",
                file=self.source or None, field="group_size",
            )

    def quantizes(self, module: str) -> bool:
        """Whether `module` (e.g. "model.layers.0.mlp.gate") holds quantised weights."""
        return not any(fnmatch.fnmatchcase(module, pattern) for pattern in self.exclude_modules)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass
class Checkpoint:
    path: Path
    config: dict
    quant: QuantConfig | None
    tensors: dict[str, TensorMeta]
    bytes_read: int = 0
    # Called as on_read(name, nbytes) after every read; runtime/load_progress.py drives a bar with it.
    on_read: Callable[[str, int], None] | None = field(default=None, repr=False)
    _handles: dict = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError("not a checkpoint directory", file=path)
        config = _read_json(path / "config.json")
        return cls(path, config, read_quant_config(path, config), _index(path))

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def has(self, name: str) -> bool:
        return name in self.tensors

    def meta(self, name: str) -> TensorMeta:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is missing (no shard of this checkpoint holds it)",
                                  file=self.path) from None

    def expect(self, name: str, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
               shape: tuple[int, ...] | None = None) -> TensorMeta:
        """`meta(name)`, checked against the dtype(s) and shape the caller needs."""
        meta = self.meta(name)
        if dtype is not None:
            allowed = dtype if isinstance(dtype, tuple) else (dtype,)
            if meta.dtype not in allowed:
                wanted = " or ".join(_dtype_name(d) for d in allowed)
                raise CheckpointError(
                    f"tensor {name!r} has dtype {_dtype_name(meta.dtype)}, expected {wanted}", file=meta.file
                )
        if shape is not None and tuple(meta.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {list(meta.shape)}, expected {list(shape)}", file=meta.file
            )
        return meta

    def close(self) -> None:
        self._handles.clear()

    def read(self, name: str, dim: int | None = None, part: tuple[int, int] | None = None,
             span: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name`; with `dim` and `part=(index, count)` only slice `index` of `count` equal
        slices along `dim` (the shape there must divide by `count`), or with `dim` and
        `span=(start, stop)` only that range along `dim`."""
        meta = self.meta(name)
        handle = self._handle(meta.file)
        span = slice_span(name, meta.shape, dim, part, span, meta.file)
        try:
            if span is None:
                out = handle.get_tensor(name)
            else:
                key = [slice(None)] * len(meta.shape)
                key[dim] = slice(*span)
                out = handle.get_slice(name)[tuple(key)]
        except SafetensorError as exc:
            raise CheckpointError(f"cannot read tensor {name!r}: {exc}", file=meta.file) from None
        nbytes = out.numel() * out.element_size()
        self.bytes_read += nbytes
        if self.on_read is not None:
            self.on_read(name, nbytes)
        return out

    def _handle(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"cannot open safetensors file: {exc}", file=file) from None
        return self._handles[file]


def slice_span(name: str, shape: tuple[int, ...], dim: int | None, part: tuple[int, int] | None,
               span: tuple[int, int] | None, file) -> tuple[int, int] | None:
    """The [start, stop) range along `dim` that `part=(index, count)` or `span` asks for; None
    for the whole tensor."""
    if dim is None or (part is None and span is None):
        return None
    if part is not None and span is not None:
        raise ValueError("give part or span, not both")
    size = shape[dim]
    if part is not None:
        index, count = part
        if count == 1:
            return None
        if size % count:
            raise CheckpointError(f"tensor {name!r} dimension {dim} has size {size}, not divisible into {count} parts",
                                  file=file)
        step = size // count
        return index * step, (index + 1) * step
    start, stop = span
    if not 0 <= start <= stop <= size:
        raise CheckpointError(f"tensor {name!r} dimension {dim} has size {size}, no range {start}..{stop}", file=file)
    return start, stop


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError("file is missing", file=path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"invalid JSON: {exc.msg}", file=path, line=exc.lineno) from None


def read_quant_config(path: Path, config: dict) -> QuantConfig | None:
    """From `hf_quant_config.json`, else `config.json["quantization_config"]`; None if neither."""
    hf_file = path / "hf_quant_config.json"
    if hf_file.is_file():
        source, section = hf_file, _read_json(hf_file).get("quantization", {})
    elif "quantization_config" in config:
        source, section = path / "config.json", config["quantization_config"]
    else:
        return None
    algo = section.get("quant_algo")
    if algo is None:
        raise CheckpointError("no quant_algo given", file=source, field="quant_algo")
    try:
        group_size = int(section.get("group_size", SUPPORTED_GROUP_SIZE))
    except (TypeError, ValueError):
        raise CheckpointError(f"not an integer: {section.get('group_size')!r}", file=source,
                              field="group_size") from None
    return QuantConfig(
        algo=str(algo),
        group_size=group_size,
        exclude_modules=tuple(section.get("exclude_modules") or section.get("ignore") or ()),
        kv_cache_algo=section.get("kv_cache_quant_algo"),
        source=str(source),
    )


def _index(path: Path) -> dict[str, TensorMeta]:
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError("no weight_map", file=index_file, field="weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (path / name).is_file():
                tensor = next(t for t, f in weight_map.items() if f == name)
                raise CheckpointError(f"shard {name} (holding {tensor!r} and others) is missing",
                                      file=index_file)
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError("no model.safetensors or model.safetensors.index.json", file=path)
        weight_map = None
    tensors: dict[str, TensorMeta] = {}
    for name in files:
        file = path / name
        for tensor, (dtype, shape) in _header(file).items():
            tensors[tensor] = TensorMeta(tensor, dtype, shape, file)
    for tensor, name in (weight_map or {}).items():
        if tensors.get(tensor) is None or tensors[tensor].file.name != name:
            raise CheckpointError(f"the weight_map puts tensor {tensor!r} in {name}, which does not hold it",
                                  file=index_file)
    return tensors


def _header(file: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Names, dtypes and shapes from a safetensors header, validated against the file size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"truncated: {size} bytes, too short for a safetensors header", file=file)
        n = int.from_bytes(raw_len, "little")
        if n > size - 8:
            raise CheckpointError(f"corrupted or truncated: header length {n} exceeds the file size {size}",
                                  file=file)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError("corrupted: safetensors header is not valid JSON", file=file) from None
    if not isinstance(header, dict):
        raise CheckpointError("corrupted: safetensors header is not a JSON object", file=file)
    out = {}
    data_size = size - 8 - n
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype_name, (begin, end) = entry["dtype"], entry["data_offsets"]
            shape = tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"corrupted: header entry of tensor {tensor!r} is malformed", file=file) from None
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(f"tensor {tensor!r} has unsupported dtype {dtype_name!r}", file=file)
        if end > data_size:
            raise CheckpointError(
                f"truncated: tensor {tensor!r} ends at byte {end} of a {data_size}-byte data section", file=file
            )
        expected = TensorMeta(tensor, dtype, shape, file).nbytes
        if end - begin != expected:
            raise CheckpointError(
                f"corrupted: tensor {tensor!r} spans {end - begin} bytes, expected {expected} for "
                f"{_dtype_name(dtype)} {list(shape)}", file=file,
            )
        out[tensor] = (dtype, shape)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
