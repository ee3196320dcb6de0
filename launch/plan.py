"""Say what fits where, and how fast it can go, before anything loads.

    hetero-run plan [--config RUN.yaml] [--target DIR|PRESET] [--drafter DIR|eagle3:DIR|PRESET]
                    [--topology T.yaml] [--context N] [--batch B] [--json]

Per rank: target weights (per tensor: quantisation format, exclusions, tensor-parallel
shards), the drafter (rank 0), the KV cache per token and for context x batch, activations,
runtime overhead and what the OS keeps, against the memory of the rank's node; the verdict
and the longest context that fits; and the decode roofline (tok/s ceilings for the target
alone and with speculative decoding). Only config files and safetensors headers are read.

Exit status: 0 when the plan fits, 1 when it does not, 2 for bad input.
Presets: qwen3-235b-a22b-nvfp4, eagle3-qwen3-235b (models); dgx-spark, cpu-host (hardware).
"""

from __future__ import annotations

import argparse
import json

NAME = "plan"
HELP = "per-rank memory plan and decode roofline, before anything loads (exit 1: does not fit)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="RUN.yaml", help="run config (docs/planner.md); flags override it")
    parser.add_argument("--target", metavar="DIR|PRESET", help="target checkpoint directory or preset")
    parser.add_argument("--drafter", metavar="DIR|eagle3:DIR|PRESET", help="drafter on rank 0")
    parser.add_argument("--context", type=int, metavar="N",
                        help="tokens per sequence the KV cache holds (default min(32768, model maximum))")
    parser.add_argument("--batch", type=int, metavar="B", help="sequences decoded together (default 1)")
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
    run_config = run_config.with_overrides(
        target=args.target, drafter=args.drafter, topology=args.topology, context=args.context, batch=args.batch,
        dtype=args.dtype, prefill_chunk=args.prefill_chunk, draft_len=args.draft_len,
        hardware=args.hardware,
    )
    if not 0.0 <= args.acceptance <= 1.0:
        raise ConfigError(f"must be between 0 and 1, got {args.acceptance}", field="--acceptance")
    hardware = hardware_preset(run_config.hardware or ("dgx-spark" if run_config.topology else "cpu-host"))
    bandwidth, measured = args.bandwidth_gbps, False
    if args.measure_bandwidth:
        bandwidth, measured = measure_bandwidth(), True
    hardware = hardware.with_(memory_bandwidth_gbps=bandwidth, link_latency_us=args.link_latency_us,
                              measured=measured or None)
    plan = plan_run(run_config, tp=args.tp, hardware=hardware, acceptance=args.acceptance)
    if args.json:
        print(json.dumps(plan.to_json(per_tensor=args.per_tensor)))
    else:
        out = console()
        out.print(tables(plan))
        if args.per_tensor:
            out.print(per_tensor_table(plan))
    return 0 if plan.fits else 1
