"""Say what fits where, and how fast it can go, before anything loads.

    hetero-run plan [--config RUN.yaml] [--target DIR|PRESET] [--drafter DIR|eagle3:DIR|PRESET]
                    [--topology T.yaml] [--context N] [--max-num-seqs N] [--block-size N]
                    [--max-num-batched-tokens N] [--kv-cache-tokens N] [--json]

Per rank: target weights (per tensor: quantisation format, exclusions, tensor-parallel
shards), the drafter (rank 0), activations, runtime overhead and what the OS keeps, against
the memory of the rank's node; the paged KV cache in what is left: bytes per block, the blocks
(and tokens) it gets, how many sequences of --context tokens fit at once and whether
--max-num-seqs of them do; the verdict and the longest context that fits; and the decode
roofline (tok/s ceilings for the target alone and with speculative decoding). The batching
flags default to `serve`'s, so the KV cache printed is the one `serve` allocates. Only config
files and safetensors headers are read.

Exit status: 0 when the plan fits, 1 when it does not, 2 for bad input.
Presets: qwen3-235b-a22b-nvfp4, eagle3-qwen3-235b (models); dgx-spark, cpu-host (hardware).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator

NAME = "plan"
HELP = "per-rank memory plan and decode roofline, before anything loads (exit 1: does not fit)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="RUN.yaml", help="run config (docs/planner.md); flags override it")
    parser.add_argument("--target", metavar="DIR|PRESET", help="target checkpoint directory or preset")
    parser.add_argument("--drafter", metavar="DIR|eagle3:DIR|PRESET", help="drafter on rank 0")
    parser.add_argument("--context", type=int, metavar="N",
                        help="tokens per sequence the KV cache holds (default min(32768, model maximum))")
    batching = parser.add_argument_group("batching (the scheduler's memory side; defaults: serve's)")
    batching.add_argument("--max-num-seqs", type=int, metavar="N",
                          help="sequences one step carries: the KV cache is sized for this many of --context tokens "
                          "(default 8; 1 plans generate)")
    batching.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                          help="rows one step carries: sizes the activations (default 512)")
    batching.add_argument("--block-size", type=int, metavar="N", help="tokens per KV cache block (default 16)")
    batching.add_argument("--kv-cache-tokens", type=int, metavar="N",
                          help="KV cache slots per rank (default: --max-num-seqs sequences of --context tokens, "
                          "within the room left)")
    parser.add_argument("--tp", type=int, metavar="N",
                        help="tensor-parallel size to plan (default: the topology's; 1 plans its first node)")
    parser.add_argument("--dtype", metavar="DTYPE",
                        help="dense weights and KV cache: auto (default: bf16, fp32 for fp32 checkpoints), bf16, "
                        "fp16, fp32")
    parser.add_argument("--prefill-chunk", type=int, metavar="N", help="prompt tokens per forward (default 512)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--per-tensor", action="store_true", help="also list every tensor's bytes on each rank")
    roof = parser.add_argument_group("roofline")
    roof.add_argument("--hardware", metavar="PRESET",
                      help="hardware profile: dgx-spark (default with a topology), cpu-host (default without)")
    roof.add_argument("--acceptance", type=float, default=0.7, metavar="A",
                      help="per-token draft acceptance rate for the speculative ceiling (default 0.7)")
    roof.add_argument("--draft-len", type=int, metavar="K", help="draft tokens per round (default 3)")
    roof.add_argument("--measure-bandwidth", action="store_true",
                      help="measure this machine's memory bandwidth (about a second) and use it")
    roof.add_argument("--bandwidth-gbps", type=float, metavar="GB/s", help="memory bandwidth per rank")
    roof.add_argument("--link-latency-us", type=float, metavar="US", help="latency of one small all-reduce")


FLAGS = ("context", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_tokens", "prefill_chunk",
         "draft_len", "dtype")


@contextlib.contextmanager
def errors_name_flags(flags: tuple[str, ...] = FLAGS) -> Iterator[None]:
    """A ConfigError about one of `flags` (a run config field, no file) names the flag instead:
    `kv_cache_tokens: ...` -> `--kv-cache-tokens: ...`."""
    from hetero_run.topology.errors import ConfigError

    try:
        yield
    except ConfigError as exc:
        if exc.file is None and exc.field in flags:
            raise ConfigError(exc.message, field="--" + exc.field.replace("_", "-")) from None
        raise


def run(args: argparse.Namespace) -> int:
    from hetero_run.launch.log import console
    from hetero_run.runtime.config import RunConfig
    from hetero_run.runtime.planner import hardware_preset, measure_bandwidth, plan_run
    from hetero_run.runtime.planner.report import per_tensor_table, tables
    from hetero_run.topology.errors import ConfigError

    if args.config:
        run_config = RunConfig.load(args.config)
    elif args.target:
        run_config = RunConfig(target=args.target)
    else:
        raise ConfigError("give --target DIR|PRESET or --config RUN.yaml", field="--target")
    with errors_name_flags():
        run_config = run_config.with_overrides(
            target=args.target, drafter=args.drafter, topology=args.topology, context=args.context,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size, kv_cache_tokens=args.kv_cache_tokens, dtype=args.dtype,
            prefill_chunk=args.prefill_chunk, draft_len=args.draft_len, hardware=args.hardware,
        )
    if not 0.0 <= args.acceptance <= 1.0:
        raise ConfigError(f"must be between 0 and 1, got {args.acceptance}", field="--acceptance")
    hardware = hardware_preset(run_config.hardware or ("dgx-spark" if run_config.topology else "cpu-host"))
    bandwidth, measured = args.bandwidth_gbps, False
    if args.measure_bandwidth:
        bandwidth, measured = measure_bandwidth(), True
    hardware = hardware.with_(memory_bandwidth_gbps=bandwidth, link_latency_us=args.link_latency_us,
                              measured=measured or None)
    with errors_name_flags():
        plan = plan_run(run_config, tp=args.tp, hardware=hardware, acceptance=args.acceptance)
    if args.json:
        print(json.dumps(plan.to_json(per_tensor=args.per_tensor)))
    else:
        out = console()
        out.print(tables(plan))
        if args.per_tensor:
            out.print(per_tensor_table(plan))
    return 0 if plan.fits else 1
