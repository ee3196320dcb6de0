"""EAGLE-3 heads written in each layout for tiny targets, and the targets themselves.

    target_dir = write_target(tmp / "t", "qwen3")       # tiny fp32 checkpoint + tokenizer
    write_head(tmp / "h", target_dir, "eagle", kind="random")

`kind="random"`: every weight random (seeded). `kind="aligned"`: random, except that the head
is built to imitate the target: the targets here are near-bigram models (their attention and
MLP outputs scaled down, so the next token depends mostly on the current one), and the aligned
head attends (almost) only to its own slot and reads the target's own embedding, final norm and
LM-head rows back out, so its drafts are often, not always, accepted. Both are lossless cases;
the aligned one makes acceptance high enough for tests that need accepted drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LAYOUTS = ("eagle", "modelopt", "vllm")
TARGET_LAYERS = 4
DRAFT_VOCAB = 192
AUX_INPUTS = (1, 2, 4)  # states entering target layers 1, 2 and the last layer's output (input of 4)


def write_target(dest: Path, arch: str, seed: int = 0, residual_scale: float = 0.02,
                 layers: int = TARGET_LAYERS) -> Path:
    from tiny_models import build_tiny_model, tiny_tokenizer

    model = build_tiny_model(arch, seed, dtype=torch.float32, num_hidden_layers=layers,
                             vocab_size=300)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj")) or "down_proj" in name:
                p.mul_(residual_scale)
            if name == "lm_head.weight":
                p.mul_(4.0)  # sharper p: greedy choices are stable, sampled ones concentrated
    model.save_pretrained(dest)
    tiny_tokenizer().save_pretrained(dest)
    return Path(dest)


def _target_tensors(target_dir: Path) -> tuple[dict, dict]:
    from hetero_run.runtime.checkpoint import Checkpoint

    ckpt = Checkpoint.open(target_dir)
    names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    return ckpt.config, {n: ckpt.read(n).clone() for n in names}


def head_tensors(target_dir: Path, kind: str = "random", seed: int = 1, draft_vocab: int = DRAFT_VOCAB,
                 heads: int = 4, kv_heads: int = 2, head_dim: int = 16, intermediate: int = 96) -> tuple[dict, dict]:
    """Canonical head tensors (names as in the eagle layout) and the shape facts."""
    config, target = _target_tensors(target_dir)
    h, vocab = config["hidden_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.1):
        return torch.randn(*shape, generator=gen) * std

    if kind == "aligned":
        kv_heads, head_dim = heads, h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    t = {
        "fc.weight": rand(h, 3 * h, std=0.05),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * h), "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h), "midlayer.self_attn.o_proj.weight": rand(h, q),
        "midlayer.mlp.gate_proj.weight": rand(intermediate, h), "midlayer.mlp.up_proj.weight": rand(intermediate, h),
        "midlayer.mlp.down_proj.weight": rand(h, intermediate),
        "midlayer.input_layernorm.weight": 1 + rand(h), "midlayer.hidden_norm.weight": 1 + rand(h),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h), "norm.weight": 1 + rand(h),
    }
    chosen = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # the draft vocabulary
    t["lm_head.weight"] = rand(draft_vocab, h, std=0.5)
    if kind == "aligned":
        eye = torch.eye(h)
        pick = torch.cat([eye, torch.zeros(h, h)], dim=1)  # reads the embedding half of [e; g]
        t["midlayer.self_attn.q_proj.weight"] = 3.0 * pick + rand(h, 2 * h, std=0.01)
        t["midlayer.self_attn.k_proj.weight"] = 3.0 * pick + rand(h, 2 * h, std=0.01)
        t["midlayer.self_attn.v_proj.weight"] = pick + rand(h, 2 * h, std=0.01)
        t["midlayer.self_attn.o_proj.weight"] = eye.clone()
        t["midlayer.mlp.down_proj.weight"] *= 0.02
        t["midlayer.input_layernorm.weight"] = torch.ones(h)
        t["fc.weight"] *= 0.02
        t["norm.weight"] = target["model.norm.weight"].clone()
        t["lm_head.weight"] = target["lm_head.weight"][chosen].clone()
    t["d2t"] = (chosen - torch.arange(draft_vocab)).long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    t["t2d"] = t2d
    shape = dict(hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                 intermediate_size=intermediate, vocab_size=vocab, draft_vocab_size=draft_vocab,
                 rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=10000.0,
                 max_position_embeddings=config.get("max_position_embeddings", 256))
    return t, shape | {"embed": target["model.embed_tokens.weight"]}


def write_head(dest: Path, target_dir: Path, layout: str, kind: str = "random", seed: int = 1,
               aux_inputs: tuple[int, ...] | None = AUX_INPUTS, **overrides) -> Path:
    """A head in `layout` whose aux layers are the states entering target layers `aux_inputs`,
    written in the layout's own numbering (None: the config names no layers)."""
    tensors, shape = head_tensors(target_dir, kind, seed, **overrides)
    embed = shape.pop("embed")
    llama = dict(model_type="llama", hidden_act="silu", num_hidden_layers=1, attention_bias=False,
                 tie_word_embeddings=False, torch_dtype="float32", **shape)
    ids = None if aux_inputs is None else [i - 1 for i in aux_inputs]  # "output of layer i"
    if layout == "eagle":
        config = dict(architectures=["LlamaForCausalLMEagle3"], target_hidden_size=shape["hidden_size"], **llama)
        if ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
        named = tensors
    elif layout == "modelopt":
        config = dict(architectures=["LlamaForCausalLMEagle3"], target_hidden_size=shape["hidden_size"], **llama)
        config["eagle_config"] = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                                  "use_last_layernorm": True}
        if ids is not None:
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        named = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if k != "t2d"}
    elif layout == "vllm":  # speculators format, as vLLM reads it; numbering "input of layer i"
        config = dict(architectures=["Eagle3Speculator"], speculators_model_type="eagle3",
                      transformer_layer_config=dict(architectures=["LlamaForCausalLM"], **llama),
                      draft_vocab_size=shape["draft_vocab_size"], target_hidden_size=shape["hidden_size"],
                      norm_before_residual=False)
        if aux_inputs is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(aux_inputs)
        named = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
        named["embed_tokens.weight"] = embed.clone()  # speculators checkpoints carry the embedding
    else:
        raise ValueError(layout)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in named.items()}, str(dest / "model.safetensors"))
    return dest
