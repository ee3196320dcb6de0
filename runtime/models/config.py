"""The shape of a target model, read from a Hugging Face `config.json` (or `model.config`).

One dataclass covers the four supported architectures; what differs between them is a few
flags: qkv bias (qwen2), per-head q/k RMSNorm (qwen3, qwen3_moe), sparse MoE layers
(qwen3_moe), attention / MLP biases and rope scaling (llama).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hetero_run.topology.errors import ConfigError

ARCHITECTURES = ("qwen3_moe", "qwen3", "qwen2", "llama")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_positions: int = 8192  # llama3

    def __post_init__(self):
        if self.kind not in ROPE_TYPES:
            raise ConfigError(f"rope type {self.kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})",
                              field="rope_scaling")
        if not self.theta > 0 or not self.factor > 0:
            raise ConfigError(f"rope theta and factor must be > 0, got {self.theta}, {self.factor}",
                              field="rope_theta")

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """[head_dim / 2] float32 inverse frequency of each rotary pair (computed in float32, as
        Hugging Face does, so positions rotate bit-identically)."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            low_wavelen = self.original_max_positions / self.low_freq_factor
            high_wavelen = self.original_max_positions / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            # Between the two wavelengths: interpolate between scaled and unscaled.
            smooth = (self.original_max_positions / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_positions: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Sparse MoE (qwen3_moe); num_experts == 0 means every layer is dense.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP in a MoE model
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"architecture {self.arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})",
                              field="model_type")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_positions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.num_heads} attention heads do not group over {self.num_kv_heads} KV heads",
                              field="num_key_value_heads")
        if self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head_dim, got {self.head_dim}", field="head_dim")
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ConfigError(f"must be in 1..{self.num_experts}, got {self.experts_per_token}",
                                  field="num_experts_per_tok")
            if self.moe_intermediate_size < 1 or self.sparse_step < 1:
                raise ConfigError("moe_intermediate_size and decoder_sparse_step must be >= 1",
                                  field="moe_intermediate_size")

    def is_sparse(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.dense_layers
                and (layer + 1) % self.sparse_step == 0)

    @classmethod
    def from_hf(cls, config: dict, source: str = "config.json") -> ModelConfig:
        """From a Hugging Face config dict; errors name `source` and the field."""
        arch = config.get("model_type")
        if arch not in ARCHITECTURES:
            raise ConfigError(f"model_type {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})",
                              file=source, field="model_type")

        def need(name: str):
            if config.get(name) is None:
                raise ConfigError("missing", file=source, field=name)
            return config[name]

        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"activation {act!r} is not supported (only silu)", file=source, field="hidden_act")
        if "sliding_attention" in (config.get("layer_types") or ()) or (
                config.get("use_sliding_window") and config.get("sliding_window")):
            raise ConfigError("sliding-window attention is not supported", file=source, field="use_sliding_window")
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = int(config.get("head_dim") or hidden // heads)
        attention_bias = bool(config.get("attention_bias", False))
        eos = config.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        try:
            return cls(
                arch=arch,
                vocab_size=int(need("vocab_size")),
                hidden_size=hidden,
                num_layers=int(need("num_hidden_layers")),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                intermediate_size=int(need("intermediate_size")),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=_rope(config, source),
                max_positions=int(config.get("max_position_embeddings") or 32768),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2" or attention_bias,
                o_bias=arch != "qwen2" and attention_bias,
                mlp_bias=arch == "llama" and bool(config.get("mlp_bias", False)),
                qk_norm=arch in ("qwen3", "qwen3_moe"),
                num_experts=int(config.get("num_experts") or config.get("num_local_experts") or 0)
                if arch == "qwen3_moe" else 0,
                experts_per_token=int(config.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                sparse_step=int(config.get("decoder_sparse_step") or 1),
                dense_layers=tuple(config.get("mlp_only_layers") or ()),
                eos_token_ids=eos,
            )
        except ConfigError as exc:
            raise ConfigError(exc.message, file=source, field=exc.field) from None


def _rope(config: dict, source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` and
    # `rope_scaling`.
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial rotary embeddings are not supported", file=source, field="partial_rotary_factor")
    return RopeConfig(
        theta=float(theta),
        kind=str(kind),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_positions=int(params.get("original_max_position_embeddings", 8192)),
    )
