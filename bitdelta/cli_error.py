"""The command line's user-facing failure, in a module of its own: the subcommand modules raise it
and `bitdelta.cli` (which registers them) catches it, so none of them imports the CLI."""

from __future__ import annotations


class CliError(Exception):
    """A user-facing failure: printed without a traceback, exit code 1 (or `code`)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code
