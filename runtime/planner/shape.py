"""The architecture facts the planner needs: a view of the runtime's own config reader.

Nothing here parses config.json: targets are read by `ModelConfig.from_hf` (the loader's
reader: same fields, same defaults, same checks, so a target the runtime refuses is refused
here too), drafters by `DecoderConfig.from_hf` (any decoder-only causal LM; their weights come
from the checkpoint headers, so only the KV cache's shape matters), and EAGLE-3 heads by
`Eagle3Config.from_hf` (the EAGLE-3 loader's reader, whose layer is a `DecoderConfig` too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero_run.runtime.eagle3.config import Eagle3Config, is_eagle3_config
from hetero_run.runtime.models.config import QK_NORM_ARCHITECTURES, DecoderConfig, ModelConfig
from hetero_run.topology.errors import ConfigError

__all__ = ["QK_NORM_ARCHITECTURES", "ModelShape"]


@dataclass(frozen=True)
class ModelShape:
    decoder: DecoderConfig  # a target's ModelConfig; for an EAGLE-3 head, its one layer
    head: Eagle3Config | None = None  # EAGLE-3 heads only

    @classmethod
    def for_target(cls, config: dict, source: str = "config.json") -> ModelShape:
        """Through the runtime's `ModelConfig`: its architectures, defaults and checks."""
        if is_eagle3_config(config):
            raise ConfigError("an EAGLE-3 head cannot be the target", file=source, field="architectures")
        return cls(ModelConfig.from_hf(config, source=source))

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> ModelShape:
        """Any decoder-only config (drafters), EAGLE-3 heads included."""
        if is_eagle3_config(config):
            head = Eagle3Config.from_hf(config, source=source)
            return cls(head.layer, head)
        return cls(DecoderConfig.from_hf(config, source=source))

    # -- what the accounting, the workspace and the roofline read --------------------------------

    model_type = property(lambda self: self.decoder.arch)
    hidden_size = property(lambda self: self.decoder.hidden_size)
    num_layers = property(lambda self: self.decoder.num_layers)
    num_heads = property(lambda self: self.decoder.num_heads)
    num_kv_heads = property(lambda self: self.decoder.num_kv_heads)
    head_dim = property(lambda self: self.decoder.head_dim)
    intermediate_size = property(lambda self: self.decoder.intermediate_size)
    vocab_size = property(lambda self: self.decoder.vocab_size)
    tied_embeddings = property(lambda self: self.decoder.tie_word_embeddings)
    max_positions = property(lambda self: self.decoder.max_positions)
    qkv_bias = property(lambda self: self.decoder.qkv_bias)
    o_bias = property(lambda self: self.decoder.o_bias)
    mlp_bias = property(lambda self: self.decoder.mlp_bias)
    qk_norm = property(lambda self: self.decoder.qk_norm)
    num_experts = property(lambda self: self.decoder.num_experts)
    experts_per_token = property(lambda self: self.decoder.experts_per_token)
    moe_intermediate_size = property(lambda self: self.decoder.moe_intermediate_size)
    moe_layers = property(lambda self: self.decoder.sparse_layers)
    q_size = property(lambda self: self.decoder.attention.q_size)
    kv_size = property(lambda self: self.decoder.attention.kv_size)

    @property
    def eagle3(self) -> bool:
        return self.head is not None

    @property
    def draft_vocab_size(self) -> int:
        return self.head.draft_vocab_size if self.head else 0

    @property
    def target_hidden_size(self) -> int:
        return self.head.target_hidden_size if self.head else 0

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def attention_input_size(self) -> int:
        """EAGLE-3 layers attend over concat(embedding, fused features): 2H inputs."""
        return 2 * self.hidden_size if self.eagle3 else self.hidden_size

    def kv_bytes_per_token(self, tp: int, dtype: torch.dtype) -> int:
        """Bytes one token's keys and values take on each of `tp` ranks (`KVCache.bytes_per_token`
        of the shard the loader builds)."""
        return self.decoder.kv_bytes_per_token(tp, dtype)
