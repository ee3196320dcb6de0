"""A GGUF file's metadata and tensor table, without reading its tensors or building its
vocabulary (the `gguf` package's reader parses every token string: seconds per file).

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; metadata entries (string key, u32 type, value); tensor infos (string name, u32 dims,
u64 per dim, innermost first, u32 type, u64 offset). Strings are u64 length + UTF-8 bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from hetero_run.runtime.checkpoint import CheckpointError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict  # scalars and strings; arrays as their length only (`<key>.len`)
    tensors: dict[str, tuple[int, ...]]  # name -> shape, outermost first (as torch sees it)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read GGUF header: {exc}", file=path) from None
    except (struct.error, IndexError, UnicodeDecodeError):
        raise CheckpointError("truncated or corrupted GGUF header", file=path) from None


def _parse(buf, path: Path) -> GGUFHeader:
    if buf[:4] != b"GGUF":
        raise CheckpointError("not a GGUF file (no GGUF magic)", file=path)
    version, n_tensors, n_meta = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise CheckpointError(f"GGUF version {version} is not supported (2 or 3)", file=path)
    pos = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8: at + 8 + n]).decode("utf-8"), at + 8 + n

    def value(kind: int, at: int):
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)
        if kind == _STRING:
            return string(at)
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALARS:
                return count, at + count * struct.calcsize(_SCALARS[item])
            for _ in range(count):
                _, at = value(item, at)
            return count, at
        raise CheckpointError(f"unknown GGUF metadata type {kind}", file=path)

    metadata = {}
    for _ in range(n_meta):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        found, pos = value(kind, pos + 4)
        metadata[f"{key}.len" if kind == _ARRAY else key] = found
    tensors = {}
    for _ in range(n_tensors):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
        pos += 4 + 8 * dims + 4 + 8
        tensors[name] = tuple(reversed(shape))
    return GGUFHeader(metadata, tensors)


# GGUF architecture -> Hugging Face model_type, for the architectures the runtime runs
_MODEL_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "llama": "llama"}


def hf_config(header: GGUFHeader, path: Path) -> dict:
    """The config.json transformers derives from a GGUF file (the fields the planner needs)."""
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch is None:
        raise CheckpointError("no general.architecture in the GGUF metadata", file=path)

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    embed = header.tensors.get("token_embd.weight")
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    if embed is None or heads is None or hidden is None or get("block_count") is None:
        raise CheckpointError(f"GGUF metadata lacks the {arch} shape (block_count, embedding_length, "
                              "attention.head_count, token_embd.weight)", file=path)
    config = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": embed[0],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "intermediate_size": get("feed_forward_length", 0),
        "max_position_embeddings": get("context_length", 0),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "attention_bias": "blk.0.attn_q.bias" in header.tensors and arch == "llama",
        "torch_dtype": "float32",
    }
    if get("expert_count"):
        config.update(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                      moe_intermediate_size=get("expert_feed_forward_length"), decoder_sparse_step=1,
                      norm_topk_prob=True)
    return config
