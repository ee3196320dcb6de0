"""Reading a Hugging Face `config.json`: where a field lives, what it defaults to, and one-line
errors that name the file and the field. The dataclasses in config.py read through this and
nothing else.

    hf = HFConfig(raw, "ckpt/config.json")
    hf.integer("num_hidden_layers")                    # missing -> "ckpt/config.json: num_hidden_layers: missing"
    hf.integer("num_key_value_heads", default=heads)   # absent or null -> heads
"""

from __future__ import annotations

from hetero_run.topology.errors import ConfigError


class HFConfig:
    """A config dict and where it came from. Keys are looked up in `sections` in order (a
    multimodal wrapper's `text_config`, a speculators head's `transformer_layer_config`), then
    at the top level, then in `defaults`; every error names the file and the field."""

    def __init__(self, raw: dict, source: str = "config.json", sections: tuple[dict | None, ...] = (),
                 defaults: dict | None = None):
        if not isinstance(raw, dict):
            raise ConfigError(f"expected a JSON object, got {type(raw).__name__}", file=source)
        self.raw, self.source = raw, source
        self.sections = tuple(s for s in (*sections, raw, defaults) if isinstance(s, dict))

    @classmethod
    def language_model(cls, raw: dict, source: str = "config.json") -> HFConfig:
        """The language model's fields: multimodal wrappers keep them in `text_config`."""
        return cls(raw, source, (raw.get("text_config"),) if isinstance(raw, dict) else ())

    def error(self, message: str, field: str) -> ConfigError:
        return ConfigError(message, file=self.source, field=field)

    def get(self, *names: str, default=None):
        """The first of `names` set (not None) in the first section holding it."""
        for section in self.sections:
            for name in names:
                if section.get(name) is not None:
                    return section[name]
        return default

    def need(self, name: str, *aliases: str):
        value = self.get(name, *aliases)
        if value is None:
            raise self.error("missing", name)
        return value

    def integer(self, name: str, *aliases: str, default: int | None = None) -> int:
        value = self.need(name, *aliases) if default is None else self.get(name, *aliases, default=default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise self.error(f"expected a whole number, got {value!r}", name)
        return int(value)

    def real(self, name: str, default: float) -> float:
        value = self.get(name, default=default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(f"expected a number, got {value!r}", name)
        return float(value)

    def flag(self, name: str, default: bool = False) -> bool:
        return bool(self.get(name, default=default))

    @property
    def model_type(self) -> str:
        return str(self.raw.get("model_type"))

    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.get("eos_token_id")
        return () if eos is None else tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)

    def check_runnable_layers(self) -> None:
        """What the runtime's decoder layer does not run: other activations, sliding windows."""
        act = self.get("hidden_act", default="silu")
        if act != "silu":
            raise self.error(f"activation {act!r} is not supported (only silu)", "hidden_act")
        if "sliding_attention" in (self.get("layer_types") or ()) or (
                self.get("use_sliding_window") and self.get("sliding_window")):
            raise self.error("sliding-window attention is not supported", "use_sliding_window")
