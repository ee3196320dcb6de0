"""The speculative engine on the real CPU pair at TP=1: every algorithm against the target alone.

    python bench/pair_engine.py [--new-tokens 96] [--algorithms none,slem,tli,slrs,auto] [--sampled]

Target: Qwen2.5-Coder-0.5B-Instruct (GGUF, through the runtime's model code, bf16); drafter:
SmolLM2-135M-Instruct (GGUF, through the same code, NVFP4 weights unless --drafter-weights
dense). Loads both once, then runs the prompts with each algorithm in turn (greedy by default;
--sampled: temperature 0.7, seeded) and prints, per algorithm: tok/s, speed-up over the target alone, tokens per round,
acceptance, draft length, and (greedy) whether every output is token-identical to the target
alone. Token identity needs a target whose logits for a token do not depend on how many tokens
share the forward; in bf16 this runtime's target differs by up to ~0.2 in a logit between a
one-token and a k+1-token forward, so near-ties can flip (--target-dtype fp32 avoids it). One
quick check of the engine; bench/speculative.py is the full benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

PAIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero-run" / "cpu-pair"  # fetch's
PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the nth Fibonacci number iteratively.",
    "Implement binary search over a sorted list in Python.",
    "Summarise in two sentences why the sky is blue.",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", type=Path, default=PAIR)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--algorithms", default="none,slem,tli,slrs,auto")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.7, top-p 0.95, seed 0")
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--fixed", action="store_true", help="no adaptive draft length")
    parser.add_argument("--drafter-weights", choices=("dense", "nvfp4"), default="nvfp4")
    parser.add_argument("--target-dtype", choices=("bf16", "fp32"), default="bf16",
                        help="fp32 gives batch-invariant target logits: greedy outputs then match exactly")
    parser.add_argument("--threads", type=int, help="torch threads for both models (default: torch's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from hetero_run.kernels.sampling import SamplingParams
    from hetero_run.runtime.drafters.load import load_drafter
    from hetero_run.runtime.driver import SpeculativeEngine
    from hetero_run.runtime.models.loader import load_model
    from hetero_run.runtime.runner import TargetRunner
    from hetero_run.runtime.speculative.config import SpeculationConfig

    begin = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(args.pair), gguf_file="qwen2.5-coder-0.5b-instruct.gguf")
    runner = TargetRunner(load_model(args.pair / "qwen2.5-coder-0.5b-instruct.gguf", max_tokens=4096,
                                    dtype=args.target_dtype))
    # NVFP4 weights with float32 activations: no bf16 round trips in the drafter's many small ops
    drafter = load_drafter(args.pair / "SmolLM2-135M-Instruct.Q4_1.gguf", weights=args.drafter_weights,
                           dtype=torch.float32 if args.drafter_weights == "nvfp4" else torch.bfloat16)
    print(f"loaded in {time.perf_counter() - begin:.0f} s", flush=True)
    sampling = SamplingParams(temperature=0.7, top_p=0.95, seed=0) if args.sampled else SamplingParams()
    prompts = PROMPTS[: args.prompts]
    rows, reference = {}, None
    for algorithm in args.algorithms.split(","):
        config = SpeculationConfig(algorithm=algorithm, draft_len=args.draft_len, adaptive=not args.fixed)
        engine = SpeculativeEngine(runner, tokenizer, drafter if algorithm != "none" else None, config)
        engine.generate(prompts[0], max_new_tokens=8, sampling=sampling, chat=True)  # warm-up
        results = [engine.generate(p, max_new_tokens=args.new_tokens, sampling=sampling, chat=True) for p in prompts]
        tokens = sum(r.new_tokens for r in results)
        seconds = sum(r.seconds for r in results)
        rows[algorithm] = {
            "tok_s": tokens / seconds, "tokens_per_round": tokens / sum(r.rounds for r in results),
            "acceptance": sum(r.accepted for r in results) / max(1, sum(r.drafted for r in results)),
            "mean_draft_len": sum(sum(r.draft_lengths) for r in results) / sum(r.rounds for r in results),
            "draft_s": sum(r.draft_seconds for r in results), "verify_s": sum(r.verify_seconds for r in results),
            "rounds_by_algorithm": _merge(r.rounds_by_algorithm() for r in results),
            "counters": _merge(r.counters for r in results),
            "ids": [r.token_ids for r in results],
        }
        if algorithm == "none":
            reference = rows[algorithm]["ids"]
        print(_line(algorithm, rows[algorithm], rows.get("none"), reference, sampling.greedy), flush=True)
    if args.json:
        print(json.dumps({a: {k: v for k, v in r.items() if k != "ids"} for a, r in rows.items()}))


def _merge(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for key, value in d.items():
            out[key] = out.get(key, 0) + value
    return out


def _line(name: str, row: dict, base: dict | None, reference, greedy: bool) -> str:
    speedup = f"{row['tok_s'] / base['tok_s']:.2f}x" if base else "-"
    same = "-" if reference is None or not greedy else ("identical" if row["ids"] == reference else "DIFFERENT")
    return (f"{name:9s} {row['tok_s']:6.2f} tok/s  {speedup:>6s}  {row['tokens_per_round']:.2f} tok/round  "
            f"acceptance {row['acceptance']:.2f}  k~{row['mean_draft_len']:.1f}  draft {row['draft_s']:.1f} s  "
            f"verify {row['verify_s']:.1f} s  {same}  {row['rounds_by_algorithm']} {row['counters'] or ''}")


if __name__ == "__main__":
    main()
