"""How many torch threads the drafter runs on, measured rather than assumed.

A small drafter is a long chain of small operations. On a machine whose cores are shared, two
threads that must meet at every operation can be slower than one; on a quiet machine two
usually win. `calibrate_threads` times a few drafter steps both ways and keeps the faster.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from hetero_run.runtime.drafters.model import DraftModel

log = logging.getLogger("hetero_run.runtime.drafters.threads")


@contextmanager
def drafter_threads(threads: int | None):
    """Run the enclosed drafter calls on `threads` torch threads (None: leave as is)."""
    if threads is None or threads == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def calibrate_threads(model: DraftModel, steps: int = 5, rounds: int = 3) -> int | None:
    """The faster of the current thread count and one thread for a drafter step (medians over
    interleaved measurements, so a passing load spike hits both); None when there is nothing
    to choose. Leaves the drafter's cache empty."""
    current = torch.get_num_threads()
    if current == 1:
        return None
    times: dict[int, list[float]] = {current: [], 1: []}
    model.truncate(0)
    model.forward(torch.arange(1, 33))
    model.forward(torch.tensor([7]))  # warm-up
    for _ in range(rounds):
        for threads in (current, 1):
            with drafter_threads(threads):
                for _ in range(steps):
                    model.truncate(33)
                    begin = time.perf_counter()
                    model.forward(torch.tensor([7]))
                    times[threads].append(time.perf_counter() - begin)
    model.truncate(0)
    median = {threads: sorted(t)[len(t) // 2] for threads, t in times.items()}
    best = min(median, key=median.get)
    log.info("drafter step %.1f ms on %d threads, %.1f ms on 1: drafting on %d", 1e3 * median[current], current,
             1e3 * median[1], best)
    return best
