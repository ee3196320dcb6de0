"""The architecture facts the planner needs, from a Hugging Face `config.json`.

Targets are read by the runtime's own `ModelConfig.from_hf` (same fields, same validation, so
a target the runtime refuses is refused here too). Drafters may be any decoder-only causal LM
(their weights come from the checkpoint headers; only the KV-cache shape is read here) or an
EAGLE-3 head (`LlamaForCausalLMEagle3`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero_run.topology.errors import ConfigError

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    max_positions: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    # EAGLE-3 heads only
    eagle3: bool = False
    draft_vocab_size: int = 0
    target_hidden_size: int = 0

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads",
                              field="num_key_value_heads")
        if self.moe_layers and not (0 < self.experts_per_token <= self.num_experts):
            raise ConfigError(f"{self.experts_per_token} active experts of {self.num_experts}",
                              field="num_experts_per_tok")

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_input_size(self) -> int:
        """EAGLE-3 layers attend over concat(embedding, fused features): 2H inputs."""
        return 2 * self.hidden_size if self.eagle3 else self.hidden_size

    @classmethod
    def for_target(cls, config: dict, source: str = "config.json") -> ModelShape:
        """Through the runtime's `ModelConfig`: its architectures, defaults and checks."""
        from hetero_run.runtime.models.config import ModelConfig

        if EAGLE3_ARCHITECTURE in (config.get("architectures") or []):
            raise ConfigError("an EAGLE-3 head cannot be the target", file=source, field="architectures")
        mc = ModelConfig.from_hf(config, source=source)
        return cls(
            model_type=mc.arch, hidden_size=mc.hidden_size, num_layers=mc.num_layers, num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, intermediate_size=mc.intermediate_size,
            vocab_size=mc.vocab_size, tied_embeddings=mc.tie_word_embeddings, max_positions=mc.max_positions,
            qkv_bias=mc.qkv_bias, o_bias=mc.o_bias, mlp_bias=mc.mlp_bias,
            num_experts=mc.num_experts, experts_per_token=mc.experts_per_token,
            moe_intermediate_size=mc.moe_intermediate_size,
            moe_layers=tuple(i for i in range(mc.num_layers) if mc.is_sparse(i)),
        )

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> ModelShape:
        """Any decoder-only config (drafters), EAGLE-3 heads included."""
        def need(key: str, *alternatives: str):
            for k in (key, *alternatives):
                if config.get(k) is not None:
                    return config[k]
            raise ConfigError("missing", file=source, field=key)

        architectures = config.get("architectures") or []
        eagle3 = EAGLE3_ARCHITECTURE in architectures or config.get("speculators_model_type") == "eagle3"
        model_type = "llama" if eagle3 else str(config.get("model_type"))
        config = config.get("text_config") or config  # multimodal wrappers keep the LM config inside
        if eagle3 and isinstance(config.get("transformer_layer_config"), dict):  # speculators (vLLM) heads
            config = {**config["transformer_layer_config"], **config}
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        moe_layers: tuple[int, ...] = ()
        if model_type == "qwen3_moe" and num_experts:
            step = int(config.get("decoder_sparse_step") or 1)
            dense = set(config.get("mlp_only_layers") or ())
            moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config.get("intermediate_size") or 0),
            vocab_size=int(need("vocab_size")),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_positions=int(config.get("max_position_embeddings") or 0),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias")),
            o_bias=model_type == "llama" and bool(config.get("attention_bias")),
            mlp_bias=model_type == "llama" and bool(config.get("mlp_bias")),
            num_experts=num_experts if moe_layers else 0,
            experts_per_token=int(config.get("num_experts_per_tok") or 0) if moe_layers else 0,
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0) if moe_layers else 0,
            moe_layers=moe_layers,
            eagle3=eagle3,
            draft_vocab_size=int(config.get("draft_vocab_size") or config.get("vocab_size")) if eagle3 else 0,
            target_hidden_size=int(config.get("target_hidden_size") or hidden) if eagle3 else 0,
        )
