"""The drafter's decode step against the target's, on the real CPU pair, in one run.

    python bench/drafter_step.py [--pair DIR] [--weights nvfp4,dense] [--context 128] [--rounds 7]

Loads the target (Qwen2.5-Coder-0.5B-Instruct, the NVFP4 checkpoint `hetero-run fetch cpu-pair`
converts, TP=1) and the drafter (SmolLM2-135M-Instruct from its converted checkpoint, made on
the first load), fills `--context` tokens of a real prompt into each, then measures in rounds,
interleaved so that a passing load spike hits every figure alike, the median of each:

- the target's decode step (one token, the cache rolled back after each);
- the drafter's decode step, one row, and one row for each of k sequences in one batched
  forward (k = 2, 4, 8 slots), per projection kind in `--weights` (where the CPU kernels may use
  AMX, once with the projections on AMX tiles and once on the vector kernels: the runtime times
  both at start and drafts on the faster, runtime/drafters/threads.py);
- with `--activations both`, the NVFP4 drafter once with int8 activations (`nvfp4_linear_i8`,
  what it runs where the CPU has AVX2 but not AVX-512) and once with the float kernels' (bf16
  where the CPU has bf16 dot products, else float32): rows "nvfp4 int8" and "nvfp4 float";
- its projections alone: the step's 121 linear products (4 per layer and the head) called back
  to back through the registered ops on one row, nothing between them, each op forking and
  joining the threads (the step computes them with the same kernels in one parallel region):
  the step against them is what its norms, rotary, attention and barriers cost, less what the
  region saves;
- with `--baseline`, the same drafter through the runtime's model code, one PyTorch operation
  at a time (what the drafter ran before the compiled step);
- the memory bandwidth, as bench/target_decode.py measures it: torch's sum over the target's
  embedding (272 MB, far beyond the caches) with the run's threads, best of three.

It prints what a drafter step reads (weights, and the keys and values of the context), what
that costs at the bandwidth measured (the roofline), what the step takes, and c = drafter step
/ target step, the figure speculative decoding's speed-up depends on.

On a machine other jobs share, elapsed times measure the queue for the cores as much as the
step (and two threads that must meet at every operation wait for each other's turn):
`--threads 1 --clock cpu` times everything, the bandwidth included, in this thread's CPU time,
what it costs on a core of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

PAIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero-run" / "cpu-pair"
TARGET = "qwen2.5-coder-0.5b-instruct-nvfp4"
DRAFTER = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = ("Write a Python function that checks whether a number is prime. Explain how it works, then give "
          "three examples of calling it and what each one returns. ")
BATCHES = (2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", type=Path, default=PAIR, help="the CPU pair (default %(default)s)")
    parser.add_argument("--weights", default="nvfp4,dense", help="drafter projections: nvfp4, dense or both")
    parser.add_argument("--activations", choices=("auto", "both"), default="auto",
                        help="NVFP4 drafter activations: the runtime's choice, or int8 and float side by side")
    parser.add_argument("--context", type=int, default=128, help="tokens cached before the steps (default 128)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="steps per figure per round (default 10)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time; cpu: this thread's CPU time, what a step costs on a core of its "
                        "own when other jobs share the machine (needs --threads 1)")
    parser.add_argument("--baseline", action="store_true",
                        help="also time the drafter through the runtime model code, one operation at a time")
    parser.add_argument("--json", action="store_true", help="also print every figure as one JSON object")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu times this thread only: run it with --threads 1")
    kinds = [k.strip() for k in args.weights.split(",") if k.strip()]
    if not kinds or set(kinds) - {"nvfp4", "dense"}:
        raise SystemExit(f"--weights: expected nvfp4, dense or both, got {args.weights!r}")
    for path in (args.pair / TARGET / "model.safetensors", args.pair / DRAFTER):
        if not path.is_file():
            raise SystemExit(f"{path}: not found (run `hetero-run fetch cpu-pair` first)")
    _run(args, kinds)


def _run(args, kinds: list[str]) -> None:
    from transformers.utils import logging as transformers_logging

    from hetero_run.kernels import cpu_ext
    from hetero_run.kernels.drafter_step import compiled_available
    from hetero_run.runtime.drafters.load import load_drafter, load_tokenizer
    from hetero_run.runtime.models.loader import load_model

    transformers_logging.disable_progress_bar()
    context, slots = args.context, max(BATCHES)
    tokens = context + 4
    target = load_model(args.pair / TARGET, max_tokens=tokens, dtype="bf16")
    target_ids = _ids(load_tokenizer(args.pair / TARGET), context)
    target.forward(target_ids, torch.arange(context), num_logits=1)
    drafters, loads = {}, {}
    for kind in kinds:
        begin = time.perf_counter()
        drafter = load_drafter(args.pair / DRAFTER, weights=kind, slots=slots, max_tokens=tokens)
        networks = {kind: drafter.network}
        if kind == "nvfp4" and args.activations == "both":
            networks = {f"{kind} {name}": _with_activations(drafter.network, int8, slots, tokens)
                        for name, int8 in (("int8", True), ("float", False))}
        ids = _ids(drafter.tokenizer, context)
        for label, network in networks.items():
            loads[label] = time.perf_counter() - begin
            for _ in range(slots):
                slot = network.acquire()
                network.forward(ids, torch.full((context,), slot))
            drafters[label] = network
    baselines = _baselines(args, drafters, tokens) if args.baseline else {}

    step_token = torch.tensor([int(target_ids[-1])])
    at = torch.tensor([context])

    def target_step():
        target.truncate(context)
        target.forward(step_token, at)

    figures = {"target": target_step}
    variants = {}  # row label -> (kind, the step's kernels)
    for kind, network in drafters.items():
        figures[f"{kind} linear"] = _linear_only(network.weights)
        choices = network.step.kernel_choices()
        for kernels in choices:
            variants[kind if len(choices) == 1 else f"{kind} {kernels}"] = (kind, kernels)
    for label, (kind, kernels) in variants.items():
        network = drafters[kind]
        for k in (1, *BATCHES):
            rows = torch.arange(k)

            def step(n=network, r=rows, kernels=kernels):
                n.step.use_kernels(kernels)
                n.forward(torch.full((r.numel(),), 7), r, torch.full((r.numel(),), context))

            figures[f"{label} x{k}"] = step
    for kind, model in baselines.items():
        def base_step(m=model):
            m.truncate(context)
            m.forward(torch.tensor([7]), at)

        figures[f"{kind} per-op"] = base_step
    for fn in figures.values():  # warm-up
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in figures}
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    bandwidth = []
    with torch.inference_mode():
        for _ in range(args.rounds):
            bandwidth.append(_stream_gbps(target.embed.weight, clock))
            for name, fn in figures.items():
                times = []
                for _ in range(args.steps):
                    begin = clock()
                    fn()
                    times.append(clock() - begin)
                samples[name].append(statistics.median(times))
    ms = {name: 1e3 * statistics.median(v) for name, v in samples.items()}
    gbps = statistics.median(bandwidth)
    report = {"threads": torch.get_num_threads(), "clock": args.clock, "context": context,
              "compiled": compiled_available(),
              "cpu_features": cpu_ext.features(), "bandwidth_gbps": gbps,
              "bandwidth_range_gbps": [min(bandwidth), max(bandwidth)], "target_ms": ms["target"],
              "target_bytes": target.decode_nbytes(), "drafters": {}}
    for label, (kind, kernels) in variants.items():
        network = drafters[kind]
        weights_bytes, read = network.weights.decode_nbytes(), network.decode_nbytes(context)
        entry = {"kind": kind, "kernels": kernels, "load_s": loads[kind], "weight_bytes": weights_bytes,
                 "kv_bytes": read - weights_bytes, "bytes": read, "roofline_ms": read / gbps / 1e6, "ms": {},
                 "c": ms[f"{label} x1"] / ms["target"], "macs": _macs(network.weights)}
        if kernels != "vector" or len(network.step.kernel_choices()) == 1:  # the registered ops' own kernels
            entry["linear_ms"] = ms[f"{kind} linear"]
        for k in (1, *BATCHES):
            entry["ms"][k] = ms[f"{label} x{k}"]
        if kind in baselines:
            entry["per_op_ms"] = ms[f"{kind} per-op"]
        report["drafters"][label] = entry
    _print(report)
    if args.json:
        print(json.dumps(report))


def _with_activations(network, int8: bool, slots: int, tokens: int):
    """A network over copies of `network`'s projections with int8 activations or without."""
    from dataclasses import replace

    from hetero_run.runtime.drafters.network import DraftNetwork
    from hetero_run.runtime.drafters.weights import with_fast_activations

    w = network.weights
    layers = [replace(layer, qkv=replace(layer.qkv), o=replace(layer.o), gate_up=replace(layer.gate_up),
                      down=replace(layer.down)) for layer in w.layers]
    copy = replace(w, layers=layers, head=replace(w.head), extra=dict(w.extra))
    return DraftNetwork(with_fast_activations(copy, int8=int8), slots, tokens)


def _linear_only(weights):
    """The step's projections on one row, back to back, through the ops the compiled step calls."""
    from hetero_run.kernels.drafter_step import project

    projections = [p for layer in weights.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    projections.append(weights.head)
    inputs = [torch.randn(1, p.in_features) for p in projections]

    def run():
        for p, x in zip(projections, inputs, strict=True):
            project(x, p)

    return run


def _macs(weights) -> int:
    """Multiply-adds of one row through every projection and the head."""
    projections = [p for layer in weights.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return sum(p.out_features * p.in_features for p in [*projections, weights.head])


def _ids(tokenizer, n: int) -> torch.Tensor:
    text = PROMPT
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        text += PROMPT
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:n], dtype=torch.long)


def _baselines(args, drafters: dict, tokens: int) -> dict:
    """The drafter as a runtime TargetModel (its weights, one PyTorch operation at a time)."""
    from hetero_run.runtime.models.loader import load_model
    from hetero_run.runtime.weights import NVFP4Weight

    out = {}
    for kind, network in drafters.items():
        model = load_model(args.pair / DRAFTER, max_tokens=tokens, dtype="bf16")  # through transformers
        if kind.startswith("nvfp4"):  # the fast drafter's own NVFP4 weights
            for layer, step_layer in zip(model.layers, network.weights.layers, strict=True):
                for linear, p in ((layer.attention.qkv, step_layer.qkv), (layer.attention.o, step_layer.o),
                                  (layer.mlp.gate_up, step_layer.gate_up), (layer.mlp.down, step_layer.down)):
                    linear.weight = NVFP4Weight(p.codes, p.block_scale, p.row_scale, activation="w4a16")
            head = network.weights.head
            model.lm_head.weight = NVFP4Weight(head.codes, head.block_scale, head.row_scale, activation="w4a16")
        ids = torch.arange(1, args.context + 1)
        model.forward(ids, torch.arange(args.context))
        out[kind] = model
    return out


def _stream_gbps(t: torch.Tensor, clock=time.perf_counter, repeats: int = 3) -> float:
    """GB/s of torch's sum over `t` (far beyond the caches), best of `repeats` (bench/target_decode.py's way)."""
    best = float("inf")
    for _ in range(repeats):
        begin = clock()
        t.sum()
        best = min(best, clock() - begin)
    return t.nbytes / best / 1e9


def _print(r: dict) -> None:
    lo, hi = r["bandwidth_range_gbps"]
    print(f"\n{r['threads']} thread(s), {r['clock']} clock, {r['context']} tokens of context, compiled step: "
          f"{'yes' if r['compiled'] else 'no (PyTorch reference)'}; bandwidth {r['bandwidth_gbps']:.1f} GB/s "
          f"(median; {lo:.1f}-{hi:.1f} over the rounds)")
    print(f"target (NVFP4, TP=1) decode step: {r['target_ms']:.2f} ms, reads {r['target_bytes'] / 1e6:.0f} MB "
          f"(roofline {r['target_bytes'] / r['bandwidth_gbps'] / 1e6:.2f} ms)")
    print(f"\n{'drafter':13} {'reads/step':>11} {'(weights + KV)':>16} {'roofline':>9} {'1 row':>8} {'x roof':>7} "
          f"{'c':>6} {'linear':>8} " + " ".join(f"{f'{k} rows':>14}" for k in BATCHES) + f" {'per-op':>8} {'load':>6}")
    for kind, d in r["drafters"].items():
        batched = " ".join(f"{d['ms'][k]:6.2f} ({d['ms'][k] / k:4.2f})" for k in BATCHES)
        per_op = f"{d['per_op_ms']:6.2f}ms" if "per_op_ms" in d else f"{'-':>8}"
        linear = f"{d['linear_ms']:6.2f}ms" if "linear_ms" in d else f"{'-':>8}"
        print(f"{kind:13} {d['bytes'] / 1e6:8.1f} MB {d['weight_bytes'] / 1e6:7.1f} + {d['kv_bytes'] / 1e6:4.1f} MB "
              f"{d['roofline_ms']:7.2f}ms {d['ms'][1]:6.2f}ms {d['ms'][1] / d['roofline_ms']:6.2f}x {d['c']:6.3f} "
              f"{linear} {batched} {per_op} {d['load_s']:5.1f}s")
    for kind, d in r["drafters"].items():
        if "linear_ms" not in d:
            continue
        print(f"{kind}: the projections alone take {d['linear_ms']:.2f} ms for {d['macs'] / 1e6:.0f} M multiply-adds "
              f"({d['macs'] / d['linear_ms'] / 1e6:.1f} GMAC/s, {d['weight_bytes'] / d['linear_ms'] / 1e6:.1f} GB/s); "
              f"the step, which also runs the norms, rotary, attention over {r['context']} tokens and residuals, "
              f"takes {d['ms'][1] - d['linear_ms']:+.2f} ms beside them (one parallel region instead of an op per "
              "product)")
    print("\nms are medians over the rounds of each round's median step; k rows: one batched forward drafting one "
          "token for each of k sequences (ms per row in brackets); c = drafter 1-row step / target step; roofline = "
          "bytes read per step / the bandwidth measured in this run; linear = the step's projections alone (the "
          "registered linear ops); per-op = the same drafter through the runtime model code, one PyTorch operation "
          "at a time (--baseline); 'amx' / 'vector': where the CPU kernels may use AMX, the step with its projections "
          "on AMX tiles and on the vector kernels (the runtime measures both at start and drafts on the faster)")


if __name__ == "__main__":
    main()
