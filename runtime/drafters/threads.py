"""How the drafter runs, measured rather than assumed: on how many threads, with which kernels.

A small drafter is a long chain of small operations. On a machine whose cores are shared, two
threads that must meet at every operation can be slower than one; on a quiet machine two
usually win. `calibrate_threads` times a few drafter steps both ways and keeps the faster.

On a CPU with AMX the registered ops multiply bf16 activations on AMX tiles, which verify many
rows for the price of one; but a tile holds the NVFP4 weights already scaled, and for a
one-row drafter step decoding them that way costs more than the vector kernels' (a Xeon guest:
SmolLM2-135M with NVFP4 projections 8.9 ms a step on the tiles, 5.0 ms on AVX512-BF16). The
drafter's bits do not reach the output (the target verifies every draft), so it may take other
kernels than the target, and may take different ones for a drafting step and for a prompt
read, where the tiles win (150 tokens: 88 ms on the tiles, 275 ms on the vector kernels):
`calibrate_kernels` times forwards of 1, 4 and 32 rows on both and keeps the faster for few rows
and for many, every row of a forward on the same kernels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager

import torch

from hetero_run.runtime.drafters.model import DraftModel

log = logging.getLogger("hetero_run.runtime.drafters.threads")

KERNEL_LABELS = {"amx": "AMX tiles", "vector": "vector kernels"}


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


def _median_steps(model: DraftModel, settings, enter: Callable[[object], AbstractContextManager],
                  steps: int, rounds: int, rows: int = 1, cached: int = 32) -> dict:
    """Median seconds of a forward of `rows` tokens after `cached` + 1 cached ones under each setting
    (`enter(setting)` applies it around the forwards), measured in interleaved rounds so a passing
    load spike hits every setting alike. Leaves the drafter's cache empty."""
    times: dict = {setting: [] for setting in settings}
    ids = torch.full((rows,), 7)
    model.truncate(0)
    model.forward(torch.arange(1, cached + 1))
    model.forward(torch.tensor([7]))
    for _ in range(rounds):
        for setting in settings:
            with enter(setting):
                model.truncate(cached + 1)
                model.forward(ids)  # the first forward after a switch is not counted
                for _ in range(steps):
                    model.truncate(cached + 1)
                    begin = time.perf_counter()
                    model.forward(ids)
                    times[setting].append(time.perf_counter() - begin)
    model.truncate(0)
    return {setting: sorted(t)[len(t) // 2] for setting, t in times.items()}


def calibrate_threads(model: DraftModel, steps: int = 5, rounds: int = 3) -> int | None:
    """The faster of the current thread count and one thread for a drafter step (medians over
    interleaved measurements); None when there is nothing to choose. Leaves the drafter's cache
    empty."""
    current = torch.get_num_threads()
    if current == 1:
        return None
    median = _median_steps(model, (current, 1), drafter_threads, steps, rounds)
    best = min(median, key=median.get)
    log.info("drafter step %.1f ms on %d threads, %.1f ms on 1: drafting on %d", 1e3 * median[current], current,
             1e3 * median[1], best)
    return best


KERNEL_ROWS = (1, 4, 32)  # a drafting step, a catch-up after a round, a prompt read (its first 32 tokens)


def calibrate_kernels(model: DraftModel, steps: int = 5, rounds: int = 3) -> tuple[str, str, int] | None:
    """Give a compiled drafter step, where it has a choice of kernels (AMX tiles or the vector
    kernels), the faster for one-token drafting steps and the faster for forwards of many rows
    (a prompt read), measured on forwards of KERNEL_ROWS rows; returns (few, many, many_from) as
    `DraftStep.kernels` gives it, or None when there is nothing to choose. Leaves the drafter's
    cache empty."""
    step = getattr(getattr(model, "network", None), "step", None)
    choices = step.kernel_choices() if step is not None else ()
    if len(choices) < 2:
        return None

    @contextmanager
    def using(name):
        step.use_kernels(name)
        yield

    medians = {rows: _median_steps(model, choices, using, steps, rounds, rows, cached=16) for rows in KERNEL_ROWS}
    best = {rows: min(median, key=median.get) for rows, median in medians.items()}
    few, many = best[KERNEL_ROWS[0]], best[KERNEL_ROWS[-1]]
    many_from = next((rows for rows in KERNEL_ROWS[1:] if best[rows] == many), KERNEL_ROWS[-1]) if few != many else 1
    step.use_kernels(few, many, many_from)
    figures = "; ".join(f"{rows} row{'s' if rows > 1 else ''}: " + ", ".join(
        f"{1e3 * medians[rows][name]:.1f} ms on {KERNEL_LABELS[name]}" for name in choices) for rows in KERNEL_ROWS)
    if few == many:
        log.info("drafter forwards, %s: drafting on %s", figures, KERNEL_LABELS[few])
    else:
        log.info("drafter forwards, %s: %s below %d rows, %s from %d", figures, KERNEL_LABELS[few], many_from,
                 KERNEL_LABELS[many], many_from)
    return step.kernels


def prompt_read_seconds(model: DraftModel, threads: int | None = None, tokens: int = 32, repeats: int = 3) -> float:
    """Drafter seconds per token of reading a prompt (a forward of `tokens` tokens from an empty
    cache, last row's logits only, the fastest of `repeats`, on `threads`): the cost model's
    estimate of a catch-up until it measures one. Leaves the drafter's cache empty."""
    ids = torch.arange(1, tokens + 1)
    best = float("inf")
    with drafter_threads(threads):
        for _ in range(repeats):
            model.truncate(0)
            begin = time.perf_counter()
            model.forward(ids, last=True)
            best = min(best, time.perf_counter() - begin)
    model.truncate(0)
    return best / tokens
