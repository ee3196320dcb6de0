"""Tiny models of the four target architectures, as bf16 or real ModelOpt NVFP4 checkpoints.

    from tiny_models import tiny_checkpoint, reference_model
    path = tiny_checkpoint("qwen3_moe", "nvfp4")     # exported once per test process, then cached
    ref = reference_model(path)                      # transformers model with the checkpoint's exact
                                                     # weights (NVFP4 dequantised), float32
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")   # a llama GGUF file (float32) with the same tokenizer
Everything is deterministic for a given seed; shapes split evenly at TP=2 (heads 4, kv heads 2,
hidden 64, intermediate 128, moe_intermediate 32, vocab 320), and the tokenizer is a byte-level
BPE trained here (300 tokens, so the embedding is padded as Qwen's is).
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import torch

ARCHITECTURES = ("qwen3_moe", "qwen3", "qwen2", "llama")
_CLASS_NAMES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}
TOKENIZER_VOCAB = 300
_BASE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
    tie_word_embeddings=False, rms_norm_eps=1e-6,
)
_EXTRA = {
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      norm_topk_prob=True),
    "qwen3": {},
    "qwen2": {},
    "llama": dict(attention_bias=False, mlp_bias=False),
}
TRAINING_TEXTS = (
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "The cat sat on the mat. The dog sat on the log.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n"
    "    def push(self, x):\n        self.items.append(x)\n",
    "Hello, world! Numbers: 0 1 2 3 4 5 6 7 8 9. Symbols: ()[]{}<>=+-*/",
)

_root: Path | None = None
_cache: dict[tuple, Path] = {}


def tiny_config(arch: str, **overrides):
    """A transformers config for `arch` (one of ARCHITECTURES), `overrides` applied last."""
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    config = AutoConfig.for_model(arch, **{**_BASE, **_EXTRA[arch], **overrides})
    config.architectures = [_CLASS_NAMES[arch]]
    return config


def tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE tokenizer trained on TRAINING_TEXTS (deterministic), as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXTS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def build_tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides):
    """A randomly initialised transformers causal LM (seeded), in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=dtype)
    return model.eval()


def save_tiny_checkpoint(arch: str, dest: str | Path, quant: str = "nvfp4", seed: int = 0,
                         max_shard_size: str = "5GB", **overrides) -> Path:
    """Write a tiny model + tokenizer to `dest`: bf16 safetensors, or NVFP4 through real ModelOpt
    (the same code path as `hetero-run convert`). A small `max_shard_size` (e.g. "40KB") gives a
    sharded checkpoint with an index."""
    from hetero_run.runtime.convert import save_converted

    model = build_tiny_model(arch, seed, **overrides)
    save_converted(model, tiny_tokenizer(), Path(dest), quant, max_shard_size=max_shard_size)
    return Path(dest)


def tiny_checkpoint(arch: str, quant: str = "nvfp4", seed: int = 0, **overrides) -> Path:
    """Like save_tiny_checkpoint, cached for the test process (treat the directory as read-only)."""
    key = (arch, quant, seed, tuple(sorted(overrides.items())))
    if key not in _cache:
        name = f"{arch}-{quant}-{seed}-{len(_cache)}"
        _cache[key] = save_tiny_checkpoint(arch, _temp_root() / name, quant, seed, **overrides)
    return _cache[key]


def reference_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The transformers model a checkpoint stands for, in `dtype`: NVFP4 weights dequantised with
    the bit-exact reference, everything else as stored. Use it as the ground truth for the
    project's own models (same weights, plain transformers forward)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from hetero_run.kernels import nvfp4
    from hetero_run.runtime.checkpoint import Checkpoint

    ckpt = Checkpoint.open(path)
    state = {}
    for name in ckpt.tensors:
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")):
            continue
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and ckpt.has(f"{prefix}.weight_scale"):
            state[name] = nvfp4.dequantize(ckpt.read(name), ckpt.read(f"{prefix}.weight_scale"),
                                           ckpt.read(f"{prefix}.weight_scale_2"), dtype)
        else:
            state[name] = ckpt.read(name).to(dtype)
    config = dict(ckpt.config)
    config.pop("quantization_config", None)
    with tempfile.TemporaryDirectory(prefix="hetero-run-ref-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        save_file(state, str(Path(tmp) / "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype)
    return model.eval()


def write_tiny_gguf(dest: str | Path, seed: int = 0) -> Path:
    """A tiny llama-architecture GGUF file (float32 tensors, tiny_tokenizer() as its gpt2-style
    tokenizer) that transformers loads with `from_pretrained(dir, gguf_file=name)`."""
    import gguf
    import numpy as np

    cfg = tiny_config("llama")
    hidden, inter, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    state = json.loads(tiny_tokenizer().backend_tokenizer.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    tokens += [f"<|pad{i}|>" for i in range(vocab - len(tokens))]
    writer = gguf.GGUFWriter(str(dest), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * vocab)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in state["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    rng = np.random.default_rng(seed)

    def tensor(name, shape):
        writer.add_tensor(name, (rng.standard_normal(shape) * cfg.initializer_range).astype(np.float32))

    tensor("token_embd.weight", (vocab, hidden))
    tensor("output_norm.weight", (hidden,))
    tensor("output.weight", (vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", (hidden,))
        tensor(p + "ffn_norm.weight", (hidden,))
        tensor(p + "attn_q.weight", (heads * head_dim, hidden))
        tensor(p + "attn_k.weight", (kv_heads * head_dim, hidden))
        tensor(p + "attn_v.weight", (kv_heads * head_dim, hidden))
        tensor(p + "attn_output.weight", (hidden, heads * head_dim))
        tensor(p + "ffn_gate.weight", (inter, hidden))
        tensor(p + "ffn_up.weight", (inter, hidden))
        tensor(p + "ffn_down.weight", (hidden, inter))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dest)


def _temp_root() -> Path:
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="hetero-run-tiny-"))
        atexit.register(shutil.rmtree, _root, True)
    return _root
