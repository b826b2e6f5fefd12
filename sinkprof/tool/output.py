"""The one output path of every command: a table, JSON or CSV, to a file or to stdout.

``Output.emit`` renders a command's result in the format asked for and writes it to stdout (no
path, or ``-``) or to a file, whole: a temp file beside the target, then an atomic rename
(``atomic_path``). Writes follow symlinks to their target (the link stays), write devices and
FIFOs (``/dev/null``) in place, and give new files the umask's mode. Files that grow while a run
goes (bench's CSV) are a ``CsvStream``: written as ``FILE.partial`` and renamed to ``FILE`` at the
end, so a crash leaves the rows written so far. ``check_writable`` and ``check_folder`` let a
command refuse an unwritable path before it starts. A name of stdout (``/dev/stdout``,
``/dev/fd/1``) is ``-``; a name of any other file descriptor is refused (``settle``).
"""
from __future__ import annotations

import contextlib
import csv
import enum
import errno
import io
import json
import math
import os
import re
import stat
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

STDOUT = "-"


class Format(str, enum.Enum):
    TABLE = "table"
    JSON = "json"
    CSV = "csv"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str, *allowed: "Format", option: str = "--format") -> "Format":
        """The format a command writes; the error names the option and what it takes."""
        allowed = allowed or tuple(cls)
        for f in allowed:
            if value == f.value:
                return f
        raise ValueError(f"{option} {value!r}: use {' or '.join(f.value for f in allowed)}")


class OutputError(RuntimeError):
    """An output could not be written: the message names the file and the rows kept."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def target(path) -> Path:
    """Where writing ``path`` lands: a symlink's target (the link itself stays a link)."""
    return Path(os.path.realpath(path))


def _in_place(path: Path) -> bool:
    """A device, a FIFO or a socket: written as it is, never replaced by a regular file (a folder
    is neither: the rename over it fails, and says so)."""
    return path.exists() and not path.is_file() and not path.is_dir()


class Stdout(str):
    """``-`` made by ``settle`` of a name of stdout: it compares and writes as ``-`` and keeps the
    name as the user typed it (``typed``) for messages."""

    typed: str

    def __new__(cls, typed: str):
        self = super().__new__(cls, STDOUT)
        self.typed = typed
        return self


def typed(path):
    """``path`` as the user typed it: ``/dev/stdout`` for the ``-`` that ``settle`` made of it."""
    return getattr(path, "typed", path)


# The folder of a process's (or one of its threads') file descriptors, as realpath gives it:
# /dev/fd, /dev/stdout, /proc/self/fd, /proc/thread-self/fd and /proc/PID/task/TID/fd lead here.
_FD_FOLDER = re.compile(r"/proc/(\d+)(?:/task/\d+)?/fd")


def _descriptor(path, option: str) -> Optional[tuple[int, str]]:
    """(process id, descriptor) when ``path`` or a link on its way is an entry of ``/proc/PID/fd``
    (a file descriptor, not a name of a file); None for a name of a file. A link on the way that
    cannot be read (``/proc/1/cwd`` of another user's process) is a ValueError naming ``option``."""
    p = os.path.abspath(path)
    for _ in range(40):   # the kernel's own limit on links followed
        found = _FD_FOLDER.fullmatch(os.path.realpath(os.path.dirname(p)))
        if found:
            return int(found.group(1)), os.path.basename(p)
        try:
            if not os.path.islink(p):
                return None
            p = os.path.join(os.path.dirname(p), os.readlink(p))
        except OSError as exc:
            raise ValueError(f"{option} {path}: the link {p} cannot be followed ({exc.strerror or exc}); "
                             f"choose another path") from None
    return None


def settle(path: Optional[str], option: str) -> Optional[str]:
    """``path`` as a run writes it: ``-`` (a ``Stdout`` that remembers the name) for a name of this
    process's stdout (``/dev/stdout``, ``/dev/fd/1``), so the result goes where ``-`` sends it and
    nothing else is printed into it. Any other file descriptor is refused, each with what it is: a
    result is written whole by a file's name (a temp file renamed over it), never through a
    descriptor, so writing through its name would replace the file it points at, or fail."""
    if path is None or path == STDOUT:
        return path
    found = _descriptor(path, option)
    if found is None:
        return path
    pid, fd = found
    if pid != os.getpid():
        raise ValueError(f"{option} {path}: names file descriptor {fd} of another process (pid {pid}), not a "
                         f"file{_the_file(path)}, or - for stdout")
    try:
        named = os.stat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EBADF):
            raise ValueError(f"{option} {path}: names file descriptor {fd}, which is closed; name a file, "
                             f"or - for stdout") from None
        raise ValueError(f"{option} {path}: names file descriptor {fd}, which cannot be followed "
                         f"({exc.strerror or exc}); name a file, or - for stdout") from None
    with contextlib.suppress(OSError):   # stdout itself closed: the name is not stdout's
        if os.path.samestat(named, os.fstat(1)):
            return Stdout(path)
    raise ValueError(f"{option} {path}: names file descriptor {fd}, not a file: a result is written whole by "
                     f"a file's name, and only stdout's descriptor is taken (as -){_the_file(path)}, or - for "
                     f"stdout")


def _the_file(path) -> str:
    """The advice for a descriptor's name: the regular file it points at, when there is one."""
    with contextlib.suppress(OSError):
        real = os.path.realpath(path)
        if os.path.isfile(real) and not _FD_FOLDER.match(real):
            return f"; name the file itself ({real})"
    return "; name a file"


@contextlib.contextmanager
def atomic_path(path):
    """A temp path beside ``path``'s target to write into; renamed over the target when the block
    succeeds (with the target's mode, or the umask's for a new file), removed when it fails. A
    non-regular target (``/dev/null``, a FIFO) is written in place. The temp name keeps the suffix
    (matplotlib reads the format from it)."""
    path = target(path)
    if _in_place(path):
        yield path
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # a bounded name: a target whose own name nearly fills NAME_MAX still gets its temp file
    suffix = path.suffix if len(path.suffix) <= 16 else ""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:32]}.", suffix=f".tmp{suffix}", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(path: Optional[str], option: str, *, partial: bool = False) -> None:
    """Before a run: ``path`` (a file, or ``-`` for stdout) can be written, or a ValueError naming
    ``option`` says why not (``settle`` first: the name of a descriptor). ``partial``: the file is
    a ``CsvStream``, written first as ``FILE.partial``, whose name must fit too. Missing folders
    are left to the write, which makes them."""
    if path == "":
        raise ValueError(f"{option} '': an empty path; name a file (or - for stdout)")
    if settle(path, option) in (None, STDOUT):
        return
    with _os_errors(option, path):
        _loop_check(path, option)
        _dotdot_check(path, option)
        where = target(path)
        if where.is_dir():
            raise ValueError(f"{option} {path}: is a folder; name a file in it")
        tail = next((t for t in (os.sep, f"{os.sep}.", f"{os.sep}..") if str(path).endswith(t)), None)
        if tail is not None or str(path) in (".", ".."):   # realpath drops these; a shell's > refuses them
            raise ValueError(f"{option} {path}: the name of a folder (it ends in {tail or path!r}), and "
                             f"{where} is {'a file' if where.exists() else 'no folder'}; name a file")
        if where.exists() and not os.access(where, os.W_OK):
            # the result replaces the file by a rename, which its own mode would not stop; a
            # protected file is refused as a shell's > or pandas' to_csv would refuse it
            raise ValueError(f"{option} {path}: cannot be written (permission denied); choose another path, "
                             f"or make it writable")
        if _in_place(where):   # a device or a FIFO: written in place
            return
        if partial:
            _partial_fits(where, option, path)
        _probe_folder(where.parent, option, path)


def _partial_fits(where: Path, option: str, path: str) -> None:
    """``FILE.partial`` (and the ``FILE.partial.N`` an earlier run's is moved to) can be named in
    ``where``'s folder: a name that fits only without the suffix is refused before a run."""
    names = [f"{where.name}.partial"]
    if os.path.lexists(f"{where}.partial"):
        names.append(_aside(Path(f"{where}.partial")).name)
    longest = max(names, key=lambda n: len(os.fsencode(n)))
    most = _name_max(where.parent)
    if len(os.fsencode(longest)) > most:
        room = most - (len(os.fsencode(longest)) - len(os.fsencode(where.name)))
        raise ValueError(f"{option} {path}: the run writes it first as {longest[len(where.name):]!r} beside it, "
                         f"a name of {len(os.fsencode(longest))} bytes, more than the {most} a file name may have "
                         f"here; choose a name of at most {room} bytes")


def _name_max(folder: Path) -> int:
    """The longest file name (bytes) the file system of ``folder`` (or of its nearest existing
    parent) takes."""
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_folder(path: Optional[str], option: str) -> None:
    """Before a run: files can be created in the folder ``path`` (made by the write if missing)."""
    if path is None:
        return
    if path in ("", STDOUT):
        raise ValueError(f"{option} {path!r}: name a folder (the files written into it cannot go to stdout)")
    if _descriptor(path, option) is not None:
        raise ValueError(f"{option} {path}: names a file descriptor; name a folder (the files are written into it)")
    with _os_errors(option, path):
        _loop_check(path, option)
        _dotdot_check(path, option)
        where = Path(os.path.realpath(path))
        if where.exists() and not where.is_dir():
            raise ValueError(f"{option} {path}: is a file, not a folder; name a folder")
        _probe_folder(where, option, path)


@contextlib.contextmanager
def _os_errors(option: str, path: str):
    """An OSError while looking at a path (a name too long, a folder that cannot be entered) as
    the usage error it is."""
    try:
        yield
    except OSError as exc:
        raise ValueError(f"{option} {path}: {exc.strerror or exc}; choose another path") from None


def _loop_check(path: str, option: str) -> None:
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{option} {path}: a loop of symbolic links; point the link at a file or "
                             f"choose another path") from None


def _dotdot_check(path: str, option: str) -> None:
    """A ``..`` steps out of a folder that exists, as the system resolves a path (a shell's
    ``> missing/../out.csv`` fails): realpath would drop the folder and write the file elsewhere."""
    parts = Path(path).parts
    for i, part in enumerate(parts):
        if part == ".." and i and not os.path.isdir(os.path.join(*parts[:i])):
            raise ValueError(f"{option} {path}: {os.path.join(*parts[:i])} is no folder, so there is no .. "
                             f"after it; name the file without it")


def under_file(folder: str, path: str) -> bool:
    """Whether the folder ``folder`` would be made inside ``path``, where a file is written (``--trace
    out/traces`` beside ``--csv out``): one of them cannot be."""
    return target(path) in target(folder).parents


def same_target(a: str, b: str) -> bool:
    """Whether writing ``a`` and ``b`` (neither ``-``) would land in the same place."""
    if STDOUT in (a, b):
        return False
    return target(a) == target(b) or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


def _probe_folder(folder: Path, option: str, path: str) -> None:
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
    if existing.exists() and not existing.is_dir():
        raise ValueError(f"{option} {path}: {existing} is a file, not a folder; choose another path")
    if existing != folder:   # the write makes the rest: nothing is left behind by a run refused later
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{option} {path}: the folder {folder} cannot be created ({existing} is not "
                             f"writable); choose another path")
        return
    try:
        fd, probe = tempfile.mkstemp(prefix=".sinkprof-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot write into {folder} ({exc.strerror}); choose another path") from None


def write_text(path, text: str) -> Path:
    """Write ``text`` to ``path`` whole (flushed to disk before the rename); ``-`` is stdout."""
    return _write_whole(path, text, "w")


def write_bytes(path, data: bytes) -> Path:
    """``write_text`` for bytes (a picture)."""
    return _write_whole(path, data, "wb")


def _write_whole(path, data, mode: str) -> Path:
    """``data`` into ``path`` whole; any failure is an ``OutputError`` that names ``path``."""
    if str(path) == STDOUT:
        out = sys.stdout if mode == "w" else sys.stdout.buffer
        out.write(data)
        out.flush()
        return Path(path)
    try:
        with atomic_path(path) as tmp, open(tmp, mode) as f:
            f.write(data)
            f.flush()
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                os.fsync(f.fileno())
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    return Path(path)


def console(file=None, width: int = 160):
    """A rich console: the terminal's width on a terminal, ``width`` columns elsewhere."""
    from rich.console import Console
    if file is not None:
        return Console(file=file, width=width)
    return Console(width=None if sys.stdout.isatty() else width)


@dataclass(frozen=True)
class Output:
    """Where and how a command writes its result."""

    format: Format = Format.TABLE
    path: Optional[str] = None      # None or "-": stdout
    width: int = 160                # columns of a table written to a file or a pipe

    @property
    def to_file(self) -> bool:
        return self.path not in (None, STDOUT)

    def emit(self, *, doc: Optional[dict] = None, rows: Optional[list] = None,
             table: Optional[Callable] = None) -> None:
        """Write the result: ``doc`` as JSON, ``rows`` (dicts) as CSV, ``table(console)`` printing
        rich renderables as a table."""
        if self.format is Format.JSON:
            self._write(json.dumps(strict_json(doc), indent=2, allow_nan=False) + "\n")
        elif self.format is Format.CSV:
            import pandas as pd
            buf = io.StringIO()
            pd.DataFrame(rows).to_csv(buf, index=False)
            self._write(buf.getvalue())
        elif self.to_file:
            buf = io.StringIO()
            table(console(buf, self.width))
            self._write(buf.getvalue())
        else:
            table(console(width=self.width))

    def _write(self, text: str) -> None:
        if self.to_file:
            write_text(self.path, text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()


def strict_json(value):
    """``value`` with every non-finite float as the string ``"inf"``, ``"-inf"`` or ``"nan"``:
    JSON has no such numbers, and strict parsers refuse Python's ``Infinity`` and ``NaN``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class CsvStream:
    """CSV rows appended to ``FILE.partial`` as they come (flushed and synced each time); ``close``
    renames it to ``FILE``, ``abandon`` leaves it for a run that stopped.

    ``FILE`` is its symlink's target; a non-regular ``FILE`` (``/dev/null``, a FIFO) and ``-``
    (stdout) are written in place. ``FILE.partial`` is created new (``O_EXCL | O_NOFOLLOW``, mode
    from the umask): whatever is there already, an earlier run's rows or a planted symlink, is
    renamed aside first (``FILE.partial.1``, ...), never followed or emptied. A failed append
    raises ``OutputError`` at once, with the rows so far written back into ``FILE.partial``.
    """

    def __init__(self, path, columns: list):
        self.columns = columns
        self.rows = 0
        self.kept: Optional[Path] = None
        self.path = None if str(path) == STDOUT else target(path)
        if self.path is None or _in_place(self.path):
            self.partial = self.path
            self._file = sys.stdout if self.path is None else open(self.path, "w", newline="")
        else:
            self.partial = Path(str(self.path) + ".partial")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.kept = _move_aside(self.partial)
            self._file = _create(self.partial)
        self._csv = csv.DictWriter(self._file, fieldnames=columns, extrasaction="ignore")
        self._written: list = []
        self._whole = (0, 0)   # bytes and rows of FILE.partial after its last whole write
        self._writing = threading.Lock()
        self._guard(self._csv.writeheader)

    @property
    def renames(self) -> bool:
        return self.path is not None and self.partial != self.path

    def append(self, rows: list) -> None:
        self._written.extend(rows)
        self._guard(lambda: self._csv.writerows(rows))
        self.rows += len(rows)

    def _guard(self, write) -> None:
        try:
            with self._writing:   # (cut_to_whole waits for a write in flight)
                write()
                self._file.flush()
                if self.renames:
                    os.fsync(self._file.fileno())
                    if os.fstat(self._file.fileno()).st_nlink == 0:
                        raise FileNotFoundError(2, f"{self.partial} was removed")
                    self._whole = (self._file.tell(), len(self._written))   # the file ends after a whole row
        except BrokenPipeError as exc:
            if self._file is sys.stdout:   # the reader of stdout went away (| head): ended quietly, as any command is
                raise
            self._rescue(exc)
        except OSError as exc:
            self._rescue(exc)

    def _rescue(self, exc: OSError) -> None:
        """Write every row so far into a fresh ``FILE.partial`` (its folder recreated) and stop."""
        saved = ""
        if self.renames:
            ours = _same_file(self.partial, self._file)
            with contextlib.suppress(OSError):
                self._file.close()
            try:
                if os.path.islink(self.partial):   # planted since: never followed
                    _move_aside(self.partial)
                with atomic_path(self.partial) as tmp, open(tmp, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
                    w.writeheader()
                    w.writerows(self._written)
                    f.flush()
                    os.fsync(f.fileno())
                saved = f"; the {len(self._written)} row(s) so far are in {self.partial}"
            except OSError as again:
                saved = f"; the rows so far could not be saved either ({again.strerror or again})"
                if ours:   # cut back to its last whole row (truncating takes no space)
                    with contextlib.suppress(OSError):
                        os.truncate(self.partial, self._whole[0])
                        saved = (f"; the rows could not be written again ({again.strerror or again}): "
                                 f"{self.partial} holds the {self._whole[1]} row(s) written before")
        raise OutputError(f"writing the CSV {self.partial} failed: {exc.strerror or exc}{saved}") from None

    def cut_to_whole(self) -> None:
        """For a process about to end, from another thread: ``FILE.partial`` cut back to the end
        of its last whole row. A write in flight is waited for (a few seconds at most), and the
        file's descriptor then points at /dev/null, so that nothing buffered lands past the cut;
        the stream takes no more rows."""
        if not self.renames:
            return
        self._writing.acquire(timeout=5.0)   # never released: the process ends
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._file.fileno())
            os.close(devnull)
            os.truncate(self.partial, self._whole[0])

    def close(self) -> None:
        if self._file is sys.stdout:
            sys.stdout.flush()
            return
        self._file.close()
        if self.renames:
            try:
                if self.path.exists():   # a file replaced keeps its mode, as atomic_path's do
                    os.chmod(self.partial, self.path.stat().st_mode & 0o7777)
                os.replace(self.partial, self.path)
            except OSError as exc:
                raise OutputError(f"cannot rename {self.partial} to {self.path}: {exc.strerror}; "
                                  f"the rows are in {self.partial}") from None

    def abandon(self) -> None:
        if self._file is not sys.stdout:
            with contextlib.suppress(OSError):
                self._file.close()


def _same_file(path: Path, file) -> bool:
    """Whether ``path`` still names the open ``file`` (not removed, not replaced)."""
    try:
        return os.path.samestat(os.stat(path, follow_symlinks=False), os.fstat(file.fileno()))
    except (OSError, ValueError):
        return False


def _create(path: Path):
    """A new file at ``path``: never follows a symlink there, never truncates what exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    return os.fdopen(fd, "w", newline="")


def _move_aside(path: Path) -> Optional[Path]:
    """Rename whatever is at ``path`` (a file or a symlink, not followed) to the first free
    ``path.N``; returns the new name, or None when nothing was there."""
    if not os.path.lexists(path):
        return None
    aside = _aside(path)
    os.rename(path, aside)
    return aside


def _aside(path: Path) -> Path:
    """The first free ``path.N`` (N = 1, 2, ...)."""
    n = 1
    while os.path.lexists(f"{path}.{n}"):
        n += 1
    return Path(f"{path}.{n}")
