"""The shape of an EAGLE-3 head (`Eagle3Config`), read from its config.json and checked against
the target it drafts for."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hetero_run.runtime.eagle3.layout import EAGLE3_ARCHITECTURES, aux_layer_ids, resolve_layers
from hetero_run.runtime.models.config import ModelConfig, RopeConfig, _rope
from hetero_run.topology.errors import ConfigError

log = logging.getLogger("hetero_run.runtime.eagle3")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    draft_vocab_size: int
    vocab_size: int  # the target's vocabulary (t2d's length)
    target_hidden_size: int
    aux_layers: tuple[int, int, int]  # target layers whose INPUT is captured (num_layers: the final state)
    aux_layers_named: bool  # False: the config named none and the default was taken
    norm_before_residual: bool = False  # the residual is hidden_norm(g) instead of g

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "draft_vocab_size", "vocab_size", "target_hidden_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.num_heads} attention heads do not group over {self.num_kv_heads} KV heads",
                              field="num_key_value_heads")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"draft vocabulary {self.draft_vocab_size} is larger than the target's "
                              f"{self.vocab_size}", field="draft_vocab_size")

    @classmethod
    def from_hf(cls, config: dict, target: ModelConfig, source: str = "config.json",
                layer_numbering: str | None = None, default_numbering: str = "output") -> Eagle3Config:
        """From a head's config dict, for `target`. `layer_numbering` overrides what the layout
        implies for the aux layer ids ("input" or "output" of layer i)."""
        architectures = config.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in architectures) and "speculators_model_type" not in config:
            raise ConfigError(f"not an EAGLE-3 head (architectures {architectures}; expected one of "
                              f"{', '.join(EAGLE3_ARCHITECTURES)})", file=source, field="architectures")
        layer = config.get("transformer_layer_config") or config  # speculators keep the layer's config inside

        def need(name: str, where: dict = layer):
            value = where.get(name, config.get(name))
            if value is None:
                raise ConfigError("missing", file=source, field=name)
            return value

        act = layer.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"activation {act!r} is not supported (only silu)", file=source, field="hidden_act")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ConfigError(f"only one-layer heads are supported, got {layer.get('num_hidden_layers')}",
                              file=source, field="num_hidden_layers")
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        ids = aux_layer_ids(config)
        numbering = layer_numbering or default_numbering
        aux = resolve_layers(ids, numbering, target.num_layers, source)
        if ids is None:
            log.warning("%s: the EAGLE-3 head names no aux layers (eagle_aux_hidden_state_layer_ids); using the "
                        "usual default, the states entering target layers %s. A head trained on other layers "
                        "drafts with ~1%% acceptance and nothing else shows it.", source, list(aux))
        else:
            log.info("%s: aux layer ids %s (%s of layer i) -> states entering target layers %s", source, ids,
                     numbering, list(aux))
        try:
            out = cls(
                hidden_size=hidden, num_heads=heads,
                num_kv_heads=int(layer.get("num_key_value_heads") or heads),
                head_dim=int(layer.get("head_dim") or hidden // heads),
                intermediate_size=int(need("intermediate_size")),
                rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                rope=_rope(layer, source),
                draft_vocab_size=int(config.get("draft_vocab_size") or layer.get("draft_vocab_size")
                                     or need("vocab_size")),
                vocab_size=int(layer.get("vocab_size") or config.get("vocab_size") or target.vocab_size),
                target_hidden_size=int(config.get("target_hidden_size") or layer.get("target_hidden_size")
                                       or target.hidden_size),
                aux_layers=aux, aux_layers_named=ids is not None,
                norm_before_residual=bool(config.get("norm_before_residual", layer.get("norm_before_residual",
                                                                                         False))),
            )
        except ConfigError as exc:
            raise ConfigError(exc.message, file=source, field=exc.field) from None
        out.check_target(target, source)
        return out

    def check_target(self, target: ModelConfig, source: str) -> None:
        if self.target_hidden_size != target.hidden_size:
            raise ConfigError(f"the head reads target states of width {self.target_hidden_size}, the target's "
                              f"hidden size is {target.hidden_size}", file=source, field="target_hidden_size")
        if self.hidden_size != target.hidden_size:
            raise ConfigError(f"the head's hidden size {self.hidden_size} differs from the target's "
                              f"{target.hidden_size}, so the target's embedding cannot feed it", file=source,
                              field="hidden_size")
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"the head is for a vocabulary of {self.vocab_size} tokens, the target has "
                              f"{target.vocab_size}", file=source, field="vocab_size")
