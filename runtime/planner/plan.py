"""The plan: per rank, what the target, the drafter, the KV cache, activations and the runtime
take against the memory of the node the rank runs on; the verdict; the decode roofline.

Ranks fill nodes in order: with R ranks on N nodes each node runs R/N consecutive ranks and
they split its memory (and the memory its OS keeps). The drafter runs on rank 0 only. The KV
cache is counted in blocks: every rank gets the same number (kv.py `kv_cache_blocks`), what
`serve` then allocates. Nothing here reads a weight: checkpoints are planned from their
safetensors headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from hetero_run.runtime.config import BatchingConfig
from hetero_run.runtime.models.config import ARCHITECTURES
from hetero_run.runtime.planner.accounting import (
    RankTensor,
    embedding_row_bytes,
    group_bytes,
    rank_tensors,
    runtime_dtype,
)
from hetero_run.runtime.planner.hardware import GiB, Hardware, hardware_preset
from hetero_run.runtime.planner.inventory import ModelSource, resolve
from hetero_run.runtime.planner.kv import kv_bytes_per_token, kv_cache_blocks
from hetero_run.runtime.planner.memory import Node, RankPlan
from hetero_run.runtime.planner.roofline import Roofline, collectives_per_forward, forward_bytes, forward_cost
from hetero_run.runtime.planner.workspace import Workspace, workspace
from hetero_run.topology.errors import ConfigError, UserError

DEFAULT_CONTEXT = 32768


class DoesNotFit(UserError):
    """A configuration whose plan does not fit; the message is the rendered plan."""

    exit_code = 1

    def __init__(self, plan: Plan):
        self.plan = plan
        super().__init__(plan.render())


@dataclass(frozen=True)
class Plan:
    target: ModelSource
    drafter: ModelSource | None
    nodes: tuple[Node, ...]
    tp: int
    context: int
    batching: BatchingConfig
    dtype: torch.dtype  # dense weights, activations and KV cache
    hardware: Hardware
    ranks: tuple[RankPlan, ...]
    roofline: Roofline
    notes: tuple[str, ...] = field(default=())
    tensors: tuple[RankTensor, ...] = field(default=(), repr=False)  # each target rank's (all alike)
    drafter_tensors: tuple[RankTensor, ...] = field(default=(), repr=False)  # rank 0

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    @property
    def verdict(self) -> str:
        return "FITS" if self.fits else "DOES NOT FIT"

    @property
    def kv_blocks(self) -> int:
        """The KV cache's blocks on every rank."""
        return self.ranks[0].kv_blocks

    @property
    def kv_tokens(self) -> int:
        """The KV cache's slots on every rank: what `serve` gives the loader (`kv_tokens`)."""
        return self.ranks[0].kv_tokens

    @property
    def sequences(self) -> int:
        """Sequences of the full context the KV cache holds at once."""
        return self.ranks[0].sequences

    @property
    def max_num_seqs_fit(self) -> bool:
        """Whether --max-num-seqs sequences of the full context fit at once on every rank."""
        return all(r.max_num_seqs_fit for r in self.ranks)

    @property
    def kv_request_problem(self) -> str | None:
        """Why --kv-cache-tokens cannot be given, when that alone stops the plan from fitting."""
        wanted = self.batching.kv_cache_tokens
        short = [r for r in self.ranks if r.kv_blocks_by_memory < r.kv_blocks]
        if wanted is None or not short or any(r.kv_blocks_by_memory < r.blocks_per_sequence for r in self.ranks):
            return None
        r = min(short, key=lambda r: r.kv_blocks_by_memory)
        return (f"{wanted:,} tokens ({r.kv_blocks:,} blocks of {r.block_size}) do not fit: rank {r.rank} ({r.node}) "
                f"has room for {r.kv_blocks_by_memory:,} blocks ({r.kv_blocks_by_memory * r.block_size:,} tokens) "
                f"besides its weights, drafter and activations")

    @property
    def model_max_context_tokens(self) -> int | None:
        return self.target.shape.max_positions or None

    @property
    def max_context_tokens_by_memory(self) -> int:
        return min(r.max_context_tokens for r in self.ranks)

    @property
    def max_context_tokens(self) -> int:
        """Longest context that fits in memory and that the model takes."""
        limit = self.model_max_context_tokens
        by_memory = self.max_context_tokens_by_memory
        return by_memory if limit is None else min(by_memory, limit)

    def check(self) -> Plan:
        """Raise unless the plan fits; returns the plan. A --kv-cache-tokens the memory cannot
        give is a one-line ConfigError naming it; anything else `DoesNotFit` (a UserError, exit
        status 1, carrying the rendered plan)."""
        if self.fits:
            return self
        problem = self.kv_request_problem
        if problem is not None:
            raise ConfigError(problem, field="kv_cache_tokens")
        raise DoesNotFit(self)

    def summary(self) -> str:
        """One line: verdict, weights and KV per rank, sequences at once, longest context, decode ceiling."""
        worst = min(self.ranks, key=lambda r: r.free_bytes)
        gib = 1 << 30
        return (f"plan: {self.verdict} on TP={self.tp} ({self.hardware.name}): "
                f"{worst.weights_bytes / gib:.2f} GiB weights + {worst.kv_bytes / gib:.2f} GiB KV "
                f"({self.kv_blocks:,} blocks of {self.batching.block_size} = {self.kv_tokens:,} tokens: "
                f"{self.sequences} sequence(s) of {self.context:,}) per rank, {worst.total_bytes / gib:.2f} of "
                f"{worst.capacity_bytes / gib:.2f} GiB on {worst.node}; longest context {self.max_context_tokens:,}; "
                f"decode ceiling {self.roofline.target_tokens_per_s:.1f} tok/s")

    def render(self, width: int = 120) -> str:
        from hetero_run.runtime.planner.report import render_text

        return render_text(self, width)

    def to_json(self, per_tensor: bool = False) -> dict:
        from hetero_run.runtime.planner.report import plan_json

        return plan_json(self, per_tensor=per_tensor)


def make_plan(
    target: str | ModelSource,
    *,
    drafter: str | ModelSource | None = None,
    nodes: Sequence[Node] | None = None,
    tp: int = 1,
    context: int | None = None,
    batching: BatchingConfig | None = None,
    hardware: str | Hardware | None = None,
    dtype: str | torch.dtype = "auto",
    prefill_chunk: int = 512,
    draft_len: int = 3,
    acceptance: float = 0.7,
) -> Plan:
    """Plan `target` (checkpoint directory, GGUF file, preset name or ModelSource) and an
    optional drafter (the same, or `eagle3:DIR`) on `tp` ranks spread over `nodes`.

    Without `nodes`: one node with the hardware profile's memory (`cpu-host`: this machine's).
    `hardware` defaults to `dgx-spark` when nodes are given (a topology) and `cpu-host` without.
    `context` is the tokens one sequence holds (prompt + new tokens); default min(32768, the
    model's max_position_embeddings). `batching`: sequences per step, rows per step, block size
    and KV cache slots (default: `serve`'s, `BatchingConfig()`; `generate` is
    `BatchingConfig.one_sequence(prefill_chunk)`). `dtype` is the loader's: "auto" (bf16, or
    fp32 for fp32 checkpoints), bf16, fp16 or fp32.
    """
    target = resolve(target, role="target") if isinstance(target, str) else target
    if isinstance(drafter, str):
        drafter = resolve(drafter, role="drafter")
    if drafter is not None and drafter.shape.head is not None:
        drafter.shape.head.check_target(target.shape.decoder, drafter.name)
    if not isinstance(hardware, Hardware):
        hardware = hardware_preset(hardware or ("dgx-spark" if nodes else "cpu-host"))
    nodes = tuple(nodes) if nodes else (Node("this machine", hardware.node_memory_bytes()),)
    batching = batching or BatchingConfig()
    dtype = runtime_dtype(target, dtype)
    if context is None:
        context = min(DEFAULT_CONTEXT, target.shape.max_positions or DEFAULT_CONTEXT)
    _validate(tp=tp, nodes=nodes, context=context, prefill_chunk=prefill_chunk, draft_len=draft_len)
    if batching.requested_blocks is not None and batching.requested_blocks < batching.blocks_for(context):
        raise ConfigError(f"{batching.kv_cache_tokens:,} tokens hold less than one sequence of the context "
                          f"({context:,} tokens: {batching.blocks_for(context):,} blocks of {batching.block_size})",
                          field="kv_cache_tokens")

    main = _Part.of(target, tp, dtype)
    # the drafter runs in the target's dtype, whatever its file holds (launch/speculate.load): a head,
    # a fast drafter (converted once: its projections and head in that dtype, or NVFP4, smaller) and a
    # transformers drafter alike
    draft = _Part.of(drafter, 1, dtype) if drafter else None
    seqs = batching.max_num_seqs
    rows = batching.max_num_batched_tokens
    target_ws = dict(rows=rows, logits_rows=min(rows, seqs * (draft_len + 1 if drafter else 1)))
    per_node = tp // len(nodes)
    head_rows, head_per_token = _eagle3_extra(target, drafter, tp, dtype) if drafter else (0, 0)
    ranks = []
    for rank in range(tp):
        node = nodes[rank // per_node]
        first = rank == 0
        ws = main.workspace(gathers_logits=first, **target_ws)
        if first and draft:
            ws = ws + draft.workspace(rows=prefill_chunk, logits_rows=min(prefill_chunk, seqs * draft_len),
                                      gathers_logits=False)
        ranks.append(RankPlan(
            rank=rank, node=node.name, capacity_bytes=node.memory_bytes // per_node, context=context,
            batching=batching, weights_by_group=main.groups, kv_bytes_per_token=main.kv_per_token,
            drafter_weights_bytes=draft.weights_bytes + head_rows if first and draft else 0,
            drafter_kv_bytes_per_token=draft.kv_per_token + head_per_token if first and draft else 0, workspace=ws,
            reserved_bytes=int(hardware.reserved_gib * GiB) // per_node,
            overhead_bytes=int(hardware.runtime_overhead_gib * GiB),
        ))
    blocks = kv_cache_blocks(batching, context, [r.kv_blocks_by_memory for r in ranks])
    ranks = [replace(r, kv_blocks=blocks) for r in ranks]
    roofline = _roofline(main, draft, hardware, tp=tp, per_node=per_node, context=context,
                         draft_len=draft_len, acceptance=acceptance)
    return Plan(target, drafter, nodes, tp, context, batching, dtype, hardware, tuple(ranks), roofline,
                _notes(target, context), tuple(main.tensors), tuple(draft.tensors) if draft else ())


@dataclass(frozen=True)
class _Part:
    """The target's shard on one rank, or the drafter on rank 0."""

    source: ModelSource
    tp: int
    tensors: list[RankTensor]
    groups: dict[str, int]
    kv_per_token: int
    dtype: torch.dtype

    @classmethod
    def of(cls, source: ModelSource, tp: int, dtype: torch.dtype) -> _Part:
        tensors = rank_tensors(source, tp, dtype)
        return cls(source, tp, tensors, group_bytes(tensors), kv_bytes_per_token(source.shape, tp, dtype), dtype)

    @property
    def weights_bytes(self) -> int:
        return sum(self.groups.values())

    @property
    def tied(self) -> bool:
        return "lm_head" not in self.groups

    @property
    def paged(self) -> bool:
        """Whether it runs on the runtime's own decoder (paged attention): targets and drafters of
        its architectures; an EAGLE-3 head or a transformers drafter masks its attention."""
        shape = self.source.shape
        return not shape.eagle3 and shape.model_type in ARCHITECTURES

    def workspace(self, *, rows: int, logits_rows: int, gathers_logits: bool) -> Workspace:
        return workspace(self.source.shape, self.tensors, tp=self.tp, rows=rows, logits_rows=logits_rows,
                         act_dtype=self.dtype, gathers_logits=gathers_logits, paged=self.paged)

    def forward_bytes(self, tokens: int, context: int, shared_routing: bool = False,
                      skip: tuple[str, ...] = ()) -> int:
        """One sequence's forward of `tokens` tokens over `context` tokens of KV cache."""
        row = embedding_row_bytes(self.tensors)
        return forward_bytes(self.groups, self.source.shape, tokens=tokens, batch=1, context=context,
                             kv_bytes_per_token=self.kv_per_token, embedding_row_bytes=row, skip=skip,
                             shared_routing=shared_routing, tied=self.tied)


def _roofline(main: _Part, draft: _Part | None, hardware: Hardware, *, tp: int, per_node: int, context: int,
              draft_len: int, acceptance: float) -> Roofline:
    collectives = collectives_per_forward(main.source.shape, tp)

    def target(tokens: int, shared_routing: bool = False):
        per_rank = main.forward_bytes(tokens, context, shared_routing)
        return forward_cost([per_rank] * tp, collectives, hardware, tokens, per_node)

    if draft is None:
        return Roofline(hardware, 1, context, target(1))
    # EAGLE-3 fuses the target features (fc) once per round; later steps reuse its output
    step = forward_cost([draft.forward_bytes(1, context, skip=("fc",))], 0, hardware, 1)
    return Roofline(hardware, 1, context, target(1), verify=target(draft_len + 1),
                    verify_shared=target(draft_len + 1, shared_routing=True), draft_step=step,
                    draft_round_extra_s=draft.groups.get("fc", 0) / hardware.bandwidth_bytes_per_s,
                    acceptance=acceptance, draft_len=draft_len)


def _eagle3_extra(target: ModelSource, drafter: ModelSource, tp: int, dtype: torch.dtype) -> tuple[int, int]:
    """What an EAGLE-3 head adds on rank 0 beyond its own tensors: (bytes, bytes per context token).

    A head without an embedding of its own embeds through the target's; at TP > 1 rank 0 holds
    only vocab / tp rows of it, so it reads the other rows once. The target states it reads
    are kept fused (hidden wide, in the target's dtype) for every position of the sequence.
    """
    if not drafter.shape.eagle3:
        return 0, 0
    own = any(name.endswith("embed_tokens.weight") for name in drafter.tensors)
    rows = 0 if own else (target.shape.vocab_size - target.shape.vocab_size // tp) * target.shape.hidden_size
    return rows * dtype.itemsize, drafter.shape.hidden_size * dtype.itemsize


def _notes(target: ModelSource, context: int) -> tuple[str, ...]:
    notes = []
    if target.kind == "gguf":
        notes.append(f"loading first dequantises the whole GGUF model to float32 on every rank: "
                     f"{target.total_bytes / GiB:.2f} GiB per rank for a moment")
    if target.shape.max_positions and context > target.shape.max_positions:
        notes.append(f"context {context:,} exceeds the model's max_position_embeddings "
                     f"{target.shape.max_positions:,}")
    return tuple(notes)


def _validate(*, tp: int, nodes: tuple[Node, ...], context: int, prefill_chunk: int, draft_len: int) -> None:
    for name, value in (("tensor_parallel_size", tp), ("context", context), ("prefill_chunk", prefill_chunk),
                        ("draft_len", draft_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"must be an integer >= 1, got {value!r}", field=name)
    if tp % len(nodes):
        raise ConfigError(f"{tp} ranks do not spread evenly over {len(nodes)} nodes", field="tensor_parallel_size")
