"""Convert a model to the checkpoints hetero-run serves.

  hetero-run convert --from qwen2.5-coder-0.5b-instruct.gguf --to out/qwen-nvfp4 --quant nvfp4
  hetero-run convert --from path/to/hf-model --to out/model-bf16 --quant bf16

SRC is a Hugging Face model directory or a GGUF file (transformers dequantises it). `nvfp4`
quantises with NVIDIA ModelOpt (NVFP4_DEFAULT_CFG, max calibration on built-in texts) and
exports with `export_hf_checkpoint`, exactly as the large deployment's checkpoints are made;
`bf16` writes plain safetensors. Tokenizer files are copied along. The destination appears
only when complete.
"""

from __future__ import annotations

import argparse
import json

NAME = "convert"
HELP = "convert a Hugging Face directory or GGUF file to a bf16 or NVFP4 (ModelOpt) checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", required=True, metavar="SRC",
                        help="Hugging Face model directory or .gguf file")
    parser.add_argument("--to", dest="dest", required=True, metavar="DST", help="output directory (must not exist)")
    parser.add_argument("--quant", choices=("nvfp4", "bf16"), default="nvfp4", help="output format (default nvfp4)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors shard, e.g. 2GB (default 5GB)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from hetero_run.launch.log import console, get_logger
    from hetero_run.runtime.convert import ConvertOptions, convert

    log = get_logger(__name__)
    opts = ConvertOptions(source=args.source, dest=args.dest, quant=args.quant, overwrite=args.overwrite,
                          max_shard_size=args.max_shard_size)
    log.info("converting %s to %s (%s)", opts.source, opts.dest, opts.quant)
    report = convert(opts)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print_report(console(), report)
    return 0


def print_report(out, report) -> None:
    from rich.table import Table

    table = Table(title=f"converted to {report.quant}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("source", f"{report.source}  ({_gb(report.source_bytes)})")
    table.add_row("output", f"{report.dest}  ({_gb(report.dest_bytes)})")
    table.add_row("model", f"{report.architecture}, {report.parameters / 1e6:.1f} M parameters")
    if report.quant == "nvfp4":
        table.add_row("NVFP4 weights", f"{report.quantized_linears} linear layers")
    table.add_row("time", ", ".join(f"{k} {v:.1f} s" for k, v in report.seconds.items())
                  + f"  (total {sum(report.seconds.values()):.1f} s)")
    out.print(table)


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
