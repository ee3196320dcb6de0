"""`hetero-run convert`: HF directories and GGUF files to bf16 / NVFP4 (real ModelOpt) checkpoints."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support import PAIR
from tiny_models import tiny_checkpoint, tiny_tokenizer, write_tiny_gguf
from transformers import AutoTokenizer

from hetero_run.runtime.checkpoint import Checkpoint
from hetero_run.runtime.convert import MANIFEST, read_manifest
from hetero_run.runtime.weights import DenseWeight, NVFP4Weight, load_linear

SAMPLE = "def add(a, b):\n    return a + b"


def _only_final_outputs(parent: Path, expected: set[str]):
    assert {p.name for p in parent.iterdir()} == expected  # no .partial / .old directories left


def test_hf_directory_to_nvfp4(run_cli, tmp_path):
    src = tiny_checkpoint("qwen3_moe", "bf16")
    dst = tmp_path / "out"
    out = run_cli("convert", "--from", src, "--to", dst, "--quant", "nvfp4", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["quant"] == "nvfp4" and report["architecture"] == "Qwen3MoeForCausalLM"
    assert report["quantized_linears"] == 2 * (4 + 4 * 3)  # attention + 4 experts x 3, per layer
    assert report["dest_bytes"] < report["source_bytes"] and set(report["seconds"]) == {"load", "quantize", "export"}
    ckpt = Checkpoint.open(dst)
    assert ckpt.quant.algo == "NVFP4"
    assert isinstance(load_linear(ckpt, "model.layers.1.mlp.experts.2.up_proj"), NVFP4Weight)
    assert isinstance(load_linear(ckpt, "model.layers.1.mlp.gate"), DenseWeight)
    assert AutoTokenizer.from_pretrained(dst)(SAMPLE).input_ids == tiny_tokenizer()(SAMPLE).input_ids
    assert read_manifest(dst)["quant"] == "nvfp4"
    _only_final_outputs(tmp_path, {"out"})


def test_hf_directory_to_bf16(run_cli, tmp_path):
    src = tmp_path / "fp32"
    shutil.copytree(tiny_checkpoint("qwen2", "bf16"), src)
    original = Checkpoint.open(src)
    state = {name: original.read(name).float() for name in original.tensors}
    save_file(state, str(src / "model.safetensors"))
    out = run_cli("convert", "--from", src, "--to", tmp_path / "bf16", "--quant", "bf16")
    assert out.returncode == 0, out.stderr
    assert "converted to bf16" in out.stdout
    ckpt = Checkpoint.open(tmp_path / "bf16")
    assert ckpt.quant is None and set(ckpt.tensors) == set(state)
    for name, meta in ckpt.tensors.items():
        assert meta.dtype == torch.bfloat16
        assert torch.equal(ckpt.read(name), state[name].bfloat16()), name


def test_gguf_file_to_nvfp4(run_cli, tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    dst = tmp_path / "out"
    out = run_cli("convert", "--from", gguf, "--to", dst, "--quant", "nvfp4", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["architecture"] == "LlamaForCausalLM" and report["quantized_linears"] == 14
    assert report["source_bytes"] == gguf.stat().st_size
    assert Checkpoint.open(dst).quant.exclude_modules == ("lm_head", "model.embed_tokens")
    assert AutoTokenizer.from_pretrained(dst)(SAMPLE).input_ids == tiny_tokenizer()(SAMPLE).input_ids


def test_gguf_file_to_bf16_keeps_the_dequantised_weights(run_cli, tmp_path):
    """transformers marks a model read from GGUF as quantised and refuses to save it; convert
    writes its de-quantised weights as a plain bf16 checkpoint."""
    from transformers import AutoModelForCausalLM

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    dst = tmp_path / "out"
    out = run_cli("convert", "--from", gguf, "--to", dst, "--quant", "bf16", "--json")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.output
    report = json.loads(out.stdout)
    assert report["architecture"] == "LlamaForCausalLM" and report["quantized_linears"] == 0
    written = Checkpoint.open(dst)
    assert written.quant is None
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.bfloat16)
    saved = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16)
    ref_state, saved_state = reference.state_dict(), saved.state_dict()
    assert ref_state.keys() == saved_state.keys()
    for name, tensor in ref_state.items():
        assert saved_state[name].dtype == torch.bfloat16 and torch.equal(saved_state[name], tensor), name
    assert AutoTokenizer.from_pretrained(dst)(SAMPLE).input_ids == tiny_tokenizer()(SAMPLE).input_ids
    _only_final_outputs(tmp_path, {"out", "tiny.gguf"})


def test_existing_destination_needs_overwrite(run_cli, tmp_path):
    src = tiny_checkpoint("llama", "bf16")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    out = run_cli("convert", "--from", src, "--to", dst, "--quant", "bf16")
    assert out.returncode == 2 and "already exists (pass --overwrite to replace it)" in out.stderr
    assert "Traceback" not in out.output and (dst / "keep.txt").exists()
    out = run_cli("convert", "--from", src, "--to", dst, "--quant", "bf16", "--overwrite")
    assert out.returncode == 0, out.stderr
    assert not (dst / "keep.txt").exists() and (dst / MANIFEST).is_file()
    _only_final_outputs(tmp_path, {"out"})


@pytest.mark.parametrize("kind", ["missing", "not-a-model", "text-file", "broken-gguf", "quantised"])
def test_bad_sources_are_one_line_errors(run_cli, tmp_path, kind):
    src = tmp_path / "src"
    expected = {
        "missing": "no such file or directory",
        "not-a-model": "not a Hugging Face model directory (no config.json)",
        "text-file": "expected a .gguf file or a Hugging Face model directory",
        "broken-gguf": "cannot load a tokenizer",
        "quantised": "is already a quantised checkpoint",
    }[kind]
    if kind == "not-a-model":
        src.mkdir()
    elif kind == "text-file":
        src = tmp_path / "model.txt"
        src.write_text("hello")
    elif kind == "broken-gguf":
        src = tmp_path / "model.gguf"
        src.write_bytes(b"GGUF" + b"\0" * 64)
    elif kind == "quantised":
        src = tiny_checkpoint("llama", "nvfp4")
    out = run_cli("convert", "--from", src, "--to", tmp_path / "out", "--quant", "nvfp4")
    assert out.returncode == 2, out.output
    assert expected in out.stderr and "Traceback" not in out.output
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


REAL_TARGET = PAIR / "qwen2.5-coder-0.5b-instruct.gguf"


@pytest.mark.slow
@pytest.mark.skipif(not REAL_TARGET.is_file(), reason="the real target GGUF is not on this machine")
def test_real_target_to_nvfp4(run_cli, tmp_path):
    out = run_cli("convert", "--from", REAL_TARGET, "--to", tmp_path / "qwen", "--quant", "nvfp4", "--json",
                  timeout=1800)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["quantized_linears"] == 24 * 7 and 0.7e9 < report["dest_bytes"] < 0.8e9
    ckpt = Checkpoint.open(tmp_path / "qwen")
    assert ckpt.tensors["lm_head.weight"].dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(tmp_path / "qwen")
    assert tok.decode(tok("print('hi')").input_ids) == "print('hi')"
