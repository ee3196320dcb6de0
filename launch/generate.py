"""Generate text with the target model alone, on one rank or tensor-parallel under mpirun.

    hetero-run generate --target DIR|FILE.gguf --prompt TEXT [--chat] [--json]
    mpirun -np 2 ... hetero-run generate --target DIR --prompts-file PROMPTS.jsonl --json
    mpirun -np 2 ... hetero-run generate --target DIR --drafter SMALL.gguf --algorithm auto --compare

Every rank loads its shard of the target; rank 0 also holds the tokenizer, runs the decode loop
and streams the text (or prints one JSON object per prompt with --json); the other ranks serve
the forwards rank 0 asks for. With --drafter, rank 0 also holds the drafter and decodes
speculatively (launch/speculate.py); the output stays the target's. Sampling (temperature,
top-p, top-k) is seeded per prompt, so the same seed gives the same text at any
tensor-parallel size.

A prompts file holds one JSON object per line: {"prompt": "..."}; blank lines are skipped.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hetero_run.launch import speculate

NAME = "generate"
HELP = "generate text with the target, alone or with a speculative drafter (one rank, or tensor-parallel)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="one prompt")
    source.add_argument("--prompts-file", metavar="FILE.jsonl", help='one {"prompt": ...} object per line')
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default 128")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1.0)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = no top-k cut (default)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed, per prompt (default 0)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What loads and how it decodes: the flags `generate` and `serve` share."""
    parser.add_argument("--target", required=True, metavar="DIR|FILE.gguf",
                        help="checkpoint directory (bf16 / fp32 / NVFP4 safetensors) or a GGUF file")
    parser.add_argument("--dtype", default="auto", metavar="DTYPE",
                        help="activations, dense weights, KV cache: auto (bf16; fp32 for fp32 checkpoints and "
                        "GGUF files), bf16, fp32")
    parser.add_argument("--context", type=int, metavar="N",
                        help="tokens per sequence the KV cache holds (default min(32768, the model's maximum))")
    parser.add_argument("--prefill-chunk", type=int, default=512, metavar="N", help="prompt tokens per forward")
    parser.add_argument("--embedding-split", choices=("balanced", "even"), default="balanced",
                        help="under tensor parallelism, who holds the embedding's rows: balanced (default) evens out "
                        "memory, rank 0 holding fewer rows for the tokenizer and drafter it alone holds; even")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    speculate.add_arguments(parser)


@dataclass(frozen=True)
class GenerateConfig:
    """Everything a generate run needs, checked before any rank starts."""

    target: Path
    sampling: object  # kernels.sampling.SamplingParams
    max_new_tokens: int = 128
    chat: bool = False
    json: bool = False
    ignore_eos: bool = False
    dtype: str = "auto"
    context: int | None = None  # KV cache slots; None: min(32768, the model's maximum)
    prefill_chunk: int = 512
    speculation: object = None  # runtime.speculative.config.SpeculationConfig
    drafter: str | None = None  # a path, or eagle3:DIR
    compare: bool = False
    embedding_split: str = "balanced"  # or "even" (loader.load_model)
    kv_tokens: int | None = None  # paged KV cache slots on each rank; None: one sequence of `context`
    block_size: int = 16  # tokens per KV cache block

    @property
    def algorithm(self) -> str:
        return self.speculation.algorithm if self.speculation is not None else "none"

    def __post_init__(self):
        from hetero_run.topology.errors import ConfigError

        for name in ("max_new_tokens", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field="--" + name.replace("_", "-"))
        if self.context is not None and self.context < 2:
            raise ConfigError(f"must be >= 2, got {self.context}", field="--context")
        if self.block_size < 1:
            raise ConfigError(f"must be >= 1, got {self.block_size}", field="--block-size")
        if self.kv_tokens is not None and self.kv_tokens < self.block_size:
            raise ConfigError(f"must hold at least one block ({self.block_size} tokens), got {self.kv_tokens}",
                              field="--kv-cache-tokens")
        if self.dtype not in ("auto", "bf16", "bfloat16", "fp32", "float32", "fp16", "float16"):
            raise ConfigError(f"expected auto, bf16 or fp32, got {self.dtype!r}", field="--dtype")
        if not self.target.exists():
            raise ConfigError("no such checkpoint directory or GGUF file", file=self.target, field="--target")


def build_config(args: argparse.Namespace) -> GenerateConfig:
    from hetero_run.kernels.sampling import SamplingParams
    from hetero_run.topology.errors import ConfigError

    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ConfigError as exc:
        raise ConfigError(exc.message, field="--" + (exc.field or "").replace("_", "-")) from None
    return GenerateConfig(
        target=Path(args.target), sampling=sampling, max_new_tokens=args.max_new_tokens, chat=args.chat,
        json=args.json, ignore_eos=args.ignore_eos, dtype=args.dtype, context=args.context,
        prefill_chunk=args.prefill_chunk, speculation=speculate.speculation_config(args),
        drafter=args.drafter, compare=args.compare, embedding_split=args.embedding_split,
    )


@dataclass(frozen=True)
class Prompt:
    text: str
    where: str  # "--prompt" or "FILE:LINE", for error messages


def read_prompts(args: argparse.Namespace) -> list[Prompt]:
    from hetero_run.topology.errors import ConfigError

    if args.prompt is not None:
        return [Prompt(args.prompt, "--prompt")]
    path = Path(args.prompts_file)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {exc}", file=path, field="--prompts-file") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"not a JSON object: {exc.msg}", file=path, line=number) from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
            raise ConfigError('expected {"prompt": "<text>"}', file=path, line=number, field="prompt")
        prompts.append(Prompt(entry["prompt"], f"{path}:{number}"))
    if not prompts:
        raise ConfigError("holds no prompts", file=path)
    return prompts


class Decoder(Protocol):
    """What generates tokens for one prompt on rank 0: the target alone, or the speculative engine."""

    algorithm: str
    sampling: object  # kernels.sampling.SamplingParams, read at every generate()

    def generate(self, prompt, max_new_tokens: int, stop_ids: set[int],
                 on_tokens: Callable[[list[int]], None]) -> dict:
        """Generate for `prompt` (a runtime.speculative.prompt.Prompt holding the target's ids),
        passing new token ids to `on_tokens` as they are decided; -> extra JSON fields."""
        ...


class TargetOnly:
    """Plain autoregressive decoding: one target forward per token."""

    algorithm = "none"

    def __init__(self, runner, sampling, sampled_verification: str = "keyed"):
        self.runner, self.sampling, self.sampled_verification = runner, sampling, sampled_verification

    def generate(self, prompt, max_new_tokens: int, stop_ids: set[int],
                 on_tokens: Callable[[list[int]], None]) -> dict:
        for ids in self.tokens(list(prompt.target_ids), max_new_tokens, stop_ids):
            on_tokens(ids)
        return {}

    def tokens(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> Iterator[list[int]]:
        import torch

        from hetero_run.runtime.speculative.round import RoundPlan
        from hetero_run.runtime.speculative.verifier import verifier_for

        runner, n = self.runner, len(prompt_ids)
        runner.truncate(0)
        choose = verifier_for(self.sampling, self.sampled_verification)  # the speculative rounds' own draws
        nothing = torch.empty(0, dtype=torch.long)
        logits = runner.forward(torch.tensor(prompt_ids), torch.arange(n), num_logits=1)  # [1, vocab]
        for step in range(max_new_tokens):
            token = choose(RoundPlan(nothing, None, n - 1 + step), logits.cpu()).token_ids[0]
            yield [token]
            if token in stop_ids or step + 1 == max_new_tokens:
                return
            logits = runner.forward(torch.tensor([token]), torch.tensor([n + step]))


def _verification(config: GenerateConfig) -> str:
    return getattr(config.speculation, "sampled_verification", "keyed")


def make_decoder(config: GenerateConfig, runner, tokenizer=None, drafter=None, live: bool | None = None) -> Decoder:
    """The target alone, or the speculative engine when there is a drafter or a model-free
    proposer. Both read `decoder.sampling` at every generate()."""
    if drafter is None and config.algorithm == "none":
        return TargetOnly(runner, config.sampling, _verification(config))
    return speculate.SpeculativeDecoder(runner, tokenizer, drafter, config.speculation, config.sampling,
                                        live=not config.json if live is None else live)


@dataclass
class Result:
    prompt: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    seconds: float
    prefill_seconds: float  # until the first new token
    finish_reason: str  # "stop" (end-of-sequence token) or "length"
    algorithm: str
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        n = len(self.token_ids)
        decode_s = self.seconds - self.prefill_seconds
        return {
            "prompt": self.prompt, "text": self.text, "token_ids": self.token_ids, "new_tokens": n,
            "prompt_tokens": self.prompt_tokens, "seconds": round(self.seconds, 6),
            "tokens_per_second": round(n / self.seconds, 3) if self.seconds > 0 else None,
            "prefill_seconds": round(self.prefill_seconds, 6),
            "decode_tokens_per_second": round((n - 1) / decode_s, 3) if n > 1 and decode_s > 0 else None,
            "finish_reason": self.finish_reason, "algorithm": self.algorithm, **self.extra,
        }


class TextStream:
    """Incremental detokenisation: emits only text that can no longer change (no half characters)."""

    def __init__(self, tokenizer, write: Callable[[str], None] | None):
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.shown = 0

    def add(self, ids: list[int]) -> None:
        self.ids += ids
        if self.write is None:
            return
        text = self.text()
        if not text.endswith("\ufffd") and len(text) > self.shown:
            self.write(text[self.shown:])
            self.shown = len(text)

    def finish(self) -> None:
        """The generation ended: write what is held back (a half character stays one, as the
        result's text has it)."""
        text = self.text()
        if self.write is not None and len(text) > self.shown:
            self.write(text[self.shown:])
            self.shown = len(text)

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def encode(tokenizer, prompt: Prompt, chat: bool, target: Path) -> list[int]:
    from hetero_run.topology.errors import ConfigError

    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the target's tokenizer has no chat template", file=target, field="--chat")
        ids = encode_chat(tokenizer, [{"role": "user", "content": prompt.text}])
    else:
        ids = encode_text(tokenizer, prompt.text)
    if not ids:
        raise ConfigError("the prompt is empty", field=prompt.where)
    return ids


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """A conversation through the target's chat template, ending with the assistant's turn (with
    `tools`, the template lists them)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_text(tokenizer, text: str) -> list[int]:
    """Raw text, with the tokenizer's own special tokens (a BOS where it adds one)."""
    return list(tokenizer(text)["input_ids"])


def run_prompts(decoder: Decoder, tokenizer, prompts: list[Prompt], config: GenerateConfig, stop_ids: set[int],
                context: int, write: Callable[[str], None] | None, emit: Callable[[Result], None],
                baseline: Decoder | None = None) -> list[Result]:
    """Encode, generate and report each prompt in turn. `write` streams text (None: don't).
    With a `baseline` decoder (--compare), each prompt runs through it first, silently, and the
    result says how much faster `decoder` was and whether the outputs are identical."""
    from hetero_run.runtime.models.kv_cache import KVCacheFull
    from hetero_run.runtime.speculative.prompt import Prompt as EnginePrompt

    results = []
    for prompt in prompts:
        ids = encode(tokenizer, prompt, config.chat, config.target)
        if len(ids) + config.max_new_tokens - 1 > context:
            raise KVCacheFull(f"{len(ids)} prompt tokens + {config.max_new_tokens} new tokens do not fit the "
                              f"KV cache of {context} tokens; raise --context or lower --max-new-tokens",
                              field=prompt.where)
        # the drafter reads the conversation (or text) its own way; the target reads exactly `ids`
        request = EnginePrompt(messages=({"role": "user", "content": prompt.text},), target_ids=tuple(ids)) \
            if config.chat else EnginePrompt(text=prompt.text, target_ids=tuple(ids))
        if baseline is not None and not results:  # untimed warm-up of both, so neither pays first-use costs
            for warm in (baseline, decoder):
                getattr(warm, "warm_up", warm.generate)(request, min(8, config.max_new_tokens), stop_ids,
                                                        lambda ids: None)
        reference = _generate(baseline, tokenizer, prompt, request, len(ids), config, stop_ids, None) \
            if baseline is not None else None
        result = _generate(decoder, tokenizer, prompt, request, len(ids), config, stop_ids, write)
        if reference is not None:
            result.extra.update(
                target_alone_tokens_per_second=round(reference.tokens_per_second, 3),
                speedup=round(reference.seconds / result.seconds, 3) if result.seconds > 0 else None,
                identical=result.token_ids == reference.token_ids,
            )
        emit(result)
        results.append(result)
    return results


def _generate(decoder: Decoder, tokenizer, prompt: Prompt, request, prompt_tokens: int, config: GenerateConfig,
              stop_ids: set[int], write: Callable[[str], None] | None) -> Result:
    stream = TextStream(tokenizer, write)
    start = time.perf_counter()
    first = None

    def on_tokens(new: list[int]) -> None:
        nonlocal first
        first = first or time.perf_counter()
        stream.add(new)

    extra = dict(decoder.generate(request, config.max_new_tokens, stop_ids, on_tokens))
    seconds = time.perf_counter() - start
    stream.finish()
    prefill = extra.pop("prefill_seconds", (first or start) - start)  # a decoder that knows better says so
    reason = "stop" if stream.ids and stream.ids[-1] in stop_ids else "length"
    return Result(prompt.text, stream.text(), stream.ids, prompt_tokens, seconds, prefill, reason, decoder.algorithm,
                  extra)


def load_tokenizer(target: Path):
    from hetero_run.topology.errors import ConfigError

    try:
        from transformers import AutoTokenizer

        if target.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(target.parent), gguf_file=target.name)
        return AutoTokenizer.from_pretrained(str(target))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load the tokenizer: {str(exc).strip().splitlines()[0]}", file=target,
                          field="--target") from None


def stop_token_ids(tokenizer, model_config, target: Path) -> set[int]:
    """End-of-sequence ids from the tokenizer, config.json and generation_config.json."""
    ids = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_file = target / "generation_config.json" if target.is_dir() else None
    if gen_file is not None and gen_file.is_file():
        try:
            eos = json.loads(gen_file.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, OSError):
            eos = None
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return {int(i) for i in ids}


def run(args: argparse.Namespace) -> int:
    from hetero_run.launch.bootstrap import launched
    from hetero_run.launch.log import get_logger
    from hetero_run.launch.settings import launch_settings

    log = get_logger(__name__)
    config = build_config(args)
    plan = check_plan(config, args)
    with launched(launch_settings(args)) as dist:
        from hetero_run.runtime.runner import TargetRunner, serve_worker

        loaded = load(config, args, dist, plan, read_inputs=lambda: read_prompts(args),
                      what="read the prompts and tokenizer")
        if not dist.is_driver:
            serve_worker(loaded.model, loaded.ctx)
            return 0
        stop_ids = set() if config.ignore_eos else loaded.stop_ids
        with TargetRunner(loaded.model, loaded.ctx) as runner:
            decoder = make_decoder(config, runner, loaded.tokenizer, loaded.drafter)  # a bad pairing fails here
            baseline = TargetOnly(runner, config.sampling, _verification(config)) \
                if config.compare else None
            run_prompts(decoder, loaded.tokenizer, loaded.inputs, config, stop_ids, loaded.model.max_tokens,
                        None if config.json else _write, lambda r: _report(r, config.json, log), baseline)
    return 0


def check_plan(config: GenerateConfig, args: argparse.Namespace, batching=None):
    """The memory plan, before any rank starts or any weight is read (DOES NOT FIT: exit 1; a
    --kv-cache-tokens the memory cannot give: exit 2). `batching`: the scheduler's memory side
    (runtime.config.BatchingConfig); default one sequence, as `generate` runs."""
    from hetero_run.launch.log import get_logger
    from hetero_run.launch.plan import errors_name_flags
    from hetero_run.launch.settings import job_shape
    from hetero_run.runtime.config import BatchingConfig, RunConfig
    from hetero_run.runtime.planner import check_before_load

    batching = batching or BatchingConfig.one_sequence(config.prefill_chunk, config.block_size, config.kv_tokens)
    with errors_name_flags():
        run_config = RunConfig(target=str(config.target), topology=getattr(args, "topology", None),
                               context=config.context, dtype=config.dtype, prefill_chunk=config.prefill_chunk,
                               drafter=config.drafter, max_num_seqs=batching.max_num_seqs,
                               max_num_batched_tokens=batching.max_num_batched_tokens, block_size=batching.block_size,
                               kv_cache_tokens=batching.kv_cache_tokens)
        plan = check_before_load(run_config, world_size=job_shape()[1])
    get_logger(__name__).info("%s", plan.summary())
    return plan


@dataclass
class Loaded:
    """What `load` leaves on a rank: its shard of the target; on rank 0 also the tokenizer,
    the drafter, the end-of-sequence ids and the inputs read with them."""

    ctx: object  # runtime.models.parallel.ParallelContext
    model: object  # runtime.models.decoder.TargetModel (this rank's shard)
    tokenizer: object = None
    drafter: object = None
    stop_ids: set[int] = field(default_factory=set)
    inputs: object = None


def load(config: GenerateConfig, args: argparse.Namespace, dist, plan, read_inputs: Callable[[], object] = lambda: None,
         what: str = "load the tokenizer") -> Loaded:
    """Every rank: rank 0 reads its inputs and the tokenizer, every rank loads its shard of the
    target, rank 0 loads the drafter. `generate` and `serve` both load through here; a bad
    input on any rank stops every rank (exit status 2)."""
    from hetero_run.launch.log import get_logger
    from hetero_run.runtime.models.loader import load_model
    from hetero_run.runtime.models.parallel import ParallelContext

    log = get_logger(__name__)
    ctx = ParallelContext.from_dist(dist)
    inputs = together(dist, what, lambda: (read_inputs(), load_tokenizer(config.target)) if dist.is_driver else None)
    start = time.perf_counter()
    split, pending = embedding_placement(config, plan, dist.rank)
    model = together(dist, "load the target", lambda: load_model(
        config.target, ctx, max_tokens=config.context, dtype=config.dtype, prefill_chunk=config.prefill_chunk,
        embedding_split=split, pending_bytes=pending, kv_tokens=config.kv_tokens, block_size=config.block_size))
    log.info("target %s: %s, TP=%d, %.2f GB of weights on rank %d (embedding rows %d..%d), context %d tokens, "
             "KV cache %d blocks of %d tokens, loaded in %.1f s", config.target.name, model.config.arch, ctx.size,
             model.weight_nbytes / 1e9, ctx.rank, model.embed.first, model.embed.first + model.embed.rows - 1,
             model.max_tokens, model.kv.num_blocks, model.kv.block_size, time.perf_counter() - start)
    prompts, tokenizer = inputs if dist.is_driver else (None, None)
    drafter = together(dist, "load the drafter", lambda: speculate.load(
        args, model, tokenizer, config.target, config.dtype) if dist.is_driver else None)
    if not dist.is_driver:
        return Loaded(ctx, model)
    return Loaded(ctx, model, tokenizer, drafter, stop_token_ids(tokenizer, model.config, config.target), prompts)


def embedding_placement(config: GenerateConfig, plan, rank: int) -> tuple[str, int]:
    """(embedding_split, pending bytes) for `load_model` on `rank`: rank 0 will also hold the
    drafter the plan counts. An EAGLE-3 head embeds through the target's embedding and copies
    the rows rank 0 lacks, so with one the split stays even."""
    from hetero_run.runtime.planner.inventory import EAGLE3_PREFIX

    if config.embedding_split == "even" or (config.drafter or "").startswith(EAGLE3_PREFIX):
        return "even", 0
    return "balanced", plan.ranks[rank].drafter_bytes if rank < len(plan.ranks) else 0


def _write(text: str) -> None:
    import sys

    sys.stdout.write(text)
    sys.stdout.flush()


def _report(result: Result, as_json: bool, log) -> None:
    if as_json:
        print(json.dumps(result.to_json()), flush=True)
        return
    _write("\n")
    r = result.to_json()
    log.info("%d new tokens (%s) in %.2f s: %.2f tok/s; prompt %d tokens in %.2f s; decode %s tok/s",
             r["new_tokens"], r["finish_reason"], r["seconds"], r["tokens_per_second"] or 0.0, r["prompt_tokens"],
             r["prefill_seconds"], r["decode_tokens_per_second"])
    if "speedup" in r:
        from hetero_run.launch.log import console

        same = "[green]yes[/]" if r["identical"] else "[red]NO[/]"
        console().print(
            f"[bold]{r['algorithm']}[/]: {r['tokens_per_second']:.2f} tok/s, target alone "
            f"{r['target_alone_tokens_per_second']:.2f} tok/s: [bold]speed-up {r['speedup']:.2f}x[/]; acceptance "
            f"{r.get('acceptance_rate', 0.0):.1%}, {r.get('tokens_per_round', 1.0):.2f} tokens/round; output identical "
            f"to the target alone: {same}")
        if r.get("rounds_by_algorithm"):
            console().print("rounds by choice: " + ", ".join(
                f"{name} {n}" for name, n in sorted(r["rounds_by_algorithm"].items(), key=lambda kv: -kv[1])))


def together(dist, what: str, step: Callable[[], object]):
    """Run `step` on every rank; when it fails with a UserError on any rank, every rank stops
    (exit status 2) instead of waiting for one that gave up."""
    from hetero_run.topology.errors import UserError

    error, value = None, None
    try:
        value = step()
    except UserError as exc:
        error = exc
    if dist.world_size > 1:
        import torch
        import torch.distributed as tdist

        flags = torch.zeros(dist.world_size, dtype=torch.int32, device=dist.device)
        flags[dist.rank] = int(error is not None)
        tdist.all_reduce(flags, group=dist.group)
        failed = flags.nonzero().flatten().tolist()
        if error is None and failed:
            raise UserError(f"stopping: rank {failed[0]} could not {what} (its message says why)")
    if error is not None:
        raise error
    return value
