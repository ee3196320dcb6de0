"""Errors that reach the user as one line: what is wrong, where, and with which value.

Every package raises these for bad input (config files, checkpoints, command-line values);
the command line prints them without a traceback and exits with `exit_code`.
"""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """A problem with the user's input or environment, reported as one clear message."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        file: str | Path | None = None,
        field: str | None = None,
        line: int | None = None,
    ):
        self.message = message
        self.file = str(file) if file is not None else None
        self.field = field
        self.line = line
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = self.file + (f":{self.line}" if self.line is not None else "")
        if self.field:
            where = f"{where}: {self.field}" if where else self.field
        return f"{where}: {self.message}" if where else self.message


class ConfigError(UserError):
    """A configuration file, field or command-line value is invalid."""


class PeerFailure(Exception):
    """Another rank died, hung or became unreachable; `rank` names it when known."""

    exit_code = 3

    def __init__(self, message: str, rank: int | None = None):
        self.rank = rank
        super().__init__(message)
