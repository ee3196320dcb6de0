"""How the drafter runs, measured rather than assumed: on how many threads, with which kernels.

A small drafter is a long chain of small operations. On a machine whose cores are shared, two
threads that must meet at every operation can be slower than one; on a quiet machine two
usually win. `calibrate_threads` times a few drafter steps both ways and keeps the faster.

On a CPU with AMX the registered ops multiply bf16 activations on AMX tiles, which verify many
rows for the price of one; but a tile holds the NVFP4 weights already scaled, and for a
one-row drafter step decoding them that way costs more than the vector kernels' (a Xeon guest:
SmolLM2-135M with NVFP4 projections 8.9 ms a step on the tiles, 5.0 ms on AVX512-BF16). The
drafter's bits do not reach the output (the target verifies every draft), so it may take other
kernels than the target: `calibrate_kernels` times its steps on both and keeps the faster,
for every row of every call from then on.
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


def _median_steps(model: DraftModel, settings: dict, enter: Callable[[object], AbstractContextManager],
                  steps: int, rounds: int) -> dict:
    """Median seconds of a one-token drafter step after 33 cached tokens under each setting
    (`enter(setting)` applies it around the steps), measured in interleaved rounds so a passing
    load spike hits every setting alike. Leaves the drafter's cache empty."""
    times: dict = {setting: [] for setting in settings}
    model.truncate(0)
    model.forward(torch.arange(1, 33))
    model.forward(torch.tensor([7]))
    for _ in range(rounds):
        for setting in settings:
            with enter(setting):
                model.truncate(33)
                model.forward(torch.tensor([7]))  # the first step after a switch is not counted
                for _ in range(steps):
                    model.truncate(33)
                    begin = time.perf_counter()
                    model.forward(torch.tensor([7]))
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
    median = _median_steps(model, {current: None, 1: None}, drafter_threads, steps, rounds)
    best = min(median, key=median.get)
    log.info("drafter step %.1f ms on %d threads, %.1f ms on 1: drafting on %d", 1e3 * median[current], current,
             1e3 * median[1], best)
    return best


def calibrate_kernels(model: DraftModel, steps: int = 5, rounds: int = 3) -> str | None:
    """Give a compiled drafter step the faster of its kernel choices for a one-token step (AMX
    tiles or the vector kernels, where both run here) and return its name; None when there is
    nothing to choose. Leaves the drafter's cache empty."""
    step = getattr(getattr(model, "network", None), "step", None)
    choices = step.kernel_choices() if step is not None else ()
    if len(choices) < 2:
        return None

    @contextmanager
    def using(name):
        step.use_kernels(name)
        yield

    median = _median_steps(model, dict.fromkeys(choices), using, steps, rounds)
    best = min(median, key=median.get)
    step.use_kernels(best)
    log.info("drafter step %s: drafting on %s", ", ".join(f"{1e3 * median[name]:.1f} ms on {KERNEL_LABELS[name]}"
                                                         for name in choices), KERNEL_LABELS[best])
    return best
