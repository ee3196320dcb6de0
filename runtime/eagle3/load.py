"""`load_eagle3`: an EAGLE-3 head directory, checked against the target, bound to rank 0's target.

    model = load_model(target_dir, ctx, ...)                    # every rank
    drafter = load_eagle3(head_dir, model, tokenizer, target_source=target_dir)   # rank 0 only
    engine = SpeculativeEngine(TargetRunner(model, ctx), tokenizer, drafter, SpeculationConfig("eagle3"))

Binding sets the target's capture layers and sink on rank 0 only: the other ranks compute the
same replicated residual stream and keep none of it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from hetero_run.runtime.drafters.load import Drafter
from hetero_run.runtime.eagle3.config import Eagle3Config
from hetero_run.runtime.eagle3.drafter import Eagle3Drafter
from hetero_run.runtime.eagle3.head import Eagle3Head, Embedding
from hetero_run.runtime.eagle3.layout import Layout, detect
from hetero_run.topology.errors import ConfigError, UserError

log = logging.getLogger("hetero_run.runtime.eagle3")

EAGLE3_PREFIX = "eagle3:"


class HeadFiles:
    """A head directory's config.json and tensors (safetensors, sharded or not, or pytorch_model.bin)."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_dir():
            raise UserError("no such EAGLE-3 head directory", file=path, field="drafter")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise UserError("not an EAGLE-3 head directory: no config.json inside", file=path, field="drafter")
        try:
            self.config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"invalid JSON: {exc.msg}", file=config_file, line=exc.lineno) from None
        self._bin: dict[str, torch.Tensor] | None = None
        self._ckpt = None
        if any(path.glob("*.safetensors")):
            from hetero_run.runtime.checkpoint import Checkpoint

            self._ckpt = Checkpoint.open(path)
            self.names = set(self._ckpt.tensors)
        elif (path / "pytorch_model.bin").is_file():
            try:
                self._bin = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
            except Exception as exc:  # a pickle or zip error: one line, not a traceback
                raise UserError(f"cannot read pytorch_model.bin: {exc}", file=path, field="drafter") from None
            self.names = set(self._bin)
        else:
            raise UserError("no model.safetensors (or index) and no pytorch_model.bin", file=path, field="drafter")

    def read(self, name: str) -> torch.Tensor:
        return self._bin[name] if self._bin is not None else self._ckpt.read(name)

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()


def read_head(path: str | Path, target_config, layer_numbering: str | None = None
              ) -> tuple[Eagle3Config, Layout, dict[str, torch.Tensor]]:
    """Config, layout and canonical tensors of the head at `path`, every shape checked."""
    files = HeadFiles(Path(path))
    source = str(Path(path) / "config.json")
    try:
        if files.config.get("quantization_config") or any(n.endswith(".weight_scale") for n in files.names):
            raise ConfigError("quantised EAGLE-3 heads are not supported; export the head in bf16", file=source,
                              field="quantization_config")
        layout = detect(files.config, files.names, str(path))
        config = Eagle3Config.from_hf(files.config, target_config, source, layer_numbering, layout.numbering)
        tensors = {canonical: files.read(name) for canonical, name in layout.names.items()}
    finally:
        files.close()
    _check_shapes(config, layout, tensors, str(path))
    draft_to_target(config, tensors, layout, str(path))
    return config, layout, tensors


def _check_shapes(c: Eagle3Config, layout: Layout, t: dict[str, torch.Tensor], source: str) -> None:
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    expected = {
        "fc.weight": (h, 3 * c.target_hidden_size),
        "layer.self_attn.q_proj.weight": (q, 2 * h), "layer.self_attn.k_proj.weight": (kv, 2 * h),
        "layer.self_attn.v_proj.weight": (kv, 2 * h), "layer.self_attn.o_proj.weight": (h, q),
        "layer.mlp.gate_proj.weight": (c.intermediate_size, h), "layer.mlp.up_proj.weight": (c.intermediate_size, h),
        "layer.mlp.down_proj.weight": (h, c.intermediate_size),
        "layer.input_layernorm.weight": (h,), "layer.hidden_norm.weight": (h,),
        "layer.post_attention_layernorm.weight": (h,), "norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h), "embed.weight": (c.vocab_size, h),
        "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,),
    }
    for canonical, shape in expected.items():
        if canonical in t and tuple(t[canonical].shape) != shape:
            raise ConfigError(f"has shape {list(t[canonical].shape)}, expected {list(shape)} for this config and "
                              "target", file=source, field=layout.names[canonical])
    for canonical, tensor in t.items():
        if canonical not in ("d2t", "t2d") and not tensor.is_floating_point():
            raise ConfigError(f"has dtype {tensor.dtype}, expected a floating-point weight", file=source,
                              field=layout.names[canonical])


def draft_to_target(c: Eagle3Config, t: dict[str, torch.Tensor], layout: Layout, source: str) -> torch.Tensor:
    """[draft_vocab] int64: the target id of each draft id (d + d2t[d]), checked."""
    if "d2t" not in t:
        if c.draft_vocab_size != c.vocab_size:
            raise ConfigError(f"no d2t tensor, but the draft vocabulary ({c.draft_vocab_size}) is smaller than the "
                              f"target's ({c.vocab_size})", file=source, field="d2t")
        return torch.arange(c.vocab_size)
    d2t = t["d2t"]
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ConfigError(f"has dtype {d2t.dtype}, expected integers", file=source, field=layout.names["d2t"])
    ids = torch.arange(c.draft_vocab_size) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
        raise ConfigError(f"maps draft ids outside the target vocabulary 0..{c.vocab_size - 1}", file=source,
                          field=layout.names["d2t"])
    if ids.unique().numel() != ids.numel():
        raise ConfigError("maps two draft ids to the same target id", file=source, field=layout.names["d2t"])
    if "t2d" in t:
        t2d = t["t2d"].bool()
        if int(t2d.sum()) != c.draft_vocab_size or not bool(t2d[ids].all()):
            raise ConfigError("disagrees with d2t (it must mark exactly the target ids d2t maps to)", file=source,
                              field=layout.names["t2d"])
    return ids


def load_eagle3(path: str | Path, target, tokenizer, *, target_source=None, layer_numbering: str | None = None,
                max_tokens: int | None = None) -> Drafter:
    """The EAGLE-3 head at `path` (a directory; an `eagle3:` prefix is accepted) as a `Drafter`
    for rank 0's `target` (a `TargetModel`), which starts capturing the head's aux layers.

    `tokenizer` is the target's (the head drafts target tokens). `target_source` (the target's
    checkpoint directory, GGUF file or model) is read for the embedding rows other ranks hold
    when TP > 1 and the head has no embedding of its own. `layer_numbering` ("input" /
    "output") overrides how the layout's aux layer ids count.
    """
    begin = time.perf_counter()
    spec = str(path)
    path = Path(spec[len(EAGLE3_PREFIX):] if spec.startswith(EAGLE3_PREFIX) else spec)
    if not target.ctx.is_first:
        raise ValueError("the EAGLE-3 head lives on rank 0")
    config, layout, tensors = read_head(path, target.config, layer_numbering)
    target_ids = draft_to_target(config, tensors, layout, str(path))
    embed = _embedding(target, tensors, target_source, path)
    head = Eagle3Head(config, tensors, embed, max_tokens or target.max_tokens, target.dtype, target.device)
    drafter = Eagle3Drafter(head, target, target_ids, target.config.vocab_size)
    target.capture(config.aux_layers, sink=drafter.record)
    log.info("EAGLE-3 head %s (%s layout): draft vocabulary %d, aux states entering target layers %s, "
             "%.0f M parameters, loaded in %.1f s", path.name, layout.name, config.draft_vocab_size,
             list(config.aux_layers), head.nbytes / target.dtype.itemsize / 1e6, time.perf_counter() - begin)
    return Drafter(drafter, tokenizer, str(path))


def _embedding(target, tensors: dict[str, torch.Tensor], target_source, path: Path) -> Embedding:
    if "embed.weight" in tensors:
        return Embedding(tensors["embed.weight"].to(device=target.device, dtype=target.dtype).contiguous())
    local = target.embed.weight  # [vocab / tp, H], rows 0 .. vocab / tp - 1 on rank 0
    if target.ctx.size == 1:
        return Embedding(local)
    if target_source is None:
        raise ConfigError("the head has no embedding of its own and the target is split over ranks: pass the "
                          "target's checkpoint (target_source) so rank 0 can read the rows it lacks", file=path,
                          field="embed_tokens")
    from hetero_run.runtime.models.loader import open_source

    src = open_source(target_source)
    try:
        full = src.read("model.embed_tokens.weight")
        rest = full[local.shape[0]:].to(device=target.device, dtype=target.dtype).clone()
    finally:
        src.close()
    return Embedding(local, rest)
