"""`hetero-run`: one console script, one module per subcommand.

Each subcommand module exposes `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`,
and imports nothing heavy at module level, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from hetero_run.launch.log import get_logger, setup_logging
from hetero_run.topology.errors import PeerFailure, UserError

SUBCOMMANDS = ("doctor", "topology_cmd", "plan", "generate", "serve", "convert", "fetch")

log = get_logger(__name__)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every multi-rank subcommand shares (pass as a parent parser)."""
    group = parser.add_argument_group("launch")
    group.add_argument("--peer-timeout", type=float, default=60.0, metavar="S",
                       help="end the job when a peer is missing or silent this long (default 60)")
    group.add_argument("--verbose", "-v", action="store_true",
                       help="debug logs; ranks other than 0 log too")
    group.add_argument("--log-dir", metavar="DIR",
                       help="also write every rank's full log to DIR/rank<N>.log")
    group.add_argument("--topology", metavar="FILE",
                       help="topology YAML: each rank binds its transports to its node's QSFP interfaces "
                       "(docs/topology.md)")
    group.add_argument("--hostfile", metavar="FILE",
                       help="the OpenMPI hostfile given to mpirun, checked against --topology")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetero-run",
        description="Serve one large model across QSFP-linked machines with lossless speculative "
        "decoding. Multi-rank commands run under `mpirun -np N hetero-run ...`; without mpirun "
        "they run as a single rank.",
    )
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"hetero_run.launch.{name}")
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_launch_arguments(p)
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    setup_logging(rank, verbose=args.verbose, log_dir=args.log_dir)
    from hetero_run.launch.signals import Interrupted

    try:
        code = args.handler(args)
    except UserError as exc:
        log.error("%s", exc)
        code = exc.exit_code
    except PeerFailure as exc:
        if not getattr(exc, "reported", False):
            log.error("%s; ending the job", exc)
        code = exc.exit_code
    except Interrupted as exc:
        code = 128 + exc.signum
    except KeyboardInterrupt:
        log.warning("stopped by SIGINT")
        code = 130
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
