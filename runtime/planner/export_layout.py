"""The tensors a Hugging Face / ModelOpt export of a config holds, from the config alone.

A preset is planned through this expansion exactly as its checkpoint would be; the tests check
it against real `export_hf_checkpoint` output (names, dtypes, shapes) for all four target
architectures, bf16 and NVFP4.
"""

from __future__ import annotations

import torch

from hetero_run.runtime.checkpoint import QuantConfig
from hetero_run.runtime.planner.shape import QK_NORM_ARCHITECTURES, ModelShape
from hetero_run.runtime.planner.tensor_info import TensorInfo


def expand(shape: ModelShape, quant: QuantConfig | None, dtype: torch.dtype) -> dict[str, TensorInfo]:
    """Checkpoint tensor names, dtypes and shapes for `shape`, as `export_hf_checkpoint` writes
    them: quantised Linear layers as NVFP4 (codes, block scales, per-tensor scale, input scale),
    everything else in `dtype`."""
    out: dict[str, TensorInfo] = {}
    h = shape.hidden_size

    def linear(module: str, n_out: int, n_in: int, bias: bool = False) -> None:
        if quant is not None and quant.quantizes(module):
            group = quant.group_size
            out[f"{module}.weight"] = TensorInfo(torch.uint8, (n_out, n_in // 2))
            out[f"{module}.weight_scale"] = TensorInfo(torch.float8_e4m3fn, (n_out, n_in // group))
            out[f"{module}.weight_scale_2"] = TensorInfo(torch.float32, ())
            out[f"{module}.input_scale"] = TensorInfo(torch.float32, ())
        else:
            out[f"{module}.weight"] = TensorInfo(dtype, (n_out, n_in))
        if bias:
            out[f"{module}.bias"] = TensorInfo(dtype, (n_out,))

    def norm(module: str, size: int) -> None:
        out[f"{module}.weight"] = TensorInfo(dtype, (size,))

    def layer(prefix: str, index: int) -> None:
        attn = f"{prefix}.self_attn"
        n_in = shape.attention_input_size
        linear(f"{attn}.q_proj", shape.q_size, n_in, shape.qkv_bias)
        linear(f"{attn}.k_proj", shape.kv_size, n_in, shape.qkv_bias)
        linear(f"{attn}.v_proj", shape.kv_size, n_in, shape.qkv_bias)
        linear(f"{attn}.o_proj", h, shape.q_size, shape.o_bias)
        if shape.model_type in QK_NORM_ARCHITECTURES:
            norm(f"{attn}.q_norm", shape.head_dim)
            norm(f"{attn}.k_norm", shape.head_dim)
        norm(f"{prefix}.input_layernorm", h)
        norm(f"{prefix}.post_attention_layernorm", h)
        if shape.eagle3:
            norm(f"{prefix}.hidden_norm", h)
        mlp = f"{prefix}.mlp"
        if index in shape.moe_layers:
            linear(f"{mlp}.gate", shape.num_experts, h)
            for e in range(shape.num_experts):
                linear(f"{mlp}.experts.{e}.gate_proj", shape.moe_intermediate_size, h)
                linear(f"{mlp}.experts.{e}.up_proj", shape.moe_intermediate_size, h)
                linear(f"{mlp}.experts.{e}.down_proj", h, shape.moe_intermediate_size)
        else:
            linear(f"{mlp}.gate_proj", shape.intermediate_size, h, shape.mlp_bias)
            linear(f"{mlp}.up_proj", shape.intermediate_size, h, shape.mlp_bias)
            linear(f"{mlp}.down_proj", h, shape.intermediate_size, shape.mlp_bias)

    if shape.eagle3:
        linear("fc", h, 3 * shape.target_hidden_size)
        layer("midlayer", 0)
        norm("norm", h)
        linear("lm_head", shape.draft_vocab_size, h)
        out["d2t"] = TensorInfo(torch.int64, (shape.draft_vocab_size,))
        out["t2d"] = TensorInfo(torch.bool, (shape.vocab_size,))
        return out
    out["model.embed_tokens.weight"] = TensorInfo(dtype, (shape.vocab_size, h))
    for i in range(shape.num_layers):
        layer(f"model.layers.{i}", i)
    norm("model.norm", h)
    if not shape.tied_embeddings:
        linear("lm_head", shape.vocab_size, h)
    return out
