"""One place that turns an error into the message the user sees and the exit code.

Exit codes: 0 success, 1 a failed or hung check (or run), 2 a usage error, 130 / 143 stopped by
SIGINT / SIGTERM. The library and the
tool raise their own errors where they find them (a ``ValueError`` that names the argument and
says what to use instead, a ``CommError`` that says where a rank hung); commands do not catch
them. ``Command``, the class of every command of the CLI, looks each one up in ``EXIT_CODES``.
"""
from __future__ import annotations

import sys
from typing import Optional

import typer
from typer.core import TyperCommand

from ..dist import CommError
from .output import OutputError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130   # 128 + SIGINT, as a shell reports Ctrl-C

# Exception type -> exit code; the message is the exception's own. Looked up along the MRO.
EXIT_CODES: dict[type, int] = {
    ValueError: EXIT_USAGE,       # an option or its combination: the message names the option
    CommError: EXIT_FAILED,       # a rank hung or died: the message names rank, case, phase, step
    OutputError: EXIT_FAILED,     # a result could not be written: the message names the file
}


def describe(exc: BaseException) -> Optional[tuple[str, int]]:
    """(message, exit code) for a known error, None for anything else (a bug: let it show)."""
    for kind in type(exc).__mro__:
        if kind in EXIT_CODES:
            return str(exc), EXIT_CODES[kind]
    return None


class Command(TyperCommand):
    """A CLI command whose known errors end as a message and an exit code, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Exception as exc:
            known = describe(exc)
            if known is None:
                raise
            message, code = known
            if code == EXIT_USAGE:
                raise typer.BadParameter(message, ctx=ctx) from None
            print(f"sinkprof: {message}", file=sys.stderr)
            raise typer.Exit(code) from None
