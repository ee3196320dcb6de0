"""A model's shape, read once from a Hugging Face `config.json`: the one reader that the
loader, the planner and the EAGLE-3 loader share, so what the planner counts (weights, KV bytes
per token, KV blocks) is what the runtime builds.

    config = ModelConfig.from_hf(raw, source="ckpt/config.json")   # a target the runtime runs
    drafter = DecoderConfig.from_hf(raw, source)                   # any decoder-only LM (planner)

One dataclass per concern, each checking itself: `RopeConfig` (rotary positions),
`AttentionConfig` (heads, KV heads, head_dim, biases, q/k norm: the KV cache's shape),
`MoEConfig` (routed experts), `DecoderConfig` (the whole decoder, any architecture) and
`ModelConfig` (a decoder the runtime's own code runs: qwen3_moe, qwen3, qwen2 or llama, silu,
full attention, a supported rotary scheme), all read through `HFConfig` (hf_config.py). The
EAGLE-3 head's layer is a `DecoderConfig` read the same way (eagle3/config.py). What differs
between the four architectures is a few flags: qkv bias (qwen2), per-head q/k RMSNorm (qwen3,
qwen3_moe), sparse MoE layers (qwen3_moe), attention / MLP biases and rope scaling (llama).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hetero_run.runtime.models.hf_config import HFConfig
from hetero_run.runtime.models.kv_cache import KVCache
from hetero_run.topology.errors import ConfigError

__all__ = ["ARCHITECTURES", "AttentionConfig", "DecoderConfig", "HFConfig", "MoEConfig", "ModelConfig", "RopeConfig",
           "kv_head_split"]

ARCHITECTURES = ("qwen3_moe", "qwen3", "qwen2", "llama")
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_MAX_POSITIONS = 32768  # a runnable config that does not say


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

    @classmethod
    def from_hf(cls, hf: HFConfig) -> RopeConfig:
        # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` and
        # `rope_scaling`.
        params = dict(hf.get("rope_scaling") or {})
        params.update(hf.get("rope_parameters") or {})
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise hf.error("partial rotary embeddings are not supported", "partial_rotary_factor")
        try:
            return cls(
                theta=float(params.get("rope_theta", hf.get("rope_theta", default=10000.0))),
                kind=str(params.get("rope_type", params.get("type", "default"))),
                factor=float(params.get("factor", 1.0)),
                low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                original_max_positions=int(params.get("original_max_position_embeddings", 8192)),
            )
        except ConfigError as exc:
            raise hf.error(exc.message, exc.field) from None

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


def kv_head_split(num_kv_heads: int, rank: int, size: int) -> tuple[int, int, int]:
    """(part index, part count, KV heads per rank) of `rank` among `size` ranks. Fewer KV heads
    than ranks: each rank keeps the one KV head its query heads read, e.g. 2 KV heads at TP=4:
    ranks 0, 1 -> head 0."""
    if num_kv_heads % size == 0:
        return rank, size, num_kv_heads // size
    if size % num_kv_heads == 0:
        return rank // (size // num_kv_heads), num_kv_heads, 1
    raise ConfigError(f"{num_kv_heads} KV heads cannot be split or replicated over {size} ranks",
                      field="tensor_parallel")


@dataclass(frozen=True)
class AttentionConfig:
    """One layer's attention: query and KV heads, their width, biases, per-head q/k norms."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=_HF_NAMES.get(name, name))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.num_heads} attention heads do not group over {self.num_kv_heads} KV heads",
                              field="num_key_value_heads")

    @classmethod
    def from_hf(cls, hf: HFConfig, model_type: str) -> AttentionConfig:
        heads = hf.integer("num_attention_heads")
        hidden = hf.integer("hidden_size")
        attention_bias = hf.flag("attention_bias")
        return cls(
            num_heads=heads,
            num_kv_heads=hf.integer("num_key_value_heads", default=heads),
            head_dim=hf.integer("head_dim", default=hidden // heads if heads > 0 else 0),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type in QK_NORM_ARCHITECTURES,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_heads_per_rank(self, tp: int) -> int:
        return kv_head_split(self.num_kv_heads, 0, tp)[2]


@dataclass(frozen=True)
class MoEConfig:
    """Sparse MoE layers (qwen3_moe): `num_experts` experts, `experts_per_token` of them routed."""

    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP

    def __post_init__(self):
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ConfigError(f"must be in 1..{self.num_experts}, got {self.experts_per_token}",
                              field="num_experts_per_tok")
        if self.moe_intermediate_size < 1 or self.sparse_step < 1:
            raise ConfigError("moe_intermediate_size and decoder_sparse_step must be >= 1",
                              field="moe_intermediate_size")

    @classmethod
    def from_hf(cls, hf: HFConfig, model_type: str) -> MoEConfig | None:
        """None for a dense model (only qwen3_moe configs have sparse layers here)."""
        experts = hf.integer("num_experts", "num_local_experts", default=0) if model_type == "qwen3_moe" else 0
        if not experts:
            return None
        return cls(
            num_experts=experts,
            experts_per_token=hf.integer("num_experts_per_tok", default=0),
            moe_intermediate_size=hf.integer("moe_intermediate_size", default=0),
            norm_topk_prob=hf.flag("norm_topk_prob"),
            sparse_step=hf.integer("decoder_sparse_step", default=1) or 1,
            dense_layers=tuple(int(i) for i in hf.get("mlp_only_layers", default=()) or ()),
        )

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "max_positions": "max_position_embeddings"}


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only language model of any architecture, as its config describes it.

    Drafters the runtime does not run itself (transformers runs them) are read as this: the
    planner needs their KV cache's shape and sizes, nothing more. `intermediate_size` and
    `max_positions` are 0 when the config does not say, `rope` None when the runtime has no
    rotary scheme of that kind.
    """

    arch: str  # the config's model_type
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: AttentionConfig
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig | None
    max_positions: int
    tie_word_embeddings: bool = False
    mlp_bias: bool = False
    moe: MoEConfig | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=_HF_NAMES.get(name, name))
        for name in ("intermediate_size", "max_positions"):
            if getattr(self, name) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, name)}", field=_HF_NAMES.get(name, name))

    @classmethod
    def from_hf(cls, raw: dict | HFConfig, source: str = "config.json") -> DecoderConfig:
        """Any decoder-only config (a multimodal wrapper's `text_config` included)."""
        hf = raw if isinstance(raw, HFConfig) else HFConfig.language_model(raw, source)
        try:
            rope = RopeConfig.from_hf(hf)
        except ConfigError:
            rope = None  # e.g. yarn: transformers runs such a drafter, the planner needs no rotary tables
        return cls.read(hf, hf.model_type, rope, max_positions=0, intermediate=0)

    @classmethod
    def read(cls, hf: HFConfig, arch: str, rope: RopeConfig | None, *, max_positions: int = 0,
             intermediate: int | None = None):
        """The fields of a `cls` read from `hf` (the one place a decoder's fields are read).
        `max_positions` and `intermediate` are the defaults when the config does not say
        (None: required). Errors name the config's file."""
        try:
            return cls(
                arch=arch,
                vocab_size=hf.integer("vocab_size"),
                hidden_size=hf.integer("hidden_size"),
                num_layers=hf.integer("num_hidden_layers"),
                attention=AttentionConfig.from_hf(hf, arch),
                intermediate_size=hf.integer("intermediate_size", default=intermediate),
                rms_norm_eps=hf.real("rms_norm_eps", 1e-6),
                rope=rope,
                max_positions=hf.integer("max_position_embeddings", default=0) or max_positions,
                tie_word_embeddings=hf.flag("tie_word_embeddings"),
                mlp_bias=arch == "llama" and hf.flag("mlp_bias"),
                moe=MoEConfig.from_hf(hf, arch),
                eos_token_ids=hf.eos_token_ids(),
            )
        except ConfigError as exc:
            if exc.file is not None:
                raise
            raise hf.error(exc.message, exc.field) from None

    # -- the fields of the parts, as every caller reads them ------------------------------------

    num_heads = property(lambda self: self.attention.num_heads)
    num_kv_heads = property(lambda self: self.attention.num_kv_heads)
    head_dim = property(lambda self: self.attention.head_dim)
    qkv_bias = property(lambda self: self.attention.qkv_bias)
    o_bias = property(lambda self: self.attention.o_bias)
    qk_norm = property(lambda self: self.attention.qk_norm)
    num_experts = property(lambda self: self.moe.num_experts if self.moe else 0)
    experts_per_token = property(lambda self: self.moe.experts_per_token if self.moe else 0)
    moe_intermediate_size = property(lambda self: self.moe.moe_intermediate_size if self.moe else 0)
    norm_topk_prob = property(lambda self: self.moe.norm_topk_prob if self.moe else False)
    sparse_step = property(lambda self: self.moe.sparse_step if self.moe else 1)
    dense_layers = property(lambda self: self.moe.dense_layers if self.moe else ())

    @property
    def model_type(self) -> str:
        return self.arch

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sparse(i))

    def kv_heads_per_rank(self, tp: int) -> int:
        return self.attention.kv_heads_per_rank(tp)

    def kv_bytes_per_token(self, tp: int, dtype: torch.dtype) -> int:
        """Bytes one token's keys and values take on each of `tp` ranks: what `KVCache` allocates
        per slot for this model's shard."""
        return KVCache.bytes_per_token(self.num_layers, self.kv_heads_per_rank(tp), self.head_dim, dtype)


@dataclass(frozen=True)
class ModelConfig(DecoderConfig):
    """A target the runtime's decoder runs (one of ARCHITECTURES)."""

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"architecture {self.arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})",
                              field="model_type")
        super().__post_init__()
        for name in ("intermediate_size", "max_positions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=_HF_NAMES.get(name, name))
        if self.rope is None:
            raise ConfigError("missing", field="rope_theta")
        if self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head_dim, got {self.head_dim}", field="head_dim")

    @classmethod
    def from_hf(cls, raw: dict | HFConfig, source: str = "config.json") -> ModelConfig:
        """From a Hugging Face config dict; errors name `source` and the field."""
        hf = raw if isinstance(raw, HFConfig) else HFConfig(raw, source)
        arch = hf.raw.get("model_type")
        if arch not in ARCHITECTURES:
            raise hf.error(f"model_type {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})",
                           "model_type")
        hf.check_runnable_layers()
        return cls.read(hf, arch, RopeConfig.from_hf(hf), max_positions=DEFAULT_MAX_POSITIONS)
