"""The one output path of every command: a table, JSON or CSV, to a file or to stdout.

``Output.emit`` renders a command's result in the format asked for and writes it to stdout (no
path, or ``-``) or to a file, whole: a temp file beside the target, then an atomic rename
(``atomic_path``). Writes follow symlinks to their target (the link stays), write devices and
FIFOs (``/dev/null``) in place, and give new files the umask's mode. Files that grow while a run
goes (bench's CSV) are a ``CsvStream``: written as ``FILE.partial`` and renamed to ``FILE`` at the
end, so a crash leaves the rows written so far. ``check_writable`` and ``check_folder`` let a
command refuse an unwritable path before it starts.
"""
from __future__ import annotations

import contextlib
import csv
import enum
import io
import json
import os
import stat
import sys
import tempfile
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
    """A device, a FIFO or a socket: written as it is, never replaced by a regular file."""
    return path.exists() and not path.is_file()


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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(path: Optional[str], option: str) -> None:
    """Before a run: ``path`` (a file, or ``-`` for stdout) can be written, or a ValueError naming
    ``option`` says why not. Creates the missing folders, as the write would."""
    if path is None or path == STDOUT:
        return
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise ValueError(f"{option} {path}: is a folder; name a file in it")
    if target.exists() and not target.is_file():   # a device or a FIFO: written in place
        if not os.access(target, os.W_OK):
            raise ValueError(f"{option} {path}: cannot be written (permission denied)")
        return
    _probe_folder(target.parent, option, path)


def check_folder(path: Optional[str], option: str) -> None:
    """Before a run: files can be created in the folder ``path`` (created if missing)."""
    if path is None:
        return
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_dir():
        raise ValueError(f"{option} {path}: is a file, not a folder; name a folder")
    _probe_folder(target, option, path)


def _probe_folder(folder: Path, option: str, path: str) -> None:
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
    if existing.exists() and not existing.is_dir():
        raise ValueError(f"{option} {path}: {existing} is a file, not a folder; choose another path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {path}: the folder {folder} cannot be created ({exc.strerror}); "
                         f"choose another path") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".sinkprof-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot write into {folder} ({exc.strerror}); choose another path") from None


def write_text(path, text: str) -> Path:
    """Write ``text`` to ``path`` whole (flushed to disk before the rename); ``-`` is stdout."""
    if str(path) == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return Path(path)
    try:
        with atomic_path(path) as tmp, open(tmp, "w") as f:
            f.write(text)
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
            self._write(json.dumps(doc, indent=2) + "\n")
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
            write()
            self._file.flush()
            if self.renames:
                os.fsync(self._file.fileno())
                if os.fstat(self._file.fileno()).st_nlink == 0:
                    raise FileNotFoundError(2, f"{self.partial} was removed")
        except OSError as exc:
            self._rescue(exc)

    def _rescue(self, exc: OSError) -> None:
        """Write every row so far into a fresh ``FILE.partial`` (its folder recreated) and stop."""
        saved = ""
        if self.renames:
            with contextlib.suppress(OSError):
                self._file.close()
            try:
                self.partial.parent.mkdir(parents=True, exist_ok=True)
                _move_aside(self.partial)
                with _create(self.partial) as f:
                    w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
                    w.writeheader()
                    w.writerows(self._written)
                saved = f"; the {len(self._written)} row(s) so far are in {self.partial}"
            except OSError as again:
                saved = f"; the rows so far could not be saved either ({again.strerror or again})"
        raise OutputError(f"writing the CSV {self.partial} failed: {exc.strerror or exc}{saved}") from None

    def close(self) -> None:
        if self._file is sys.stdout:
            sys.stdout.flush()
            return
        self._file.close()
        if self.renames:
            try:
                os.replace(self.partial, self.path)
            except OSError as exc:
                raise OutputError(f"cannot rename {self.partial} to {self.path}: {exc.strerror}; "
                                  f"the rows are in {self.partial}") from None

    def abandon(self) -> None:
        if self._file is not sys.stdout:
            with contextlib.suppress(OSError):
                self._file.close()


def _create(path: Path):
    """A new file at ``path``: never follows a symlink there, never truncates what exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    return os.fdopen(fd, "w", newline="")


def _move_aside(path: Path) -> Optional[Path]:
    """Rename whatever is at ``path`` (a file or a symlink, not followed) to the first free
    ``path.N``; returns the new name, or None when nothing was there."""
    if not os.path.lexists(path):
        return None
    n = 1
    while os.path.lexists(f"{path}.{n}"):
        n += 1
    aside = Path(f"{path}.{n}")
    os.rename(path, aside)
    return aside
