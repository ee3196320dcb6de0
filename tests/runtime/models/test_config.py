"""Model configs from Hugging Face config dicts, and how heads split over ranks."""

import pytest
import torch
from tiny_models import tiny_config

from hetero_run.runtime.models.config import ModelConfig, RopeConfig
from hetero_run.runtime.models.loader import kv_head_split
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.topology.errors import ConfigError


def _ctx(rank: int, size: int) -> ParallelContext:
    return ParallelContext(object(), rank, size)  # the group is never used here


def test_qwen3_235b_config_reads_as_published():
    published = {  # Qwen/Qwen3-235B-A22B config.json (older key names: rope_theta, num_experts)
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "eos_token_id": 151645,
    }
    cfg = ModelConfig.from_hf(published)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.qk_norm, cfg.qkv_bias) == (128, 8, True, False)
    assert cfg.rope.theta == 1e6 and cfg.is_sparse(0) and cfg.eos_token_ids == (151645,)
    assert kv_head_split(cfg.num_kv_heads, _ctx(1, 2)) == (1, 2, 2)  # 4 KV heads -> 2 per rank at TP=2


@pytest.mark.parametrize("arch,bias,qk_norm", [("qwen2", True, False), ("qwen3", False, True), ("llama", False, False)])
def test_architecture_flags(arch, bias, qk_norm):
    cfg = ModelConfig.from_hf(tiny_config(arch).to_dict())
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.num_experts, cfg.o_bias) == (bias, qk_norm, 0, False)


def test_moe_dense_layers_and_sparse_step():
    cfg = ModelConfig.from_hf(tiny_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
                                          mlp_only_layers=[3]).to_dict())
    assert [cfg.is_sparse(i) for i in range(4)] == [False, True, False, False]


@pytest.mark.parametrize("change,field,message", [
    ({"model_type": "gemma3"}, "model_type", "not supported"),
    ({"hidden_act": "gelu"}, "hidden_act", "only silu"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "do not group"),
    ({"num_hidden_layers": None}, "num_hidden_layers", "missing"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_scaling", "'yarn' is not supported"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "use_sliding_window", "not supported"),
])
def test_bad_configs_name_file_and_field(change, field, message):
    config = {**tiny_config("qwen3").to_dict(), **change}
    with pytest.raises(ConfigError, match=message) as info:
        ModelConfig.from_hf(config, source="ckpt/config.json")
    assert info.value.file == "ckpt/config.json" and info.value.field == field


def test_llama3_inverse_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = ModelConfig.from_hf(hf.to_dict()).rope
    assert ours == RopeConfig(500000.0, "llama3", 32.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(ours.inv_freq(64), expected, atol=0, rtol=0)


@pytest.mark.parametrize("kv_heads,size,expected", [
    (4, 2, [(0, 2, 2), (1, 2, 2)]),
    (2, 2, [(0, 2, 1), (1, 2, 1)]),
    (2, 4, [(0, 2, 1), (0, 2, 1), (1, 2, 1), (1, 2, 1)]),  # fewer KV heads than ranks: replicated
    (1, 2, [(0, 1, 1), (0, 1, 1)]),
])
def test_kv_heads_split_or_replicate(kv_heads, size, expected):
    assert [kv_head_split(kv_heads, _ctx(r, size)) for r in range(size)] == expected


def test_kv_heads_that_neither_split_nor_replicate_are_an_error():
    with pytest.raises(ConfigError, match="6 KV heads cannot be split or replicated over 4 ranks"):
        kv_head_split(6, _ctx(0, 4))


def test_parallel_context_checks_itself():
    with pytest.raises(ConfigError, match="needs a process group"):
        ParallelContext(None, 0, 2)
    with pytest.raises(ConfigError, match="rank 2 is not in a group of size 2"):
        ParallelContext(object(), 2, 2)
    with pytest.raises(ConfigError, match="num_attention_heads = 14 does not divide across 4"):
        _ctx(0, 4).split(14, "num_attention_heads")
    single = ParallelContext.single()
    x = torch.ones(3)
    assert single.all_reduce(x) is x and single.gather_first(x) is x and single.broadcast(x) is x
