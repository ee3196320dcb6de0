"""The three ways EAGLE-3 heads are stored, and which target states each one means.

    layout       tensors                          config                               aux layer ids mean
    eagle        midlayer.*, fc, d2t, t2d         LlamaForCausalLMEagle3 (EAGLE,       "output of layer i"
                                                  SpecForge; ids in eagle_config)      (SpecForge's numbering)
    modelopt     layers.0.*, fc, d2t              LlamaForCausalLMEagle3 + eagle_config "output of layer i"
    vllm         layers.0.* / model.layers.0.*,   Eagle3Speculator (speculators) or a  "input of layer i"
                 model.fc, d2t, t2d               vLLM-native llama eagle3 checkpoint

Every name is mapped to one canonical set (`fc`, `layer.*`, `norm`, `lm_head`, `embed`, `d2t`,
`t2d`) so the head is built the same way from each. The numbering rule, with L target layers:
the state entering layer i is the state leaving layer i - 1, so the usual default, the inputs
of layers (2, L // 2, L - 3), is written (1, L // 2 - 1, L - 4) by the "output" convention.
A head that names no layers gets that default and a warning: a head trained on other layers
drafts garbage (~1% acceptance) without any other symptom.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero_run.topology.errors import ConfigError

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3Speculator", "Eagle3DraftModel")
LAYOUTS = ("eagle", "modelopt", "vllm")
NUMBERINGS = ("input", "output")

LAYER_LEAVES = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
)
_LAYER_PREFIXES = {"eagle": "midlayer.", "modelopt": "layers.0.", "vllm": "layers.0."}


@dataclass(frozen=True)
class Layout:
    name: str  # one of LAYOUTS
    names: dict[str, str]  # canonical name -> name in the checkpoint (only those present)
    numbering: str  # how the config's aux layer ids count: "input" or "output" of layer i

    def has(self, canonical: str) -> bool:
        return canonical in self.names


def detect(config: dict, tensor_names: set[str], source: str) -> Layout:
    """The layout of a head from its config.json and tensor names."""
    names: dict[str, str] = {}
    vllm_native = any(n.startswith("model.layers.0.") for n in tensor_names)
    if any(n.startswith("midlayer.") for n in tensor_names):
        kind = "eagle"
    elif vllm_native or "speculators_model_type" in config or "transformer_layer_config" in config:
        kind = "vllm"
    elif any(n.startswith("layers.0.") for n in tensor_names):
        kind = "modelopt"
    else:
        raise ConfigError("no EAGLE-3 decoder layer among its tensors (expected midlayer.*, layers.0.* or "
                          "model.layers.0.*)", file=source, field="tensors")
    if any(n.startswith(("midlayer.", "layers.", "model.layers.")) and not n.startswith(
            ("midlayer.", "layers.0.", "model.layers.0.")) for n in tensor_names):
        raise ConfigError("holds more than one decoder layer; only one-layer EAGLE-3 heads are supported",
                          file=source, field="num_hidden_layers")
    prefix = "model." if vllm_native else ""
    layer_prefix = prefix + _LAYER_PREFIXES[kind]
    for leaf in LAYER_LEAVES:
        names[f"layer.{leaf}"] = layer_prefix + leaf
    for canonical, stored in (("fc.weight", "fc.weight"), ("norm.weight", "norm.weight"),
                              ("embed.weight", "embed_tokens.weight")):
        for candidate in (prefix + stored, stored, "model." + stored):
            if candidate in tensor_names:
                names[canonical] = candidate
                break
        else:
            names[canonical] = prefix + stored
    names["lm_head.weight"] = "lm_head.weight"
    for canonical, candidates in (("d2t", ("d2t", "draft_id_to_target_id", "model.d2t")),
                                  ("t2d", ("t2d", "model.t2d"))):
        names[canonical] = next((c for c in candidates if c in tensor_names), candidates[0])
    present = {c: n for c, n in names.items() if n in tensor_names}
    required = [c for c in names if c not in ("embed.weight", "t2d", "d2t")]
    missing = [names[c] for c in required if c not in present]
    if missing:
        raise ConfigError(f"the {kind} layout needs tensor {missing[0]!r}, which is missing"
                          + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""),
                          file=source, field="tensors")
    return Layout(kind, present, "input" if kind == "vllm" else "output")


def aux_layer_ids(config: dict) -> list[int] | None:
    """The aux layer ids a config names, wherever its layout keeps them; None if it names none."""
    for section in (config.get("eagle_config"), config, config.get("speculators_config"),
                    config.get("transformer_layer_config")):
        if isinstance(section, dict):
            ids = section.get("eagle_aux_hidden_state_layer_ids")
            if ids is not None:
                return list(ids)
    return None


def resolve_layers(ids: list[int] | None, numbering: str, num_layers: int, source: str) -> tuple[int, int, int]:
    """Aux layer ids as the target layers whose INPUT is captured (0-based; num_layers means the
    last layer's output). None: the usual default, the inputs of layers (2, L // 2, L - 3)."""
    if numbering not in NUMBERINGS:
        raise ConfigError(f"must be input or output, got {numbering!r}", field="layer_numbering")
    if ids is None:
        resolved = [2, num_layers // 2, num_layers - 3]
    else:
        if len(ids) != 3 or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConfigError(f"expected three integer layer ids, got {ids}", file=source,
                              field="eagle_aux_hidden_state_layer_ids")
        resolved = [i + 1 if numbering == "output" else i for i in ids]
    if any(not 0 <= i <= num_layers for i in resolved) or len(set(resolved)) != 3:
        raise ConfigError(f"aux layers {ids if ids is not None else resolved} ({numbering} of layer i) do not fit "
                          f"a target of {num_layers} layers", file=source, field="eagle_aux_hidden_state_layer_ids")
    return tuple(sorted(resolved))
