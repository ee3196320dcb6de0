"""Speculative decoding on the real CPU pair: every algorithm against the target alone, on an open
and an input-grounded prompt set, at TP=1 and TP=2, greedy and sampled, in one run.

    hetero-run fetch cpu-pair            # once: the pair and its NVFP4 target
    make bench-peers                     # optional: llama-cpp-python for the llama.cpp rows
    python bench/speculative.py [--sets open,grounded] [--tp 1,2] [--modes greedy,sampled]
                                [--algorithms none,ngram,suffix,drafter,hybrid,auto] [--new-tokens 64]
                                [--prompts N] [--transformers] [--no-llama-cpp] [--out DIR]

A row of --algorithms may set fields of SpeculationConfig in brackets, compared side by side
with the defaults in the same run: `--algorithms "none,auto,auto[prompt_lookup_min=1]"`.

Target: Qwen2.5-Coder-0.5B-Instruct through the runtime's model code (the NVFP4 checkpoint from
`fetch`, or the GGUF in bf16); TP=2 runs the same measurements under `mpirun -np 2` (one core per
rank, the drafter on rank 0). Drafter: SmolLM2-135M-Instruct (another vocabulary, NVFP4
projections). `drafter` is slem when greedy and tli when sampled (auto's own pick); `hybrid` is
that drafter with the model-free candidates verified in the same round (`--hybrid`); `ngram`
and `suffix` need no drafter. Prompt sets (chat template, 64 new tokens each, end-of-turn
ignored so every row generates the same number of tokens):

- open: bench/prompts/speculative.jsonl, coding and summarisation requests;
- grounded: bench/prompts/grounded.jsonl, requests that work on a given input: edit this code,
  summarise this text, answer from this passage, convert this record.

Prefill is the same work in every hetero-run row, and on this CPU the NVFP4 target prefills
slowly (its kernel is compute-bound), so a long grounded prompt's prefill can outweigh its 64
new tokens: the tables give decode tok/s (new tokens after the first, over the time after it)
beside end-to-end tok/s, and the ratios of both to the target alone in the same run. Each row
is a fresh engine (its suffix cache starts empty: only earlier prompts of the same row are
"earlier generations"; the warm-up prompt is not in any set). Also per row: tokens per round,
acceptance (accepted / draft rows verified), whether every output is token-identical to the
target alone (greedy; and sampled, seed 0: keyed verification draws each token from noise of
the seed and its position, so a seeded sampled output is the target alone's too; that the
draws follow p exactly is what tests/runtime/speculative/test_sampling_exact.py shows), what
auto picked, and the model-free proposers' lookup and update cost per round (the suffix tree's update included). With
llama-cpp-python importable, llama.cpp runs the same GGUF target on 2 threads alone and with
its prompt-lookup drafter (greedy; the same prompts rendered by the same chat template).
For greedy rows it also prints a foresight bound per set: what drafting from earlier occurrences
(prompt, output so far, earlier outputs) could reach if it knew which tokens will be accepted,
at the target's verify costs measured in the same run (`foresight`).
Writes DIR/speculative.json and prints one table per
prompt set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPTS = {"open": Path(__file__).parent / "prompts" / "speculative.jsonl",
           "grounded": Path(__file__).parent / "prompts" / "grounded.jsonl"}
TARGET_GGUF, DRAFTER_GGUF = "qwen2.5-coder-0.5b-instruct.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLED = dict(temperature=0.7, top_p=0.95)
WARM_UP = "Say hello."


def main() -> None:
    from hetero_run.runtime.fetch import cache_root

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", type=Path, default=cache_root() / "cpu-pair", help="where `fetch cpu-pair` put it")
    parser.add_argument("--target", choices=("nvfp4", "bf16"), default="nvfp4")
    parser.add_argument("--sets", default="open,grounded")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes (2: under mpirun -np 2)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--algorithms", default="none,ngram,suffix,drafter,hybrid,auto",
                        help="rows; a row may set speculation fields in brackets, as in "
                             "'auto[prompt_lookup_min=1,suffix_spec_factor=2]' or 'auto[modelfree=suffix]' "
                             "(each field of SpeculationConfig; a list joined by +)")
    parser.add_argument("--prompts", type=int, default=0, help="first N prompts of each set (0: all)")
    parser.add_argument("--transformers", action="store_true", help="also transformers alone and assisted (slow)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp rows")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # an mpirun rank writes its rows here
    args = parser.parse_args()

    sets = {name: _prompts(name, args.prompts) for name in args.sets.split(",")}
    if args.child is not None:
        return _child(args, sets)
    rows = []
    for tp in [int(t) for t in args.tp.split(",")]:
        rows += _measure(args, sets) if tp == 1 else _mpirun(args, tp)
    if not args.no_llama_cpp:
        rows += LlamaCpp.rows(args.pair, sets, args.new_tokens, args.modes.split(","))
    if args.transformers:
        hf = TransformersPair(args.pair)
        for name, prompts in sets.items():
            for mode in args.modes.split(","):
                for assisted in (False, True):
                    rows.append({**hf.run(assisted, mode, prompts, args.new_tokens, _sampling(mode)), "set": name,
                                 "tp": 1})
                    _progress(rows[-1])
    _compare(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"target": args.target, "new_tokens": args.new_tokens, "sets": {k: [p["prompt"] for p in v]
                                                                           for k, v in sets.items()},
              "rows": [{k: v for k, v in r.items() if k != "ids"} for r in rows]}
    (args.out / "speculative.json").write_text(json.dumps(report, indent=1))
    _tables(rows)
    print(f"wrote {args.out / 'speculative.json'}")


def _prompts(name: str, first: int) -> list[dict]:
    entries = [json.loads(line) for line in PROMPTS[name].read_text().splitlines() if line.strip()]
    if first:
        tasks = sorted({e["task"] for e in entries}, key=[e["task"] for e in entries].index)
        entries = [e for task in tasks for e in [x for x in entries if x["task"] == task][:first]]
    return entries


def _rows(spec: str) -> list[str]:
    """--algorithms split at the commas outside brackets."""
    return [part for part in re.split(r",(?![^\[]*\])", spec) if part]


def _overrides(row: str) -> tuple[str, dict]:
    """'auto[prompt_lookup_min=1,suffix_min_prob=0.05]' -> ('auto', {...}), each value of its field's type."""
    import dataclasses

    from hetero_run.runtime.speculative.config import SpeculationConfig

    name, _, rest = row.partition("[")
    if not rest:
        return name, {}
    if not rest.endswith("]"):
        raise SystemExit(f"--algorithms: {row!r} has no closing bracket")
    types = {f.name: f.type for f in dataclasses.fields(SpeculationConfig)}
    out = {}
    for item in rest[:-1].split(","):
        key, _, value = item.partition("=")
        if key not in types or key in ("algorithm", "hybrid"):
            raise SystemExit(f"--algorithms: {key!r} in {row!r} is not a speculation field this bench can set")
        cast = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true", "yes"),
                "tuple[str, ...]": lambda v: tuple(v.split("+"))}.get(types[key], str)
        try:
            out[key] = cast(value)
        except ValueError:
            raise SystemExit(f"--algorithms: {key}={value!r} in {row!r} is not a {types[key]}") from None
    return name, out


def _sampling(mode: str) -> dict:
    return dict(SAMPLED, seed=0) if mode == "sampled" else {}


def _measure(args, sets: dict, ctx=None) -> list[dict]:
    runtime = RuntimePair(args.pair, args.target, ctx)
    tp = 1 if ctx is None else ctx.size
    rows = []
    try:
        for name, prompts in sets.items():
            for mode in args.modes.split(","):
                for row in runtime.run(_rows(args.algorithms), mode, prompts, args.new_tokens, _sampling(mode)):
                    rows.append({**row, "set": name, "tp": tp})
                    _progress(rows[-1])
    finally:
        runtime.close()
    return rows


def _mpirun(args, tp: int) -> list[dict]:
    """The same measurements under mpirun -np tp; rank 0 writes its rows to a file."""
    out = args.out / f"tp{tp}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    mpirun = Path(sys.executable).parent / "mpirun"
    argv = [str(mpirun if mpirun.exists() else "mpirun"), "-np", str(tp), "--oversubscribe", "--bind-to", "none",
            sys.executable, __file__, "--child", str(out), "--pair", str(args.pair), "--target", args.target,
            "--sets", args.sets, "--new-tokens", str(args.new_tokens), "--modes", args.modes,
            "--algorithms", args.algorithms, "--prompts", str(args.prompts), "--no-llama-cpp", "--out", str(args.out)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("OMP_NUM_THREADS", None)  # the bootstrap splits the cores between the ranks
    proc = subprocess.run(argv, env=env)
    if proc.returncode != 0 or not out.is_file():
        print(f"TP={tp} run failed (exit status {proc.returncode})", flush=True)
        return []
    return json.loads(out.read_text())


def _child(args, sets: dict) -> None:
    from hetero_run.launch.bootstrap import LaunchSettings, launched
    from hetero_run.runtime.models.parallel import ParallelContext

    with launched(LaunchSettings(peer_timeout_s=600)) as dist:
        ctx = ParallelContext.from_dist(dist)
        if not dist.is_driver:
            from hetero_run.runtime.models.loader import load_model
            from hetero_run.runtime.runner import serve_worker

            serve_worker(load_model(_target_path(args.pair, args.target), ctx, max_tokens=4096, dtype="bf16"), ctx)
            return
        rows = _measure(args, sets, ctx)
        args.child.write_text(json.dumps(rows))


def _target_path(pair: Path, target: str) -> Path:
    path = pair / "qwen2.5-coder-0.5b-instruct-nvfp4" if target == "nvfp4" else pair / TARGET_GGUF
    if not path.exists():
        raise SystemExit(f"{path}: not found; run `hetero-run fetch cpu-pair` first")
    return path


class RuntimePair:
    """hetero-run's target (TP=1, or rank 0 of a TP group) and drafter, loaded once."""

    def __init__(self, pair: Path, target: str, ctx=None):
        from transformers import AutoTokenizer

        from hetero_run.runtime.drafters.load import load_drafter
        from hetero_run.runtime.models.loader import load_model
        from hetero_run.runtime.runner import TargetRunner

        self.tokenizer = AutoTokenizer.from_pretrained(str(pair), gguf_file=TARGET_GGUF)
        model = load_model(_target_path(pair, target), ctx, max_tokens=4096, dtype="bf16")
        self.runner = TargetRunner(model, ctx)
        # as `hetero-run generate --drafter-weights nvfp4` loads it beside a bf16 target: NVFP4
        # projections, bf16 activations (on AMX hosts the tiles for prompt reads, docs/drafter.md)
        self.drafter = load_drafter(pair / DRAFTER_GGUF, dtype=torch.bfloat16, weights="nvfp4", max_tokens=4096)

    def close(self) -> None:
        self.runner.close()

    def verify_ms(self, rows: int, repeat: int = 5) -> dict[int, float]:
        """The target's forward of n = 1..rows rows after a 128-token prompt: ms, median of `repeat`."""
        gen = torch.Generator().manual_seed(0)
        vocab = self.runner.model.config.vocab_size
        prompt = torch.randint(0, vocab, (128,), generator=gen)
        ids = torch.randint(0, vocab, (rows,), generator=gen)
        self.runner.truncate(0)
        self.runner.forward(prompt, torch.arange(128), num_logits=1)
        from verify_forward import time_rows  # bench/, the folder of the script that runs

        times, _ = time_rows(self.runner, 128, ids, list(range(1, rows + 1)), repeat)
        self.runner.truncate(0)
        return {n: statistics.median(t) * 1e3 for n, t in times.items()}

    def run(self, algorithms: list[str], mode: str, prompts: list[dict], new_tokens: int, sampling: dict) -> list[dict]:
        """One row per algorithm. The algorithms take turns on each prompt (the machine's load
        drifts over minutes; turns keep the ratios fair), each with its own engine, so what one
        learns from earlier prompts (cost model, suffix cache) stays its own."""
        from hetero_run.kernels.sampling import SamplingParams
        from hetero_run.runtime.driver import SpeculativeEngine
        from hetero_run.runtime.speculative.config import MODEL_FREE, SpeculationConfig
        from hetero_run.topology.errors import UserError

        params = SamplingParams(**sampling)
        drafter_algorithm = "slem" if mode == "greedy" else "tli"
        engines, rows = {}, []
        for row in algorithms:
            algorithm, fields = _overrides(row)
            name = {"drafter": drafter_algorithm, "hybrid": drafter_algorithm}.get(algorithm, algorithm)
            label = f"{name} + model-free (hybrid)" if algorithm == "hybrid" else name
            if fields:
                label += " [" + ", ".join(f"{k}={v}" for k, v in fields.items()) + "]"
            drafter = None if name in ("none", *MODEL_FREE) else self.drafter
            try:
                engine = SpeculativeEngine(self.runner, self.tokenizer, drafter,
                                           SpeculationConfig(algorithm=name, hybrid=algorithm == "hybrid", **fields))
            except UserError as e:
                rows.append({"system": "hetero-run", "algorithm": label, "mode": mode, "skipped": str(e)})
                continue
            engine.generate(WARM_UP, 8, params, chat=True, stop_ids=set())
            if engine.suffix_cache is not None:  # the warm-up is no earlier generation of the set
                engine.suffix_cache.clear()
            engines[label] = engine
        results = {label: [] for label in engines}
        for p in prompts:
            for label, engine in engines.items():
                results[label].append(engine.generate(p["prompt"], new_tokens, params, chat=True, stop_ids=set()))
        for label, done in results.items():
            rows.append({"system": "hetero-run", "algorithm": label, "mode": mode, **_figures(done)})
            if label == "none" and mode == "greedy":
                from hetero_run.runtime.speculative.prompt import Prompt

                depth = SpeculationConfig().modelfree_max_nodes
                verify = self.verify_ms(depth + 1)
                prompt_ids = [Prompt.of(p["prompt"], chat=True).for_target(self.tokenizer) for p in prompts]
                rows[-1]["foresight"] = {**foresight(prompt_ids, [r.token_ids for r in done], verify, depth),
                                         "verify_ms": {n: round(v, 2) for n, v in verify.items()}}
        return rows


def foresight(prompts: list[list[int]], outputs: list[list[int]], verify_ms: dict[int, float],
              depth: int = 16) -> dict:
    """What drafting from earlier occurrences could reach with perfect foresight, on the target
    alone's greedy outputs: a bound for prompt lookup and suffix trees on this set.

    Each round, the next tokens are drafted from the earlier occurrence of the last token (in the
    prompt, the output so far, or an earlier output of the set, as the suffix cache holds them)
    whose continuation matches the most of them, at most `depth`, and exactly those are verified
    (a round with none is a plain step). Any model-free proposer drafts from such occurrences (a
    longer match is one of them), so none accepts more per round; and none verifies fewer rows
    for what it accepts. `verify_ms[n]`: the target's forward of n rows, measured in the same run.
    Returns tokens per round and the decode time against one plain step per token.
    """
    earlier: list[list[int]] = []
    tokens = rounds = 0
    ms = plain_ms = 0.0
    for prompt, output in zip(prompts, outputs, strict=True):
        context = list(prompt)
        i = 0
        while i < len(output):
            best = 0
            for pool in (context, *earlier):
                limit = len(pool) - 1 if pool is context else len(pool)
                for j in range(limit):
                    if pool[j] != context[-1]:
                        continue
                    run = 0
                    while (run < depth and i + run < len(output) and j + 1 + run < len(pool)
                           and pool[j + 1 + run] == output[i + run]):
                        run += 1
                    best = max(best, run)
            step = min(best + 1, len(output) - i)
            ms += verify_ms[step]
            context += output[i:i + step]
            i += step
            rounds += 1
        tokens += len(output)
        plain_ms += len(output) * verify_ms[1]
        earlier.append(list(output))
    return {"tokens_per_round": tokens / max(1, rounds), "decode_speedup": plain_ms / ms if ms else 1.0,
            "depth": depth}


def _figures(results) -> dict:
    tokens, seconds = sum(r.new_tokens for r in results), sum(r.seconds for r in results)
    decode = sum(r.seconds - r.prefill_seconds for r in results)
    rounds = sum(r.rounds for r in results)
    counters: dict = {}
    for r in results:
        for key, value in r.rounds_by_algorithm().items():
            counters[key] = counters.get(key, 0) + value
    cost = {k: round(sum(r.counters.get(k, 0.0) for r in results) / len(results), 1)
            for k in ("modelfree_propose_us_per_round", "modelfree_update_us_per_round",
                      "modelfree_suffix_update_us_per_round")}
    return {"decode_tok_s": (tokens - len(results)) / decode, "tok_s": tokens / seconds, "tokens": tokens,
            "seconds": seconds, "prefill_seconds": seconds - decode, "tokens_per_round": tokens / rounds,
            "rounds": rounds, "acceptance": sum(r.accepted for r in results) / max(1, sum(r.drafted for r in results)),
            "rounds_by": counters, "modelfree_cost": cost, "ids": [r.token_ids for r in results]}


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on the same GGUF target, 2 threads: alone and with its
    prompt-lookup drafter. Greedy only (its sampler is not ours)."""

    @staticmethod
    def rows(pair: Path, sets: dict, new_tokens: int, modes: list[str]) -> list[dict]:
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            print("llama.cpp rows skipped: llama_cpp does not import (make bench-peers builds it)", flush=True)
            return []
        if "greedy" not in modes:
            return []
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(pair), gguf_file=TARGET_GGUF)
        stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        rows = []
        for drafted in (False, True):
            draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if drafted else None
            llm = Llama(model_path=str(pair / TARGET_GGUF), n_threads=2, n_threads_batch=2, n_ctx=4096,
                        draft_model=draft, verbose=False, logits_all=drafted)
            for name, prompts in sets.items():
                texts = [tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                                       add_generation_prompt=True, tokenize=False) for p in prompts]
                options = dict(max_tokens=new_tokens, temperature=0.0, top_k=1, logit_bias={s: -1e9 for s in stops})
                llm.create_completion(WARM_UP, max_tokens=8, temperature=0.0)
                tokens, seconds, decode = 0, 0.0, 0.0
                for text in texts:
                    llm.reset()
                    begin = time.perf_counter()
                    first, n = None, 0
                    for _ in llm.create_completion(text, stream=True, **options):  # one chunk per token
                        first = first or time.perf_counter()
                        n += 1
                    end = time.perf_counter()
                    seconds += end - begin
                    decode += end - first
                    tokens += n
                rows.append({"system": "llama.cpp", "algorithm": "prompt lookup" if drafted else "none",
                             "mode": "greedy", "set": name, "tp": 1, "tok_s": tokens / seconds,
                             "decode_tok_s": (tokens - len(texts)) / decode, "tokens": tokens, "seconds": seconds,
                             "prefill_seconds": seconds - decode})
                _progress(rows[-1])
            del llm
        return rows


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
        ids, tokens, seconds = [], 0, 0.0
        for i, p in enumerate([{"prompt": WARM_UP}] + prompts):  # the first is a warm-up
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
                tokens += out.shape[1] - prompt_ids.shape[1]
                seconds += time.perf_counter() - begin
                ids.append(out[0, prompt_ids.shape[1]:].tolist())
        return {"system": "transformers", "algorithm": "assisted" if assisted else "none", "mode": mode,
                "tok_s": tokens / seconds, "decode_tok_s": None, "tokens": tokens, "seconds": seconds, "ids": ids}


def _compare(rows: list[dict]) -> None:
    """Ratios to the runtime's target alone and greedy identity, within a set, mode and TP."""
    def alone(r):
        return next((x for x in rows if x["system"] == "hetero-run" and x["algorithm"] == "none" and "tok_s" in x
                     and (x["set"], x["mode"], x["tp"]) == (r["set"], r["mode"], r["tp"])), None)

    for r in rows:
        if "tok_s" not in r:
            continue
        base = alone(r) if r["system"] == "hetero-run" else alone({**r, "tp": 1})
        r["vs_target_alone"] = r["tok_s"] / base["tok_s"] if base else None
        r["decode_vs_target_alone"] = r["decode_tok_s"] / base["decode_tok_s"] \
            if base and r.get("decode_tok_s") else None
        # greedy, and seeded sampled rows (keyed verification): token-identical to the target alone
        same_engine = r["system"] == "hetero-run" or r["mode"] == "greedy"
        r["identical"] = (r["ids"] == base["ids"]) if same_engine and base and "ids" in r else None


def _progress(r: dict) -> None:
    what = r.get("skipped") or f"{r['tok_s']:.2f} tok/s end to end" + (
        f", {r['decode_tok_s']:.2f} tok/s decode" if r.get("decode_tok_s") else "")
    print(f"{r['system']:12s} TP={r.get('tp', 1)} {r.get('set', ''):9s} {r['mode']:7s} {r['algorithm']:28s} {what}",
          flush=True)


def _tables(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)
    for name in dict.fromkeys(r.get("set") for r in rows):
        table = Table(title=f"prompt set '{name}': decode tok/s (after the first token) and end-to-end tok/s "
                            "(prefill included) over all its prompts; ratios to hetero-run's target alone in the "
                            "same run, same TP and mode")
        for column in ("TP", "mode", "system", "algorithm", "decode tok/s", "vs target alone", "end-to-end tok/s",
                       "vs target alone ", "tokens/round", "acceptance", "identical", "rounds by choice",
                       "model-free us/round (lookup, update, of it suffix)"):
            table.add_column(column, justify="left" if column in ("mode", "system", "algorithm", "rounds by choice")
                             else "right")
        for r in rows:
            if r.get("set") != name:
                continue
            if "skipped" in r:
                table.add_row(str(r["tp"]), r["mode"], r["system"], r["algorithm"], *["-"] * 7, r["skipped"], "-")
                continue
            cost = r.get("modelfree_cost") or {}
            table.add_row(
                str(r["tp"]), r["mode"], r["system"], r["algorithm"],
                f"{r['decode_tok_s']:.2f}" if r.get("decode_tok_s") else "-", _x(r.get("decode_vs_target_alone")),
                f"{r['tok_s']:.2f}", _x(r.get("vs_target_alone")),
                f"{r['tokens_per_round']:.2f}" if "tokens_per_round" in r else "-",
                f"{r['acceptance']:.1%}" if "acceptance" in r else "-",
                {None: "-", True: "yes", False: "NO"}[r.get("identical")],
                ", ".join(f"{k} {v}" for k, v in sorted(r.get("rounds_by", {}).items(), key=lambda kv: -kv[1])),
                _us(cost))
        console.print(table)
        for r in rows:
            bound = r.get("foresight") if r.get("set") == name else None
            if bound:
                ms = bound["verify_ms"]
                console.print(f"  foresight bound, TP={r['tp']} greedy: drafting from earlier occurrences with perfect "
                              f"foresight (up to {bound['depth']} tokens) would give {bound['tokens_per_round']:.2f} "
                              f"tokens/round and decode at most {bound['decode_speedup']:.2f}x the target alone "
                              f"(verify of 1 / 2 / 5 / 9 / 17 rows measured in this run: "
                              f"{' / '.join(f'{ms[n]:.1f}' for n in (1, 2, 5, 9, 17) if n in ms)} ms)")


def _us(cost: dict) -> str:
    if not any(cost.values()):
        return "-"
    return (f"{cost['modelfree_propose_us_per_round']:.0f}, {cost['modelfree_update_us_per_round']:.0f}, "
            f"{cost['modelfree_suffix_update_us_per_round']:.0f}")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    main()
