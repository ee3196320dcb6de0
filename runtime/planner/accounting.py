"""Per-rank bytes of every tensor a model holds at run time, under tensor parallelism.

The rules are the loader's (`runtime/models/loader.py`): q/k/v and gate/up (dense and per
expert) are column-parallel (rows split; KV heads split, or one replicated head per rank when
there are fewer KV heads than ranks), o and down are row-parallel (inputs split; their bias is
whole), embeddings and lm_head are vocab-parallel (rows split), routers and norms are whole. A
tied or absent lm_head shares the embedding. Floating-point tensors are held in the run's
dtype (`resolve_dtype`: bf16 for NVFP4 checkpoints); quantised layers stay packed, sized by
the runtime's own `NVFP4Weight` built on the meta device (codes, block scales and one float32
row scale, plus an input scale, per local output row). KV-cache scales (`k_scale`, `v_scale`)
are not held.

Worked example, Qwen3-235B expert `gate_proj` [1536, 4096] NVFP4 at TP=2, on each rank:
codes [768, 2048] uint8 + block scales [768, 256] fp8 + row scales [768] f32 + input scales
[768] f32 = 1572864 + 196608 + 3072 + 3072 bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import Enum

import torch

from hetero_run.runtime.planner.inventory import ModelSource
from hetero_run.runtime.planner.tensor_info import TensorInfo
from hetero_run.topology.errors import ConfigError

HELD_LEAVES = ("weight", "bias")
NVFP4_LEAVES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class Role(Enum):
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    REPLICATED = "replicated"


_ROLES = {"q_proj": Role.COLUMN, "k_proj": Role.COLUMN, "v_proj": Role.COLUMN, "gate_proj": Role.COLUMN,
          "up_proj": Role.COLUMN, "o_proj": Role.ROW, "down_proj": Role.ROW, "embed_tokens": Role.VOCAB,
          "lm_head": Role.VOCAB}


def role_of(module: str) -> Role:
    return _ROLES.get(module.rpartition(".")[2], Role.REPLICATED)


def group_of(name: str) -> str:
    """Where a tensor's bytes are reported: embedding, attention, experts, router, mlp, norms,
    lm_head; EAGLE-3 heads add fc and vocab_map (d2t, t2d)."""
    if ".mlp.experts." in name:
        return "experts"
    if ".self_attn." in name:
        return "attention"
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "mlp"
    if name.endswith("norm.weight"):
        return "norms"
    first = name.split(".")[0]
    return "fc" if first == "fc" else "vocab_map" if first in ("d2t", "t2d") else "other"


@dataclass(frozen=True)
class RankTensor:
    name: str  # checkpoint name, or `module.codes|block_scale|row_scale|input_scale` for NVFP4
    group: str
    role: Role
    dtype: torch.dtype
    shape: tuple[int, ...]  # this rank's part
    nbytes: int = -1

    def __post_init__(self):
        if self.nbytes < 0:
            object.__setattr__(self, "nbytes", math.prod(self.shape) * self.dtype.itemsize)


def runtime_dtype(source: ModelSource, dtype: str | torch.dtype = "auto") -> torch.dtype:
    """The dtype the loader gives dense weights, activations and the KV cache."""
    from hetero_run.runtime.models.loader import resolve_dtype

    if source.kind == "gguf" and dtype == "auto":
        return torch.float32  # the loader dequantises GGUF files to float32 first
    return resolve_dtype(dtype, source)


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    from hetero_run.runtime.models.config import kv_head_split

    return kv_head_split(num_kv_heads, 0, tp)[2]


def check_splits(shape, tp: int) -> None:
    """The loader's own divisibility checks (same messages), before any per-tensor rule."""
    from hetero_run.runtime.models.parallel import ParallelContext

    ctx = ParallelContext(group=object() if tp > 1 else None, rank=0, size=tp)  # no collective runs
    ctx.split(shape.num_heads, "num_attention_heads")
    local_kv_heads(shape.num_kv_heads, tp)
    ctx.split(shape.vocab_size, "vocab_size")
    if len(shape.moe_layers) < shape.num_layers:
        ctx.split(shape.intermediate_size, "intermediate_size")
    if shape.moe_layers:
        ctx.split(shape.moe_intermediate_size, "moe_intermediate_size")


def rank_tensors(source: ModelSource, tp: int = 1, dtype: torch.dtype | None = None) -> list[RankTensor]:
    """What each of `tp` ranks holds for `source` (every rank holds an equal part of every
    split tensor, so the list is the same on every rank). `dtype`: the run's dtype
    (default: the loader's choice for this checkpoint)."""
    dtype = dtype or runtime_dtype(source)
    shape = source.shape
    if not shape.eagle3:
        check_splits(shape, tp)
    kv_rows = local_kv_heads(shape.num_kv_heads, tp) * shape.head_dim if not shape.eagle3 else None
    tied = shape.tied_embeddings or "lm_head.weight" not in source.tensors
    out: list[RankTensor] = []
    for module, leaves in _modules(source).items():
        if module == "lm_head" and tied and not shape.eagle3:
            continue  # shares the embedding
        role = role_of(module)
        weight = leaves.get("weight")
        if weight is not None and weight.dtype == torch.uint8 and source.quant and source.quant.quantizes(module):
            out += _nvfp4(module, leaves, role, tp, kv_rows, dtype)
            continue
        for leaf, info in leaves.items():
            name = f"{module}.{leaf}" if module else leaf
            if module and leaf not in HELD_LEAVES:
                continue  # k_scale / v_scale and other extras the runtime does not keep
            held = dtype if info.dtype.is_floating_point else info.dtype
            local = _local_shape(name, info.shape, role, tp, kv_rows if _is_kv(module) else None)
            out.append(RankTensor(name, group_of(name), role, held, local))
    return out


def group_bytes(tensors: list[RankTensor]) -> dict[str, int]:
    """Bytes per group (see `group_of`)."""
    groups: dict[str, int] = {}
    for t in tensors:
        groups[t.group] = groups.get(t.group, 0) + t.nbytes
    return groups


def embedding_row_bytes(tensors: list[RankTensor]) -> int:
    """Bytes of one embedding row (what a token's lookup reads)."""
    for t in tensors:
        if t.group == "embedding" and len(t.shape) == 2:
            return t.nbytes // t.shape[0]
    return 0


def _modules(source: ModelSource) -> dict[str, dict[str, TensorInfo]]:
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in source.tensors.items():
        module, _, leaf = name.rpartition(".")
        modules.setdefault(module, {})[leaf] = info
    return modules


def _is_kv(module: str) -> bool:
    return module.endswith((".k_proj", ".v_proj"))


def _nvfp4(module: str, leaves: dict[str, TensorInfo], role: Role, tp: int, kv_rows: int | None,
           dtype_of_bias: torch.dtype) -> list[RankTensor]:
    codes = leaves["weight"].shape  # [out, in / 2]; a missing scale is the loader's error to report
    out, inp = _local_shape(f"{module}.weight", (codes[0], codes[1] * 2), role, tp, kv_rows if _is_kv(module) else None)
    if role is Role.ROW and inp % 16:
        raise ConfigError(f"NVFP4 layer {module!r}: {codes[1] * 2} inputs do not split into {tp} parts of whole "
                          "16-element blocks", field="tensor_parallel_size")
    group = group_of(f"{module}.weight")
    held = [RankTensor(f"{module}.{part}", group, role, dtype, shape, nbytes)
            for part, dtype, shape, nbytes in _nvfp4_parts(out, inp, "input_scale" in leaves)]
    if "bias" in leaves:
        bias = _local_shape(f"{module}.bias", leaves["bias"].shape, role, tp, kv_rows if _is_kv(module) else None)
        held.append(RankTensor(f"{module}.bias", group, role, dtype_of_bias, bias))
    return held


@functools.lru_cache(maxsize=1024)
def _nvfp4_parts(out: int, inp: int, input_scale: bool) -> tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]:
    """The tensors of the runtime's `NVFP4Weight` for a local [out, in] layer, built on the meta
    device (no memory), so its own rules (per-row scales) decide the bytes."""
    from hetero_run.runtime.weights import NVFP4Weight

    def meta(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    w = NVFP4Weight(meta((out, inp // 2), torch.uint8), meta((out, inp // 16), torch.float8_e4m3fn),
                    meta((), torch.float32), meta((), torch.float32) if input_scale else None)
    parts = [("codes", w.codes), ("block_scale", w.block_scale), ("row_scale", w.row_scale)]
    if w.input_scale is not None:
        parts.append(("input_scale", w.input_scale))
    out_parts = tuple((name, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for name, t in parts)
    if sum(p[3] for p in out_parts) != w.nbytes:
        raise RuntimeError("NVFP4Weight.nbytes counts more than codes, block scales, row and input scales: "
                           "the planner's accounting needs updating")
    return out_parts


def _local_shape(name: str, shape: tuple[int, ...], role: Role, tp: int, kv_rows: int | None) -> tuple[int, ...]:
    if kv_rows is not None and shape:
        return (kv_rows, *shape[1:])
    try:
        return _split(shape, role, tp)
    except _Indivisible as exc:
        raise ConfigError(f"tensor {name!r} {list(shape)} does not split into {tp} equal parts along "
                          f"dimension {exc.args[0]}", field="tensor_parallel_size") from None


class _Indivisible(Exception):
    pass


@functools.lru_cache(maxsize=4096)
def _split(shape: tuple[int, ...], role: Role, tp: int) -> tuple[int, ...]:
    if tp == 1 or role is Role.REPLICATED or not shape:
        return shape
    if len(shape) == 1 and role is Role.ROW:
        return shape  # a row-parallel bias is added once, after the all-reduce
    dim = 1 if role is Role.ROW else 0
    if shape[dim] % tp:
        raise _Indivisible(dim)
    return tuple(d // tp if i == dim else d for i, d in enumerate(shape))
