"""Who holds which embedding rows under tensor parallelism, from what each rank holds.

Rank 0 alone holds the tokenizer and the drafter. Just before the weights load, every rank
reports its resident memory, its node's available memory and what it will still load besides
the target; `balanced_rows` then water-fills the embedding's rows so that the ranks' claims on
their nodes come out level (embedding.py says why the embedding, and only it, can move).
"""

from __future__ import annotations

import ctypes
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from hetero_run.runtime.models.parallel import ParallelContext

ROW_QUANTUM = 64  # balanced splits move rows in multiples of this


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them unless asked to trim)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def even_rows(vocab: int, size: int) -> list[int]:
    return [vocab // size] * size


def balanced_rows(vocab: int, row_bytes: int, used: Sequence[int], quantum: int = ROW_QUANTUM) -> list[int]:
    """Rows per rank, summing to `vocab`, that level `used[i] + rows[i] * row_bytes` (bytes each
    rank holds besides its embedding rows, in comparable terms) as far as whole rows allow: the
    fullest ranks get no rows when the embedding cannot make up the difference. Rows move in
    multiples of `quantum`; the rest goes where it is most short."""
    size = len(used)
    if size == 1 or row_bytes <= 0:
        return [vocab] if size == 1 else even_rows(vocab, size)
    order = sorted(range(size), key=lambda i: used[i])
    budget = vocab * row_bytes
    for k in range(size, 0, -1):  # water filling: the k emptiest ranks take rows up to one level
        filled = order[:k]
        level = (budget + sum(used[i] for i in filled)) / k
        if level >= used[filled[-1]]:
            break
    ideal = [max(0.0, (level - used[i]) / row_bytes) if i in filled else 0.0 for i in range(size)]
    rows = [int(x // quantum) * quantum for x in ideal]
    while (left := vocab - sum(rows)) > 0:
        short = max(range(size), key=lambda i: (ideal[i] - rows[i], -i))
        rows[short] += min(quantum, left)
    return rows


@dataclass(frozen=True)
class RankMemory:
    """What one rank reports before its weights load."""

    host: str
    resident: int  # this process's resident bytes now
    available: int  # its node's available memory now
    pending: int  # bytes it will still hold besides the target (rank 0: the drafter)


def measure(pending: int = 0) -> RankMemory:
    """This process's resident memory (after handing freed heap back) and its node's available memory."""
    import psutil

    return_freed_memory()
    return RankMemory(socket.gethostname(), psutil.Process(os.getpid()).memory_info().rss,
                      psutil.virtual_memory().available, pending)


def committed(ranks: Sequence[RankMemory]) -> list[int]:
    """Each rank's claim on its node, comparable across nodes: what it holds and will hold, less
    its share of its node's memory (available + what its ranks hold, split evenly among them).
    Ranks on one node report its available memory at slightly different moments; the lowest
    report is the one taken after all of them had what they hold, so it is the one used."""
    hosts: dict[str, list[RankMemory]] = {}
    for r in ranks:
        hosts.setdefault(r.host, []).append(r)
    out = []
    for r in ranks:
        peers = hosts[r.host]
        share = (min(p.available for p in peers) + sum(p.resident for p in peers)) // len(peers)
        out.append(r.resident + r.pending - share)
    return out


def balance(ctx: ParallelContext, vocab: int, row_bytes: int, pending: int = 0) -> list[int]:
    """Rows per rank for the embedding, from every rank's `measure` (a collective over ctx's
    group; every rank computes the same answer from the same reports)."""
    if ctx.size == 1:
        return [vocab]
    import torch.distributed as tdist

    tdist.barrier(group=ctx.group)  # every rank measures once the others have stopped allocating
    reports: list[RankMemory | None] = [None] * ctx.size
    tdist.all_gather_object(reports, measure(pending), group=ctx.group)
    return balanced_rows(vocab, row_bytes, committed(reports))
