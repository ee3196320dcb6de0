"""Planned bytes equal what the runtime holds, on tiny checkpoints exported by real ModelOpt.

Every rank of a TP job is built in this process with the real loader (reading only its
slices); building a shard needs no collective, so a placeholder group stands in for the
process group. The plan must equal, per rank: the loader's weight bytes, the KV cache it
allocates (blocks and bytes, given the KV budget `serve` takes from the plan), and (with the
context's KV and the embedding row removed) the model's own count of weight bytes read per
decoded token.
"""

from __future__ import annotations

import pytest
import torch
from support import PAIR
from tiny_models import ARCHITECTURES, tiny_checkpoint

from hetero_run.launch.generate import GenerateConfig
from hetero_run.launch.serve import kv_budget
from hetero_run.runtime.checkpoint import Checkpoint
from hetero_run.runtime.config import BatchingConfig
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.runtime.planner import Node, make_plan
from hetero_run.runtime.planner.export_layout import expand
from hetero_run.runtime.planner.shape import ModelShape
from hetero_run.runtime.planner.tensor_info import TensorInfo
from hetero_run.topology.errors import UserError

CONTEXT = 200


BATCHING = BatchingConfig(max_num_seqs=3, max_num_batched_tokens=64, block_size=16)


def _shard(path, rank: int, tp: int, kv_tokens: int | None = None, block_size: int = 16):
    ctx = ParallelContext(group=object() if tp > 1 else None, rank=rank, size=tp)
    return load_model(path, ctx, max_tokens=CONTEXT, kv_tokens=kv_tokens, block_size=block_size)


def _served(path, plan):
    """What `serve` gives the loader: its config with the plan's KV budget."""
    return kv_budget(GenerateConfig(target=path, sampling=None, context=CONTEXT, block_size=plan.batching.block_size),
                     plan)


def _check_plan_equals_loader(path, tp: int, batching: BatchingConfig = BATCHING) -> None:
    plan = make_plan(str(path), tp=tp, context=CONTEXT, batching=batching)
    served = _served(path, plan)
    assert plan.kv_blocks == 3 * 13  # three sequences of 200 tokens, 13 blocks of 16 each
    for rank in range(tp):
        model = _shard(path, rank, tp, served.kv_tokens, served.block_size)
        planned = plan.ranks[rank]
        assert planned.weights_bytes == model.weight_nbytes, (rank, tp)
        assert (model.kv.num_blocks, model.kv.block_size) == (planned.kv_blocks, planned.block_size), (rank, tp)
        assert planned.kv_bytes == model.kv.nbytes, (rank, tp)
        assert planned.kv_block_bytes * model.kv.num_blocks == model.kv.nbytes
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


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_room_limited_kv_cache_is_what_the_loader_allocates(quant, tp):
    """Memory for fewer than --max-num-seqs sequences: every rank gets the blocks the tightest
    rank has room for (not one more fits it), and that is what each shard allocates."""
    path = tiny_checkpoint("qwen3_moe", quant)
    batching = BatchingConfig(max_num_seqs=64, max_num_batched_tokens=64, block_size=32)
    roomy = make_plan(str(path), nodes=[Node("n", 64 << 30)], tp=tp, context=CONTEXT, batching=batching)
    tight = roomy.ranks[0]
    capacity = tight.other_bytes + 10 * tight.kv_block_bytes + tight.kv_block_bytes // 2  # 10.5 blocks of room
    plan = make_plan(str(path), nodes=[Node("n", capacity * tp)], tp=tp, context=CONTEXT, batching=batching)
    assert plan.fits and plan.kv_blocks == 10 and plan.sequences == 10 // 7 and not plan.max_num_seqs_fit
    assert min(r.free_bytes for r in plan.ranks) < plan.ranks[0].kv_block_bytes
    served = _served(path, plan)
    assert (served.kv_tokens, served.block_size) == (320, 32)
    for rank in range(tp):
        model = _shard(path, rank, tp, served.kv_tokens, served.block_size)
        assert model.kv.num_blocks == plan.ranks[rank].kv_blocks == 10
        assert model.kv.nbytes == plan.ranks[rank].kv_bytes


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_cache_tokens_are_what_the_loader_allocates(tp):
    path = tiny_checkpoint("llama", "nvfp4")
    plan = make_plan(str(path), tp=tp, context=CONTEXT, batching=BatchingConfig(kv_cache_tokens=1000))
    served = _served(path, plan)
    assert plan.kv_blocks == 63 and served.kv_tokens == 1008  # 1000 tokens in whole blocks of 16
    for rank in range(tp):
        model = _shard(path, rank, tp, served.kv_tokens, served.block_size)
        assert model.kv.num_blocks == plan.ranks[rank].kv_blocks and model.kv.nbytes == plan.ranks[rank].kv_bytes


@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_preset_expansion_is_what_modelopt_exports(arch, quant):
    """Presets are planned from their config alone: the tensors it expands to must be exactly
    what ModelOpt's export of that config holds (names, dtypes, shapes)."""
    ckpt = Checkpoint.open(tiny_checkpoint(arch, quant))
    expanded = expand(ModelShape.for_target(ckpt.config), ckpt.quant, torch.bfloat16)
    assert expanded == {name: TensorInfo(m.dtype, m.shape) for name, m in ckpt.tensors.items()}


@pytest.mark.slow
@pytest.mark.skipif(not (PAIR / "qwen2.5-coder-0.5b-instruct-nvfp4").is_dir(), reason="the CPU model pair is absent")
def test_real_cpu_pair_kv_cache_is_what_the_plan_printed():
    """The real NVFP4 target at TP=2 with serve's defaults and its drafter: each shard allocates
    the blocks the plan printed."""
    path = PAIR / "qwen2.5-coder-0.5b-instruct-nvfp4"
    plan = make_plan(str(path), drafter=str(PAIR / "SmolLM2-135M-Instruct.Q4_1.gguf"), tp=2, context=2048,
                     batching=BatchingConfig(max_num_seqs=8))
    served = kv_budget(GenerateConfig(target=path, sampling=None, context=2048), plan)
    assert plan.fits and plan.kv_blocks == 8 * 128 and served.kv_tokens == 8 * 2048
    for rank in range(2):
        model = load_model(path, ParallelContext(group=object(), rank=rank, size=2), max_tokens=2048,
                           kv_tokens=served.kv_tokens, block_size=served.block_size)
        assert model.kv.num_blocks == plan.ranks[rank].kv_blocks and model.kv.nbytes == plan.ranks[rank].kv_bytes
        assert model.weight_nbytes == plan.ranks[rank].weights_bytes
        del model
