"""The shape of an EAGLE-3 head (`Eagle3Config`), read from its config.json and checked against
the target it drafts for.

The head's one decoder layer is a `DecoderConfig` read by the runtime's shared config reader
(models/config.py), so the head's KV cache and weights are sized the same way wherever they
are read; a speculators (vLLM) head keeps that layer's fields in `transformer_layer_config`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hetero_run.runtime.eagle3.layout import EAGLE3_ARCHITECTURES, aux_layer_ids, resolve_layers
from hetero_run.runtime.models.config import DecoderConfig, HFConfig, ModelConfig, RopeConfig
from hetero_run.topology.errors import ConfigError

log = logging.getLogger("hetero_run.runtime.eagle3")


def is_eagle3_config(config: dict) -> bool:
    architectures = config.get("architectures") or []
    return any(a in EAGLE3_ARCHITECTURES for a in architectures) or "speculators_model_type" in config


@dataclass(frozen=True)
class Eagle3Config:
    layer: DecoderConfig  # the head's Llama layer; its vocab_size is the target's (t2d's length)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # target layers whose INPUT is captured (num_layers: the final state); () unread
    aux_layers_named: bool  # False: the config named none and the default was taken
    norm_before_residual: bool = False  # the residual is hidden_norm(g) instead of g

    def __post_init__(self):
        for name in ("draft_vocab_size", "target_hidden_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        if self.layer.intermediate_size < 1:
            raise ConfigError(f"must be >= 1, got {self.layer.intermediate_size}", field="intermediate_size")
        if self.layer.rope is None:
            raise ConfigError("missing", field="rope_theta")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"draft vocabulary {self.draft_vocab_size} is larger than the target's "
                              f"{self.vocab_size}", field="draft_vocab_size")

    hidden_size = property(lambda self: self.layer.hidden_size)
    num_heads = property(lambda self: self.layer.num_heads)
    num_kv_heads = property(lambda self: self.layer.num_kv_heads)
    head_dim = property(lambda self: self.layer.head_dim)
    intermediate_size = property(lambda self: self.layer.intermediate_size)
    rms_norm_eps = property(lambda self: self.layer.rms_norm_eps)
    vocab_size = property(lambda self: self.layer.vocab_size)

    @property
    def rope(self) -> RopeConfig:
        return self.layer.rope

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """The head's own KV cache (one layer, all its KV heads, on rank 0)."""
        return self.layer.kv_bytes_per_token(1, dtype)

    @classmethod
    def from_hf(cls, config: dict, target: ModelConfig | None = None, source: str = "config.json",
                layer_numbering: str | None = None, default_numbering: str = "output") -> Eagle3Config:
        """From a head's config dict, for `target`. `layer_numbering` overrides what the layout
        implies for the aux layer ids ("input" or "output" of layer i). Without a target (the
        planner, before it pairs them) the aux layers stay unresolved and the vocabulary and
        target width are the config's."""
        if not is_eagle3_config(config):
            raise ConfigError(f"not an EAGLE-3 head (architectures {config.get('architectures') or []}; expected "
                              f"one of {', '.join(EAGLE3_ARCHITECTURES)})", file=source, field="architectures")
        defaults = {"vocab_size": target.vocab_size, "target_hidden_size": target.hidden_size} if target else {}
        hf = HFConfig(config, source, (config.get("transformer_layer_config"),), defaults)
        hf.check_runnable_layers()
        if hf.integer("num_hidden_layers", default=1) != 1:
            raise hf.error(f"only one-layer heads are supported, got {hf.get('num_hidden_layers')}",
                           "num_hidden_layers")
        layer = DecoderConfig.read(hf, "llama", RopeConfig.from_hf(hf))
        aux, ids = (), aux_layer_ids(config)
        if target is not None:
            numbering = layer_numbering or default_numbering
            aux = resolve_layers(ids, numbering, target.num_layers, source)
            if ids is None:
                log.warning("%s: the EAGLE-3 head names no aux layers (eagle_aux_hidden_state_layer_ids); using "
                            "the usual default, the states entering target layers %s. A head trained on other "
                            "layers drafts with ~1%% acceptance and nothing else shows it.", source, list(aux))
            else:
                log.info("%s: aux layer ids %s (%s of layer i) -> states entering target layers %s", source, ids,
                         numbering, list(aux))
        inner = config.get("transformer_layer_config")
        top = HFConfig(config, source, (), {**defaults, **(inner if isinstance(inner, dict) else {})})
        try:
            out = cls(
                layer=layer,
                draft_vocab_size=top.integer("draft_vocab_size", default=layer.vocab_size),
                target_hidden_size=top.integer("target_hidden_size", default=layer.hidden_size),
                aux_layers=aux, aux_layers_named=ids is not None,
                norm_before_residual=top.flag("norm_before_residual"),
            )
        except ConfigError as exc:
            raise ConfigError(exc.message, file=source, field=exc.field) from None
        if target is not None:
            out.check_target(target, source)
        return out

    def check_target(self, target: DecoderConfig, source: str) -> None:
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
