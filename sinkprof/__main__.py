"""The command's entry, ``sinkprof`` (pyproject.toml) and ``python -m sinkprof``.

It imports nothing heavy itself (nor does ``import sinkprof``), so its handling of a Ctrl-C is set
before the command line loads (typer, torch and the tool: seconds). A Ctrl-C then ends the command
as one while it runs does (``tool.errors.Command``): one line on stderr and exit 130. It ends it at
once, from the signal handler, rather than by a KeyboardInterrupt through torch's import, which
does not always let one through: a library under it can take it for a failed optional import (the
Ctrl-C is lost and the command runs on), fail the next import with an ImportError, print it as an
"Exception ignored" traceback (raised in a weakref callback), or leave the interpreter to end itself
by SIGINT (-2, not 130). The handler stays while typer parses the command line (it imports pydantic
then, and takes a KeyboardInterrupt for a silent exit 130), until the command runs: ``Command.invoke``
hands SIGINT back to Python's KeyboardInterrupt, which the command handles from there. Nothing has
started before it, so there is nothing to clean up.
"""
import contextlib
import os
import signal
import sys
from typing import NoReturn

EXIT_INTERRUPTED = 128 + signal.SIGINT   # 130, as tool.errors.EXIT_INTERRUPTED


def main() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # not where SIGINT is ignored (``cmd &``)
        signal.signal(signal.SIGINT, _stopped)
    from .cli import main as run   # typer, torch and the tool
    try:
        run()
    except KeyboardInterrupt:   # after the command, while typer ends it
        _stopped()
    except SystemExit as exc:
        if exc.code == EXIT_INTERRUPTED:   # the command was stopped by a Ctrl-C and said so
            _leave(EXIT_INTERRUPTED)
        raise


def _stopped(signum=None, frame=None) -> NoReturn:
    """End now with the words and the exit code of ``tool.errors.Command``."""
    with contextlib.suppress(OSError, ValueError, RuntimeError):   # a closed, broken or busy stderr: no words
        if sys.stderr is not None:
            print("sinkprof: stopped by SIGINT", file=sys.stderr, flush=True)
    _leave(EXIT_INTERRUPTED)


def _leave(code: int) -> NoReturn:
    """End now with ``code``, what stdout and stderr hold flushed. Not by the interpreter's own end:
    under ``python -m`` it ends by SIGINT (-2) after a KeyboardInterrupt that any string ``exec``
    saw end (dataclasses, namedtuple and typing build their code so), even one the command caught
    (CPython's ``Py_RunMain`` checks a flag that such an ``exec`` sets and no ``except`` clears)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):
            stream.flush()
    os._exit(code)


_stopped.until_a_command_runs = True   # the mark ``tool.errors.Command`` knows it by


if __name__ == "__main__":
    main()
