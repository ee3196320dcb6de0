"""The cost of a speculative verify forward (k + 1 tokens) against a 1-token decode forward, on the
real CPU target at TP=1, whether the verify rows are bitwise equal to sequential decoding, and
how close the 1-token forward comes to the memory-bandwidth roofline.

    python bench/verify_forward.py [--quant bf16,nvfp4] [--sizes 1,2,5,9,16] [--repeat 30] [--threads N]
                                   [--cpu-time] [--context 128]

Uses the checkpoints bench/target_decode.py converts (~/.cache/hetero-run/bench; run it once
first). Per quantisation prints, for each forward size n: the median ms of one forward of n
tokens after a prompt of --context tokens (128; the cache rolled back after each; sizes timed round robin, so
a change in the machine's load touches all of them alike), its ratio to n = 1, and whether its
logits equal n sequential 1-token forwards bit for bit (`torch.equal`). Then the roofline: the
bytes a 1-token forward must read (every weight it uses, model.decode_nbytes()) over the memory
bandwidth measured just before and after the timings (torch's sum over 512 MB of float32 with
the same threads and clock, as the planner measures it; the higher reading), against the
measured n = 1 time.

On a machine other jobs share, wall time counts the time the scheduler gives to them;
`--threads 1 --cpu-time` times this process's own CPU time instead (memory stalls included),
which only other jobs' use of the caches and memory bus still disturbs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

CACHE = Path.home() / ".cache" / "hetero-run" / "bench"
NAME = "qwen2.5-coder-0.5b-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quant", default="bf16,nvfp4", help="comma-separated subset of bf16, nvfp4")
    parser.add_argument("--sizes", default="1,2,5,9,16", help="forward sizes n to time (1 is always timed)")
    parser.add_argument("--repeat", type=int, default=30, help="timed forwards per size (median kept)")
    parser.add_argument("--cache", type=Path, default=CACHE, help="converted checkpoints (default %(default)s)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--cpu-time", action="store_true", help="time CPU time, not wall time (with --threads 1)")
    parser.add_argument("--context", type=int, default=128,
                        help="prompt tokens cached before the timed forwards (default %(default)s): attention's "
                             "share grows with it")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time and torch.get_num_threads() != 1:
        parser.error("--cpu-time needs --threads 1 (other threads' waiting would count)")
    sizes = sorted({1, *(int(s) for s in args.sizes.split(","))})
    from hetero_run.kernels import cpu_ext

    print(f"CPU kernels: {cpu_ext.describe()}; threads {torch.get_num_threads()}")
    for quant in args.quant.split(","):
        _measure(args.cache / f"{NAME}-{quant}", quant, sizes, args.repeat, time.process_time if args.cpu_time
                 else time.perf_counter, args.context)


def _measure(folder: Path, quant: str, sizes: list[int], repeat: int, clock, context: int) -> None:
    from hetero_run.runtime.models.loader import load_model
    from hetero_run.runtime.models.parallel import ParallelContext

    if not folder.is_dir():
        raise SystemExit(f"{folder}: not found (python bench/target_decode.py converts it)")
    model = load_model(folder, ParallelContext.single(), max_tokens=max(512, context + 2 * max(sizes)))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=gen)
    model.forward(prompt, torch.arange(context), num_logits=1)
    ids = torch.randint(0, model.config.vocab_size, (max(sizes),), generator=gen)
    seq = []
    for i in range(max(sizes)):  # the reference: one token per forward
        seq.append(model.forward(ids[i:i + 1], torch.tensor([context + i])))
    seq = torch.cat(seq)

    bandwidth = [_bandwidth(clock)]
    times, logits = time_rows(model, context, ids, sizes, repeat, clock)
    bandwidth.append(_bandwidth(clock))
    same = {n: torch.equal(logits[n], seq[:n]) for n in sizes}
    base = statistics.median(times[1]) * 1e3
    print(f"{quant} ({'CPU' if clock is time.process_time else 'wall'} time, after {context} cached tokens):")
    for n in sizes:
        ms = statistics.median(times[n]) * 1e3
        print(f"  n={n:3d}  {ms:8.2f} ms  x{ms / base:5.2f} of n=1   bitwise equal to sequential: {same[n]}")
    nbytes = model.decode_nbytes()
    gbps = max(bandwidth)
    floor_ms = nbytes / (gbps * 1e9) * 1e3
    print(f"  roofline: {nbytes / 1e6:.0f} MB per token at {gbps:.1f} GB/s (measured {bandwidth[0]:.1f} before, "
          f"{bandwidth[1]:.1f} after) = {floor_ms:.2f} ms; n=1 reaches {floor_ms / base:.0%} of it")


def time_rows(model, prefix: int, ids: torch.Tensor, sizes: list[int], repeat: int,
              clock=time.perf_counter) -> tuple[dict[int, list[float]], dict[int, torch.Tensor]]:
    """Seconds of `repeat` forwards of n = ids[:n] rows after the first `prefix` cached positions
    of `model` (a model or a runner: `forward(ids, positions)` and `truncate(length)`), for each n
    in `sizes`, taken round robin so a drift in the machine's load touches every size alike; the
    cache is rolled back to `prefix` before each. Also the logits of the last forward of each n."""
    times: dict[int, list[float]] = {n: [] for n in sizes}
    logits = {}
    for _ in range(repeat):
        for n in sizes:
            model.truncate(prefix)
            start = clock()
            logits[n] = model.forward(ids[:n], torch.arange(prefix, prefix + n))
            times[n].append(clock() - start)
    model.truncate(prefix)
    return times, logits


def _bandwidth(clock, nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """GB/s of the best of `repeats` torch sums over `nbytes` of float32 (runtime/planner's
    measure_bandwidth, timed with `clock`)."""
    data = torch.ones(nbytes // 4, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        data.sum()
        best = min(best, clock() - start)
    return nbytes / best / 1e9


if __name__ == "__main__":
    main()
