"""Logging with rich, one prefix per rank.

Rank 0 logs at INFO by default; other ranks log only warnings and errors unless `verbose`.
With a log directory every rank also writes everything to `rank<N>.log` there.
Logs go to stderr; stdout is kept for results (text, JSON).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

LOGGER_NAME = "hetero_run"
_consoles: dict[str, Console] = {}


def console(stderr: bool = False) -> Console:
    """The shared rich console for stdout (results) or stderr (logs, live stats)."""
    key = "err" if stderr else "out"
    if key not in _consoles:
        stream = sys.stderr if stderr else sys.stdout
        # Under mpirun a rank's output is a pipe or a pty that mpirun relays; neither says how
        # wide the user's terminal is, and rich would squash tables to 80 columns.
        relayed = "OMPI_COMM_WORLD_SIZE" in os.environ or not stream.isatty()
        width = None
        if relayed:
            width = int(os.environ.get("COLUMNS", "0")) or max(120, shutil.get_terminal_size((120, 24)).columns)
        color = None if relayed and "FORCE_COLOR" not in os.environ else "auto"
        _consoles[key] = Console(
            file=stream, width=width, soft_wrap=False, highlight=False, color_system=color,
        )
    return _consoles[key]


class _RankPrefix(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.prefix = f"[rank {rank}]"

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = self.prefix
        return True


def setup_logging(rank: int = 0, verbose: bool = False, log_dir: str | Path | None = None) -> None:
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    prefix = _RankPrefix(rank)

    handler = RichHandler(
        console=console(stderr=True), show_path=False, markup=False, rich_tracebacks=False,
        log_time_format="%H:%M:%S",
    )
    handler.addFilter(prefix)
    handler.setFormatter(logging.Formatter("%(rank_prefix)s %(message)s"))
    if verbose:
        handler.setLevel(logging.DEBUG)
    else:
        handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.addHandler(handler)

    if log_dir is not None:
        path = Path(log_dir)
        path.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path / f"rank{rank}.log", mode="w")
        file_handler.addFilter(prefix)
        file_handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(rank_prefix)s %(name)s: %(message)s")
        )
        file_handler.setLevel(logging.DEBUG)
        logger.addHandler(file_handler)
    # records below every handler's level are never made: a server's per-round debug lines cost
    # nothing unless some handler writes them
    logger.setLevel(min(h.level for h in logger.handlers))


def get_logger(name: str) -> logging.Logger:
    """A logger under the project's root logger (`name` is usually `__name__`)."""
    if not name.startswith(LOGGER_NAME):
        name = f"{LOGGER_NAME}.{name}"
    return logging.getLogger(name)
