"""Batch-1 greedy decode of the real CPU target: this runtime (bf16, NVFP4; TP=1, TP=2) against
transformers `generate` (fp32) on the same model and prompts, in the same run; plus per-rank
peak memory.

    python bench/target_decode.py [--gguf FILE] [--new-tokens 128] [--configs tp1-bf16,...]

Prints, per configuration: decode tok/s and ms/token, overall tok/s (prefill included, as
transformers is timed) and the speed-up over transformers, weight bytes read per token and
the share of the memory-bandwidth roofline, per-rank peak RSS, TP=2 / TP=1 ratios, and how many
tokens match transformers' greedy output. The bandwidth is measured by the planner's method
(torch's sum over memory beyond the caches) during each TP=1 run, after every prompt over the
run's own embedding with the run's threads (the median counts), and just before and after the
other runs (the better of the two counts): this machine's varies by half from one minute to
the next with what else its host runs, so one reading at the start would misstate every later
share. `tp1-*-1core` run TP=1 on one core, what each rank of TP=2
has on this 2-core machine. The bf16 and NVFP4 checkpoints are converted from the GGUF once
(ModelOpt for NVFP4) into ~/.cache/hetero-run/bench. Each configuration runs in fresh
processes (`mpirun -np 2` for TP=2), so peak RSS is that configuration's alone; TP=2 loads as
`hetero-run generate` does (rank 0 reads the tokenizer first; the embedding split balanced).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_GGUF = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero-run" / "cpu-pair" \
    / "qwen2.5-coder-0.5b-instruct.gguf"  # `hetero-run fetch cpu-pair`
PROMPTS = (  # the reference measurement's three coding prompts (chat template)
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the nth Fibonacci number iteratively.",
    "Implement binary search over a sorted list in Python.",
)
CONFIGS = ("tp1-bf16", "tp1-nvfp4", "tp1-bf16-1core", "tp1-nvfp4-1core", "tp2-bf16", "tp2-nvfp4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the target GGUF (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt (default 128)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    parser.add_argument("--cache", type=Path, help="converted checkpoints (default ~/.cache/hetero-run/bench)")
    parser.add_argument("--skip-transformers", action="store_true", help="skip the transformers reference")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every configuration N times, round robin, and keep each one's fastest run and "
                        "each rank's median peak memory (use 2-3 on a machine other jobs share)")
    parser.add_argument("--embedding-split", choices=("balanced", "even"), default="balanced",
                        help="who holds the embedding's rows at TP=2 (as `hetero-run generate --embedding-split`)")
    parser.add_argument("--json", action="store_true", help="also print all figures as one JSON object")
    parser.add_argument("--worker", choices=("ours", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--target", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "ours":
        return _ours_worker(args)
    if args.worker == "transformers":
        return _transformers_worker(args)
    _orchestrate(args)


# ------------------------------------------------------------------ orchestration (no model in memory)

def _orchestrate(args) -> None:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        sys.exit(f"unknown config(s): {', '.join(sorted(unknown))}")
    if not args.gguf.is_file():
        sys.exit(f"{args.gguf}: not found (hetero-run fetch cpu-pair downloads it)")
    checkpoints = {q: _checkpoint(args, q) for q in sorted({c.split("-")[1] for c in configs})}
    from hetero_run.runtime.planner import measure_bandwidth

    print(f"{len(PROMPTS)} chat prompts x {args.new_tokens} greedy tokens; {os.cpu_count()} cores; memory bandwidth "
          "measured before and after every run (this machine's varies with what its host runs)", flush=True)
    jobs = {}  # name -> (argv, tp, threads or None)
    if not args.skip_transformers:
        jobs["transformers-fp32"] = ([sys.executable, __file__, "--worker", "transformers", "--target",
                                      str(args.gguf), "--new-tokens", str(args.new_tokens)], 1, None)
    for config in configs:
        tp, quant, *cores = config.split("-")
        jobs[config] = ([sys.executable, __file__, "--worker", "ours", "--target", str(checkpoints[quant]),
                         "--new-tokens", str(args.new_tokens), "--embedding-split", args.embedding_split],
                        int(tp[2:]), 1 if cores else None)
    runs, peaks, shares = {}, {}, {}
    for round_ in range(args.repeat):
        for name, (argv, tp, threads) in jobs.items():
            before = measure_bandwidth()
            run = _spawn(argv, tp, threads)
            run["bandwidth_gbps"] = run.get("stream_gbps") or max(before, measure_bandwidth())
            _line(name if args.repeat == 1 else f"{name} #{round_ + 1}", run)
            peaks.setdefault(name, []).append([r["peak_rss"] for r in run["ranks"]])
            shares.setdefault(name, []).append(_share(run))
            if name not in runs or run["decode_tps"] > runs[name]["decode_tps"]:
                runs[name] = run
    for name, run in runs.items():  # speed: the fastest run; memory and roofline: medians over the runs
        for rank, info in enumerate(run["ranks"]):
            info["peak_rss"] = statistics.median_low(p[rank] for p in peaks[name])
        run["roofline_share"] = statistics.median(shares[name])
    _table(runs)
    if args.json:
        print(json.dumps({"runs": runs}))


def _checkpoint(args, quant: str) -> Path:
    from hetero_run.runtime.convert import load_source, read_manifest, save_converted
    from hetero_run.runtime.fetch import cache_root

    out = (args.cache or cache_root() / "bench") / f"{args.gguf.stem}-{quant}"
    labels = {"source_size": str(args.gguf.stat().st_size)}
    manifest = read_manifest(out) if out.is_dir() else None
    if manifest and manifest.get("quant") == quant and manifest.get("labels") == labels:
        return out
    print(f"converting {args.gguf.name} to {quant} in {out} (once; about a minute)", flush=True)
    model, tokenizer = load_source(args.gguf)
    # transformers marks a GGUF-loaded model as quantised ("gguf") and refuses save_pretrained,
    # although its weights are plain dequantised tensors by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    save_converted(model, tokenizer, out, quant, overwrite=True, source=args.gguf, labels=labels)
    return out


def _spawn(argv: list[str], tp: int, threads: int | None) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if tp > 1:
        mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun"
        argv = [mpirun, "-np", str(tp), "--oversubscribe", "--bind-to", "none"] + argv
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def _share(run: dict) -> float:
    """Decode's weight traffic as a share of the bandwidth measured with that run."""
    return run["decode_bytes"] / 1e9 * run["decode_tps"] / run["bandwidth_gbps"]


def _line(name: str, run: dict) -> None:
    ranks = ", ".join(f"rank {r['rank']} {r['peak_rss'] / 2**20:.0f}" for r in run["ranks"])
    print(f"  {name:18s} decode {run['decode_tps']:6.2f} tok/s, overall {run['overall_tps']:6.2f} tok/s, "
          f"peak RSS {ranks} MiB, bandwidth {run['bandwidth_gbps']:.1f} GB/s, roofline {_share(run):.0%}", flush=True)


def _table(runs: dict) -> None:
    ref = runs.get("transformers-fp32")
    header = (f"{'config':18s} {'decode tok/s':>12s} {'ms/token':>9s} {'overall':>8s} {'vs HF':>6s} "
              f"{'GB/token':>9s} {'GB/s':>6s} {'of':>5s} {'roofline':>9s} {'peak RSS/rank':>14s} {'vs TP=1':>14s} "
              f"{'vs 1 core':>9s} {'HF-equal tokens':>16s}")
    print("\n" + header + "\n" + "-" * len(header))
    for name, run in runs.items():
        ms = 1000 / run["decode_tps"]
        gb = run["decode_bytes"] / 1e9  # read by every rank together per token
        speed = f"{run['overall_tps'] / ref['overall_tps']:.2f}x" if ref else "-"
        rss = max(r["peak_rss"] for r in run["ranks"])
        versus = one_core = "-"
        if name.startswith("tp2"):
            quant = name.split("-")[1]
            if base := runs.get(f"tp1-{quant}"):
                versus = f"{base['decode_tps'] / run['decode_tps']:.2f}x ms, {rss / _peak(base):.0%}"
            if base := runs.get(f"tp1-{quant}-1core"):
                one_core = f"{base['decode_tps'] / run['decode_tps']:.2f}x"
        equal = "-"
        if ref and name != "transformers-fp32":
            same = [_prefix(a, b) for a, b in zip(run["token_ids"], ref["token_ids"], strict=True)]
            equal = f"{sum(same)}/{sum(len(t) for t in ref['token_ids'])}"
        achieved = gb * run["decode_tps"]
        print(f"{name:18s} {run['decode_tps']:12.2f} {ms:9.1f} {run['overall_tps']:8.2f} {speed:>6s} {gb:9.3f} "
              f"{achieved:6.1f} {run['bandwidth_gbps']:5.1f} {run['roofline_share']:9.0%} "
              f"{rss / 2**20:10.0f} MiB {versus:>14s} {one_core:>9s} {equal:>16s}")
    print("\nGB/s = weight bytes read per token x decode tok/s, of the bandwidth measured during the run (TP=1:"
          "\nafter each prompt, with the run's threads, the median; TP=2 and transformers: just before and after it,"
          "\nthe better of the two); roofline = decode's GB/s over that run's bandwidth, the median over the runs"
          "\n(all ranks share this machine's memory); the other columns are the fastest run's, memory the median;"
          "\nvs TP=1 = per-token latency ratio and peak-RSS ratio (largest rank) against the same format at TP=1;"
          "\nvs 1 core = per-token latency ratio against TP=1 on one core (what one rank of TP=2 has here);"
          "\nHF-equal tokens = leading greedy tokens identical to transformers fp32 (bf16 rounding may diverge).")
    _memory(runs)


def _peak(run: dict) -> int:
    return max(r["peak_rss"] for r in run["ranks"])


def _memory(runs: dict) -> None:
    """Per-rank peak memory at TP=2 against TP=1, and what each rank held before its weights."""
    lines = []
    for name, run in runs.items():
        if not name.startswith("tp2") or not (base := runs.get(f"tp1-{name.split('-')[1]}")):
            continue
        ranks = "; ".join(f"rank {r['rank']}: {r['peak_rss'] / 2**20:.0f} MiB ({r['peak_rss'] / _peak(base):.1%}), "
                          f"{r['embedding_rows']} embedding rows, {r['before_load'] / 2**20:.0f} MiB before its weights"
                          for r in run["ranks"])
        lines.append(f"  {name}: TP=1 {_peak(base) / 2**20:.0f} MiB ({base['ranks'][0]['before_load'] / 2**20:.0f} "
                     f"before its weights); {ranks}")
    if lines:
        print("\nper-rank peak RSS at TP=2 against TP=1 (the largest rank is what counts):\n" + "\n".join(lines))


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ------------------------------------------------------------------ workers (one configuration each)

def _peak_rss() -> int:
    """This process's own peak resident set (VmHWM). Not ru_maxrss: Linux carries that across
    exec from the parent's forked image, so a child would inherit the orchestrator's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _ours_worker(args) -> None:
    import torch

    from hetero_run.kernels.sampling import SamplingParams
    from hetero_run.launch.bootstrap import LaunchSettings, launched
    from hetero_run.launch.generate import TargetOnly
    from hetero_run.runtime.models.balance import measure
    from hetero_run.runtime.models.loader import load_model
    from hetero_run.runtime.models.parallel import ParallelContext
    from hetero_run.runtime.runner import TargetRunner, serve_worker

    with launched(LaunchSettings(peer_timeout_s=120)) as dist:
        ctx = ParallelContext.from_dist(dist)
        if dist.is_driver:  # as `hetero-run generate` does: the tokenizer first, on rank 0 only
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(args.target))
            prompts = [_chat_ids(tokenizer, p) for p in PROMPTS]
        before_load = measure().resident  # the runtime, and on rank 0 the tokenizer
        model = load_model(args.target, ctx, max_tokens=1024, embedding_split=args.embedding_split)
        info = {"rank": dist.rank, "threads": torch.get_num_threads(), "weight_bytes": model.weight_nbytes,
                "decode_bytes": model.decode_nbytes(), "embedding_rows": model.embed.rows, "before_load": before_load}
        if dist.is_driver:
            with TargetRunner(model, ctx) as runner:
                decoder = TargetOnly(runner, SamplingParams())
                list(decoder.tokens(prompts[0], 8, set()))  # warm-up
                timings, ids, streams = [], [], []
                for prompt in prompts:
                    start = time.perf_counter()
                    stamps, tokens = [], []
                    for new in decoder.tokens(prompt, args.new_tokens, set()):
                        stamps.append(time.perf_counter())
                        tokens += new
                    timings.append((start, stamps))
                    ids.append(tokens)
                    if dist.world_size == 1:  # the machine's bandwidth right now, with this run's threads
                        streams.append(_stream_gbps(model.embed.weight))
        else:
            serve_worker(model, ctx)
        info["peak_rss"] = _peak_rss()
        ranks = [info]
        if dist.world_size > 1:
            import torch.distributed as tdist

            ranks = [None] * dist.world_size
            tdist.all_gather_object(ranks, info, group=dist.group)
        if dist.is_driver:
            decode_s = sum(s[-1] - s[0] for _, s in timings)
            total_s = sum(s[-1] - start for start, s in timings)
            n = sum(len(s) for _, s in timings)
            print(json.dumps({
                "decode_tps": sum(len(s) - 1 for _, s in timings) / decode_s, "overall_tps": n / total_s,
                "decode_bytes": sum(r["decode_bytes"] for r in ranks), "token_ids": ids, "ranks": ranks,
                "stream_gbps": sorted(streams)[len(streams) // 2] if streams else None,
            }), flush=True)


def _stream_gbps(t, repeats: int = 3) -> float:
    """GB/s of torch's sum over `t` (the embedding: 272 MB here, far beyond the caches), best of
    `repeats`: the planner's bandwidth measure, taken between prompts over memory the run already holds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - start)
    return t.nbytes / best / 1e9


def _transformers_worker(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(args.target.parent), args.target.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    n = args.new_tokens
    config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    prompts = [torch.tensor([_chat_ids(tokenizer, p)]) for p in PROMPTS]
    with torch.inference_mode():
        model.generate(prompts[0], generation_config=GenerationConfig(max_new_tokens=8, do_sample=False,
                                                                      pad_token_id=0))  # warm-up
        seconds, ids = 0.0, []
        for prompt in prompts:
            start = time.perf_counter()
            out = model.generate(prompt, generation_config=config, attention_mask=torch.ones_like(prompt))
            seconds += time.perf_counter() - start
            ids.append(out[0, prompt.shape[1]:].tolist())
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed_tokens" not in name)
    tps = n * len(prompts) / seconds
    print(json.dumps({"decode_tps": tps, "overall_tps": tps, "decode_bytes": weights, "token_ids": ids,
                      "ranks": [{"rank": 0, "threads": torch.get_num_threads(), "peak_rss": _peak_rss()}]}),
          flush=True)


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


if __name__ == "__main__":
    main()
