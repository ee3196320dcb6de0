"""Speculative decoding on the real CPU pair: every algorithm against the target alone and against
transformers' assisted generation, greedy and sampled, in one run.

    hetero-run fetch cpu-pair            # once: the pair and its NVFP4 target
    python bench/speculative.py [--new-tokens 64] [--modes greedy,sampled] [--target nvfp4|bf16]
                                [--algorithms none,standard,slem,tli,slrs,auto] [--out DIR]

Target: Qwen2.5-Coder-0.5B-Instruct through the runtime's model code (NVFP4 checkpoint from
`fetch`, or the GGUF in bf16), TP=1. Drafter: SmolLM2-135M-Instruct (another vocabulary) on the
same process. Prompts: bench/prompts/speculative.jsonl (coding and summarisation, chat template).
transformers runs the same two models from their GGUF files (fp32, as it dequantises them):
`generate` alone and with `assistant_model` + `assistant_tokenizer` (its cross-vocabulary path).

Figures: tok/s over all prompts (prefill included, for every row alike), speed-up over the
runtime's target alone and over transformers' assisted generation, tokens per round, acceptance,
and for greedy rows whether every output is token-identical to its own target alone. Sampled
rows cannot be compared token by token (different random streams); their exactness is what
tests/runtime/speculative/test_sampling_exact.py shows. `standard` needs a drafter with the
target's vocabulary; this pair has none, so its row says so. Writes DIR/speculative.json and
DIR/speculative.png and prints a rich table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PROMPTS = Path(__file__).parent / "prompts" / "speculative.jsonl"
TARGET_GGUF, DRAFTER_GGUF = "qwen2.5-coder-0.5b-instruct.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLED = dict(temperature=0.7, top_p=0.95)


def main() -> None:
    from hetero_run.runtime.fetch import cache_root

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", type=Path, default=cache_root() / "cpu-pair", help="where `fetch cpu-pair` put it")
    parser.add_argument("--target", choices=("nvfp4", "bf16"), default="nvfp4")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--algorithms", default="none,standard,slem,tli,slrs,auto")
    parser.add_argument("--prompts", type=int, default=0, help="first N prompts of each task (0: all)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers rows")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()

    prompts = _prompts(args.prompts)
    runtime = RuntimePair(args.pair, args.target)
    hf = None if args.no_transformers else TransformersPair(args.pair)
    rows = []
    for mode in args.modes.split(","):
        sampling = dict(SAMPLED, seed=0) if mode == "sampled" else {}
        for algorithm in args.algorithms.split(","):
            rows.append(runtime.run(algorithm, mode, prompts, args.new_tokens, sampling))
            _progress(rows[-1])
        if hf is not None:
            for assisted in (False, True):
                rows.append(hf.run(assisted, mode, prompts, args.new_tokens, sampling))
                _progress(rows[-1])
    _compare(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"target": args.target, "new_tokens": args.new_tokens, "prompts": [p["prompt"] for p in prompts],
              "threads": torch.get_num_threads(), "rows": [{k: v for k, v in r.items() if k != "ids"} for r in rows]}
    (args.out / "speculative.json").write_text(json.dumps(report, indent=1))
    _table(rows)
    _chart(rows, args.out / "speculative.png")
    print(f"wrote {args.out / 'speculative.json'} and {args.out / 'speculative.png'}")


def _prompts(per_task: int) -> list[dict]:
    entries = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    if per_task:
        entries = [e for task in ("coding", "summarisation")
                   for e in [x for x in entries if x["task"] == task][:per_task]]
    return entries


class RuntimePair:
    """hetero-run's target (TP=1) and drafter, loaded once."""

    def __init__(self, pair: Path, target: str):
        from transformers import AutoTokenizer

        from hetero_run.runtime.drafters.load import load_drafter
        from hetero_run.runtime.models.loader import load_model
        from hetero_run.runtime.runner import TargetRunner

        path = pair / "qwen2.5-coder-0.5b-instruct-nvfp4" if target == "nvfp4" else pair / TARGET_GGUF
        if not path.exists():
            raise SystemExit(f"{path}: not found; run `hetero-run fetch cpu-pair` first")
        self.tokenizer = AutoTokenizer.from_pretrained(str(pair), gguf_file=TARGET_GGUF)
        self.runner = TargetRunner(load_model(path, max_tokens=4096, dtype="bf16"))
        # NVFP4 projections with float32 activations: a quarter of the bytes, no bf16 round trips
        self.drafter = load_drafter(pair / DRAFTER_GGUF, dtype=torch.float32, weights="nvfp4")

    def run(self, algorithm: str, mode: str, prompts: list[dict], new_tokens: int, sampling: dict) -> dict:
        from hetero_run.kernels.sampling import SamplingParams
        from hetero_run.runtime.driver import SpeculativeEngine
        from hetero_run.runtime.speculative.config import SpeculationConfig
        from hetero_run.topology.errors import UserError

        row = {"system": "hetero-run", "algorithm": algorithm, "mode": mode}
        try:
            engine = SpeculativeEngine(self.runner, self.tokenizer, None if algorithm == "none" else self.drafter,
                                       SpeculationConfig(algorithm=algorithm))
        except UserError as e:
            return {**row, "skipped": str(e)}
        params = SamplingParams(**sampling)
        engine.generate(prompts[0]["prompt"], 8, params, chat=True, stop_ids=set())  # warm-up
        results = [engine.generate(p["prompt"], new_tokens, params, chat=True, stop_ids=set()) for p in prompts]
        tokens, seconds = sum(r.new_tokens for r in results), sum(r.seconds for r in results)
        rounds = sum(r.rounds for r in results)
        counters: dict = {}
        for r in results:
            for key, value in {**r.rounds_by_algorithm(), **r.counters}.items():
                counters[key] = counters.get(key, 0) + value
        return {**row, "tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
                "tokens_per_round": tokens / rounds, "rounds": rounds,
                "acceptance": sum(r.accepted for r in results) / max(1, sum(r.drafted for r in results)),
                "by_task": _by_task(prompts, [(r.new_tokens, r.seconds) for r in results]),
                "details": counters, "ids": [r.token_ids for r in results]}


class TransformersPair:
    """The same two models through transformers: `generate` alone and assisted."""

    def __init__(self, pair: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        self.tokenizer = AutoTokenizer.from_pretrained(str(pair), gguf_file=TARGET_GGUF)
        self.draft_tokenizer = AutoTokenizer.from_pretrained(str(pair), gguf_file=DRAFTER_GGUF)
        self.target = AutoModelForCausalLM.from_pretrained(str(pair), gguf_file=TARGET_GGUF, dtype=torch.float32).eval()
        self.drafter = AutoModelForCausalLM.from_pretrained(str(pair), gguf_file=DRAFTER_GGUF,
                                                            dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(self, assisted: bool, mode: str, prompts: list[dict], new_tokens: int, sampling: dict) -> dict:
        extra = dict(assistant_model=self.drafter, tokenizer=self.tokenizer,
                     assistant_tokenizer=self.draft_tokenizer) if assisted else {}
        options = dict(do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=0) \
            if sampling else dict(do_sample=False)
        ids, timings = [], []
        for i, p in enumerate([prompts[0]] + prompts):  # the first is a warm-up
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                                      add_generation_prompt=True, tokenize=False)
            prompt_ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
            torch.manual_seed(sampling.get("seed", 0))
            begin = time.perf_counter()
            out = self.target.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                       max_new_tokens=8 if i == 0 else new_tokens, min_new_tokens=0,
                                       eos_token_id=None, pad_token_id=self.tokenizer.eos_token_id, **options,
                                       **extra)
            if i:
                timings.append((out.shape[1] - prompt_ids.shape[1], time.perf_counter() - begin))
                ids.append(out[0, prompt_ids.shape[1]:].tolist())
        tokens, seconds = sum(t for t, _ in timings), sum(s for _, s in timings)
        return {"system": "transformers", "algorithm": "assisted" if assisted else "none", "mode": mode,
                "tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
                "by_task": _by_task(prompts, timings), "ids": ids}


def _by_task(prompts: list[dict], timings: list[tuple[int, float]]) -> dict:
    out = {}
    for task in sorted({p["task"] for p in prompts}):
        picked = [t for p, t in zip(prompts, timings, strict=True) if p["task"] == task]
        out[task] = sum(n for n, _ in picked) / sum(s for _, s in picked)
    return out


def _compare(rows: list[dict]) -> None:
    """Speed-ups and identity against the same mode's baselines."""
    def find(system, algorithm, mode):
        return next((r for r in rows if (r["system"], r["algorithm"], r["mode"]) == (system, algorithm, mode)
                     and "tok_s" in r), None)

    for r in rows:
        if "tok_s" not in r:
            continue
        alone = find(r["system"], "none", r["mode"])
        ours, assisted = find("hetero-run", "none", r["mode"]), find("transformers", "assisted", r["mode"])
        r["vs_target_alone"] = r["tok_s"] / ours["tok_s"] if ours else None
        r["vs_transformers_assisted"] = r["tok_s"] / assisted["tok_s"] if assisted else None
        r["identical"] = (r["ids"] == alone["ids"]) if r["mode"] == "greedy" and alone else None


def _progress(r: dict) -> None:
    what = r.get("skipped") or f"{r['tok_s']:.2f} tok/s"
    print(f"{r['system']:12s} {r['mode']:7s} {r['algorithm']:9s} {what}", flush=True)


def _table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Speculative decoding on the real CPU pair (tok/s over all prompts, prefill included)")
    for column in ("system", "mode", "algorithm", "tok/s", "vs target alone", "vs transformers assisted",
                   "coding tok/s", "summarisation tok/s", "tokens/round", "acceptance", "identical", "notes"):
        table.add_column(column, justify="left" if column in ("system", "mode", "algorithm", "notes") else "right")
    for r in rows:
        if "skipped" in r:
            table.add_row(r["system"], r["mode"], r["algorithm"], *["-"] * 8, r["skipped"])
            continue
        identical = {None: "-", True: "yes", False: "NO"}[r.get("identical")]
        table.add_row(r["system"], r["mode"], r["algorithm"], f"{r['tok_s']:.2f}", _x(r.get("vs_target_alone")),
                      _x(r.get("vs_transformers_assisted")), f"{r['by_task'].get('coding', 0):.2f}",
                      f"{r['by_task'].get('summarisation', 0):.2f}",
                      f"{r['tokens_per_round']:.2f}" if "tokens_per_round" in r else "-",
                      f"{r['acceptance']:.1%}" if "acceptance" in r else "-", identical,
                      ", ".join(f"{k} {v}" for k, v in r.get("details", {}).items()))
    Console(width=200).print(table)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows}, key=["greedy", "sampled"].index)
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        picked = [r for r in rows if r["mode"] == mode and "tok_s" in r]
        labels = [f"{'hf ' if r['system'] == 'transformers' else ''}{r['algorithm']}" for r in picked]
        ax.bar(labels, [r["tok_s"] for r in picked],
               color=["tab:gray" if r["system"] == "transformers" else "tab:blue" for r in picked])
        ax.set_title(f"{mode}: tok/s (higher is better)")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
