"""A drafter's weights in the layout of the compiled decode step (`kernels.drafter_step`).

They come from a loaded runtime model (`from_model`: its layer objects, as `load_model` builds
them for any llama / qwen2 / qwen3 checkpoint, GGUF file or transformers model), are optionally
quantised to NVFP4 (`quantize`: every projection and the head, weight-only), and are saved and
loaded as one safetensors file (`save`, `load`) that the fast drafter reads directly:

    embed, norm, rope_inv_freq                        embedding [vocab, hidden], final norm, rotary
    layers.{i}.input_norm / post_norm / qk_norm       float32 norms (qk_norm: qwen3 family)
    layers.{i}.{qkv,o,gate_up,down}.weight            dense [out, in], or NVFP4:
    layers.{i}.{...}.codes / .block_scale / .row_scale  uint8 [out, in/2], float8_e4m3fn [out, in/16], float32 [out]
    layers.{i}.{...}.bias                             float32 [out], where the model has one
    head.*                                            as a projection; absent when the head is the embedding
"""

from __future__ import annotations

from pathlib import Path

import torch

from hetero_run.kernels import cpu_ext, nvfp4
from hetero_run.kernels.drafter_step import Projection, StepLayer, StepWeights
from hetero_run.topology.errors import UserError

FORMAT = "hetero-run-drafter"
VERSION = 1
PROJECTIONS = ("qkv", "o", "gate_up", "down")
DTYPES = (torch.bfloat16, torch.float32)


class DraftWeightsError(UserError):
    """A drafter weights file that is not what the fast drafter reads."""


def _projection(linear, dtype: torch.dtype) -> Projection:
    """A runtime linear layer (`.weight` dense or NVFP4, `.bias`) as a Projection."""
    from hetero_run.runtime.weights import DenseWeight, NVFP4Weight

    weight, bias = linear.weight, getattr(linear, "bias", None)
    bias = None if bias is None else bias.float()
    if isinstance(weight, NVFP4Weight):  # weight-only: a drafter's activations stay as they are
        return Projection(codes=weight.codes, block_scale=weight.block_scale, row_scale=weight.row_scale, bias=bias)
    if isinstance(weight, DenseWeight):
        return Projection(weight=weight.weight.to(dtype), bias=bias)
    raise DraftWeightsError(f"the fast drafter cannot run a {type(weight).__name__} projection", field="drafter")


def from_model(model, dtype: torch.dtype | None = None) -> StepWeights:
    """The weights of a runtime `TargetModel` at TP size 1 (shared, not copied, where the dtype matches)."""
    from hetero_run.runtime.models.mlp import GatedMLP

    config = model.config
    dtype = dtype or model.dtype
    if dtype not in DTYPES:
        raise DraftWeightsError(f"the fast drafter runs bf16 or float32 weights, not {dtype}", field="dtype")
    if model.ctx.size != 1:
        raise DraftWeightsError("a drafter runs at tensor-parallel size 1", field="drafter")
    layers = []
    for i, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, GatedMLP):
            raise DraftWeightsError(f"layer {i} is not a dense gated MLP (mixture-of-experts drafters are not "
                                    "supported by the fast drafter)", field="drafter")
        attention = layer.attention
        layers.append(StepLayer(
            layer.input_norm.float(), _projection(attention.qkv, dtype), _projection(attention.o, dtype),
            layer.post_norm.float(), _projection(layer.mlp.gate_up, dtype), _projection(layer.mlp.down, dtype),
            None if attention.qk_norm is None else attention.qk_norm.float()))
    embed = model.embed.weight.to(dtype)
    head = Projection(weight=embed) if model.lm_head.tied else _projection(model.lm_head, dtype)
    return StepWeights(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps, embed, layers,
                       model.norm.float(), head, extra={"rope_inv_freq": config.rope.inv_freq(config.head_dim)})


def _quantized(p: Projection) -> Projection:
    if p.nvfp4:
        return p
    q = nvfp4.quantize(p.weight.float())
    return Projection(codes=q.codes, block_scale=q.block_scale,
                      row_scale=q.global_scale.reshape(1).expand(p.out_features).contiguous(), bias=p.bias)


def quantize(weights: StepWeights) -> StepWeights:
    """Every projection and the head in NVFP4 (ModelOpt's rounding, one global scale per fused
    weight); the embedding, read one row per token, stays as it is. A quarter of bf16's bytes
    per step; the drafts change a little, and any drafts keep the output exact."""
    layers = [StepLayer(layer.input_norm, _quantized(layer.qkv), _quantized(layer.o), layer.post_norm,
                        _quantized(layer.gate_up), _quantized(layer.down), layer.qk_norm)
              for layer in weights.layers]
    return StepWeights(weights.heads, weights.kv_heads, weights.head_dim, weights.eps, weights.embed, layers,
                       weights.norm, _quantized(weights.head), extra=dict(weights.extra))


def cast(weights: StepWeights, dtype: torch.dtype) -> StepWeights:
    """Dense weights and the embedding in `dtype` (NVFP4 and the float32 norms stay); a head tied
    to the embedding stays tied."""
    if dtype not in DTYPES:
        raise DraftWeightsError(f"the fast drafter runs bf16 or float32 weights, not {dtype}", field="dtype")

    def to(p: Projection) -> Projection:
        if p.nvfp4 or p.weight.dtype == dtype:
            return p
        return Projection(weight=p.weight.to(dtype), bias=p.bias, bf16_x=p.bf16_x)

    embed = weights.embed.to(dtype)
    head = Projection(weight=embed) if weights.head.weight is weights.embed else to(weights.head)
    layers = [StepLayer(layer.input_norm, to(layer.qkv), to(layer.o), layer.post_norm, to(layer.gate_up),
                        to(layer.down), layer.qk_norm) for layer in weights.layers]
    return StepWeights(weights.heads, weights.kv_heads, weights.head_dim, weights.eps, embed, layers, weights.norm,
                       head, extra=dict(weights.extra))


def kind(weights: StepWeights) -> str:
    """"nvfp4" when the projections are NVFP4, else "dense"."""
    return "nvfp4" if weights.layers[0].qkv.nvfp4 else "dense"


def with_fast_activations(weights: StepWeights, int8: bool | None = None) -> StepWeights:
    """The activations each projection multiplies, for the fastest kernels the CPU has. The
    drafts change slightly; the output stays the target's.

    - bf16 (in a bf16 drafter, for bf16 and NVFP4 weights) where the CPU has bf16 dot products:
      twice the multiply rate of widening the weights.
    - int8 (NVFP4 weights; `int8=None`: in a bf16 drafter where the kernels may use AVX2 but not
      AVX-512): each block of 16 activations quantised with its own scale, then integer dot
      products (`nvfp4_linear_i8`); on AVX2 the E2M1 decode and widening of the float paths
      made the step compute-bound at a quarter of the memory's speed. `int8=True` forces it wherever the
      compiled kernels are (any x86 CPU with AVX2; the portable loops elsewhere), False never.
    - float32 otherwise (and in a float32 drafter, unless int8 is forced)."""
    features = cpu_ext.features()
    able = bool(features & (cpu_ext.FEATURE_AVX512_BF16 | cpu_ext.FEATURE_AMX))
    bf16 = weights.embed.dtype == torch.bfloat16
    if int8 is None:
        int8 = bf16 and bool(features & cpu_ext.FEATURE_AVX2) and not features & cpu_ext.FEATURE_AVX512
    int8 = int8 and cpu_ext.ops() is not None
    for p in _projections(weights):
        p.int8_x = int8 and p.nvfp4
        p.bf16_x = not p.int8_x and able and bf16 and (p.nvfp4 or p.weight.dtype == torch.bfloat16)
    return weights


def _projections(weights: StepWeights) -> list[Projection]:
    out = [p for layer in weights.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [*out, weights.head]


# ---------------------------------------------------------------- one safetensors file


def _put(tensors: dict, name: str, p: Projection) -> None:
    if p.nvfp4:
        tensors[f"{name}.codes"], tensors[f"{name}.block_scale"] = p.codes, p.block_scale
        tensors[f"{name}.row_scale"] = p.row_scale
    else:
        tensors[f"{name}.weight"] = p.weight
    if p.bias is not None:
        tensors[f"{name}.bias"] = p.bias


def save(weights: StepWeights, path: str | Path) -> None:
    """Write `weights` to the safetensors file `path` (the caller makes it appear atomically)."""
    from safetensors.torch import save_file

    tensors = {"embed": weights.embed, "norm": weights.norm, "rope_inv_freq": weights.extra["rope_inv_freq"].float()}
    for i, layer in enumerate(weights.layers):
        tensors[f"layers.{i}.input_norm"], tensors[f"layers.{i}.post_norm"] = layer.input_norm, layer.post_norm
        if layer.qk_norm is not None:
            tensors[f"layers.{i}.qk_norm"] = layer.qk_norm
        for name in PROJECTIONS:
            _put(tensors, f"layers.{i}.{name}", getattr(layer, name))
    tied = weights.head.weight is weights.embed
    if not tied:
        _put(tensors, "head", weights.head)
    metadata = {"format": FORMAT, "version": str(VERSION), "layers": str(len(weights.layers)),
                "heads": str(weights.heads), "kv_heads": str(weights.kv_heads), "head_dim": str(weights.head_dim),
                "eps": repr(weights.eps), "tied_head": str(int(tied)), "weights": kind(weights)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


class _Reader:
    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        try:
            self.file = safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise DraftWeightsError(f"not a safetensors file ({str(exc).splitlines()[0]})", file=path) from None
        self.meta = self.file.metadata() or {}
        self.names = set(self.file.keys())

    def number(self, key: str, cast=int):
        try:
            return cast(self.meta[key])
        except (KeyError, ValueError):
            raise DraftWeightsError(f"metadata {key!r} is missing or not a number", file=self.path,
                                    field=key) from None

    def tensor(self, name: str, shape: tuple[int, ...] | None = None, dtypes: tuple = ()) -> torch.Tensor:
        if name not in self.names:
            raise DraftWeightsError("tensor is missing", file=self.path, field=name)
        t = self.file.get_tensor(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise DraftWeightsError(f"shape {list(t.shape)}, expected {list(shape)}", file=self.path, field=name)
        if dtypes and t.dtype not in dtypes:
            raise DraftWeightsError(f"dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}", file=self.path,
                                    field=name)
        return t

    def projection(self, name: str, out: int | None, inp: int) -> Projection:
        bias = self.tensor(f"{name}.bias", dtypes=(torch.float32,)) if f"{name}.bias" in self.names else None
        if f"{name}.codes" in self.names:
            codes = self.tensor(f"{name}.codes", dtypes=(torch.uint8,))
            rows = codes.shape[0]
            if out is not None and tuple(codes.shape) != (out, inp // 2) or codes.shape[1] * 2 != inp:
                raise DraftWeightsError(f"NVFP4 codes {list(codes.shape)} do not fit [{out}, {inp}]", file=self.path,
                                        field=f"{name}.codes")
            return Projection(codes=codes,
                              block_scale=self.tensor(f"{name}.block_scale", (rows, inp // 16), (torch.float8_e4m3fn,)),
                              row_scale=self.tensor(f"{name}.row_scale", (rows,), (torch.float32,)), bias=bias)
        w = self.tensor(f"{name}.weight", dtypes=DTYPES)
        if w.dim() != 2 or w.shape[1] != inp or out is not None and w.shape[0] != out:
            raise DraftWeightsError(f"shape {list(w.shape)}, expected [{out if out else 'rows'}, {inp}]",
                                    file=self.path, field=f"{name}.weight")
        return Projection(weight=w, bias=bias)


def load(path: str | Path) -> StepWeights:
    """The weights `save` wrote, checked: a wrong or missing tensor is a one-line error naming it."""
    path = Path(path)
    r = _Reader(path)
    if r.meta.get("format") != FORMAT:
        raise DraftWeightsError(f"not a drafter weights file (format {r.meta.get('format')!r}, expected {FORMAT!r})",
                                file=path, field="format")
    if r.number("version") != VERSION:
        raise DraftWeightsError(f"version {r.meta['version']}, this runtime reads version {VERSION}", file=path,
                                field="version")
    layers, heads, kv_heads, d = (r.number(k) for k in ("layers", "heads", "kv_heads", "head_dim"))
    eps = r.number("eps", float)
    embed = r.tensor("embed", dtypes=DTYPES)
    if embed.dim() != 2:
        raise DraftWeightsError(f"shape {list(embed.shape)}, expected [vocab, hidden]", file=path, field="embed")
    hidden = embed.shape[1]
    out = []
    for i in range(layers):
        p = f"layers.{i}"
        qk_norm = None
        if f"{p}.qk_norm" in r.names:
            qk_norm = r.tensor(f"{p}.qk_norm", (heads + kv_heads, d), (torch.float32,))
        gate_up = r.projection(f"{p}.gate_up", None, hidden)
        out.append(StepLayer(r.tensor(f"{p}.input_norm", (hidden,), (torch.float32,)),
                             r.projection(f"{p}.qkv", (heads + 2 * kv_heads) * d, hidden),
                             r.projection(f"{p}.o", hidden, heads * d),
                             r.tensor(f"{p}.post_norm", (hidden,), (torch.float32,)),
                             gate_up, r.projection(f"{p}.down", hidden, gate_up.out_features // 2), qk_norm))
    head = Projection(weight=embed) if r.number("tied_head") else r.projection("head", None, hidden)
    inv_freq = r.tensor("rope_inv_freq", (d // 2,), (torch.float32,))
    return StepWeights(heads, kv_heads, d, eps, embed, out, r.tensor("norm", (hidden,), (torch.float32,)), head,
                       extra={"rope_inv_freq": inv_freq})
