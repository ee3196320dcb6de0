"""The plan as tables (rich) or as one JSON object."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from hetero_run.runtime.planner.plan import Plan

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10
GROUP_ORDER = ("attention", "experts", "mlp", "router", "norms", "embedding", "lm_head", "fc", "vocab_map", "other")


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _small(n: int) -> str:
    return f"{n / MiB:.2f} MiB" if n >= MiB else f"{n / KiB:.1f} KiB"


def _source_json(source) -> dict | None:
    if source is None:
        return None
    return {"name": source.name, "kind": source.kind, "format": source.format,
            "model_type": "eagle3" if source.shape.eagle3 else source.shape.model_type,
            "parameters": _parameters(source), "total_bytes": source.total_bytes}


def _parameters(source) -> int:
    """Weights as stored (NVFP4 codes count two per byte); scales and biases are not parameters."""
    n = 0
    for name, t in source.tensors.items():
        leaf = name.rpartition(".")[2]
        if leaf != "weight" or name in ("d2t", "t2d"):
            continue
        n += t.numel * (2 if source.quant is not None and t.dtype.itemsize == 1 and len(t.shape) == 2 else 1)
    return n


def _tensors_json(tensors) -> list[dict]:
    return [{"name": t.name, "group": t.group, "role": t.role.value, "dtype": str(t.dtype).removeprefix("torch."),
             "shape": list(t.shape), "bytes": t.nbytes} for t in tensors]


def plan_json(plan: Plan, per_tensor: bool = False) -> dict:
    out = {
        "fits": plan.fits,
        "verdict": plan.verdict,
        "max_context_tokens": plan.max_context_tokens,
        "max_context_tokens_by_memory": plan.max_context_tokens_by_memory,
        "model_max_context_tokens": plan.model_max_context_tokens,
        "context_tokens": plan.context,
        "max_num_seqs": plan.batching.max_num_seqs,
        "max_num_batched_tokens": plan.batching.max_num_batched_tokens,
        "block_size": plan.batching.block_size,
        "kv_cache_tokens_requested": plan.batching.kv_cache_tokens,
        "kv_blocks": plan.kv_blocks,
        "kv_tokens": plan.kv_tokens,
        "sequences": plan.sequences,
        "max_num_seqs_fit": plan.max_num_seqs_fit,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "tensor_parallel_size": plan.tp,
        "target": _source_json(plan.target),
        "drafter": _source_json(plan.drafter),
        "hardware": {"name": plan.hardware.name, "memory_bandwidth_gbps": plan.hardware.memory_bandwidth_gbps,
                     "link_latency_us": plan.hardware.link_latency_us, "reserved_gib": plan.hardware.reserved_gib,
                     "runtime_overhead_gib": plan.hardware.runtime_overhead_gib,
                     "bandwidth_measured": plan.hardware.measured},
        "nodes": [{"name": n.name, "memory_bytes": n.memory_bytes} for n in plan.nodes],
        "per_rank": [r.to_json() for r in plan.ranks],
        "roofline": plan.roofline.to_json(),
        "notes": list(plan.notes),
    }
    if per_tensor:
        out["tensors_per_rank"] = _tensors_json(plan.tensors)
        out["drafter_tensors"] = _tensors_json(plan.drafter_tensors)
    return out


def per_tensor_table(plan: Plan) -> Table:
    table = Table(title="tensors held by each rank (the same on every rank; the drafter's on rank 0)",
                  title_justify="left")
    for col in ("tensor", "group", "split", "dtype", "local shape"):
        table.add_column(col)
    table.add_column("bytes", justify="right")
    for t in plan.tensors:
        table.add_row(t.name, t.group, t.role.value, str(t.dtype).removeprefix("torch."), str(list(t.shape)),
                      f"{t.nbytes:,}")
    for t in plan.drafter_tensors:
        table.add_row(f"drafter: {t.name}", t.group, "rank 0", str(t.dtype).removeprefix("torch."),
                      str(list(t.shape)), f"{t.nbytes:,}")
    return table


def tables(plan: Plan) -> Group:
    return Group(Text(_title(plan)), _memory_table(plan), _roofline_table(plan), Text(_verdict(plan)))


def render_text(plan: Plan, width: int = 120) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, soft_wrap=False, highlight=False)
    console.print(tables(plan))
    return buffer.getvalue().rstrip()


def _title(plan: Plan) -> str:
    t = plan.target
    text = f"{t.name}: {t.format}, {_parameters(t) / 1e9:.2f} B parameters, {gib(t.total_bytes)}"
    if plan.drafter is not None:
        text += f" + drafter {plan.drafter.name} ({gib(plan.drafter.total_bytes)})"
    b = plan.batching
    return (f"{text}\nTP={plan.tp} over {len(plan.nodes)} node(s), context {plan.context:,}, up to {b.max_num_seqs} "
            f"sequences and {b.max_num_batched_tokens} rows a step, KV blocks of {b.block_size} tokens, "
            f"{str(plan.dtype).removeprefix('torch.')} weights/KV, hardware {plan.hardware.name}")


def _memory_table(plan: Plan) -> Table:
    table = Table()
    table.add_column("memory per rank")
    for r in plan.ranks:
        table.add_column(f"rank {r.rank} ({r.node})", justify="right")
    ranks = plan.ranks

    def row(label: str, values, style: str | None = None):
        table.add_row(label, *values, style=style)

    row("target weights", [gib(r.weights_bytes) for r in ranks], "bold")
    groups = [g for g in GROUP_ORDER if any(r.weights_by_group.get(g) for r in ranks)]
    for g in groups:
        row(f"  {g}", [gib(r.weights_by_group.get(g, 0)) for r in ranks])
    if plan.drafter is not None:
        row("drafter weights", [gib(r.drafter_weights_bytes) for r in ranks])
    row("KV cache per token", [f"{r.kv_bytes_per_token / KiB:.1f} KiB" for r in ranks])
    row(f"KV cache per block ({plan.batching.block_size} tokens)", [_small(r.kv_block_bytes) for r in ranks])
    row("KV cache", [f"{r.kv_blocks:,} blocks = {r.kv_tokens:,} tok" for r in ranks])
    row("", [gib(r.kv_bytes) for r in ranks])
    if plan.drafter is not None:
        row(f"drafter KV cache ({plan.context:,} x {plan.batching.max_num_seqs})",
            [gib(r.drafter_kv_bytes) for r in ranks])
    row(f"activations / workspace (est., {plan.batching.max_num_batched_tokens} rows)",
        [gib(r.activation_bytes) for r in ranks])
    row("runtime overhead", [gib(r.overhead_bytes) for r in ranks])
    row("reserved (OS, drivers)", [gib(r.reserved_bytes) for r in ranks])
    row("total", [gib(r.total_bytes) for r in ranks], "bold")
    row("capacity", [gib(r.capacity_bytes) for r in ranks])
    row("free", [gib(r.free_bytes) for r in ranks], "bold")
    row("room for KV cache", [gib(r.kv_room_bytes) for r in ranks])
    row("", [f"{r.kv_blocks_by_memory:,} blocks = {r.kv_blocks_by_memory * r.block_size:,} tok" for r in ranks])
    row(f"sequences of {plan.context:,} tokens at once", [f"{r.sequences} (room: {r.sequences_by_memory})"
                                                         for r in ranks], "bold")
    row(f"--max-num-seqs {plan.batching.max_num_seqs} at full context fit",
        ["yes" if r.max_num_seqs_fit else "no" for r in ranks])
    return table


def _roofline_table(plan: Plan) -> Table:
    roof = plan.roofline
    hw = plan.hardware
    measured = " (measured)" if hw.measured else ""
    table = Table(title=f"decode roofline of one sequence, context {roof.context:,}: "
                        f"{hw.memory_bandwidth_gbps:.0f} GB/s{measured} per node, {hw.link_latency_us:.0f} us "
                        f"per all-reduce", title_justify="left")
    table.add_column("step", no_wrap=True)
    table.add_column("bytes read per rank", justify="right")
    table.add_column("collectives", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("ceiling", justify="right", no_wrap=True)

    def add(label, cost, ceiling=""):
        table.add_row(label, " / ".join(gib(b) for b in cost.bytes_per_rank), str(cost.collectives),
                      f"{cost.seconds * 1e3:.2f}", ceiling)

    add("target decode (1 token)", roof.decode, f"{roof.target_tokens_per_s:.1f} tok/s")
    if roof.verify is not None:
        add("drafter step (rank 0)", roof.draft_step)
        moe = plan.target.shape.is_moe
        add(f"target verify ({roof.draft_len + 1} tokens{', experts independent' if moe else ''})", roof.verify)
        if moe:
            add(f"target verify ({roof.draft_len + 1} tokens, experts shared)", roof.verify_shared)
        low, high = roof.speculative_tokens_per_s(), roof.speculative_tokens_per_s(shared_routing=True)
        ceiling = f"{low:.1f} tok/s ({roof.speedup():.2f}x)"
        if moe:
            ceiling = f"{low:.1f}-{high:.1f} tok/s ({roof.speedup():.2f}-{roof.speedup(True):.2f}x)"
        table.add_row(f"speculative: K={roof.draft_len}, acceptance {roof.acceptance:.2f}",
                      f"{roof.expected_tokens_per_round:.2f} tokens/round", "",
                      f"{roof.round_seconds() * 1e3:.2f}", ceiling)
    return table


def _sequences(n: int) -> str:
    return f"{n:,} sequence" + ("" if n == 1 else "s")


def _verdict(plan: Plan) -> str:
    limit = plan.model_max_context_tokens
    by_memory = plan.max_context_tokens_by_memory
    limited = f"memory allows {by_memory:,}" + (f", the model takes {limit:,}" if limit else "")
    b = plan.batching
    lines = [f"{plan.verdict}: longest context {plan.max_context_tokens:,} tokens ({limited})",
             f"KV cache: {plan.kv_blocks:,} blocks of {b.block_size} tokens ({plan.kv_tokens:,} tokens) on every rank, "
             f"{_sequences(plan.sequences)} of {plan.context:,} tokens at once"]
    if plan.fits and not plan.max_num_seqs_fit:
        room = min(r.sequences_by_memory for r in plan.ranks)
        lines.append(f"only {_sequences(room)} of {plan.context:,} tokens fit at once, not --max-num-seqs "
                     f"{b.max_num_seqs}: the rest wait, or are preempted at full length")
    problem = plan.kv_request_problem
    if problem is not None:
        lines.append(f"--kv-cache-tokens: {problem}")
    elif not plan.fits:
        worst = min(plan.ranks, key=lambda r: r.free_bytes)
        lines.append(f"rank {worst.rank} ({worst.node}) needs {gib(worst.total_bytes)} of {gib(worst.capacity_bytes)}"
                     f" ({gib(-worst.free_bytes)} over)")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
