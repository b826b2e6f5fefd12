"""The one output path of every command: a table, JSON or CSV, to a file or to stdout.

``Output.emit`` renders a command's result in the format asked for and writes it to stdout (no
path, or ``-``) or to a file, whole: a temp file beside the target, then an atomic rename
(``atomic_path``). Files that grow while a run goes (bench's CSV) are a ``CsvStream``: written as
``FILE.partial`` and renamed to ``FILE`` at the end, so a crash leaves the rows written so far.
"""
from __future__ import annotations

import contextlib
import csv
import enum
import io
import json
import os
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


@contextlib.contextmanager
def atomic_path(path):
    """A temp path beside ``path`` to write into; renamed to ``path`` when the block succeeds,
    removed when it fails. The temp name keeps the suffix (matplotlib reads the format from it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
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
    """Write ``text`` to ``path`` whole (flushed to disk before the rename)."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
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
    """CSV rows appended to ``path.partial`` as they come (flushed and synced each time);
    ``close`` renames it to ``path``. ``abandon`` leaves ``path.partial`` for a run that stopped."""

    def __init__(self, path, columns: list):
        self.path = Path(path)
        self.partial = Path(str(path) + ".partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.partial, "w", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=columns, extrasaction="ignore")
        self._csv.writeheader()

    def append(self, rows: list) -> None:
        self._csv.writerows(rows)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()
        os.replace(self.partial, self.path)

    def abandon(self) -> None:
        self._file.close()
