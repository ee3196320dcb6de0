"""Build this rank's shard of a target model, reading only this rank's slices of the weights.

Sources: a checkpoint directory (bf16 / fp32 / ModelOpt NVFP4 safetensors), a GGUF file
(dequantised by transformers into an in-memory model first), or an in-memory Hugging Face
model or state dict (`TensorSource`), e.g. a same-architecture drafter run at TP size 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from hetero_run.runtime.checkpoint import Checkpoint, CheckpointError, TensorMeta, slice_span
from hetero_run.runtime.models.attention import Attention
from hetero_run.runtime.models.balance import balance, even_rows, return_freed_memory
from hetero_run.runtime.models.config import ModelConfig
from hetero_run.runtime.models.decoder import DecoderLayer, TargetModel
from hetero_run.runtime.models.embedding import ParallelLMHead, VocabParallelEmbedding
from hetero_run.runtime.models.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from hetero_run.runtime.models.linear import ColumnParallelLinear, RowParallelLinear
from hetero_run.runtime.models.mlp import GatedMLP
from hetero_run.runtime.models.moe import Expert, SparseMoE
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.runtime.models.rotary import Rotary
from hetero_run.runtime.weights import DenseWeight, concat_out, load_linear
from hetero_run.topology.errors import ConfigError

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


class TensorSource(Checkpoint):
    """A `Checkpoint` over in-memory tensors (a transformers model's state dict): the same
    `config`, `quant` (None), `has`, `meta`, `expect` and `read(name, dim=, part=)`."""

    def __init__(self, config: dict, named: dict[str, torch.Tensor], path: str | Path = "<in-memory model>"):
        named = _split_fused_experts(named)
        path = Path(path)
        metas = {n: TensorMeta(n, t.dtype, tuple(t.shape), path) for n, t in named.items()}
        super().__init__(path, config, None, metas)
        self.named = named

    @classmethod
    def from_module(cls, model) -> TensorSource:
        """From a transformers model (`model.config`, `model.state_dict()`)."""
        config = model.config.to_dict()
        return cls(config, dict(model.state_dict()), f"<in-memory {config.get('model_type')} model>")

    def read(self, name: str, dim: int | None = None, part: tuple[int, int] | None = None,
             span: tuple[int, int] | None = None) -> torch.Tensor:
        t = self.named[self.meta(name).name]
        span = slice_span(name, tuple(t.shape), dim, part, span, self.path)
        if span is not None:
            t = t.narrow(dim, span[0], span[1] - span[0])
        t = t.detach().contiguous()
        self.bytes_read += t.nbytes
        return t


def _split_fused_experts(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 keeps a MoE layer's experts as 3-D `experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I]; checkpoints name them per expert. Views, no copies."""
    out = {}
    for name, t in named.items():
        if name.endswith(".experts.gate_up_proj") and t.dim() == 3:
            base, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{base}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith(".experts.down_proj") and t.dim() == 3:
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


class OwnedReads:
    """A checkpoint whose reads own their memory.

    Checkpoint.read returns views of the memory-mapped file; a weight kept as such a view
    keeps every page it touched resident (a row-parallel slice touches the whole tensor), and
    fused weights would hold both the copy and the mapped original. Each read here is copied
    and the file closed right after it, so at any moment at most one tensor (or one piece of a
    large one) is mapped besides the weights already built: the load's peak stays near the
    weights' total.
    """

    piece_bytes = 16 << 20  # big row-wise reads (embedding, lm_head) go in pieces of about this size

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def __getattr__(self, name: str):  # everything but read: the checkpoint's own
        return getattr(self.ckpt, name)

    def read(self, name: str, dim: int | None = None, part: tuple[int, int] | None = None,
             span: tuple[int, int] | None = None) -> torch.Tensor:
        meta = self.ckpt.meta(name)
        if dim not in (None, 0):
            return self._owned(name, dim=dim, part=part, span=span)
        if not meta.shape:
            return self._owned(name)
        start, stop = slice_span(name, meta.shape, 0, part, span, meta.file) or (0, meta.shape[0])
        rows = stop - start
        step = max(1, self.piece_bytes * meta.shape[0] // max(meta.nbytes, 1))  # rows per piece
        if rows <= step:
            return self._owned(name, dim=0, span=(start, stop))
        out = torch.empty((rows, *meta.shape[1:]), dtype=meta.dtype)
        for first in range(start, stop, step):  # e.g. rank 1's half of the embedding, 16 MiB at a time
            last = min(stop, first + step)
            out[first - start:last - start] = self.ckpt.read(name, dim=0, span=(first, last))
            self.ckpt.close()
        return out

    def _owned(self, name: str, **where) -> torch.Tensor:
        t = self.ckpt.read(name, **where).clone(memory_format=torch.contiguous_format)
        self.ckpt.close()
        return t


def open_source(source) -> Checkpoint:
    """A checkpoint directory, a .gguf file, a transformers model, or an already open source."""
    if isinstance(source, Checkpoint):
        return source
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.suffix == ".gguf":
            return _gguf_source(path)
        return Checkpoint.open(path)
    if hasattr(source, "state_dict") and hasattr(source, "config"):
        return TensorSource.from_module(source)
    raise TypeError(f"cannot load a model from {type(source).__name__}")


def _gguf_source(path: Path) -> TensorSource:
    if not path.is_file():
        raise CheckpointError("GGUF file not found", file=path)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as exc:
        raise CheckpointError(f"cannot load GGUF: {str(exc).splitlines()[0]}", file=path) from None
    return TensorSource(model.config.to_dict(), dict(model.state_dict()), path)


def resolve_dtype(dtype: str | torch.dtype, src: Checkpoint) -> torch.dtype:
    """"auto": float32 for float32 weights, else bfloat16 (NVFP4 runs with bf16 activations)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ConfigError(f"expected auto, bf16, fp16 or fp32, got {dtype!r}", field="dtype")
        return DTYPES[dtype]
    if src.quant is not None:
        return torch.bfloat16
    name = "model.embed_tokens.weight"
    stored = src.meta(name).dtype if src.has(name) else torch.bfloat16
    return torch.float32 if stored == torch.float32 else torch.bfloat16


def kv_head_split(num_kv_heads: int, ctx: ParallelContext) -> tuple[int, int, int]:
    """(part index, part count, KV heads per rank). Fewer KV heads than ranks: each rank keeps
    the one KV head its query heads read, e.g. 2 KV heads at TP=4: ranks 0, 1 -> head 0."""
    if num_kv_heads % ctx.size == 0:
        return ctx.rank, ctx.size, num_kv_heads // ctx.size
    if ctx.size % num_kv_heads == 0:
        return ctx.rank // (ctx.size // num_kv_heads), num_kv_heads, 1
    raise ConfigError(f"{num_kv_heads} KV heads cannot be split or replicated over {ctx.size} ranks",
                      field="tensor_parallel")


DEFAULT_CONTEXT = 32768


EMBEDDING_SPLITS = ("even", "balanced")


def load_model(source, ctx: ParallelContext | None = None, *, max_tokens: int | None = None,
               dtype: str | torch.dtype = "auto", prefill_chunk: int = 512,
               embedding_split: str | Sequence[int] = "even", pending_bytes: int = 0,
               kv_tokens: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> TargetModel:
    """This rank's `TargetModel`: sequences of up to `max_tokens` tokens (default
    min(32768, the model's max_position_embeddings)), a paged KV cache of `kv_tokens` slots
    (default max_tokens: one full-length sequence) in blocks of `block_size`.

    `embedding_split`: the embedding rows each rank holds, in rank order: "even", explicit
    counts, or "balanced" (untied embeddings at TP > 1; a collective): the ranks compare the
    memory each holds now plus `pending_bytes` (what it will load besides the target, e.g.
    rank 0's drafter), and the fuller ones hold fewer rows (embedding.py). Rows of the head
    are always split evenly.
    """
    ctx = ctx or ParallelContext.single()
    src = open_source(source)
    where = src.path if isinstance(src, TensorSource) else src.path / "config.json"
    config = ModelConfig.from_hf(src.config, source=str(where))
    if max_tokens is None:
        max_tokens = min(DEFAULT_CONTEXT, config.max_positions)
    reads = src if isinstance(src, TensorSource) else OwnedReads(src)  # in-memory tensors are shared, not copied
    try:
        run_dtype = resolve_dtype(dtype, src)
        rows = _embedding_rows(embedding_split, config, src, ctx, run_dtype, pending_bytes)
        return _Builder(reads, config, ctx, run_dtype, rows).model(max_tokens, prefill_chunk, kv_tokens or max_tokens,
                                                                   block_size)
    finally:
        src.close()
        return_freed_memory()


def _tied(config: ModelConfig, src: Checkpoint) -> bool:
    return config.tie_word_embeddings or not src.has("lm_head.weight")


def _embedding_rows(split: str | Sequence[int], config: ModelConfig, src: Checkpoint, ctx: ParallelContext,
                    dtype: torch.dtype, pending_bytes: int) -> list[int]:
    vocab = config.vocab_size
    if isinstance(split, str):
        if split not in EMBEDDING_SPLITS:
            raise ConfigError(f"expected {' or '.join(EMBEDDING_SPLITS)} or row counts, got {split!r}",
                              field="embedding_split")
        if split == "even" or ctx.size == 1 or _tied(config, src):
            return even_rows(vocab, ctx.size)
        return balance(ctx, vocab, config.hidden_size * dtype.itemsize, pending_bytes)
    rows = [int(r) for r in split]
    if len(rows) != ctx.size or sum(rows) != vocab or min(rows) < 0:
        raise ConfigError(f"needs {ctx.size} non-negative row counts summing to vocab_size {vocab}, got {rows}",
                          field="embedding_split")
    if rows != even_rows(vocab, ctx.size) and _tied(config, src):
        raise ConfigError("a tied lm_head shares the embedding, whose rows are then split evenly",
                          field="embedding_split")
    return rows


class _Builder:
    def __init__(self, src, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, embedding_rows: list[int]):
        self.src, self.cfg, self.ctx, self.dtype = src, config, ctx, dtype
        self.heads = ctx.split(config.num_heads, "num_attention_heads")
        self.kv_part, self.kv_parts, self.kv_heads = kv_head_split(config.num_kv_heads, ctx)
        ctx.split(config.vocab_size, "vocab_size")
        first = sum(embedding_rows[:ctx.rank])
        self.embedding_span = (first, first + embedding_rows[ctx.rank])  # this rank's rows of the embedding
        self.col = (0, ctx.rank, ctx.size)  # output rows of a column-parallel weight
        self.row = (1, ctx.rank, ctx.size)  # input columns of a row-parallel weight

    def tensor(self, name: str, shape: tuple[int, ...], shard: tuple[int, int, int] | None = None,
               rows: tuple[int, int] | None = None) -> torch.Tensor:
        """A norm, bias or embedding (its full `shape` is checked), this rank's part of it, or
        the `rows` [start, stop) of it."""
        self.src.expect(name, shape=shape)
        if rows is not None:
            t = self.src.read(name, dim=0, span=rows)
        elif shard is None:
            t = self.src.read(name)
        else:
            t = self.src.read(name, dim=shard[0], part=shard[1:])
        return t.to(device=self.ctx.device, dtype=self.dtype).contiguous()

    def linear(self, prefix: str, shape: tuple[int, int], shard):
        weight = load_linear(self.src, prefix, shard=shard, dtype=self.dtype, shape=shape)
        return weight if self.ctx.device.type == "cpu" else weight.to(self.ctx.device)

    def model(self, max_tokens: int, prefill_chunk: int, kv_tokens: int, block_size: int) -> TargetModel:
        cfg, ctx, hidden = self.cfg, self.ctx, self.cfg.hidden_size
        kv = KVCache(cfg.num_layers, self.kv_heads, cfg.head_dim, kv_tokens, self.dtype, ctx.device, block_size)
        rotary = Rotary(cfg.rope, cfg.head_dim, max_tokens, self.dtype, ctx.device)
        embed = self.tensor("model.embed_tokens.weight", (cfg.vocab_size, hidden), rows=self.embedding_span)
        embed = VocabParallelEmbedding(embed, ctx, first=self.embedding_span[0])
        layers = []
        for i in range(cfg.num_layers):
            layers.append(self.layer(i, kv, rotary))
            return_freed_memory()  # the layer's transient copies (parts of fused weights): the peak stays low
        norm = self.tensor("model.norm.weight", (hidden,))
        tied = _tied(cfg, self.src)
        head = DenseWeight(embed.weight) if tied else self.linear("lm_head", (cfg.vocab_size, hidden), self.col)
        return TargetModel(cfg, ctx, embed, layers, norm, ParallelLMHead(head, ctx, tied), kv, rotary, self.dtype,
                           prefill_chunk, context=max_tokens)

    def layer(self, i: int, kv: KVCache, rotary: Rotary) -> DecoderLayer:
        cfg, p, hidden = self.cfg, f"model.layers.{i}", (self.cfg.hidden_size,)
        mlp = self.moe(f"{p}.mlp") if cfg.is_sparse(i) else self.mlp(f"{p}.mlp", cfg.intermediate_size)
        return DecoderLayer(self.tensor(f"{p}.input_layernorm.weight", hidden),
                            self.attention(f"{p}.self_attn", i, kv, rotary),
                            self.tensor(f"{p}.post_attention_layernorm.weight", hidden), mlp, cfg.rms_norm_eps)

    def attention(self, p: str, i: int, kv: KVCache, rotary: Rotary) -> Attention:
        cfg, hidden = self.cfg, self.cfg.hidden_size
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        kv_shard = (0, self.kv_part, self.kv_parts)
        qkv = concat_out([self.linear(f"{p}.q_proj", (q_out, hidden), self.col),
                          self.linear(f"{p}.k_proj", (kv_out, hidden), kv_shard),
                          self.linear(f"{p}.v_proj", (kv_out, hidden), kv_shard)])
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([self.tensor(f"{p}.q_proj.bias", (q_out,), self.col),
                              self.tensor(f"{p}.k_proj.bias", (kv_out,), kv_shard),
                              self.tensor(f"{p}.v_proj.bias", (kv_out,), kv_shard)])
        o = self.linear(f"{p}.o_proj", (hidden, q_out), self.row)
        o_bias = self.tensor(f"{p}.o_proj.bias", (hidden,)) if cfg.o_bias else None
        q_norm = k_norm = None
        if cfg.qk_norm:
            q_norm = self.tensor(f"{p}.q_norm.weight", (cfg.head_dim,))
            k_norm = self.tensor(f"{p}.k_norm.weight", (cfg.head_dim,))
        return Attention(ColumnParallelLinear(qkv, bias), RowParallelLinear(o, self.ctx, o_bias), rotary, self.heads,
                         self.kv_heads, cfg.head_dim, kv.k[i], kv.v[i], q_norm, k_norm, cfg.rms_norm_eps)

    def mlp(self, p: str, intermediate: int) -> GatedMLP:
        hidden = self.cfg.hidden_size
        self.ctx.split(intermediate, "intermediate_size")
        gate_up = concat_out([self.linear(f"{p}.gate_proj", (intermediate, hidden), self.col),
                              self.linear(f"{p}.up_proj", (intermediate, hidden), self.col)])
        bias = down_bias = None
        if self.cfg.mlp_bias:
            bias = torch.cat([self.tensor(f"{p}.gate_proj.bias", (intermediate,), self.col),
                              self.tensor(f"{p}.up_proj.bias", (intermediate,), self.col)])
            down_bias = self.tensor(f"{p}.down_proj.bias", (hidden,))
        down = self.linear(f"{p}.down_proj", (hidden, intermediate), self.row)
        return GatedMLP(ColumnParallelLinear(gate_up, bias), RowParallelLinear(down, self.ctx, down_bias))

    def moe(self, p: str) -> SparseMoE:
        cfg, hidden, inter = self.cfg, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        self.ctx.split(inter, "moe_intermediate_size")
        experts = []
        for e in range(cfg.num_experts):
            q = f"{p}.experts.{e}"
            gate_up = concat_out([self.linear(f"{q}.gate_proj", (inter, hidden), self.col),
                                  self.linear(f"{q}.up_proj", (inter, hidden), self.col)])
            experts.append(Expert(gate_up, self.linear(f"{q}.down_proj", (hidden, inter), self.row)))
        router = self.tensor(f"{p}.gate.weight", (cfg.num_experts, hidden))
        return SparseMoE(router, experts, cfg.experts_per_token, cfg.norm_topk_prob, self.ctx)
