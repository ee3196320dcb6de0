"""GGUF files are planned from their header alone, as the loader will hold them (float32)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support import PAIR

from hetero_run.runtime.checkpoint import CheckpointError
from hetero_run.runtime.config import BatchingConfig
from hetero_run.runtime.planner import make_plan, resolve
from hetero_run.runtime.planner.gguf_header import read_gguf_header


def _write_llama_gguf(path: Path, tied: bool) -> Path:
    import gguf

    hidden, ffn, layers, heads, kv, vocab = 64, 96, 2, 4, 2, 128
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"t{i}" for i in range(vocab)])  # an array the reader skips
    rng = np.random.default_rng(0)

    def add(name, *shape):  # torch order [out, in]; GGUF stores dims innermost first
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    add("token_embd.weight", vocab, hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv * 16, hidden)
        add(f"blk.{i}.attn_v.weight", kv * 16, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    add("output_norm.weight", hidden)
    if not tied:
        add("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_header_and_plan(tmp_path, tied):
    path = _write_llama_gguf(tmp_path / "tiny.gguf", tied)
    header = read_gguf_header(path)
    assert header.metadata["llama.block_count"] == 2 and header.metadata["tokenizer.ggml.tokens.len"] == 128
    assert header.tensors["token_embd.weight"] == (128, 64)
    assert header.tensors["blk.0.ffn_down.weight"] == (64, 96)
    source = resolve(str(path))
    assert source.kind == "gguf" and source.shape.tied_embeddings is tied
    params = sum(int(np.prod(s)) for s in header.tensors.values())
    assert sum(t.numel for t in source.tensors.values()) == params  # the same tensors under HF names
    assert ("lm_head.weight" in source.tensors) is not tied
    plan = make_plan(str(path), tp=2, context=100)
    assert str(plan.dtype) == "torch.float32"  # the loader dequantises GGUF to float32
    per_rank = (params - 2 * 2 * 64 - 64) // 2 * 4 + (2 * 2 * 64 + 64) * 4  # norms are whole on each rank
    assert plan.ranks[1].weights_bytes == per_rank
    assert plan.ranks[0].kv_bytes_per_token == 2 * 2 * 1 * 16 * 4
    assert any("dequantises the whole GGUF model" in note for note in plan.notes)


@pytest.mark.parametrize("weights", ["dense", "nvfp4"])
def test_a_converted_drafter_directory_plans_as_its_gguf_source(tmp_path, weights):
    # its config.json keeps the GGUF's quantization_config, which is not a ModelOpt one
    import torch
    from tiny_models import write_tiny_gguf

    from hetero_run.runtime.drafters import cache
    from hetero_run.runtime.drafters.load import load_drafter
    from hetero_run.topology.errors import ConfigError

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    load_drafter(gguf, dtype=torch.float32, weights=weights)
    converted = cache.location(gguf, weights, torch.float32)
    assert cache.is_converted(converted)
    assert "quantization_config" in json.loads((converted / "config.json").read_text())
    source, direct = resolve(str(gguf), role="drafter"), resolve(str(converted), role="drafter")
    assert direct.kind == "converted" and direct.quant is None
    assert direct.tensors == source.tensors
    target = make_plan(str(gguf), drafter=str(gguf), context=64)
    assert make_plan(str(gguf), drafter=str(converted), context=64).ranks == target.ranks
    with pytest.raises(ConfigError, match="converted drafter directory.*not a target checkpoint") as err:
        resolve(str(converted))
    assert str(converted) in str(err.value)


def test_bad_gguf_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01")
    with pytest.raises(CheckpointError, match="truncated or corrupted GGUF header"):
        read_gguf_header(bad)
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        read_gguf_header(tmp_path / "not.gguf")


@pytest.mark.slow
@pytest.mark.skipif(not (PAIR / "qwen2.5-coder-0.5b-instruct.gguf").is_file(), reason="the CPU model pair is absent")
@pytest.mark.parametrize("name, tp", [("SmolLM2-135M-Instruct.Q4_1.gguf", 1), ("qwen2.5-coder-0.5b-instruct.gguf", 2)])
def test_real_gguf_plans_equal_the_loaded_shards(name, tp):
    from hetero_run.runtime.models.loader import load_model
    from hetero_run.runtime.models.parallel import ParallelContext

    path = PAIR / name
    plan = make_plan(str(path), tp=tp, context=512, batching=BatchingConfig.one_sequence())  # as load_model sizes it
    for rank in range(tp):
        model = load_model(path, ParallelContext(group=object() if tp > 1 else None, rank=rank, size=tp),
                           max_tokens=512)
        assert plan.ranks[rank].weights_bytes == model.weight_nbytes
        assert plan.ranks[rank].kv_bytes == model.kv.nbytes
        del model
