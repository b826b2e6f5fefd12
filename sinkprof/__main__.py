"""The command's entry, ``sinkprof`` (pyproject.toml) and ``python -m sinkprof``.

It imports nothing heavy itself (nor does ``import sinkprof``), so its handling of a Ctrl-C is set
before the command line loads (typer, torch and the tool: seconds). A Ctrl-C then ends the command
as one while it runs does (``tool.errors.Command``): one line on stderr and exit 130. It ends it at
once, from the signal handler, rather than by a KeyboardInterrupt through torch's import, which
does not always let one through: a library under it can take it for a failed optional import (the
Ctrl-C is lost and the command runs on), fail the next import with an ImportError, print it as an
"Exception ignored" traceback (raised in a weakref callback), or leave the interpreter to end itself
by SIGINT (-2, not 130). Nothing has started yet, so there is nothing to clean up.
"""
import contextlib
import os
import signal
import sys
from typing import NoReturn

EXIT_INTERRUPTED = 128 + signal.SIGINT   # 130, as tool.errors.EXIT_INTERRUPTED


def main() -> None:
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:   # not where SIGINT is ignored (``cmd &`` in a script)
        signal.signal(signal.SIGINT, _stopped)
    try:
        from .cli import main as run   # typer, torch and the tool
    finally:
        signal.signal(signal.SIGINT, previous)   # each command handles its own from here
    try:
        run()
    except KeyboardInterrupt:   # before a command started (typer building the command line)
        _stopped()


def _stopped(signum=None, frame=None) -> NoReturn:
    """End now with the words and the exit code of ``tool.errors.Command``."""
    with contextlib.suppress(OSError, ValueError, RuntimeError):   # a closed, broken or busy stderr: no words
        if sys.stderr is not None:
            print("sinkprof: stopped by SIGINT", file=sys.stderr, flush=True)
    os._exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
