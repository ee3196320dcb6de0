"""Loading EAGLE-3 heads: the three layouts, the aux-layer numbering, and one-line errors."""

from __future__ import annotations

import json
import logging

import heads
import pytest
import torch
from conftest import head_dir, target_dir
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hetero_run.runtime.eagle3 import read_head
from hetero_run.runtime.eagle3.layout import resolve_layers
from hetero_run.runtime.models.config import ModelConfig
from hetero_run.runtime.models.loader import load_model
from hetero_run.topology.errors import ConfigError, UserError


def target_config(arch: str = "qwen3", layers: int = heads.TARGET_LAYERS) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((target_dir(arch, layers) / "config.json").read_text()))


@pytest.mark.parametrize("layout", heads.LAYOUTS)
def test_each_layout_reads_to_the_same_head(layout):
    config, found, tensors = read_head(head_dir("qwen3", layout, "random"), target_config())
    reference, _, ref_tensors = read_head(head_dir("qwen3", "eagle", "random"), target_config())
    assert found.name == layout
    assert config.draft_vocab_size == heads.DRAFT_VOCAB and config.target_hidden_size == 64
    assert config.aux_layers == heads.AUX_INPUTS and config.aux_layers_named  # each layout's own numbering
    for name in ("fc.weight", "layer.self_attn.q_proj.weight", "layer.hidden_norm.weight", "lm_head.weight", "d2t"):
        assert torch.equal(tensors[name], ref_tensors[name]), (layout, name)
    assert ("embed.weight" in tensors) == (layout == "vllm")


def test_numbering_rule_input_vs_output():
    assert resolve_layers([1, 46, 90], "output", 94, "x") == (2, 47, 91)  # SpecForge / ModelOpt ids
    assert resolve_layers([2, 47, 91], "input", 94, "x") == (2, 47, 91)  # vLLM / SGLang ids, same states
    assert resolve_layers(None, "input", 94, "x") == (2, 47, 91)  # the usual default
    assert resolve_layers([0, 1, 3], "output", 4, "x") == (1, 2, 4)  # 4: the last layer's output
    with pytest.raises(ConfigError, match="do not fit a target of 4 layers"):
        resolve_layers([1, 2, 4], "output", 4, "x")
    config, _, _ = read_head(head_dir("qwen3", "eagle", "random"), target_config(), layer_numbering="input")
    assert config.aux_layers == (0, 1, 3)  # the explicit override reads the same ids one layer earlier


def test_a_head_naming_no_layers_gets_the_default_and_a_warning(tmp_path, caplog):
    path = heads.write_head(tmp_path / "h", target_dir("qwen3", 8), "eagle", aux_inputs=None)
    with caplog.at_level(logging.WARNING, logger="hetero_run.runtime.eagle3"):
        config, _, _ = read_head(path, target_config("qwen3", 8))
    assert config.aux_layers == (2, 4, 5) and not config.aux_layers_named
    assert any("names no aux layers" in r.message and "1% acceptance" in r.message for r in caplog.records)


def test_vllm_native_names_load(tmp_path):
    path = heads.write_head(tmp_path / "h", target_dir("qwen3"), "vllm")
    tensors = load_file(path / "model.safetensors")
    renamed = {("model." + k if not k.startswith(("lm_head", "d2t", "t2d")) else k): v for k, v in tensors.items()}
    save_file(renamed, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config = {**config["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": config["draft_vocab_size"], "eagle_aux_hidden_state_layer_ids": [1, 2, 4]}
    (path / "config.json").write_text(json.dumps(config))
    config, layout, tensors = read_head(path, target_config())
    assert layout.name == "vllm" and config.aux_layers == (1, 2, 4) and "embed.weight" in tensors


def _edit(tmp_path, layout="eagle", tensors=None, config=None):
    path = heads.write_head(tmp_path / "h", target_dir("qwen3"), layout)
    if tensors is not None:
        t = load_file(path / "model.safetensors")
        tensors(t)
        save_file(t, str(path / "model.safetensors"))
    if config is not None:
        c = json.loads((path / "config.json").read_text())
        config(c)
        (path / "config.json").write_text(json.dumps(c))
    return path


@pytest.mark.parametrize("edit, message", [
    (dict(tensors=lambda t: t.pop("fc.weight")), "needs tensor 'fc.weight', which is missing"),
    (dict(tensors=lambda t: t.update({"fc.weight": torch.zeros(64, 128)})), r"fc.weight: has shape \[64, 128\]"),
    (dict(tensors=lambda t: t.update({"d2t": t["d2t"] + 400})), "outside the target vocabulary"),
    (dict(tensors=lambda t: t.update({"t2d": torch.zeros(300, dtype=torch.bool)})), "disagrees with d2t"),
    (dict(tensors=lambda t: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)})),
     r"q_proj.weight: has shape \[64, 64\], expected \[64, 128\]"),
    (dict(config=lambda c: c.update({"target_hidden_size": 128})), "target_hidden_size"),
    (dict(config=lambda c: c.update({"architectures": ["LlamaForCausalLM"]})), "not an EAGLE-3 head"),
    (dict(config=lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [0, 9, 12]})),
     "do not fit a target of 4 layers"),
    (dict(config=lambda c: c.update({"quantization_config": {"quant_algo": "NVFP4"}})), "quantised"),
    (dict(tensors=lambda t: t.update({"midlayer2.x": torch.zeros(1), "layers.1.x": torch.zeros(1)})),
     "more than one decoder layer"),
])
def test_bad_heads_are_one_line_errors(tmp_path, edit, message):
    path = _edit(tmp_path, **edit)
    with pytest.raises(ConfigError, match=message) as info:
        read_head(path, target_config())
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(UserError, match="no such EAGLE-3 head directory"):
        read_head(tmp_path / "nope", target_config())
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        read_head(tmp_path / "empty", target_config())


def test_capture_gives_the_states_entering_layers_and_the_last_output():
    """The captured residual stream equals transformers' hidden states (input of layer i)."""
    model = load_model(target_dir("qwen3_moe"), max_tokens=32, dtype=torch.float32)
    seen = []
    model.capture((0, 2, 4), sink=lambda batch, states: seen.append((int(batch.logical[0]), states.clone())))
    ids = torch.tensor([5, 17, 42, 99, 7, 3])
    model.forward(ids[:4], torch.arange(4))
    model.forward(ids[4:], torch.arange(4, 6))
    reference = AutoModelForCausalLM.from_pretrained(target_dir("qwen3_moe"), dtype=torch.float32).eval()
    with torch.no_grad():
        out = reference(ids[None], output_hidden_states=True)
        last = reference.model.layers[-1]
        # transformers' final entry has the final norm applied: rebuild the pre-norm state
        hooked = []
        handle = last.register_forward_hook(lambda m, a, o: hooked.append(o[0] if isinstance(o, tuple) else o))
        reference(ids[None])
        handle.remove()
    expected = torch.cat([out.hidden_states[0][0], out.hidden_states[2][0], hooked[0][0]], dim=-1)  # [6, 192]
    assert [s for s, _ in seen] == [0, 4]
    got = torch.cat([states for _, states in seen])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.captured, seen[-1][1])
