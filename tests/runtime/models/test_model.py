"""The project's own decoders against Hugging Face transformers with the same weights (TP=1).

float32 throughout, so "match" means float32 rounding: the dense architectures come out
bit-identical, the MoE one within a few ulps (experts are summed in another order).
"""

import pytest
import torch
from tiny_models import ARCHITECTURES, build_tiny_model, reference_model, save_tiny_checkpoint, tiny_checkpoint

from hetero_run.runtime.models.kv_cache import KVCacheFull
from hetero_run.runtime.models.loader import load_model

ATOL = 1e-5


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids[None]).logits[0]


def _hf_greedy(ref, ids: torch.Tensor, n: int) -> list[int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        mask = torch.ones(1, len(ids), dtype=torch.long)
        out = ref.generate(ids[None], generation_config=config, attention_mask=mask)
    return out[0, len(ids):].tolist()


def _greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    model.truncate(0)
    logits = model.forward(ids, torch.arange(len(ids)), num_logits=1)
    out = []
    for i in range(n):
        out.append(int(logits[-1].argmax()))
        if i + 1 < n:
            logits = model.forward(torch.tensor(out[-1:]), torch.tensor([len(ids) + i]))
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prompt_and_verify_step_match_transformers(arch):
    path = tiny_checkpoint(arch, "bf16")
    ref = reference_model(path)
    model = load_model(path, dtype=torch.float32, max_tokens=64, prefill_chunk=8)
    ids = _ids(25)
    expected = _hf_logits(ref, ids)  # [25, vocab]
    prompt = model.forward(ids[:20], torch.arange(20))  # 3 chunks of at most 8
    verify = model.forward(ids[20:], torch.arange(20, 25))  # last token + 4 drafts in one forward
    assert model.length == 25
    torch.testing.assert_close(prompt, expected[:20], atol=ATOL, rtol=0)
    torch.testing.assert_close(verify, expected[20:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rollback_then_forward_equals_a_fresh_forward(arch):
    path = tiny_checkpoint(arch, "bf16")
    model = load_model(path, dtype=torch.float32, max_tokens=64)
    ids = _ids(24)
    model.forward(ids[:16], torch.arange(16))
    model.forward(_ids(6, seed=5), torch.arange(16, 22))  # a verify step whose drafts are all rejected
    model.truncate(17)  # keep the first draft token ...
    kept = torch.cat([ids[:16], _ids(6, seed=5)[:1]])
    after = model.forward(ids[17:24], torch.arange(17, 24))  # ... and continue with other tokens
    fresh = load_model(path, dtype=torch.float32, max_tokens=64)
    full = fresh.forward(torch.cat([kept, ids[17:24]]), torch.arange(24))
    torch.testing.assert_close(after, full[17:], atol=ATOL, rtol=0)
    torch.testing.assert_close(after, _hf_logits(reference_model(path), torch.cat([kept, ids[17:24]]))[17:],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_64_tokens_identical_to_transformers_generate(arch):
    path = tiny_checkpoint(arch, "bf16")
    ids = _ids(12, seed=3)
    ours = _greedy(load_model(path, dtype=torch.float32, max_tokens=128), ids, 64)
    assert ours == _hf_greedy(reference_model(path), ids, 64)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_nvfp4_checkpoint_matches_its_dequantised_weights(arch):
    path = tiny_checkpoint(arch, "nvfp4")
    model = load_model(path, dtype=torch.float32, max_tokens=64)
    assert any(type(layer.mlp).__name__ == "SparseMoE" for layer in model.layers) == (arch == "qwen3_moe")
    qkv = model.layers[0].attention.qkv.weight
    assert type(qkv).__name__ == "NVFP4Weight"  # packed in memory, not dequantised
    ids = _ids(20, seed=7)
    expected = _hf_logits(reference_model(path), ids)
    got = torch.cat([model.forward(ids[:17], torch.arange(17)), model.forward(ids[17:], torch.arange(17, 20))])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_bf16_run_stays_close_and_reads_half_the_bytes():
    path = tiny_checkpoint("qwen3", "bf16")
    ids = _ids(16)
    fp32 = load_model(path, dtype=torch.float32, max_tokens=32)
    bf16 = load_model(path, max_tokens=32)  # auto: bf16 checkpoint -> bf16
    assert bf16.dtype == torch.bfloat16 and bf16.kv.k.dtype == torch.bfloat16
    assert bf16.weight_nbytes * 2 == fp32.weight_nbytes
    a, b = fp32.forward(ids, torch.arange(16)), bf16.forward(ids, torch.arange(16))
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.1 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_in_memory_transformers_model_loads_like_its_checkpoint(arch):
    # transformers 5 keeps MoE experts fused in memory ([E, 2I, H]); checkpoints name them one by one.
    hf = build_tiny_model(arch, seed=4, dtype=torch.float32)
    ids = _ids(10)
    model = load_model(hf, max_tokens=16)
    assert model.dtype == torch.float32
    torch.testing.assert_close(model.forward(ids, torch.arange(10)), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_tied_embeddings_share_one_tensor():
    path = tiny_checkpoint("qwen2", "bf16", tie_word_embeddings=True)
    model = load_model(path, dtype=torch.float32, max_tokens=32)
    assert model.lm_head.tied and model.lm_head.weight.weight.data_ptr() == model.embed.weight.data_ptr()
    ids = _ids(12)
    torch.testing.assert_close(model.forward(ids, torch.arange(12)), _hf_logits(reference_model(path), ids),
                               atol=ATOL, rtol=0)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    path = save_tiny_checkpoint("llama", tmp_path / "llama3", "bf16", rope_parameters=rope)
    model = load_model(path, dtype=torch.float32, max_tokens=128)
    assert model.config.rope.kind == "llama3"
    ids = _ids(100)
    torch.testing.assert_close(model.forward(ids, torch.arange(100)), _hf_logits(reference_model(path), ids),
                               atol=ATOL, rtol=0)


def test_num_logits_keeps_the_last_rows_across_chunks():
    path = tiny_checkpoint("qwen3", "bf16")
    ids = _ids(20)
    full = load_model(path, dtype=torch.float32, max_tokens=32).forward(ids, torch.arange(20))
    chunked = load_model(path, dtype=torch.float32, max_tokens=32, prefill_chunk=6)
    last = chunked.forward(ids, torch.arange(20), num_logits=9)  # spans the last two chunks
    torch.testing.assert_close(last, full[-9:], atol=ATOL, rtol=0)


def test_captured_hidden_states_are_the_layer_inputs():
    path = tiny_checkpoint("qwen3", "bf16", num_hidden_layers=4)
    model = load_model(path, dtype=torch.float32, max_tokens=32, prefill_chunk=5)
    with pytest.raises(ValueError, match=r"ascending and in 0\.\.4"):  # 4: the last layer's output
        model.capture((3, 1))
    with pytest.raises(ValueError, match="got \\(1, 5\\)"):
        model.capture((1, 5))
    model.capture((1, 3))
    ids = _ids(12)
    model.forward(ids, torch.arange(12))
    with torch.no_grad():
        hidden = reference_model(path)(ids[None], output_hidden_states=True).hidden_states
    assert model.captured.shape == (12, 2 * 64)
    torch.testing.assert_close(model.captured, torch.cat([hidden[1][0], hidden[3][0]], -1), atol=ATOL, rtol=0)


def test_kv_cache_overflow_is_a_clear_error_and_changes_nothing():
    model = load_model(tiny_checkpoint("qwen2", "bf16"), dtype=torch.float32, max_tokens=16)
    model.forward(_ids(10), torch.arange(10))
    with pytest.raises(KVCacheFull, match="would reach 17 tokens but the KV cache holds 16"):
        model.forward(_ids(7), torch.arange(10, 17))
    assert model.length == 10
    with pytest.raises(ValueError, match="cannot truncate a cache of 10 tokens to 11"):
        model.truncate(11)


def test_checkpoint_that_disagrees_with_its_config_is_a_clear_error(tmp_path):
    import json
    import shutil

    from hetero_run.runtime.checkpoint import CheckpointError

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama", "bf16"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\], "
                                              r"expected \[96, 64\]"):
        load_model(path, max_tokens=8)
