"""Checkpoint discovery (single file, sharded index, quantisation config) and its error messages."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import save_tiny_checkpoint, tiny_checkpoint

from hetero_run.runtime.checkpoint import Checkpoint, CheckpointError, QuantConfig
from hetero_run.runtime.weights import DenseWeight, NVFP4Weight, load_linear

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def nvfp4_copy(tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("qwen3", "nvfp4"), dest)
    return dest


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return save_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("sharded") / "ckpt", "nvfp4",
                                max_shard_size="40KB")


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    section = data.get("quantization", data)
    section.update(changes)
    path.write_text(json.dumps(data))


def test_sharded_index_reads_tensors_from_every_shard(sharded):
    ckpt = Checkpoint.open(sharded)
    files = {meta.file.name for meta in ckpt.tensors.values()}
    assert len(files) >= 3 and (sharded / "model.safetensors.index.json").is_file()
    single = Checkpoint.open(tiny_checkpoint("qwen3_moe", "nvfp4"))
    assert set(ckpt.tensors) == set(single.tensors)
    for name in ckpt.tensors:
        a, b = ckpt.read(name).reshape(-1), single.read(name).reshape(-1)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_nvfp4_detected_from_config_json_alone(nvfp4_copy):
    (nvfp4_copy / "hf_quant_config.json").unlink()
    ckpt = Checkpoint.open(nvfp4_copy)
    assert ckpt.quant.algo == "NVFP4" and ckpt.quant.source.endswith("config.json")
    assert ckpt.quant.exclude_modules == ("lm_head", "model.embed_tokens")
    assert isinstance(load_linear(ckpt, Q), NVFP4Weight)
    assert isinstance(load_linear(ckpt, "lm_head"), DenseWeight)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_dense_checkpoints_of_each_float_dtype(tmp_path, dtype):
    src = tiny_checkpoint("llama", "bf16")
    shutil.copytree(src, tmp_path / "ckpt")
    state = {k: Checkpoint.open(src).read(k).to(dtype) for k in Checkpoint.open(src).tensors}
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"))
    ckpt = Checkpoint.open(tmp_path / "ckpt")
    assert ckpt.quant is None
    w = load_linear(ckpt, Q, (0, 1, 2), dtype=torch.float32)
    assert isinstance(w, DenseWeight) and w.weight.dtype == torch.float32 and w.out_features == 32
    assert torch.equal(w.weight, state[f"{Q}.weight"][32:].float())


# One test per error the brief names: each message names the file, the tensor and expected vs found.

def test_missing_shard(sharded, tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(sharded, dest)
    victim = sorted(dest.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(dest)
    assert victim.name in str(err.value) and "is missing" in str(err.value)
    assert "model.safetensors.index.json" in str(err.value)


def test_missing_tensor(nvfp4_copy):
    ckpt = Checkpoint.open(nvfp4_copy)
    with pytest.raises(CheckpointError) as err:
        load_linear(ckpt, "model.layers.7.self_attn.q_proj")
    assert "'model.layers.7.self_attn.q_proj.weight' is missing" in str(err.value)
    assert str(nvfp4_copy) in str(err.value)


def test_shape_mismatch(nvfp4_copy):
    ckpt = Checkpoint.open(nvfp4_copy)
    with pytest.raises(CheckpointError) as err:
        load_linear(ckpt, Q, shape=(64, 128))
    message = str(err.value)
    assert "model.safetensors" in message and f"{Q}.weight" in message
    assert "[64, 64] weight, expected [64, 128]" in message
    with pytest.raises(CheckpointError, match=r"has shape \[320, 64\], expected \[321, 64\]"):
        load_linear(ckpt, "lm_head", shape=(321, 64))


def test_truncated_file(nvfp4_copy):
    file = nvfp4_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor '.+' ends at byte \d+"):
        Checkpoint.open(nvfp4_copy)
    file.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated: 5 bytes"):
        Checkpoint.open(nvfp4_copy)


def test_corrupted_header(nvfp4_copy):
    file = nvfp4_copy / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"not json at!"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted: safetensors header is not valid JSON"):
        Checkpoint.open(nvfp4_copy)
    data[:8] = (1 << 40).to_bytes(8, "little")
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header length 1099511627776 exceeds the file size"):
        Checkpoint.open(nvfp4_copy)


def test_unsupported_quant_algo(nvfp4_copy):
    _edit_json(nvfp4_copy / "hf_quant_config.json", quant_algo="FP8")
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(nvfp4_copy)
    assert str(err.value) == (f"{nvfp4_copy / 'hf_quant_config.json'}: quant_algo: unsupported quant_algo 'FP8'; "
                              "supported: NVFP4, W4A16_NVFP4")


def test_unsupported_group_size(nvfp4_copy):
    _edit_json(nvfp4_copy / "hf_quant_config.json", group_size=32)
    with pytest.raises(CheckpointError, match="hf_quant_config.json: group_size: unsupported group_size 32"):
        Checkpoint.open(nvfp4_copy)
    with pytest.raises(CheckpointError, match="group_size"):
        QuantConfig("NVFP4", 8)


def test_dtype_mismatch(nvfp4_copy):
    _edit_json(nvfp4_copy / "hf_quant_config.json", exclude_modules=["model.embed_tokens"])
    ckpt = Checkpoint.open(nvfp4_copy)
    with pytest.raises(CheckpointError) as err:
        load_linear(ckpt, "lm_head")
    assert "model.safetensors: tensor 'lm_head.weight' has dtype bfloat16, expected uint8" in str(err.value)
    _edit_json(nvfp4_copy / "hf_quant_config.json", exclude_modules=["lm_head", "model.embed_tokens", "*q_proj"])
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.q_proj.weight' has dtype uint8, "
                                              r"expected bfloat16, float16 or float32 \(excluded"):
        load_linear(Checkpoint.open(nvfp4_copy), Q)
    with pytest.raises(CheckpointError, match=r"has dtype uint8, expected float8_e4m3fn"):
        Checkpoint.open(nvfp4_copy).expect(f"{Q}.weight", dtype=torch.float8_e4m3fn)


def test_index_that_names_the_wrong_shard(sharded, tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(sharded, dest)
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["lm_head.weight"] = next(s for s in shards if s != index["weight_map"]["lm_head.weight"])
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="puts tensor 'lm_head.weight' in model-"):
        Checkpoint.open(dest)
