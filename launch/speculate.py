"""`hetero-run generate --drafter`: the speculative engine as a generate decoder, with live stats.

The drafter and both tokenizers live on rank 0 only; the other ranks serve the target's
forwards exactly as they do for the target alone (runtime/runner.py).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from hetero_run.runtime.speculative.config import ALGORITHMS

log = logging.getLogger("hetero_run.launch.speculate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (the drafter runs on rank 0)")
    group.add_argument("--drafter", metavar="DIR|FILE.gguf|eagle3:DIR",
                       help="a small causal LM with its own tokenizer, any vocabulary (docs/algorithms.md); or "
                       "eagle3:DIR, an EAGLE-3 head for this target (docs/eagle3.md)")
    group.add_argument("--algorithm", choices=ALGORITHMS, default=None,
                       help="auto picks, every round, from measured cost per token: the target alone, the model-free "
                       "proposers, the drafter or both in one tree; ngram (prompt lookup) and suffix (suffix "
                       "decoding) need no drafter (default: auto with --drafter, none without)")
    group.add_argument("--draft-len", type=int, default=4, metavar="K",
                       help="draft length of the first round; every round's with --fixed-draft-len (default 4)")
    group.add_argument("--fixed-draft-len", action="store_true",
                       help="keep --draft-len every round instead of adapting it to measured acceptance and cost")
    group.add_argument("--max-draft-len", type=int, default=12, metavar="K", help="adaptive upper bound (default 12)")
    group.add_argument("--hybrid", action="store_true",
                       help="with a drafter algorithm: also verify the model-free candidates in the same round")
    group.add_argument("--model-free", default="ngram,suffix", metavar="LIST",
                       help="model-free proposers auto and --hybrid use: ngram, suffix or both (default ngram,suffix)")
    group.add_argument("--prompt-lookup-min", type=int, default=2, metavar="N",
                       help="ngram: shortest earlier match that proposes (default 2)")
    group.add_argument("--prompt-lookup-max", type=int, default=5, metavar="N",
                       help="ngram: longest match looked for (default 5)")
    group.add_argument("--suffix-max-depth", type=int, default=24, metavar="N",
                       help="suffix: longest match and deepest continuation (default 24)")
    group.add_argument("--suffix-spec-factor", type=float, default=1.0, metavar="F",
                       help="suffix: tree nodes per matched token at most (default 1.0)")
    group.add_argument("--suffix-spec-offset", type=float, default=5.0, metavar="F",
                       help="suffix: tree nodes beyond spec-factor x match length (default 5.0)")
    group.add_argument("--suffix-min-match", type=int, default=1, metavar="N",
                       help="suffix: shortest match of the text's last tokens that proposes (default 1)")
    group.add_argument("--suffix-min-prob", type=float, default=0.1, metavar="P",
                       help="suffix: continuations below this estimated probability are not proposed (default 0.1)")
    group.add_argument("--suffix-max-generations", type=int, default=256, metavar="N",
                       help="suffix: earlier generations the process keeps, oldest evicted first (default 256)")
    group.add_argument("--sampled-verification", choices=("keyed", "rejection"), default="keyed",
                       help="seeded sampled requests: keyed draws each token from noise of (seed, position), so the "
                       "output equals the target alone's with that seed under any speculation and batching; "
                       "rejection accepts more drafts but its output depends on them (default keyed)")
    group.add_argument("--eagle3-layer-numbering", choices=("input", "output"),
                       help="override how the head's aux layer ids count (default: its layout's convention)")
    group.add_argument("--drafter-weights", choices=("dense", "nvfp4"), default="dense",
                       help="nvfp4 quantises a llama/qwen drafter's projections (a quarter of the bytes per step)")
    group.add_argument("--compare", action="store_true",
                       help="also run the target alone on each prompt; report the speed-up and whether the outputs "
                       "are identical")


def speculation_config(args: argparse.Namespace):
    """The SpeculationConfig the flags ask for (a ConfigError names the flag)."""
    from hetero_run.runtime.speculative.config import MODEL_FREE, SpeculationConfig
    from hetero_run.topology.errors import ConfigError

    algorithm = args.algorithm or ("auto" if args.drafter else "none")
    if args.drafter is None and algorithm not in ("none", "auto", *MODEL_FREE):
        raise ConfigError(f"algorithm {algorithm!r} needs a drafter", field="--drafter")
    if args.drafter is not None and not drafter_path(args.drafter).exists():
        raise ConfigError("no such drafter directory or GGUF file", file=drafter_path(args.drafter),
                          field="--drafter")
    modelfree = tuple(m.strip() for m in args.model_free.split(",") if m.strip())
    flags = {"modelfree": "--model-free"}
    try:
        return SpeculationConfig(algorithm=algorithm, draft_len=args.draft_len, adaptive=not args.fixed_draft_len,
                                 max_draft_len=max(args.max_draft_len, args.draft_len), hybrid=args.hybrid,
                                 modelfree=modelfree, prompt_lookup_min=args.prompt_lookup_min,
                                 prompt_lookup_max=args.prompt_lookup_max, suffix_max_depth=args.suffix_max_depth,
                                 suffix_spec_factor=args.suffix_spec_factor, suffix_min_prob=args.suffix_min_prob,
                                 suffix_spec_offset=args.suffix_spec_offset, suffix_min_match=args.suffix_min_match,
                                 suffix_max_generations=args.suffix_max_generations,
                                 sampled_verification=getattr(args, "sampled_verification", "keyed"))
    except ConfigError as exc:
        field = flags.get(exc.field) or "--" + (exc.field or "").replace("_", "-")
        raise ConfigError(exc.message, field=field) from None


class LiveStats:
    """One status line on rank 0's terminal, redrawn every round: tok/s, acceptance, tokens per
    round, draft length, algorithm. Off when stderr is not a terminal (the log has the totals)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.live = None

    def __enter__(self) -> LiveStats:
        from hetero_run.launch.log import console

        if self.enabled and console(stderr=True).is_terminal:
            from rich.live import Live

            # stdout (the streamed text) goes through Live too, so the status line stays below it
            self.live = Live("", console=console(stderr=True), refresh_per_second=8, transient=True,
                             redirect_stdout=True, redirect_stderr=False)
            self.live.__enter__()
        return self

    def update(self, stats) -> None:
        if self.live is not None:
            self.live.update(
                f"[bold]{stats.tokens_per_second:6.2f} tok/s[/]  acceptance {stats.acceptance_rate:6.1%}  "
                f"{stats.tokens_per_round:5.2f} tokens/round  draft length {stats.draft_len:2d}  "
                f"[dim]{stats.algorithm}, round {stats.round}, {stats.new_tokens} tokens[/]")

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
            self.live = None


class SpeculativeDecoder:
    """The generate decoder for --drafter: one SpeculativeEngine over the TP target runner."""

    def __init__(self, runner, target_tokenizer, drafter, config, sampling, live: bool):
        from hetero_run.runtime.driver import SpeculativeEngine

        self.engine = SpeculativeEngine(runner, target_tokenizer, drafter, config)
        self.algorithm = config.algorithm
        self.sampling, self.live = sampling, live

    def warm_up(self, prompt, max_new_tokens: int, stop_ids: set[int], on_tokens) -> dict:
        """An untimed run that leaves no trace in the suffix cache (it is no earlier generation)."""
        out = self.generate(prompt, max_new_tokens, stop_ids, on_tokens)
        if self.engine.suffix_cache is not None:
            self.engine.suffix_cache.clear()
        return out

    def generate(self, prompt, max_new_tokens: int, stop_ids: set[int],
                 on_tokens: Callable[[list[int]], None]) -> dict:
        with LiveStats(self.live) as stats:
            def on_round(round_stats) -> None:
                stats.update(round_stats)
                if round_stats.token_ids:
                    on_tokens(round_stats.token_ids)

            result = self.engine.generate(prompt, max_new_tokens, self.sampling, stop_ids=stop_ids,
                                          on_round=on_round)
        log.info("%s: %d rounds, acceptance %.1f%%, %.2f tokens/round, draft %.2f s, verify %.2f s, rounds %s",
                 result.algorithm, result.rounds, 100 * result.acceptance_rate, result.tokens_per_round,
                 result.draft_seconds, result.verify_seconds, result.rounds_by_algorithm())
        return {"prefill_seconds": result.prefill_seconds, "rounds": result.rounds,
                "acceptance_rate": round(result.acceptance_rate, 4),
                "tokens_per_round": round(result.tokens_per_round, 4),
                "rounds_by_algorithm": result.rounds_by_algorithm(), "draft_seconds": round(result.draft_seconds, 4),
                "verify_seconds": round(result.verify_seconds, 4), "counters": result.counters}


def drafter_path(spec: str) -> Path:
    from hetero_run.runtime.eagle3 import EAGLE3_PREFIX

    return Path(spec.removeprefix(EAGLE3_PREFIX))


def load(args: argparse.Namespace, target, target_tokenizer, target_source: Path, dtype: str):
    """The drafter named by --drafter, on rank 0 (None without one). An EAGLE-3 head attaches
    to rank 0's shard of the target (it reads the target's hidden states)."""
    import torch

    from hetero_run.runtime.drafters.load import load_drafter
    from hetero_run.runtime.eagle3 import EAGLE3_PREFIX, load_eagle3
    from hetero_run.runtime.speculative.config import MODEL_FREE

    if args.drafter is None or (args.algorithm or "auto") in ("none", *MODEL_FREE):
        return None
    if args.drafter.startswith(EAGLE3_PREFIX):
        return load_eagle3(args.drafter, target, target_tokenizer, target_source=target_source,
                           layer_numbering=args.eagle3_layer_numbering)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # GGUF de-quantisation bars; the log says what loads
    torch_dtype = torch.float32 if dtype in ("fp32", "float32") else torch.bfloat16
    return load_drafter(args.drafter, dtype=torch_dtype, max_tokens=target.max_tokens, weights=args.drafter_weights,
                        slots=getattr(args, "max_num_seqs", 1))  # serve drafts for each running request
