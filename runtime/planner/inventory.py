"""What a model holds, tensor by tensor, without reading a weight.

A `ModelSource` is a checkpoint directory (names, dtypes and shapes from the safetensors
headers via `Checkpoint.open`), a GGUF file (its header), or a preset (small config data
shipped in `runtime/presets/`, expanded into the tensors a ModelOpt export of that config
holds). All go through the same accounting, so a preset is planned exactly as its checkpoint
would be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from hetero_run.runtime.checkpoint import Checkpoint, QuantConfig
from hetero_run.runtime.planner.export_layout import expand
from hetero_run.runtime.planner.shape import ModelShape
from hetero_run.runtime.planner.tensor_info import TensorInfo
from hetero_run.topology.errors import ConfigError

EAGLE3_PREFIX = "eagle3:"

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelSource:
    name: str  # preset name or checkpoint directory
    kind: str  # "checkpoint" | "gguf" | "preset"
    config: dict
    quant: QuantConfig | None
    tensors: dict[str, TensorInfo]
    shape: ModelShape
    description: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # `Checkpoint` look-alike, so the loader's `resolve_dtype` reads presets too
    def has(self, name: str) -> bool:
        return name in self.tensors

    def meta(self, name: str) -> TensorInfo:
        return self.tensors[name]

    @property
    def format(self) -> str:
        return f"{self.quant.algo} (ModelOpt)" if self.quant else str(self.dense_dtype).removeprefix("torch.")

    @property
    def dense_dtype(self) -> torch.dtype:
        name = self.config.get("dtype") or self.config.get("torch_dtype") or "bfloat16"
        return DTYPES.get(str(name), torch.bfloat16)


def resolve(spec: str, *, role: str = "target", field: str | None = None) -> ModelSource:
    """A checkpoint directory, a GGUF file, `eagle3:DIR` (an EAGLE-3 head) or a preset name,
    as the target or as a drafter."""
    field = field or role
    eagle3 = spec.startswith(EAGLE3_PREFIX)
    if eagle3:
        spec = spec[len(EAGLE3_PREFIX):]
    path = Path(spec).expanduser()
    if path.is_dir() and not eagle3 and _is_converted_drafter(path):
        source = from_converted_drafter(path, role, field)
    elif path.is_dir():
        source = from_checkpoint(path, role)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError("no such GGUF file", file=path, field=field)
        source = from_gguf(path, role)
    elif spec in model_presets():
        source = from_preset(spec, role)
    else:
        raise ConfigError(f"{spec!r} is neither a checkpoint directory nor a preset "
                          f"(presets: {', '.join(sorted(model_presets()))})", field=field)
    if eagle3 and not source.shape.eagle3:
        raise ConfigError(f"{spec!r} is not an EAGLE-3 head (architectures: "
                          f"{source.config.get('architectures')})", field=field)
    return source


def _shape(config: dict, role: str, source: str) -> ModelShape:
    return ModelShape.for_target(config, source) if role == "target" else ModelShape.from_config(config, source)


def from_checkpoint(path: str | Path, role: str = "target") -> ModelSource:
    ckpt = Checkpoint.open(path)
    shape = _shape(ckpt.config, role, str(Path(path) / "config.json"))
    tensors = {name: TensorInfo(m.dtype, m.shape) for name, m in ckpt.tensors.items()}
    return ModelSource(str(path), "checkpoint", ckpt.config, ckpt.quant, tensors, shape)


def _is_converted_drafter(path: Path) -> bool:
    from hetero_run.runtime.drafters.cache import is_converted

    return is_converted(path)


def from_converted_drafter(path: str | Path, role: str = "drafter", field: str = "drafter") -> ModelSource:
    """A drafter directory hetero-run converted (its manifest beside weights in the fast drafter's
    own layout), planned as the model it was converted from is: its tensors dense, in the dtype it
    was converted to. Its config.json keeps its source's `quantization_config` (a GGUF's), which
    describes the source, not these weights."""
    from hetero_run.runtime.drafters.cache import MANIFEST

    path = Path(path)
    if role == "target":
        raise ConfigError(f"a converted drafter directory (it holds {MANIFEST}), not a target checkpoint: give it "
                          "as --drafter, or give the target's own checkpoint", file=path, field=field)
    try:
        config = json.loads((path / "config.json").read_text())
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"unreadable converted drafter: {exc}", file=path, field=field) from None
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    shape = _shape(config, role, str(path / "config.json"))
    dtype = torch.float32 if manifest.get("dtype") == "fp32" else torch.bfloat16
    return ModelSource(str(path), "converted", config, None, expand(shape, None, dtype), shape,
                       f"converted drafter ({manifest.get('weights', 'dense')} weights)")


def from_gguf(path: str | Path, role: str = "target") -> ModelSource:
    """A GGUF file as the loader holds it: transformers dequantises it to a float32 Hugging Face
    model, so an architecture the runtime runs is planned as that model's float32 tensors; any
    other (a drafter) as its GGUF tensors in float32."""
    from hetero_run.runtime.planner.gguf_header import hf_config, read_gguf_header

    path = Path(path)
    header = read_gguf_header(path)
    config = hf_config(header, path)
    shape = _shape(config, role, str(path))
    if role == "target" or config["model_type"] in ("qwen3_moe", "qwen3", "qwen2", "llama"):
        tensors = expand(shape, None, torch.float32)
    else:
        tensors = {name: TensorInfo(torch.float32, dims) for name, dims in header.tensors.items()}
    return ModelSource(str(path), "gguf", config, None, tensors, shape, "GGUF, dequantised to float32 on load")


def model_presets() -> dict[str, Path]:
    return {name: path for name, (kind, path) in _presets().items() if kind == "model"}


def read_preset(name: str, kind: str) -> dict:
    found = _presets().get(name)
    if found is None or found[0] != kind:
        names = sorted(n for n, (k, _) in _presets().items() if k == kind)
        raise ConfigError(f"unknown {kind} preset {name!r} (known: {', '.join(names)})")
    return json.loads(found[1].read_text())


def from_preset(name: str, role: str = "target") -> ModelSource:
    data = read_preset(name, "model")
    source = f"preset {name}"
    config = data["config"]
    shape = _shape(config, role, source)
    quant = None
    if data.get("quantization"):
        q = data["quantization"]
        quant = QuantConfig(algo=q["quant_algo"], group_size=int(q["group_size"]),
                            exclude_modules=tuple(q.get("exclude_modules", ())),
                            kv_cache_algo=q.get("kv_cache_quant_algo"), source=source)
    dtype = DTYPES[config.get("dtype") or config.get("torch_dtype") or "bfloat16"]
    tensors = expand(shape, quant, dtype)
    return ModelSource(name, "preset", config, quant, tensors, shape, data.get("description", ""))


def _presets() -> dict[str, tuple[str, Path]]:
    folder = resources.files("hetero_run.runtime").joinpath("presets")
    out = {}
    for entry in folder.iterdir():
        if entry.name.endswith(".json"):
            path = Path(str(entry))
            out[path.stem] = (json.loads(path.read_text()).get("kind", "model"), path)
    return out
