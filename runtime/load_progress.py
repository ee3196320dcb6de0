"""A rich progress bar over the tensors a checkpoint reads while a model loads.

    with load_progress(ckpt, total_bytes=ckpt.total_bytes // world_size, enabled=dist.is_driver) as stats:
        model = build(ckpt, ...)          # every ckpt.read(...) advances the bar
    log.info("read %d tensors, %.2f GB in %.1f s", stats.tensors, stats.bytes / 1e9, stats.seconds)

The bar counts bytes (with speed and time left) and tensors. It draws on stderr, so stdout
stays clean for results; on a pipe (e.g. under mpirun) rich prints only the final state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from hetero_run.runtime.checkpoint import Checkpoint


@dataclass
class LoadStats:
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0


@contextmanager
def load_progress(
    ckpt: Checkpoint,
    description: str = "loading weights",
    total_bytes: int | None = None,
    enabled: bool = True,
    console: Console | None = None,
) -> Iterator[LoadStats]:
    """Count (and, if `enabled`, draw) what `ckpt` reads inside the block.

    total_bytes: what this process is expected to read (default: the whole checkpoint; a rank
    of a TP job reads about total / world_size). The bar completes when the block ends.
    """
    stats = LoadStats()
    start = time.perf_counter()
    previous = ckpt.on_read
    progress = None
    task = None
    if enabled:
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[tensors]} tensors"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
        )
        task = progress.add_task(description, total=max(total_bytes or ckpt.total_bytes, 1), tensors=0)

    def on_read(name: str, nbytes: int) -> None:
        stats.tensors += 1
        stats.bytes += nbytes
        if progress is not None:
            progress.update(task, advance=nbytes, tensors=stats.tensors)
        if previous is not None:
            previous(name, nbytes)

    ckpt.on_read = on_read
    try:
        if progress is None:
            yield stats
        else:
            with progress:
                yield stats
                progress.update(task, total=max(stats.bytes, 1), completed=max(stats.bytes, 1))
    finally:
        ckpt.on_read = previous
        stats.seconds = time.perf_counter() - start
