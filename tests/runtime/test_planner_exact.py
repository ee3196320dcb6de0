"""Planned bytes equal what the runtime holds, on tiny checkpoints exported by real ModelOpt.

Every rank of a TP job is built in this process with the real loader (reading only its
slices); building a shard needs no collective, so a placeholder group stands in for the
process group. The plan must equal, per rank: the loader's weight bytes, the KV cache it
allocates, and (with the context's KV and the embedding row removed) the model's own count of
weight bytes read per decoded token.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES, tiny_checkpoint

from hetero_run.runtime.checkpoint import Checkpoint
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.runtime.planner import make_plan
from hetero_run.runtime.planner.export_layout import expand
from hetero_run.runtime.planner.shape import ModelShape
from hetero_run.runtime.planner.tensor_info import TensorInfo
from hetero_run.topology.errors import UserError

CONTEXT = 200


def _shard(path, rank: int, tp: int):
    ctx = ParallelContext(group=object() if tp > 1 else None, rank=rank, size=tp)
    return load_model(path, ctx, max_tokens=CONTEXT)


def _check_plan_equals_loader(path, tp: int) -> None:
    plan = make_plan(str(path), tp=tp, context=CONTEXT)
    for rank in range(tp):
        model = _shard(path, rank, tp)
        planned = plan.ranks[rank]
        assert planned.weights_bytes == model.weight_nbytes, (rank, tp)
        assert planned.kv_bytes == model.kv.nbytes, (rank, tp)
        assert planned.kv_bytes_per_token * planned.kv_tokens == model.kv.nbytes  # whole blocks
        tied = not any(t.group == "lm_head" for t in plan.tensors)
        row = 0 if tied else model.embed.weight[0].nbytes
        read = plan.roofline.decode.bytes_per_rank[rank] - (CONTEXT + 1) * planned.kv_bytes_per_token - row
        assert read == model.decode_nbytes(), (rank, tp)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_planned_bytes_equal_the_loaded_shards(arch, quant, tp):
    _check_plan_equals_loader(tiny_checkpoint(arch, quant), tp)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tied_embeddings_and_replicated_kv_heads(arch):
    # tied: the head shares the embedding; TP=4 with 2 KV heads: each rank keeps one head
    path = tiny_checkpoint(arch, "bf16", tie_word_embeddings=True)
    _check_plan_equals_loader(path, 4)


def test_planner_and_loader_refuse_the_same_split():
    # moe_intermediate 32 over 4 ranks leaves 8 inputs per rank: not a whole NVFP4 block
    path = tiny_checkpoint("qwen3_moe", "nvfp4")
    with pytest.raises(UserError, match="16-element blocks"):
        make_plan(str(path), tp=4, context=CONTEXT)
    with pytest.raises(UserError, match="16-element blocks"):
        _shard(path, 0, 4)


@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_preset_expansion_is_what_modelopt_exports(arch, quant):
    """Presets are planned from their config alone: the tensors it expands to must be exactly
    what ModelOpt's export of that config holds (names, dtypes, shapes)."""
    ckpt = Checkpoint.open(tiny_checkpoint(arch, quant))
    expanded = expand(ModelShape.for_target(ckpt.config), ckpt.quant, torch.bfloat16)
    assert expanded == {name: TensorInfo(m.dtype, m.shape) for name, m in ckpt.tensors.items()}
