"""Typed run configuration: what a run serves and how (`RunConfig`), read from YAML or flags.

    target: /models/qwen3-235b-a22b-nvfp4     # checkpoint directory or preset
    drafter: eagle3:/models/eagle3-head       # optional, rank 0
    topology: two-sparks.yaml                 # optional
    hardware: dgx-spark                       # optional roofline profile
    context: 32768                            # tokens per sequence
    max_num_seqs: 8                           # sequences the KV cache is sized for (serve's default)
    max_num_batched_tokens: 512               # rows in one step: sizes the activations
    block_size: 16                            # tokens per KV cache block
    kv_cache_tokens: null                     # KV cache slots per rank; null: the planner's default
    dtype: auto                               # auto | bf16 | fp16 | fp32
    prefill_chunk: 512
    draft_len: 3

Speculation settings live in `runtime.speculative.config.SpeculationConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from hetero_run.runtime.models.kv_cache import DEFAULT_BLOCK_SIZE
from hetero_run.topology.errors import ConfigError

DTYPES = ("auto", "bf16", "fp16", "fp32")


def _whole(value, name: str, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"must be a whole number >= {minimum}, got {value!r}", field=name)


@dataclass(frozen=True)
class BatchingConfig:
    """The scheduler's memory side: how many sequences and rows one step carries, and the paged
    KV cache's blocks (`serve`'s --max-num-seqs, --max-num-batched-tokens, --block-size,
    --kv-cache-tokens; `generate` is one sequence whose steps are prefill chunks)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_tokens: int | None = None  # KV cache slots per rank; None: the planner's default

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _whole(getattr(self, name), name)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"must be >= max_num_seqs ({self.max_num_seqs}), got {self.max_num_batched_tokens}",
                              field="max_num_batched_tokens")
        if self.kv_cache_tokens is not None:
            _whole(self.kv_cache_tokens, "kv_cache_tokens", self.block_size)

    @classmethod
    def one_sequence(cls, prefill_chunk: int = 512, block_size: int = DEFAULT_BLOCK_SIZE,
                     kv_cache_tokens: int | None = None) -> BatchingConfig:
        """What `generate` runs: one sequence, prompts in chunks of `prefill_chunk` rows."""
        return cls(1, prefill_chunk, block_size, kv_cache_tokens)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def requested_blocks(self) -> int | None:
        return None if self.kv_cache_tokens is None else self.blocks_for(self.kv_cache_tokens)


@dataclass(frozen=True)
class RunConfig:
    target: str
    drafter: str | None = None
    topology: str | None = None
    hardware: str | None = None
    context: int | None = None  # None: min(32768, the model's maximum)
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_tokens: int | None = None
    dtype: str = "auto"
    prefill_chunk: int = 512
    draft_len: int = 3
    source: str | None = None  # the YAML file it came from

    def __post_init__(self):
        where = {"file": self.source} if self.source else {}
        if not isinstance(self.target, str) or not self.target:
            raise ConfigError(f"must name a checkpoint directory or preset, got {self.target!r}", field="target",
                              **where)
        try:
            for name in ("context", "prefill_chunk", "draft_len"):
                if getattr(self, name) is not None:
                    _whole(getattr(self, name), name)
            self.batching  # noqa: B018  (it checks itself)
        except ConfigError as exc:
            raise ConfigError(exc.message, field=exc.field, **where) from None
        if self.dtype not in DTYPES:
            raise ConfigError(f"expected one of {', '.join(DTYPES)}, got {self.dtype!r}", field="dtype", **where)

    @property
    def batching(self) -> BatchingConfig:
        return BatchingConfig(self.max_num_seqs, self.max_num_batched_tokens, self.block_size, self.kv_cache_tokens)

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
