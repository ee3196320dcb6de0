"""The plan: per rank, what the target, the drafter, the KV cache, activations and the runtime
take against the memory of the node the rank runs on; the verdict; the decode roofline.

Ranks fill nodes in order: with R ranks on N nodes each node runs R/N consecutive ranks and
they split its memory (and the memory its OS keeps). The drafter runs on rank 0 only.
Nothing here reads a weight: checkpoints are planned from their safetensors headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hetero_run.runtime.planner.accounting import (
    RankTensor,
    embedding_row_bytes,
    group_bytes,
    rank_tensors,
    runtime_dtype,
)
from hetero_run.runtime.planner.hardware import GiB, Hardware, hardware_preset
from hetero_run.runtime.planner.inventory import ModelSource, resolve
from hetero_run.runtime.planner.kv import kv_bytes_per_token
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
    batch: int
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
        """Raise `DoesNotFit` (a UserError, exit status 1, carrying the rendered plan) unless
        the plan fits; returns the plan."""
        if not self.fits:
            raise DoesNotFit(self)
        return self

    def summary(self) -> str:
        """One line: verdict, weights and KV per rank, longest context, decode ceiling."""
        worst = min(self.ranks, key=lambda r: r.free_bytes)
        gib = 1 << 30
        return (f"plan: {self.verdict} on TP={self.tp} ({self.hardware.name}): "
                f"{worst.weights_bytes / gib:.2f} GiB weights + {worst.kv_bytes / gib:.2f} GiB KV "
                f"({self.context:,} tokens) per rank, {worst.total_bytes / gib:.2f} of "
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
    batch: int = 1,
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
    `context` is the tokens each sequence's KV cache holds (prompt + new tokens); default
    min(32768, the model's max_position_embeddings). `dtype` is the loader's: "auto" (bf16,
    or fp32 for fp32 checkpoints), bf16, fp16 or fp32.
    """
    target = resolve(target, role="target") if isinstance(target, str) else target
    if isinstance(drafter, str):
        drafter = resolve(drafter, role="drafter")
    if not isinstance(hardware, Hardware):
        hardware = hardware_preset(hardware or ("dgx-spark" if nodes else "cpu-host"))
    nodes = tuple(nodes) if nodes else (Node("this machine", hardware.node_memory_bytes()),)
    dtype = runtime_dtype(target, dtype)
    if context is None:
        context = min(DEFAULT_CONTEXT, target.shape.max_positions or DEFAULT_CONTEXT)
    _validate(tp=tp, nodes=nodes, context=context, batch=batch, prefill_chunk=prefill_chunk, draft_len=draft_len)

    shape = dict(batch=batch, chunk=prefill_chunk)
    main = _Part.of(target, tp, dtype, logits_tokens=draft_len + 1 if drafter else 1, **shape)
    draft_dtype = (dtype if drafter.shape.eagle3 else runtime_dtype(drafter)) if drafter else None  # a head runs in
    draft = _Part.of(drafter, 1, draft_dtype, logits_tokens=draft_len, **shape) if drafter else None  # the target's
    per_node = tp // len(nodes)
    head_rows, head_per_token = _eagle3_extra(target, drafter, tp, dtype) if drafter else (0, 0)
    ranks = []
    for rank in range(tp):
        node = nodes[rank // per_node]
        first = rank == 0
        ws = main.workspace(gathers_logits=first)
        if first and draft:
            ws = ws + draft.workspace(gathers_logits=False)
        ranks.append(RankPlan(
            rank=rank, node=node.name, capacity_bytes=node.memory_bytes // per_node, context=context, batch=batch,
            weights_by_group=main.groups, kv_bytes_per_token=main.kv_per_token,
            drafter_weights_bytes=draft.weights_bytes + head_rows if first and draft else 0,
            drafter_kv_bytes_per_token=draft.kv_per_token + head_per_token if first and draft else 0, workspace=ws,
            reserved_bytes=int(hardware.reserved_gib * GiB) // per_node,
            overhead_bytes=int(hardware.runtime_overhead_gib * GiB),
        ))
    roofline = _roofline(main, draft, hardware, tp=tp, per_node=per_node, context=context,
                         draft_len=draft_len, acceptance=acceptance)
    return Plan(target, drafter, nodes, tp, context, batch, dtype, hardware, tuple(ranks), roofline,
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
    batch: int
    chunk: int
    logits_tokens: int

    @classmethod
    def of(cls, source: ModelSource, tp: int, dtype: torch.dtype, **kw) -> _Part:
        tensors = rank_tensors(source, tp, dtype)
        return cls(source, tp, tensors, group_bytes(tensors), kv_bytes_per_token(source.shape, tp, dtype), dtype,
                   **kw)

    @property
    def weights_bytes(self) -> int:
        return sum(self.groups.values())

    @property
    def tied(self) -> bool:
        return "lm_head" not in self.groups

    def workspace(self, gathers_logits: bool) -> Workspace:
        return workspace(self.source.shape, self.tensors, tp=self.tp, batch=self.batch, chunk=self.chunk,
                         logits_tokens=self.logits_tokens, act_dtype=self.dtype, gathers_logits=gathers_logits)

    def forward_bytes(self, tokens: int, context: int, shared_routing: bool = False,
                      skip: tuple[str, ...] = ()) -> int:
        row = embedding_row_bytes(self.tensors)
        return forward_bytes(self.groups, self.source.shape, tokens=tokens, batch=self.batch, context=context,
                             kv_bytes_per_token=self.kv_per_token, embedding_row_bytes=row, skip=skip,
                             shared_routing=shared_routing, tied=self.tied)


def _roofline(main: _Part, draft: _Part | None, hardware: Hardware, *, tp: int, per_node: int, context: int,
              draft_len: int, acceptance: float) -> Roofline:
    collectives = collectives_per_forward(main.source.shape, tp)

    def target(tokens: int, shared_routing: bool = False):
        per_rank = main.forward_bytes(tokens, context, shared_routing)
        return forward_cost([per_rank] * tp, collectives, hardware, tokens, per_node)

    if draft is None:
        return Roofline(hardware, main.batch, context, target(1))
    # EAGLE-3 fuses the target features (fc) once per round; later steps reuse its output
    step = forward_cost([draft.forward_bytes(1, context, skip=("fc",))], 0, hardware, 1)
    return Roofline(hardware, main.batch, context, target(1), verify=target(draft_len + 1),
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


def _validate(*, tp: int, nodes: tuple[Node, ...], context: int, batch: int, prefill_chunk: int,
              draft_len: int) -> None:
    for name, value in (("tensor_parallel_size", tp), ("context", context), ("batch", batch),
                        ("prefill_chunk", prefill_chunk), ("draft_len", draft_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"must be an integer >= 1, got {value!r}", field=name)
    if tp % len(nodes):
        raise ConfigError(f"{tp} ranks do not spread evenly over {len(nodes)} nodes", field="tensor_parallel_size")
