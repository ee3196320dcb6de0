"""Typed run configuration: what a run serves and how (`RunConfig`), read from YAML or flags.

    target: /models/qwen3-235b-a22b-nvfp4     # checkpoint directory or preset
    drafter: eagle3:/models/eagle3-head       # optional, rank 0
    topology: two-sparks.yaml                 # optional
    hardware: dgx-spark                       # optional roofline profile
    context: 32768
    batch: 1
    dtype: auto                               # auto | bf16 | fp16 | fp32
    prefill_chunk: 512
    draft_len: 3

Speculation settings live in `runtime.speculative.config.SpeculationConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from hetero_run.topology.errors import ConfigError

DTYPES = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class RunConfig:
    target: str
    drafter: str | None = None
    topology: str | None = None
    hardware: str | None = None
    context: int | None = None  # None: min(32768, the model's maximum)
    batch: int = 1
    dtype: str = "auto"
    prefill_chunk: int = 512
    draft_len: int = 3
    source: str | None = None  # the YAML file it came from

    def __post_init__(self):
        where = {"file": self.source} if self.source else {}
        if not isinstance(self.target, str) or not self.target:
            raise ConfigError(f"must name a checkpoint directory or preset, got {self.target!r}", field="target",
                              **where)
        for name in ("context", "batch", "prefill_chunk", "draft_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"must be a whole number >= 1, got {value!r}", field=name, **where)
        if self.dtype not in DTYPES:
            raise ConfigError(f"expected one of {', '.join(DTYPES)}, got {self.dtype!r}", field="dtype", **where)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """Read a run config YAML file; errors name the file, the key and its line."""
        from hetero_run.topology.yaml_source import load_yaml

        src = load_yaml(path)
        if not isinstance(src.data, dict):
            raise src.error((), "expected a mapping of run settings")
        known = {f.name for f in fields(cls)} - {"source"}
        for key in src.data:
            if key not in known:
                raise src.error((key,), f"unknown key {key!r} (known: {', '.join(sorted(known))})")
        if "target" not in src.data:
            raise src.error((), "missing key 'target'")
        try:
            return cls(**src.data, source=str(path))
        except ConfigError as e:
            raise src.error((e.field,) if e.field else (), e.message) from e

    def with_overrides(self, **values) -> RunConfig:
        """A copy with the given settings replaced; None leaves a setting as it is."""
        return replace(self, **{k: v for k, v in values.items() if v is not None})
