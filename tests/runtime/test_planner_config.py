"""One config reader for the planner, the loader and the EAGLE-3 loader: the planner's view of
every architecture (checkpoints, GGUF metadata, presets, drafters of other architectures) is
the runtime's own `ModelConfig`, field for field, and its KV bytes per token are what the
loaded model's `KVCache` holds per slot."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES, tiny_checkpoint, tiny_config, write_tiny_gguf

from hetero_run.runtime.checkpoint import Checkpoint
from hetero_run.runtime.models.config import DecoderConfig, HFConfig, ModelConfig
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.runtime.planner import make_plan, resolve
from hetero_run.runtime.planner.gguf_header import hf_config, read_gguf_header
from hetero_run.runtime.planner.shape import ModelShape
from hetero_run.topology.errors import ConfigError

FIELDS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "intermediate_size", "rms_norm_eps", "rope", "max_positions", "tie_word_embeddings", "qkv_bias", "o_bias",
          "mlp_bias", "qk_norm", "num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob",
          "sparse_step", "dense_layers", "sparse_layers")


def _same(a, b) -> None:
    assert {f: getattr(a, f) for f in FIELDS} == {f: getattr(b, f) for f in FIELDS}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_planner_reads_every_architecture_as_the_runtime_does(arch):
    overrides = dict(attention_bias=True) if arch in ("qwen3", "llama") else {}
    raw = tiny_config(arch, **overrides).to_dict()
    runtime = ModelConfig.from_hf(raw)
    shape = ModelShape.for_target(raw)
    assert shape.decoder == runtime  # the planner's view is the runtime's config itself
    drafter = ModelShape.from_config(raw).decoder  # read as a drafter: the same numbers
    assert type(drafter) is DecoderConfig
    _same(drafter, runtime)
    assert shape.moe_layers == ((0, 1) if arch == "qwen3_moe" else ())
    assert (runtime.qkv_bias, runtime.o_bias, runtime.qk_norm) == {
        "qwen3_moe": (False, False, True), "qwen3": (True, True, True), "qwen2": (True, False, False),
        "llama": (True, True, False)}[arch]
    for tp in (1, 2, 4):  # 2 KV heads: split at TP=2, one replicated head per rank at TP=4
        heads = {1: 2, 2: 1, 4: 1}[tp]
        assert shape.kv_bytes_per_token(tp, torch.bfloat16) == 2 * 2 * heads * 16 * 2


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_kv_bytes_per_token_are_the_loaded_cache_per_slot(arch, tp):
    path = tiny_checkpoint(arch, "bf16")
    source = resolve(str(path))
    for rank in range(tp):
        model = load_model(path, ParallelContext(group=object() if tp > 1 else None, rank=rank, size=tp),
                           max_tokens=40, block_size=8)
        assert model.config == source.shape.decoder
        assert source.shape.kv_bytes_per_token(tp, model.dtype) == model.kv.nbytes // model.kv.num_slots


def test_gguf_metadata_reads_as_the_loader_reads_the_model(tmp_path):
    """The planner reads a GGUF file's header; the loader reads the config transformers derives
    from the same file. Both go through ModelConfig and must agree."""
    from hetero_run.runtime.models.loader import open_source

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    planned = ModelShape.for_target(hf_config(read_gguf_header(path), path), str(path)).decoder
    loaded = ModelConfig.from_hf(open_source(path).config)
    for name in ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "tie_word_embeddings", "qkv_bias", "o_bias", "num_experts"):
        assert getattr(planned, name) == getattr(loaded, name), name
    assert planned.rope.theta == loaded.rope.theta and planned.rms_norm_eps == pytest.approx(loaded.rms_norm_eps)
    assert planned.max_positions == loaded.max_positions == 256
    plan = make_plan(str(path), tp=2, context=64)
    assert plan.ranks[0].kv_bytes_per_token == loaded.kv_bytes_per_token(2, torch.float32)


def test_presets_read_through_the_runtime_config():
    target, head = resolve("qwen3-235b-a22b-nvfp4").shape, resolve("eagle3-qwen3-235b", role="drafter").shape
    assert isinstance(target.decoder, ModelConfig) and target.decoder.num_experts == 128
    assert target.moe_layers == tuple(range(94)) and target.kv_bytes_per_token(2, torch.bfloat16) == 94 * 1024
    assert head.eagle3 and head.num_layers == 1 and head.draft_vocab_size == 32000
    assert head.head.kv_bytes_per_token(torch.bfloat16) == 2 * 4 * 128 * 2
    head.head.check_target(target.decoder, "eagle3-qwen3-235b")


def test_drafters_of_other_architectures_read_leniently():
    gemma = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 640, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "num_hidden_layers": 18, "vocab_size": 262144, "intermediate_size": 2048,
        "hidden_activation": "gelu_pytorch_tanh", "rope_scaling": {"rope_type": "yarn", "factor": 8.0},
        "sliding_window": 512, "use_sliding_window": True}}
    drafter = DecoderConfig.from_hf(gemma, "gemma/config.json")
    assert (drafter.arch, drafter.num_layers, drafter.num_kv_heads, drafter.head_dim) == ("gemma3", 18, 1, 256)
    assert drafter.rope is None and drafter.max_positions == 0  # unknown: transformers runs it
    assert drafter.kv_bytes_per_token(1, torch.bfloat16) == 2 * 18 * 1 * 256 * 2
    with pytest.raises(ConfigError, match=r"gemma/config.json: model_type: model_type 'gemma3' is not supported"):
        ModelConfig.from_hf(gemma, "gemma/config.json")
    with pytest.raises(ConfigError, match="gemma/config.json: num_attention_heads: missing"):
        DecoderConfig.from_hf({"hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 4}, "gemma/config.json")


@pytest.mark.parametrize("change, field, message", [
    ({"num_key_value_heads": 3}, "num_key_value_heads", "4 attention heads do not group over 3 KV heads"),
    ({"num_attention_heads": 0}, "num_attention_heads", "must be >= 1, got 0"),
    ({"num_hidden_layers": "two"}, "num_hidden_layers", "expected a whole number, got 'two'"),
    ({"head_dim": 15}, "head_dim", "rotary embeddings need an even head_dim"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok", r"must be in 1\.\.4, got 9"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps", "expected a number"),
])
def test_one_reader_one_message_for_every_reader(change, field, message):
    """A bad config is the same one-line error from the loader's reader and the planner's."""
    raw = {**tiny_config("qwen3_moe").to_dict(), **change}
    with pytest.raises(ConfigError, match=message) as runtime:
        ModelConfig.from_hf(raw, "ck/config.json")
    assert (runtime.value.file, runtime.value.field) == ("ck/config.json", field)
    with pytest.raises(ConfigError, match=message) as planned:
        ModelShape.for_target(raw, "ck/config.json")
    assert (planned.value.file, planned.value.field) == ("ck/config.json", field)


def test_hf_config_sections_and_defaults():
    hf = HFConfig({"a": 1, "b": None, "inner": {"b": 2}}, "x.json", ({"b": 2, "a": 5},), {"c": 3})
    assert (hf.get("a"), hf.get("b"), hf.get("c"), hf.get("d", default=4)) == (5, 2, 3, 4)
    assert hf.integer("c") == 3
    with pytest.raises(ConfigError, match="x.json: d: missing"):
        hf.integer("d")


def test_checkpoint_config_is_read_once_the_same_way():
    ckpt = Checkpoint.open(tiny_checkpoint("qwen3", "nvfp4"))
    assert resolve(str(ckpt.path)).shape.decoder == ModelConfig.from_hf(ckpt.config)
