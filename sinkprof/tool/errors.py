"""One place that turns an error into the message the user sees and the exit code.

Exit codes: 0 success, 1 a failed or hung check (or run), 2 a usage error, 130 / 143 stopped by
SIGINT / SIGTERM. A closed pipe (``| head -1``) ends the command quietly with 1, as Python advises
and rich does. The library and the tool raise their own errors where they find them (a ``ValueError`` that names the
argument and says what to use instead, a ``CommError`` that says where a rank hung); commands do
not catch them. ``Command``, the class of every command of the CLI, looks each one up in ``EXIT_CODES``.
A ``ValueError`` is a usage error only where sinkprof raised it (``raised_by_sinkprof``): one from
inside pandas, matplotlib or torch is a bug, and shows as one.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
from typing import Optional

import typer
from typer.core import TyperCommand

from ..dist import CommError
from .output import OutputError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT   # 130, as a shell reports Ctrl-C

class StartError(RuntimeError):
    """A self-launched rank could not be started (the system refused a process); the message names it."""


# Exception type -> exit code; the message is the exception's own (``message``). Looked up along the MRO.
EXIT_CODES: dict[type, int] = {
    ValueError: EXIT_USAGE,       # an option or its combination: the message names the option (one
                                  # raised inside a package sinkprof calls is a bug: describe)
    CommError: EXIT_FAILED,       # a rank hung or died: the message names rank, case, phase, step
    StartError: EXIT_FAILED,      # a rank could not be started: the message names it and why
    OutputError: EXIT_FAILED,     # a result could not be written: the message names the file
    OSError: EXIT_FAILED,         # stdout could not be written (WRITE_ERRORS; a file's failure is an
                                  # OutputError, a closed pipe says nothing)
}
# The errors of a write that fails (a full disk, a closed pipe or descriptor): the OSErrors the map
# takes; any other (a library that cannot load, a bug) shows as it is.
WRITE_ERRORS = (errno.ENOSPC, errno.EIO, errno.EPIPE, errno.EBADF, errno.EFBIG, errno.EDQUOT)


def describe(exc: BaseException) -> Optional[tuple[str, int]]:
    """(message, exit code) for a known error, None for anything else (a bug: let it show). An
    empty message is said by ending quietly."""
    if isinstance(exc, OSError) and exc.errno not in WRITE_ERRORS:
        return None
    if isinstance(exc, ValueError) and not raised_by_sinkprof(exc):
        return None
    for kind in type(exc).__mro__:
        if kind in EXIT_CODES:
            return message(exc), EXIT_CODES[kind]
    return None


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raised_by_sinkprof(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by sinkprof's own code, or by the standard library or a builtin
    it called (``int(text)``, an ``Enum`` of a value), rather than inside an installed package
    (pandas, matplotlib, torch) or a compiled module: the module of the innermost frame of its
    traceback decides (by name: a frozen ``os`` has no file, a distribution may install packages
    beside the standard library). An error never raised (no traceback) is sinkprof's."""
    tb = exc.__traceback__
    if tb is None:
        return True
    while tb.tb_next is not None:
        tb = tb.tb_next
    top = str(tb.tb_frame.f_globals.get("__name__", "")).partition(".")[0]
    if top == "sinkprof" or top in sys.stdlib_module_names:
        return True
    # ``python -m sinkprof`` runs the package's __main__.py as __main__
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE + os.sep)


def message(exc: BaseException) -> str:
    """What the user is told of a known error: an OSError in the words ``cat`` uses for a stdout
    that cannot be written (or the file it names); nothing for a closed pipe."""
    if isinstance(exc, BrokenPipeError):
        return ""
    if isinstance(exc, OSError):
        return f"{exc.filename}: {exc.strerror}" if exc.filename else f"write error: {exc.strerror or exc}"
    return str(exc)


def say(text: str) -> None:
    """One line on stderr (a closed stderr takes nothing)."""
    if text and sys.stderr is not None:
        print(f"sinkprof: {text}", file=sys.stderr, flush=True)


def drop_stdout() -> None:
    """Point stdout at /dev/null once its reader is gone, so the interpreter's last flush has
    nowhere to fail (the BrokenPipeError advice of Python's signal documentation, what rich does)."""
    if sys.stdout is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def stdout_open() -> None:
    """Before a command whose result goes to stdout: stdout is there (``>&-`` closes it)."""
    if sys.stdout is None:
        raise OutputError("stdout is closed (>&-): the result has nowhere to go; leave stdout open, or give "
                          "--output FILE where the command has it")


def take_ctrl_c() -> None:
    """From here a Ctrl-C is a KeyboardInterrupt, which the command handles (``Command``, and the
    launcher once the ranks start). Until here the entry's handler (``sinkprof/__main__.py``, marked
    ``until_a_command_runs``) ends the process at once: while the command line loads and while typer
    parses it, where typer would take a KeyboardInterrupt for a silent exit 130. A handler of anyone
    else (SIGINT ignored by ``cmd &``, a test's) stays."""
    if getattr(signal.getsignal(signal.SIGINT), "until_a_command_runs", False):
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Command(TyperCommand):
    """A CLI command whose known errors end as a message and an exit code, never a traceback."""

    def invoke(self, ctx):
        try:
            take_ctrl_c()
            return super().invoke(ctx)
        except KeyboardInterrupt:   # Ctrl-C before the ranks start (the launcher handles it after)
            say("stopped by SIGINT")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:
            known = describe(exc)
            if known is None:
                raise
            text, code = known
            if code == EXIT_USAGE:
                raise typer.BadParameter(text, ctx=ctx) from None
            if isinstance(exc, BrokenPipeError):
                drop_stdout()
            say(text)
            raise typer.Exit(code) from None
