"""Weights of linear layers, dense or NVFP4, behind one interface: `w.matmul(x) == x @ W.T`.

NVFP4 weights stay packed in memory (0.5625 bytes per parameter plus 4 per row) and are only
ever dequantised inside a kernel or one tile at a time. Models build them with `load_linear`
(one tensor-parallel rank's slice straight from the checkpoint) and fuse q/k/v or gate/up
with `concat_out`; bias stays with the model.

Tensor parallelism, for a weight [out, in]: `shard=(0, rank, world)` keeps rows
out/world * rank ... (column parallel), `shard=(1, rank, world)` keeps that slice of the inputs
(row parallel; NVFP4 needs in/world to be a whole number of 16-element blocks).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hetero_run.kernels import nvfp4
from hetero_run.kernels.dense_linear import dense_linear
from hetero_run.kernels.nvfp4_gpu import fp4_tensor_cores
from hetero_run.kernels.nvfp4_linear import nvfp4_dequantize, nvfp4_linear
from hetero_run.runtime.checkpoint import Checkpoint, CheckpointError

ACTIVATIONS = ("auto", "w4a16", "w4a4")
DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class LinearWeight(ABC):
    """A linear layer's weight W [out_features, in_features]."""

    @property
    @abstractmethod
    def out_features(self) -> int: ...

    @property
    @abstractmethod
    def in_features(self) -> int: ...

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes resident in memory."""

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x @ W.T [..., out] in x's dtype."""

    def matmul_float(self, x: torch.Tensor) -> torch.Tensor:
        """matmul(x).float(): x's dtype's values, held in float32 (a model's logits)."""
        return self.matmul(x).float()

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] in `dtype`; for references and tests, never on the hot path."""

    @abstractmethod
    def to(self, device: torch.device | str) -> LinearWeight: ...


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


@dataclass(eq=False)
class DenseWeight(LinearWeight):
    weight: torch.Tensor  # [out, in], bf16 / fp16 / fp32

    def __post_init__(self):
        if self.weight.dim() != 2 or self.weight.dtype not in DENSE_DTYPES:
            raise ValueError(f"a dense weight is a 2-D float tensor, got {self.weight.dtype} {list(self.weight.shape)}")
        self.weight = self.weight.contiguous()

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(_flat(x), self.weight).reshape(*x.shape[:-1], self.out_features)

    def matmul_float(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(_flat(x), self.weight, float_out=True).reshape(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def to(self, device) -> DenseWeight:
        return DenseWeight(self.weight.to(device))

    def __repr__(self) -> str:
        return f"DenseWeight([{self.out_features}, {self.in_features}], {self.weight.dtype}, {self.weight.device})"


@dataclass(eq=False)
class NVFP4Weight(LinearWeight):
    """Packed NVFP4 weight. Each row has its own global scale, so fusing parts that came with
    different `weight_scale_2` stays exact; `input_scale` (W4A4 only) is per row for the same reason.

    activation: "w4a16" keeps activations as they are; "w4a4" quantises them to NVFP4 with
    `input_scale` (FP4 tensor cores on Blackwell, emulated elsewhere); "auto" is w4a4 exactly
    where FP4 tensor cores exist and the checkpoint has input scales, else w4a16.
    """

    codes: torch.Tensor  # uint8 [out, in / 2]
    block_scale: torch.Tensor  # float8_e4m3fn [out, in / 16]
    row_scale: torch.Tensor  # float32 [out]
    input_scale: torch.Tensor | None = None  # float32 [out]
    activation: str = "auto"
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        out, half_in = self.codes.shape
        if self.codes.dtype != torch.uint8 or self.block_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"NVFP4 needs uint8 codes and float8_e4m3fn scales, got {self.codes.dtype}, "
                             f"{self.block_scale.dtype}")
        if tuple(self.block_scale.shape) != (out, half_in * 2 // nvfp4.GROUP_SIZE) or (half_in * 2) % nvfp4.GROUP_SIZE:
            raise ValueError(f"block_scale {list(self.block_scale.shape)} does not fit codes {[out, half_in]}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        self.codes = self.codes.contiguous()
        self.block_scale = self.block_scale.contiguous()
        self.row_scale = _per_row(self.row_scale, out, self.codes.device)
        if self.input_scale is not None:
            self.input_scale = _per_row(self.input_scale, out, self.codes.device)

    @classmethod
    def quantize(cls, w: torch.Tensor, input_scale: float | None = None, activation: str = "auto") -> NVFP4Weight:
        """Quantise a float weight [out, in] as ModelOpt would (global scale from its amax)."""
        q = nvfp4.quantize(w)
        scale = None if input_scale is None else torch.tensor(input_scale, dtype=torch.float32)
        return cls(q.codes, q.block_scale, q.global_scale, scale, activation)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 2

    @property
    def nbytes(self) -> int:
        tensors = [self.codes, self.block_scale, self.row_scale]
        if self.input_scale is not None:
            tensors.append(self.input_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

    def uses_w4a4(self, device: torch.device) -> bool:
        if self.activation == "w4a16":
            return False
        if self.activation == "w4a4":
            if self.input_scale is None:
                raise ValueError("activation='w4a4' needs input_scale, and this weight has none")
            return True
        return self.input_scale is not None and device.type == "cuda" and fp4_tensor_cores(device)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.activation != "w4a4" and x.is_cpu:  # a decode step's hot path: ~100 calls
            return nvfp4_linear(x, self.codes, self.block_scale, self.row_scale)
        x2 = _flat(x)
        if not self.uses_w4a4(x.device):
            y = nvfp4_linear(x2, self.codes, self.block_scale, self.row_scale)
        else:
            y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            for start, stop, scale in self._input_scale_runs():
                y[:, start:stop] = nvfp4_linear(x2, self.codes[start:stop], self.block_scale[start:stop],
                                                self.row_scale[start:stop], scale, self._cache.setdefault(start, {}))
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return nvfp4_dequantize(self.codes, self.block_scale, self.row_scale, dtype)

    def to(self, device) -> NVFP4Weight:
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return NVFP4Weight(move(self.codes), move(self.block_scale), move(self.row_scale),
                           move(self.input_scale), self.activation)

    def __repr__(self) -> str:
        return (f"NVFP4Weight([{self.out_features}, {self.in_features}], activation={self.activation!r}, "
                f"input_scale={'yes' if self.input_scale is not None else 'no'}, {self.codes.device})")

    def _input_scale_runs(self) -> list[tuple[int, int, float]]:
        """Consecutive rows sharing one input scale: [(start, stop, scale)], usually one run."""
        if "runs" not in self._cache:
            values = self.input_scale.tolist()
            runs, start = [], 0
            for row in range(1, len(values) + 1):
                if row == len(values) or values[row] != values[start]:
                    runs.append((start, row, values[start]))
                    start = row
            self._cache["runs"] = runs
        return self._cache["runs"]


def _per_row(scale: torch.Tensor | float, rows: int, device: torch.device) -> torch.Tensor:
    scale = torch.as_tensor(scale, dtype=torch.float32, device=device)
    if scale.numel() == 1:
        return scale.reshape(1).expand(rows).contiguous()
    if scale.shape != (rows,):
        raise ValueError(f"expected one scale or {rows} (one per row), got shape {list(scale.shape)}")
    return scale.contiguous()


def concat_out(weights: list[LinearWeight]) -> LinearWeight:
    """Fuse weights with the same inputs along the output dimension (q/k/v, gate/up)."""
    if not weights:
        raise ValueError("nothing to concatenate")
    in_features = {w.in_features for w in weights}
    if len(in_features) != 1:
        raise ValueError(f"cannot fuse weights with different in_features {sorted(in_features)}")
    if all(isinstance(w, DenseWeight) for w in weights):
        dtypes = {w.weight.dtype for w in weights}
        if len(dtypes) != 1:
            raise ValueError(f"cannot fuse dense weights of different dtypes {sorted(map(str, dtypes))}")
        return DenseWeight(torch.cat([w.weight for w in weights]))
    if all(isinstance(w, NVFP4Weight) for w in weights):
        activations = {w.activation for w in weights}
        if len(activations) != 1:
            raise ValueError(f"cannot fuse NVFP4 weights with different activation modes {sorted(activations)}")
        with_input = [w.input_scale is not None for w in weights]
        input_scale = torch.cat([w.input_scale for w in weights]) if all(with_input) else None
        return NVFP4Weight(
            torch.cat([w.codes for w in weights]),
            torch.cat([w.block_scale.view(torch.uint8) for w in weights]).view(torch.float8_e4m3fn),
            torch.cat([w.row_scale for w in weights]),
            input_scale,
            activations.pop(),
        )
    kinds = sorted({type(w).__name__ for w in weights})
    raise ValueError(f"cannot fuse weights of different formats {kinds}")


def load_linear(
    ckpt: Checkpoint,
    prefix: str,
    shard: tuple[int, int, int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    shape: tuple[int, int] | None = None,
    activation: str = "auto",
) -> LinearWeight:
    """The weight of module `prefix` (e.g. "model.layers.0.self_attn.q_proj"), or this rank's part.

    shard: (dim, index, count) as in the module doc, None for the whole weight. dtype: what a
    dense weight is converted to (NVFP4 stays packed). shape: the full [out, in] the model
    expects, checked against the checkpoint. Reads only the slice this rank keeps.
    """
    name = f"{prefix}.weight"
    meta = ckpt.meta(name)
    quant = ckpt.quant
    if quant is not None and quant.quantizes(prefix):
        if meta.dtype != torch.uint8:
            raise CheckpointError(
                f"tensor {name!r} has dtype {_dtype_name(meta.dtype)}, expected uint8 (NVFP4 codes: "
                f"{Path(quant.source).name} does not exclude {prefix!r})", file=meta.file,
            )
        return _load_nvfp4(ckpt, prefix, shard, shape, activation)
    if meta.dtype not in DENSE_DTYPES:
        why = f"excluded from quantisation in {Path(quant.source).name}" if quant else "no quantisation config"
        raise CheckpointError(
            f"tensor {name!r} has dtype {_dtype_name(meta.dtype)}, expected bfloat16, float16 or float32 "
            f"({why})", file=meta.file,
        )
    ckpt.expect(name, shape=shape)
    if len(meta.shape) != 2:
        raise CheckpointError(f"tensor {name!r} has shape {list(meta.shape)}, expected a 2-D weight", file=meta.file)
    dim, part = _split(shard)
    return DenseWeight(ckpt.read(name, dim=dim, part=part).to(dtype))


def _load_nvfp4(ckpt, prefix, shard, shape, activation) -> NVFP4Weight:
    name = f"{prefix}.weight"
    group = ckpt.quant.group_size
    codes_meta = ckpt.expect(name, dtype=torch.uint8)
    if len(codes_meta.shape) != 2:
        raise CheckpointError(f"tensor {name!r} has shape {list(codes_meta.shape)}, expected NVFP4 codes "
                              f"[out, in/2]", file=codes_meta.file)
    out, in_features = codes_meta.shape[0], codes_meta.shape[1] * 2
    if shape is not None and (out, in_features) != tuple(shape):
        raise CheckpointError(
            f"tensor {name!r} holds NVFP4 codes for a [{out}, {in_features}] weight, expected {list(shape)}",
            file=codes_meta.file,
        )
    ckpt.expect(f"{prefix}.weight_scale", dtype=torch.float8_e4m3fn, shape=(out, in_features // group))
    dim, part = _split(shard)
    if dim == 1 and part is not None and (in_features % part[1] or (in_features // part[1]) % group):
        raise CheckpointError(
            f"tensor {name!r}: {in_features} inputs do not split into {part[1]} parts of whole "
            f"{group}-element blocks", file=codes_meta.file,
        )
    codes = ckpt.read(name, dim=dim, part=part)
    block_scale = ckpt.read(f"{prefix}.weight_scale", dim=dim, part=part)
    row_scale = _scalar(ckpt, f"{prefix}.weight_scale_2")
    input_scale = _scalar(ckpt, f"{prefix}.input_scale") if ckpt.has(f"{prefix}.input_scale") else None
    return NVFP4Weight(codes, block_scale, row_scale, input_scale, activation)


def _scalar(ckpt: Checkpoint, name: str) -> torch.Tensor:
    meta = ckpt.expect(name, dtype=(torch.float32, torch.bfloat16, torch.float16))
    if meta.nbytes // meta.dtype.itemsize != 1:
        raise CheckpointError(f"tensor {name!r} has shape {list(meta.shape)}, expected a scalar", file=meta.file)
    return ckpt.read(name).float().reshape(())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _split(shard: tuple[int, int, int] | None) -> tuple[int | None, tuple[int, int] | None]:
    if shard is None:
        return None, None
    dim, index, count = shard
    if dim not in (0, 1) or not 0 <= index < count:
        raise ValueError(f"shard must be (dim 0 or 1, index, count) with 0 <= index < count, got {shard}")
    return dim, (index, count)
