"""``sinkprof report``: summaries, pictures, a self-contained HTML page and a Chrome trace of
``sinkprof bench`` CSVs.

One summary per run and case: per phase and ring step, the compute time, the communication time,
how much of it overlapped compute and how much was exposed, and the MB sent (medians over
iterations, the slowest rank); per iteration the wall time of the slowest rank, the FLOP/s per GPU
(per rank on the CPU, in the unit that fits) from the useful FLOPs (causal counted once), the
exposed share: the union of the exchanges' exposed parts (kv and dkv overlap in the backward;
counted once) over the wall time, and the MB sent by the rank that sent most. MB are decimal (1e6
bytes), summed from the ``bytes`` of the communication rows; unknown (NaN, shown ``-``) for a CSV
without them. Pictures (``figures``), the page (``page``) and the trace (``chrome_trace``) are
drawn from the same loaded frame.
"""
from __future__ import annotations

import bz2
import csv
import gzip
import hashlib
import io
import lzma
import os
import re
import stat
import sys
import zlib
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Optional

import pandas as pd

from ..options import Backend, MaskType, PackLayout, parse_window, window_pair
from .cases import ALL, docs_label
from .output import STDOUT, Output, check_writable, same_target, target, typed, under_file, write_bytes, write_text

CASE_KEYS = ["run_id", "comm", "softmax", "sink_strategy", "sink_grad", "mask", "window", "bias", "qkv_format", "dtype",
             "b", "s", "h", "g", "d", "cp", "a2a_size", "kv_schedule", "backend", "simulated", "docs", "pack_layout",
             "link"]
COMM_KINDS = ("kv", "dkv", "a2a")
PHASES = ("fwd", "bwd", "fwdbwd")
STEP_KINDS = ("compute",) + COMM_KINDS    # the rows of one ring step (an iteration row has step -1)

# What a bench CSV must hold, and what report fills in when a CSV of an older (or newer) version
# lacks it. The one list of both; README's CSV table documents the columns.
REQUIRED_COLUMNS = ("run_id", "rank", "iteration", "phase", "step", "kind", "dur_ms")
OPTIONAL_COLUMNS = {
    "timestamp": "", "start_ms": float("nan"), "end_ms": float("nan"), "overlap_ms": float("nan"),
    "exposed_ms": float("nan"), "comm": "", "softmax": "", "sink_strategy": "", "sink_grad": "", "mask": "",
    "window": "", "bias": False, "qkv_format": "",
    "dtype": "", "b": "", "s": "", "h": "", "g": "", "d": "", "cp": None,  # None: the number of ranks of the run
    "docs": "", "pack_layout": "", "a2a_size": "", "kv_schedule": "", "backend": "", "merges": "", "simulated": False, "predicted": False,
    "link": "", "flops": float("nan"), "bytes": float("nan"), "device_name": "", "torch": "", "cudnn": "", "nccl": "",
    "sinkprof": "", "git_sha": "",
}
# Read as text, whatever they look like (a git sha "0123abc" keeps its leading zero).
TEXT_COLUMNS = ("run_id", "timestamp", "phase", "kind", "comm", "softmax", "sink_strategy", "sink_grad", "mask",
                "window", "qkv_format",
                "docs", "pack_layout", "dtype", "kv_schedule", "backend", "merges", "a2a_size", "link", "device_name",
                "torch", "cudnn", "nccl", "sinkprof", "git_sha")
SHAPE_COLUMNS = ("b", "s", "h", "g", "d", "cp")
INT_COLUMNS = ("rank", "iteration", "step") + SHAPE_COLUMNS
FLOAT_COLUMNS = ("dur_ms", "start_ms", "end_ms", "overlap_ms", "exposed_ms", "flops", "bytes")
BOOL_COLUMNS = ("simulated", "predicted", "bias")
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")   # a bool cell, any case ("True" as Python writes it)
# The least value of each number column: no count, time or size is negative, and a case has at
# least one of each dimension and rank.
LEAST = (("rank", 0), ("iteration", 0), ("step", -1), ("dur_ms", 0), ("overlap_ms", 0), ("exposed_ms", 0),
         ("bytes", 0), ("flops", 0)) + tuple((col, 1) for col in SHAPE_COLUMNS)
# The values of each categorical column: the row kinds, and for the case columns what bench writes
# (``cases.ALL``: what a user may ask for; the kernel that ran, auto resolved), "" where it leaves a
# cell empty (no sink for vanilla, no ring for a2a, no pack). Any other value would make its rows a
# case of their own, dropped from the case they belong to.
CHOICES = {
    "phase": PHASES, "kind": STEP_KINDS + ("iteration",),
    "comm": ALL["comm"], "softmax": ALL["softmax"], "mask": ALL["mask"], "dtype": ALL["dtype"],
    "sink_strategy": ALL["sink_strategy"] + ("",), "sink_grad": ALL["sink_grad"] + ("",),
    "qkv_format": ALL["qkv_format"] + ("",), "kv_schedule": ALL["kv_schedule"] + ("",),
    "pack_layout": tuple(p.value for p in PackLayout) + ("",),
    "backend": tuple(b.value for b in Backend if b is not Backend.AUTO),
}
# The most of each number column: a time longer than three centuries, or a count or size that no
# run reaches, is a cell written wrong; the numbers derived from them (TFLOP/s, microseconds on the
# trace's axis) would overflow to infinities that no picture or JSON can hold.
MOST = (("dur_ms", 1e13), ("start_ms", 1e13), ("end_ms", 1e13), ("overlap_ms", 1e13), ("exposed_ms", 1e13),
        ("flops", 1e30), ("bytes", 1e30))
# The compressed files pandas reads by their suffix, known here by their first bytes.
COMPRESSED = {b"\x1f\x8b": ("gzip", gzip.decompress), b"BZh": ("bzip2", bz2.decompress),
              b"\xfd7zXZ\x00": ("xz", lzma.decompress)}
# What makes a row one span: its case, rank, iteration, phase, step and kind, and its start (an a2a
# step sends several messages) and duration (which tells them apart in a CSV without start_ms).
SPAN_KEYS = CASE_KEYS + ["rank", "iteration", "phase", "step", "kind", "start_ms", "dur_ms"]


def _truth(value) -> bool:
    return str(value).strip().lower() in TRUE


def _read_one(path) -> pd.DataFrame:
    """One bench CSV, checked; a ValueError names the file and says what is wrong with it."""
    if str(path) == "":   # Path("") is ".", the current folder
        raise ValueError("'': an empty path, not a CSV file; name the bench CSV")
    if str(path) == "-":
        raise ValueError("-: report reads no CSV from stdin; name the CSV file (a command's output as <(command))")
    p = Path(path)
    try:
        if p.is_dir():
            raise ValueError(f"{path}: a folder, not a CSV file; name the bench CSVs in it")
        if not p.exists():
            raise ValueError(f"{path}: no such CSV file")
        data = p.read_bytes()   # once: a pipe (<(...)) cannot be read again
    except OSError as exc:   # a folder that cannot be entered, a file that cannot be read
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    for magic, (kind, decompress) in COMPRESSED.items():
        if data.startswith(magic):   # read as pandas reads FILE.csv.gz
            try:
                data = decompress(data)
            except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error) as exc:
                raise ValueError(f"{path}: a {kind} file that cannot be decompressed ({exc})") from None
            break
    if not data.strip():
        raise ValueError(f"{path}: empty file, not a sinkprof bench CSV "
                         f"(it needs the columns {', '.join(REQUIRED_COLUMNS)})")
    if b"\0" in data[:8192]:
        raise ValueError(f"{path}: a binary file, not a sinkprof bench CSV")
    try:
        df = pd.read_csv(io.BytesIO(data), keep_default_na=False, na_values=[""],
                         dtype={c: str for c in TEXT_COLUMNS + INT_COLUMNS + BOOL_COLUMNS})
        text = data.decode()
        short = _short_row(text)
        header = next(csv.reader(io.StringIO(text)), [])
    except (UnicodeDecodeError, csv.Error, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise ValueError(f"{path}: not a sinkprof bench CSV ({str(exc).splitlines()[0]})") from None
    repeated = next((name for name in header if header.count(name) > 1), None)
    if repeated is not None:   # pandas would read the second as "NAME.1", and nothing would read it
        raise ValueError(f"{path}: the header names column {repeated} {header.count(repeated)} times; a bench CSV "
                         f"names each column once")
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: not a sinkprof bench CSV: missing columns {', '.join(missing)} "
                         f"(it has {', '.join(map(str, df.columns[:8]))}{' ...' if len(df.columns) > 8 else ''})")
    if df.empty:
        raise ValueError(f"{path}: a bench CSV header without rows")
    if short is not None:
        row, fields = short
        raise ValueError(f"{path}: data row {row} has {fields} of the {len(df.columns)} columns (a file cut "
                         f"short? a run that stopped leaves its rows whole in FILE.partial)")
    written = {col: df[col] for col in INT_COLUMNS if col in df.columns}   # the cells as written
    for col in INT_COLUMNS:
        if col in df.columns:
            df[col] = _whole_numbers(path, col, df[col])
    for col in FLOAT_COLUMNS:
        if col not in df.columns:
            continue
        values = pd.to_numeric(df[col], errors="coerce")
        # text, an infinity (no time or size is one; JSON and the pictures have none), or a blank
        # cell of a required column
        bad = (values.isna() & df[col].notna()) | values.isin([float("inf"), float("-inf")])
        if col in REQUIRED_COLUMNS:
            bad |= values.isna()
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            cell = df[col].iloc[row]
            raise ValueError(f"{path}: column {col} of data row {row + 1} is "
                             f"{'empty' if pd.isna(cell) else repr(cell) if isinstance(cell, str) else cell}, not a "
                             f"finite number")
        df[col] = values.astype(float)
    _check_text(path, df)
    for col, least in LEAST:
        if col in df.columns and (df[col] < least).any():
            row = int((df[col] < least).to_numpy().nonzero()[0][0])
            cell = written[col].iloc[row].strip() if col in written else f"{df[col].iloc[row]:g}"
            raise ValueError(f"{path}: column {col} of data row {row + 1} is {cell}, below its least value {least}")
    for col, most in MOST:
        if col in df.columns and (df[col] > most).any():
            row = int((df[col] > most).to_numpy().nonzero()[0][0])
            raise ValueError(f"{path}: column {col} of data row {row + 1} is {df[col].iloc[row]:g}, above its most "
                             f"value {most:g}")
    if "cp" in df.columns and (df["rank"] >= df["cp"]).any():
        row = int((df["rank"] >= df["cp"]).to_numpy().nonzero()[0][0])
        cp = df["cp"].iloc[row]
        raise ValueError(f"{path}: column rank of data row {row + 1} is {df['rank'].iloc[row]}, not a rank of its "
                         f"run: column cp says {cp} ranks, 0 to {cp - 1}")
    if {"start_ms", "end_ms"} <= set(df.columns) and (df["start_ms"] > df["end_ms"]).any():
        row = int((df["start_ms"] > df["end_ms"]).to_numpy().nonzero()[0][0])
        raise ValueError(f"{path}: data row {row + 1} ends before it starts: column start_ms is "
                         f"{df['start_ms'].iloc[row]}, column end_ms {df['end_ms'].iloc[row]}; a span's start_ms "
                         f"is at most its end_ms")
    _check_repeats(path, df)
    return df


def _check_text(path, df: pd.DataFrame) -> None:
    """The text cells: a run id in every row, a known value in each categorical column
    (``CHOICES``) and bool column, a window as ``options`` takes one; a ValueError names the first
    cell that is not."""
    def refuse(col: str, row: int, why: str):
        cell = df[col].iloc[row]
        shown = "empty" if pd.isna(cell) or not cell.strip() else repr(cell)
        raise ValueError(f"{path}: column {col} of data row {row + 1} is {shown}, {why}")

    blank = df["run_id"].isna() | (df["run_id"].str.strip() == "")
    if blank.any():
        refuse("run_id", int(blank.to_numpy().nonzero()[0][0]), "not a run id: every row names the run that "
               "wrote it, as bench does (e.g. 20261203-075527-040e0d)")
    for col in (c for c in CHOICES if c in df.columns):
        bad = ~df[col].fillna("").isin(CHOICES[col])
        if bad.any():
            named = ", ".join(v for v in CHOICES[col] if v)
            refuse(col, int(bad.to_numpy().nonzero()[0][0]),
                   f"not one of {named}{' (or empty)' if '' in CHOICES[col] else ''}")
    for col in (c for c in BOOL_COLUMNS if c in df.columns):
        bad = ~df[col].fillna("").str.strip().str.lower().isin(TRUE + FALSE)
        if bad.any():
            refuse(col, int(bad.to_numpy().nonzero()[0][0]), "not True or False")
    if "window" in df.columns:   # one check per window and mask: a causal window's right side is 0 or -1
        masks = df["mask"] if "mask" in df.columns else MaskType.NO_MASK.value
        pairs = df[["window"]].assign(mask=masks).dropna(subset=["window"]).drop_duplicates()
        for row, window, mask in pairs.itertuples():
            try:
                parse_window(window_pair(window), MaskType.parse(mask, "mask"))
            except ValueError as exc:
                refuse("window", row, f"not a window of mask {mask}: {exc}")


def _check_repeats(path, df: pd.DataFrame) -> None:
    """No span twice (``SPAN_KEYS``): a file appended to itself would count every time and byte twice.
    A CSV of an older version is not checked: without ``qkv_format``, ``sink_grad`` and ``bias`` two
    of its cases may share every column, and without ``start_ms`` two a2a messages of a step may."""
    if not {"qkv_format", "start_ms"} <= set(df.columns):
        return
    keys = [k for k in SPAN_KEYS if k in df.columns]
    repeat = df.duplicated(keys)
    if repeat.any():
        second = int(repeat.to_numpy().nonzero()[0][0])
        spans = df.groupby(keys, dropna=False, sort=False).ngroup()
        first = int((spans == spans.iloc[second]).to_numpy().nonzero()[0][0])
        r = df.iloc[second]
        start = r.get("start_ms", float("nan"))
        at = "" if pd.isna(start) else f" from {start} ms"
        raise ValueError(f"{path}: data rows {first + 1} and {second + 1} are one span twice (run {r['run_id']}, "
                         f"rank {r['rank']}, iteration {r['iteration']}, {r['phase']} step {r['step']} {r['kind']}"
                         f"{at}): its times and bytes would count twice; remove the repeated row (a file appended "
                         f"to itself?)")


INT64 = (-2 ** 63, 2 ** 63 - 1)


# A decimal number as a CSV writes one: ``-0.5``, ``1e19``; no ``inf``, no ``1_000``, no ``0x1``.
NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _whole_numbers(path, col: str, cells: pd.Series) -> pd.Series:
    """The cells (text) of a whole-number column as int64, each read exactly (``12``, ``1e3``,
    ``2.0``); a ValueError names the first cell, as written, that is empty, not a whole number or
    outside int64 (pandas would wrap it round, or round it through a float)."""
    plain = cells.str.fullmatch(r"\s*[+-]?[0-9]{1,18}\s*").fillna(False).astype(bool)
    if plain.all():   # the usual CSV: every cell fits
        return cells.astype("int64")
    for row in (~plain).to_numpy().nonzero()[0]:
        cell = cells.iloc[row]
        text = "" if pd.isna(cell) else cell.strip()
        value = _exact(text)
        where = f"{path}: column {col} of data row {row + 1} is"
        if value is not None and not INT64[0] <= value <= INT64[1]:
            raise ValueError(f"{where} {text}, outside the 64-bit whole numbers ({INT64[0]} to {INT64[1]})")
        if text == col:
            raise ValueError(f"{where} {col!r}, the header's: a second header line (CSVs joined with cat?); give "
                             f"report each CSV as bench wrote it")
        if value is None or value % 1:
            shown = "empty" if not text else text if NUMBER.fullmatch(text) else repr(cell)
            raise ValueError(f"{where} {shown}, not a whole number")
    return cells.map(lambda cell: int(_exact(cell.strip()))).astype("int64")


def _exact(text: str) -> Optional[Decimal]:
    """The number ``text`` writes, exactly (``18446744073709551615`` and ``1e19`` stay what they
    are); infinite for an exponent too large for a Decimal; None for no number (or one too small
    for a Decimal, which is no whole number either)."""
    if not NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:   # an exponent beyond 10**18: float() says which way
        far = float(text)
        return Decimal(far) if far else None


def _short_row(text: str) -> Optional[tuple[int, int]]:
    """The first data row (1-based, counted as pandas counts them) with fewer fields than the
    header, and its count of fields."""
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))   # a long pack's docs cell is one field
    lines = _Lines(text)
    # pandas skips a line of nothing but spaces and tabs (a quoted "  " is a row)
    rows = (row for row in csv.reader(lines) if lines.taken().strip(" \t\r\n"))
    width = len(next(rows, []))
    for n, row in enumerate(rows, 1):
        if len(row) < width:
            return n, len(row)
    return None


class _Lines:
    """The lines of ``text`` for ``csv.reader``; ``taken()``: the text of the lines it read since
    the last call (one record, which a quoted newline spreads over several lines)."""

    def __init__(self, text: str):
        self._lines = iter(io.StringIO(text, newline=""))
        self._taken: list = []

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = next(self._lines)
        self._taken.append(line)
        return line

    def taken(self) -> str:
        text, self._taken = "".join(self._taken), []
        return text


def load(paths) -> pd.DataFrame:
    """The rows of every CSV, with the optional columns an older CSV lacks filled in;
    ``df.attrs["absent"]``: per file (as given) the optional columns it lacked; ``df.attrs["runs"]``:
    per file the run ids it holds."""
    for i, a in enumerate(paths):
        for b in paths[:i]:
            if os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b):
                raise ValueError(f"{b} and {a} are the same file: give each CSV once")
    frames = [_read_one(p) for p in paths]
    seen: dict = {}
    for p, f in zip(paths, frames):
        for run in f["run_id"].dropna().unique():
            if run in seen:
                raise ValueError(f"run {run} is in both {seen[run]} and {p} (a copy?): a run is one CSV, "
                                 f"give it once")
            seen[run] = p
    absent = {str(p): [c for c in OPTIONAL_COLUMNS if c not in f.columns] for p, f in zip(paths, frames)}
    runs = {str(p): set(f["run_id"].fillna("").astype(str)) for p, f in zip(paths, frames)}
    for p, f in zip(paths, frames):   # each file's own: another file having a column fills no row of this one
        _fill_optional(p, f)
    df = pd.concat(frames, ignore_index=True)
    for col in TEXT_COLUMNS:
        df[col] = df[col].astype(object).where(df[col].notna(), "").astype(str)
    for col in BOOL_COLUMNS:
        df[col] = df[col].map(_truth)
    keys = [k for k in CASE_KEYS if k not in TEXT_COLUMNS and k not in BOOL_COLUMNS]
    df[keys] = df[keys].astype(object).where(df[keys].notna(), "")
    df.attrs["absent"] = {path: cols for path, cols in absent.items() if cols}
    df.attrs["runs"] = runs
    return df


def _fill_optional(path, f: pd.DataFrame) -> None:
    """The optional columns ``f`` (the rows of CSV ``path``) lacks, in place: their defaults, and
    ``cp`` the number of ranks of each run. A ``--simulate`` run holds every size under one run id,
    so its ``cp`` cannot be told from its ranks: such a file without the column is refused."""
    for col, default in OPTIONAL_COLUMNS.items():
        if col in f.columns:
            continue
        if col == "cp":
            if "simulated" in f.columns and f["simulated"].map(_truth).any():
                raise ValueError(f"{path}: rows of a --simulate run but no cp column, which tells its sizes "
                                 f"apart; give the CSV as sinkprof bench wrote it")
            f[col] = f.groupby("run_id")["rank"].transform("max") + 1
        else:
            f[col] = default


TIME_COLUMNS = ("start_ms", "end_ms")


def untimed_cases(df: pd.DataFrame) -> list:
    """The cases (tuples of CASE_KEYS) whose compute and communication rows carry no start and end
    times (a CSV older than the columns): a timeline or a trace cannot place them."""
    spans = df[df["kind"].isin(STEP_KINDS)]
    timed = spans[list(TIME_COLUMNS)].notna().all(axis=1)
    per_case = timed.groupby([spans[k] for k in CASE_KEYS], sort=False).any()
    return [case for case, any_timed in per_case.items() if not any_timed]


def untimed_note(df: pd.DataFrame, left_out: str) -> Optional[str]:
    """One line for stderr when some cases have no times: which files lack the columns (or which
    runs have them blank) and what ``left_out`` of them; None when every case has times."""
    cases = untimed_cases(df)
    if not cases:
        return None
    runs = sorted({case[CASE_KEYS.index("run_id")] for case in cases})
    files = [path for path, cols in df.attrs.get("absent", {}).items() if set(TIME_COLUMNS) & set(cols)]
    cols = ", ".join(TIME_COLUMNS)
    where = (f"{', '.join(files)} {'has' if len(files) == 1 else 'have'} no {cols} columns" if files
             else f"run{'s' if len(runs) > 1 else ''} {', '.join(runs)} {'have' if len(runs) > 1 else 'has'} "
                  f"no {cols} values")
    return f"sinkprof report: {where} (the times of each span): {left_out} left out for {len(cases)} " \
           f"case{'s' if len(cases) > 1 else ''}; the rest of the report is written"


def cases_without(df: pd.DataFrame, kinds: tuple) -> list:
    """The cases (tuples of CASE_KEYS) with no row of ``kinds``. Without ring-step rows
    (``STEP_KINDS``: iteration rows only) no per-step table, timeline or trace event can show a
    case, and its exposed communication is unknown; without iteration rows (a CSV cut down to its
    steps) its steps are shown, its wall time, FLOP/s and exposed share are unknown."""
    has = df["kind"].isin(kinds).groupby([df[k] for k in CASE_KEYS], sort=False).any()
    return [case for case, any_row in has.items() if not any_row]


def _files_of(df: pd.DataFrame, cases: list) -> list:
    """The files (as given) that hold rows of ``cases``."""
    runs = {case[CASE_KEYS.index("run_id")] for case in cases}
    return [path for path, ids in df.attrs.get("runs", {}).items() if ids & runs]


def stepless_note(df: pd.DataFrame, left_out: list) -> Optional[str]:
    """One line for stderr when some cases have iteration rows only: which files hold them and
    what ``left_out`` of them (besides the per-step tables); None when every case has step rows."""
    cases = cases_without(df, STEP_KINDS)
    if not cases:
        return None
    files = _files_of(df, cases)
    one = len(cases) == 1
    what = ["per-step table" if one else "per-step tables", *left_out]
    what = " and ".join([", ".join(what[:-1]), what[-1]] if len(what) > 1 else what)
    its = "its" if one else "their"
    return (f"sinkprof report: {', '.join(files)} {'has' if len(files) == 1 else 'have'} {len(cases)} "
            f"case{'' if one else 's'} with iteration rows only, no per-step rows (kind {', '.join(STEP_KINDS[:-1])} "
            f"or {STEP_KINDS[-1]}, which sinkprof bench --csv writes for every ring step): {its} {what} "
            f"{'is' if what == 'per-step table' else 'are'} left out, and {its} exposed communication is unknown; "
            f"the rest of the report is written")


def iterationless_note(df: pd.DataFrame, figure: bool) -> Optional[str]:
    """One line for stderr when some cases have no iteration rows: which files hold them, and what
    is unknown of them (``figure``: and that the summary figure leaves them out); None when every
    case has iteration rows."""
    cases = cases_without(df, ("iteration",))
    if not cases:
        return None
    files = _files_of(df, cases)
    one = len(cases) == 1
    drawn = "" if not figure else (" and left out of the summary figure" if (df["kind"] == "iteration").any()
                                   else ", and no summary figure is drawn")
    return (f"sinkprof report: {', '.join(files)} {'has' if len(files) == 1 else 'have'} {len(cases)} "
            f"case{'' if one else 's'} with per-step rows only, no iteration rows (kind iteration, which sinkprof "
            f"bench --csv writes for every rank and iteration): {'its' if one else 'their'} wall time, FLOP/s and "
            f"exposed share are unknown{drawn}; the rest of the report is written")


def case_rows(df: pd.DataFrame, its: pd.DataFrame) -> pd.DataFrame:
    """The cases to show, in order: the rows of ``its`` (``iteration_table``: a case and phase each),
    then one row of each case without iteration rows (CASE_KEYS and ``predicted``, its ``wall_ms``
    NaN)."""
    rest = pd.DataFrame(cases_without(df, ("iteration",)), columns=CASE_KEYS)
    rest = rest.merge(_predicted(df, CASE_KEYS).reset_index(), on=CASE_KEYS, how="left")
    return pd.concat([its, rest], ignore_index=True) if not its.empty else rest


def _predicted(rows: pd.DataFrame, keys: list) -> pd.Series:
    """Per group of ``keys``: whether any of its rows is a prediction (not a measurement)."""
    return rows.groupby(keys)["predicted"].any().rename("predicted")


def _sent_mb(df: pd.DataFrame, keys: list) -> pd.Series:
    """MB (1e6 bytes) sent per group of ``keys`` (which end in ``rank``): the sum of the ``bytes`` of
    its communication rows; 0 for a group without any, NaN for every group of a case whose
    communication rows carry no bytes (a CSV older than the column, a run without communication)."""
    comm = df[df["kind"].isin(COMM_KINDS)]
    sent = comm.groupby(keys)["bytes"].sum(min_count=1).div(1e6).reindex(df.groupby(keys).size().index)
    with_bytes = comm.dropna(subset=["bytes"]).groupby(CASE_KEYS).size().index
    known = sent.index.droplevel([k for k in keys if k not in CASE_KEYS]).isin(with_bytes)
    return sent.where(sent.notna() | ~known, 0.0).rename("sent_mb")


def _max_known(values, level: list):
    """The largest of ``values`` (a Series or DataFrame) per group of the index ``level``; NaN where
    one of the group's values is NaN (unknown): the slowest rank is not known then."""
    groups = values.groupby(level=level)
    return groups.max().where(~values.isna().groupby(level=level).any())


def step_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (case, phase, step): compute, comm, overlap and exposed ms and the MB sent (``sent_mb``,
    NaN without bytes); medians over iterations of the slowest rank; ``predicted`` when any of its
    rows is a prediction. Overlap and exposed are 0 for a step without communication and NaN
    (unknown) when its exchanges carry no ``overlap_ms``/``exposed_ms`` (an older CSV). The a2a
    exchanges around the ring (step -1) are a row of their own, first in its phase (``step_name``)."""
    steps = df[(df["step"] >= 0) | (df["kind"] == "a2a")]
    if steps.empty:
        return pd.DataFrame()
    keys = CASE_KEYS + ["phase", "step"]
    comp = steps[steps["kind"] == "compute"].groupby(keys + ["iteration", "rank"])["dur_ms"].sum()
    comm = steps[steps["kind"].isin(COMM_KINDS)].groupby(keys + ["iteration", "rank"])[
        ["dur_ms", "overlap_ms", "exposed_ms"]].sum(min_count=1)
    per = pd.concat([comp.rename("compute_ms"), comm.rename(columns={"dur_ms": "comm_ms"})], axis=1)
    for col in ("comm_ms", "overlap_ms", "exposed_ms"):
        if col not in per.columns:
            per[col] = 0.0
    has_comm = per["comm_ms"].notna()
    per["compute_ms"] = per["compute_ms"].fillna(0.0)
    for col in ("comm_ms", "overlap_ms", "exposed_ms"):
        per[col] = per[col].where(has_comm, 0.0)
    per = per.join(_sent_mb(steps, keys + ["iteration", "rank"]))
    worst = _max_known(per, keys + ["iteration"])
    out = worst.groupby(level=keys).median().join(_predicted(steps, keys)).reset_index()
    order = out["phase"].map({"fwd": 0, "bwd": 1}).fillna(2)
    return out.assign(_order=order).sort_values(CASE_KEYS + ["_order", "step"], kind="stable").drop(
        columns="_order").reset_index(drop=True)


def step_name(step) -> str:
    """A step of the step table as a table shows it: its number, or ``a2a`` for the a2a exchanges
    around the ring."""
    return "a2a" if int(step) < 0 else str(int(step))


def iteration_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per case and phase: wall ms of the slowest rank (median over iterations), TFLOP/s per GPU
    (``per``: GPU, or rank on the CPU), the exposed communication (``exposed_time``) and its
    share of the wall time, and ``sent_mb``: the MB sent per iteration by the rank that sent most
    (median over iterations; NaN without bytes). The exposed time and share are NaN (unknown)
    for a case whose exchanges have neither times nor ``exposed_ms``; throughput and share are NaN
    for a wall time of 0."""
    it = df[df["kind"] == "iteration"]
    if it.empty:
        return pd.DataFrame()
    worst = it.groupby(CASE_KEYS + ["phase", "iteration"]).agg(wall_ms=("dur_ms", "max"), flops=("flops", "first"))
    out = worst.groupby(level=CASE_KEYS + ["phase"]).agg(wall_ms=("wall_ms", "median"), flops=("flops", "first"),
                                                         iterations=("wall_ms", "size")).reset_index()
    wall = out["wall_ms"].where(out["wall_ms"] > 0)  # a 0 ms iteration has no rate
    out["tflops_per_gpu"] = out["flops"] / out["cp"].astype(float) / (wall * 1e-3) / 1e12
    out = out.merge(df.groupby(CASE_KEYS)["device_name"].agg(per_device).rename("per").reset_index(),
                    on=CASE_KEYS, how="left")
    # A run measures one phase (fwd, bwd or fwdbwd): its communication rows belong to that phase.
    comm = exposed_time(df)
    if not comm.empty:
        exposed = _max_known(comm, CASE_KEYS + ["iteration"]).groupby(
            level=CASE_KEYS).median().rename("exposed_comm_ms").reset_index()
        out = out.merge(exposed, on=CASE_KEYS, how="left")
    else:
        out["exposed_comm_ms"] = float("nan")
    has = df.assign(has_comm=df["kind"].isin(COMM_KINDS), has_steps=df["kind"].isin(STEP_KINDS)).groupby(
        CASE_KEYS)[["has_comm", "has_steps"]].any()
    out = out.merge(has.reset_index(), on=CASE_KEYS, how="left")
    # no communication: 0; no step rows at all (iteration rows only): unknown
    out["exposed_comm_ms"] = out["exposed_comm_ms"].where(out["has_comm"], 0.0).where(out["has_steps"])
    out["exposed_pct"] = 100.0 * out["exposed_comm_ms"] / wall
    sent = _sent_mb(df, CASE_KEYS + ["iteration", "rank"]).groupby(level=CASE_KEYS + ["iteration"]).max()
    out = out.merge(sent.groupby(level=CASE_KEYS).median().reset_index(), on=CASE_KEYS, how="left")
    return out.merge(_predicted(df, CASE_KEYS).reset_index(), on=CASE_KEYS, how="left")


def exposed_spans(comm, computes) -> list[tuple[float, float]]:
    """The parts of one exchange [start, end] during which its rank computed nothing of its phase
    (``computes``: that phase's compute rows of the rank and iteration, any step: a forward run's
    messages are posted at the step before the run and labelled with their own steps, and a dK/dV
    part is hidden by the step after its own), as ``overlap_rows`` counts them."""
    s, e = float(comm["start_ms"]), float(comm["end_ms"])
    spans, at = [], s
    for cs, ce in sorted((float(c["start_ms"]), float(c["end_ms"])) for c in computes):
        if ce <= at or cs >= e:
            continue
        if cs > at:
            spans.append((at, cs))
        at = max(at, ce)
    if at < e:
        spans.append((at, e))
    return [(a, b) for a, b in spans if b > a]


def beside(row, computes) -> bool:
    """Whether the compute row ``row`` is a step 0 that ran beside a later step (on a second
    stream, ``ring.Beside``): it overlaps another of ``computes`` (its rank's compute rows of the
    iteration and phase)."""
    return int(row["step"]) == 0 and any(
        int(c["step"]) != 0 and c["start_ms"] < row["end_ms"] and row["start_ms"] < c["end_ms"] for c in computes)


def union_ms(spans) -> float:
    """The length of the union of the intervals ``spans`` (each counted once where they overlap)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def exposed_time(df: pd.DataFrame) -> pd.Series:
    """Exposed communication ms per (case, iteration, rank): the length of the union of the
    exchanges' exposed parts (``exposed_spans``), so time when two exchanges (kv and dkv in the
    backward) are both exposed counts once. A row without start and end times (it cannot be
    placed) adds its ``exposed_ms``; NaN (unknown) when such a row has none."""
    keys = CASE_KEYS + ["iteration", "rank"]
    rows = df[df["kind"].isin(STEP_KINDS)]
    if not rows["kind"].isin(COMM_KINDS).any():
        return pd.Series(dtype=float)
    out = {}
    for key, part in rows.groupby(keys, sort=False):
        computes = [c for _, c in part[part["kind"] == "compute"].iterrows()]
        comm = part[part["kind"] != "compute"]
        if comm.empty:
            continue
        timed = comm["start_ms"].notna() & comm["end_ms"].notna()
        spans = [sp for _, r in comm[timed].iterrows()
                 for sp in exposed_spans(r, [c for c in computes if c["phase"] == r["phase"]])]
        untimed = comm.loc[~timed, "exposed_ms"]
        out[key] = union_ms(spans) + (float(untimed.sum()) if untimed.notna().all() else float("nan"))
    return pd.Series(out, dtype=float).rename_axis(keys).rename("exposed_ms")


def per_device(device_names) -> str:
    """What a throughput is per: ``GPU`` when the rows ran on GPUs, else ``rank`` (CPU ranks)."""
    return "GPU" if any(str(n) not in ("", "cpu") for n in device_names) else "rank"


def flops_unit(tflops: float) -> tuple[float, str]:
    """(scale, unit) that shows ``tflops`` (TFLOP/s) with a few digits: a CPU run in GFLOP/s."""
    for scale, unit in ((1.0, "TFLOP/s"), (1e3, "GFLOP/s"), (1e6, "MFLOP/s")):
        if tflops * scale >= 1.0:
            return scale, unit
    return 1e6, "MFLOP/s"


def flops_text(tflops: float, per: str = "GPU") -> str:
    """``tflops`` in the unit that fits, per GPU or per rank: ``3.2 GFLOP/s per rank``."""
    if tflops != tflops:
        return f"FLOP/s per {per} unknown (no flops in the CSV)"
    scale, unit = flops_unit(tflops)
    value = tflops * scale
    return f"{value:.3g} {unit} per {per}" if value < 1e3 else f"{value:.0f} {unit} per {per}"


def _busy_ms(rows: pd.DataFrame) -> float:
    """One rank's compute time in one iteration: the union of its compute spans (step 0 may run
    beside the next step, ``ring.Beside``), or their sum where the rows have no start and end."""
    if rows[["start_ms", "end_ms"]].notna().all().all():
        return union_ms(zip(rows["start_ms"].astype(float), rows["end_ms"].astype(float)))
    return float(rows["dur_ms"].sum())


def rank_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per case, phase and rank: median compute ms over iterations (load balance)."""
    compute = df[df["kind"] == "compute"]
    if compute.empty:
        return pd.DataFrame()
    comp = compute.groupby(CASE_KEYS + ["phase", "iteration", "rank"])[["start_ms", "end_ms", "dur_ms"]].apply(_busy_ms)
    return comp.groupby(level=CASE_KEYS + ["phase", "rank"]).median().rename("compute_ms").reset_index()


def select(table: pd.DataFrame, key: dict) -> pd.DataFrame:
    """The rows of ``table`` that belong to the case ``key`` (CASE_KEYS -> value)."""
    if table.empty:
        return table
    mask = pd.Series(True, index=table.index)
    for k, v in key.items():
        mask &= table[k] == v
    return table[mask]


def case_key(row) -> dict:
    return {k: row[k] for k in CASE_KEYS}


def num_text(value: float, spec: str = ".3f") -> str:
    """A number for a table cell; ``-`` when unknown (NaN: a column the CSV lacks)."""
    return "-" if value != value else format(value, spec)


def mb_text(mb: float) -> str:
    """MB (1e6 bytes) for a table cell; ``-`` when unknown (a CSV without bytes)."""
    return num_text(mb)


def exposed_text(pct: float) -> str:
    """The exposed share for a title: ``exposed comm 12.3%``, or that it is unknown."""
    return "exposed comm unknown (no exposed_ms or times)" if pct != pct else f"exposed comm {pct:.1f}%"


def sent_text(mb: float) -> str:
    """The MB a case sent per iteration (the rank that sent most), for its title: ``, sent 1.835
    MB/iter (most of any rank)``; nothing when unknown."""
    return "" if mb != mb else f", sent {mb:.3f} MB/iter (most of any rank)"


def case_row(rows: pd.DataFrame) -> pd.Series:
    """One row that stands for a case's ``rows`` in its title: the first, marked ``predicted``
    where any of them is (a prediction's compute rows are measured, its exchanges predicted)."""
    first = rows.iloc[0].copy()
    first["predicted"] = bool(rows["predicted"].any())
    return first


def label(row) -> str:
    """The whole case in words (titles)."""
    parts = [str(row["comm"]), str(row["softmax"]), str(row["mask"]), str(row["dtype"]), f"cp={row['cp']}"]
    if str(row.get("sink_strategy", "")):
        parts.insert(2, str(row["sink_strategy"]))
    if str(row.get("sink_grad", "")) not in ("", "full"):
        parts.append(f"sink_grad={row['sink_grad']}")
    if str(row.get("a2a_size", "")):
        parts.append(f"a2a_size={row['a2a_size']}")
    if str(row.get("kv_schedule", "")):
        parts.append(f"kv={row['kv_schedule']}")
    if str(row.get("window", "")):
        parts.append(f"window={row['window']}")
    if str(row.get("docs", "")):
        parts.append(f"docs={docs_text(row['docs'])}")
    if str(row.get("pack_layout", "")) not in ("", "zigzag"):
        parts.append(f"layout={row['pack_layout']}")
    if str(row.get("qkv_format", "")) not in ("", "bshd", "thd"):   # a thd pack shows as docs=
        parts.append(str(row["qkv_format"]))
    if row.get("bias", False):
        parts.append("bias")
    if row["simulated"]:
        parts.append("simulated")
    # a CSV of an older version leaves some of these blank: they are left out, not "b= ()"
    shape = " ".join(f"{k}={row[k]}" for k in ("b", "s", "h", "g", "d") if str(row[k]))
    text = " ".join(filter(None, ("/".join(p for p in parts if p), shape,
                                  f"({row['backend']})" if str(row["backend"]) else "",
                                  f"over {row['link']}" if str(row.get("link", "")) else "")))
    return f"PREDICTION {text}" if row.get("predicted", False) else text


def docs_text(docs: str) -> str:
    """A pack's document lengths (a CSV cell) as a title shows them (``cases.docs_label``)."""
    return docs_label([d for d in str(docs).split(",") if d.strip()])


def _slug_part(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", str(text).lower()).strip("-")


def _window_part(window: str) -> str:
    left, _, right = str(window).partition(",")
    return "w" + "-".join("inf" if v.strip() == "-1" else _slug_part(v) for v in (left, right))


def run_part(run_id: str) -> str:
    """The random part of a run id (``20261203-075527-040e0d`` -> ``040e0d``)."""
    found = re.findall(r"(?<![0-9a-f])[0-9a-f]{6}(?![0-9a-f])", str(run_id))
    return found[-1] if found else _slug_part(run_id)


def slugs(cases: pd.DataFrame) -> dict:
    """A short file-name slug per case (the tuple of its CASE_KEYS): ``comm-softmax[-strategy]-mask
    [-window][-thdNdocs]-dtype-cpN[-sim][-pred]``; cases that would share one add what tells them
    apart (the K/V schedule as ``kv-ring`` or ``kv-direct``, the layout, sink gradient, bias and a2a
    group, a pack's lengths, the shape, the backend, then the run), so a slug
    depends only on the cases read, in any order."""
    rows = cases.drop_duplicates(subset=CASE_KEYS)
    base = {}
    for _, r in rows.iterrows():
        parts = [r["comm"], r["softmax"], r["sink_strategy"], r["mask"]]
        parts += [_window_part(r["window"])] if str(r["window"]) else []
        parts += [f"thd{len(str(r['docs']).split(','))}docs"] if str(r.get("docs", "")) else []
        parts += [str(r["pack_layout"])] if str(r.get("pack_layout", "")) not in ("", "zigzag") else []
        parts += [r["dtype"], f"cp{r['cp']}"]
        parts += ["sim"] if r["simulated"] else []
        parts += ["pred"] if r.get("predicted", False) else []
        base[tuple(r[k] for k in CASE_KEYS)] = [_slug_part(p) for p in parts if str(p)]
    kv = CASE_KEYS.index("kv_schedule")
    docs = CASE_KEYS.index("docs")
    at = {n: CASE_KEYS.index(n) for n in ("qkv_format", "sink_grad", "bias", "a2a_size")}
    for extra in (lambda k: [f"kv-{k[kv]}" if k[kv] else ""],
                  lambda k: [str(k[at["qkv_format"]]), f"grad-{k[at['sink_grad']]}" if k[at["sink_grad"]] else "",
                             "bias" if k[at["bias"]] else "no-bias",
                             f"a2a{k[at['a2a_size']]}" if str(k[at["a2a_size"]]) else ""],
                  lambda k: ["docs-" + "-".join(str(k[docs]).split(",")) if str(k[docs]) else ""],
                  lambda k: [f"{n}{k[CASE_KEYS.index(n)]}" for n in ("b", "s", "h", "g", "d")],
                  lambda k: [k[CASE_KEYS.index("backend")]],
                  lambda k: [run_part(k[CASE_KEYS.index("run_id")])]):
        groups: dict = {}
        for key, parts in base.items():
            groups.setdefault("-".join(parts), []).append(key)
        for keys in groups.values():
            if len(keys) < 2:
                continue
            extras = [extra(k) for k in keys]
            differs = [i for i in range(len(extras[0])) if len({e[i] for e in extras}) > 1]
            for key, e in zip(keys, extras):
                base[key] = base[key] + [_slug_part(e[i]) for i in differs if e[i]]
    named: dict = {}
    for key in sorted(base, key=lambda k: tuple(map(str, k))):
        slug = "-".join(base[key])
        named[key] = slug if slug not in named.values() else f"{slug}-{list(named.values()).count(slug) + 1}"
    return {key: _bounded(slug) for key, slug in named.items()}


SLUG_MAX = 120   # characters: a file name ``<slug>-<phase>.png`` stays far below NAME_MAX (255 bytes)


def _bounded(slug: str) -> str:
    """``slug``, or when longer than SLUG_MAX (a pack of many documents tells cases apart by their
    lengths) its start and a hash of the whole, which keeps slugs that differ apart."""
    if len(slug) <= SLUG_MAX:
        return slug
    digest = hashlib.sha1(slug.encode()).hexdigest()[:12]
    head = slug[:SLUG_MAX - len(digest)]
    return f"{head[:head.rfind('-')] if '-' in head else head[:-1]}-{digest}"   # cut between parts


def summarize(df: pd.DataFrame, console) -> None:
    """Print the per-case tables onto ``console``. Every value from a CSV is printed as plain text
    (a cell holding ``[/]`` or ``[link=...]`` prints as written)."""
    from rich.table import Table
    from rich.text import Text
    steps = step_table(df)
    ranks = rank_table(df)
    cases = case_rows(df, iteration_table(df))
    labels = [label(row) for _, row in cases.iterrows()]
    for name, (_, row) in zip(labels, cases.iterrows()):
        key = case_key(row)
        sel = select(steps, key)
        if labels.count(name) > 1:   # the same case in several runs (CSVs): which run each table is
            name = f"{name} run {row['run_id']}"
        if pd.isna(row.get("wall_ms")):   # no iteration rows: every phase's steps
            title = f"{name}: no iteration rows (wall time, FLOP/s and exposed share unknown)"
        else:
            title = (f"{name}: {row['phase']} {row['wall_ms']:.3f} ms/iter (slowest rank), "
                     f"{flops_text(row['tflops_per_gpu'], row['per'])}, {exposed_text(row['exposed_pct'])}"
                     + sent_text(row["sent_mb"]))
            if not sel.empty and row["phase"] != "fwdbwd":
                sel = sel[sel["phase"] == row["phase"]]
        table = Table(title=Text(title))
        predicted = bool(row["predicted"])
        for col in ("phase", "step", "compute ms", "comm ms", "overlap ms", "exposed ms", "sent MB") + (
                ("source",) if predicted else ()):
            table.add_column(col, justify="right")
        for _, s in sel.iterrows():
            cells = [str(s["phase"]), step_name(s["step"]), f"{s['compute_ms']:.3f}", f"{s['comm_ms']:.3f}",
                     num_text(s["overlap_ms"]), num_text(s["exposed_ms"]), mb_text(s["sent_mb"])]
            if predicted:
                cells.append("predicted" if s["predicted"] else "measured")
            table.add_row(*map(Text, cells))
        console.print(table)
        rsel = select(ranks, key)
        if not rsel.empty:
            per = rsel.groupby("rank")["compute_ms"].sum()
            console.print(Text("compute ms per rank: " + ", ".join(f"{r}: {v:.3f}" for r, v in per.items())
                               + f" (max/mean {per.max() / per.mean():.3f})"))


def print_summary(rows: list) -> None:
    """The summary of the rows a bench run measured, on stdout."""
    if not rows:
        print("sinkprof bench: no rows measured")
        return
    df = pd.DataFrame(rows)
    for col, default in OPTIONAL_COLUMNS.items():
        if col not in df.columns and col != "cp":
            df[col] = default
    df["bytes"] = pd.to_numeric(df["bytes"], errors="coerce")  # compute rows hold ""
    for col in BOOL_COLUMNS:
        df[col] = df[col].map(_truth)
    keys = [k for k in CASE_KEYS if k not in BOOL_COLUMNS]
    df[keys] = df[keys].astype(object).where(df[keys].notna(), "")
    Output().emit(table=lambda console: summarize(df, console))


def _write(path: str, text: str) -> None:
    """A whole file, or stdout for ``-`` (the rule of every output)."""
    if path == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        write_text(path, text)


def report(paths, plot_dir: Optional[str] = None, output: Output = Output(), html: Optional[str] = None,
           chrome_trace: Optional[str] = None) -> list:
    """Summarise the CSVs; with ``plot_dir`` write the pictures (a timeline per case and phase,
    one summary across cases), with ``html`` one self-contained page, with ``chrome_trace`` one
    trace of every rank. Returns the paths written (not ``-``). When the page or the trace goes
    to stdout, the tables are left out of it; otherwise they follow the files (a pipe that closes
    early, ``| head``, then leaves the files written)."""
    check_outputs(paths, html, chrome_trace, plot_dir)
    df = load(paths)
    written = []
    left_out = [what for what, wanted in (("timelines", plot_dir or html),
                                          ("Chrome trace events", chrome_trace)) if wanted]
    notes = [untimed_note(df, " and ".join(left_out)) if left_out else None, stepless_note(df, left_out),
             iterationless_note(df, bool(plot_dir or html))]
    for note in filter(None, notes):
        print(note, file=sys.stderr)
    if plot_dir or html:
        from . import figures
        pictures = figures.draw(df)
        if plot_dir:
            files = {str(Path(plot_dir) / name): png for name, png in pictures.files().items()}
            check_pictures(paths, plot_dir, list(files), html, chrome_trace)
            for path, png in files.items():
                write_bytes(path, png)   # a failure is an OutputError naming the picture
                written.append(path)
        if html:
            from .page import page
            _write(html, page(df, pictures, [str(p) for p in paths]))
            written += [html] if html != STDOUT else []
    if chrome_trace:
        import json
        from .chrome_trace import trace
        # allow_nan=False: never NaN or Infinity (not JSON; trace() leaves unknown numbers out)
        _write(chrome_trace, json.dumps(trace(df), separators=(",", ":"), allow_nan=False) + "\n")
        written += [chrome_trace] if chrome_trace != STDOUT else []
    if STDOUT not in (html, chrome_trace):
        output.emit(table=lambda console: summarize(df, console))
    return written


@dataclass(frozen=True)
class OutputFile:
    """A file the report writes: ``path`` (``-`` for stdout); ``what`` names it in a message
    (``--html page.html``, ``the picture summary.png of --plot plots``) and ``elsewhere`` says how
    to move it."""

    what: str
    path: str
    elsewhere: str = "write it elsewhere"


def _options(html: Optional[str], chrome_trace: Optional[str]) -> list:
    """The page and the trace, named as typed (``/dev/stdout``, not the ``-`` that
    ``output.settle`` made of it)."""
    return [OutputFile(f"{option} {typed(out)}", out)
            for option, out in (("--html", html), ("--chrome-trace", chrome_trace)) if out is not None]


def _refuse_overlaps(paths, files: list, others: list = ()) -> None:
    """No two of ``files``, nor one of them and one of ``others``, write one file (stdout, or one
    target through symlinks), and none writes an input CSV."""
    for i, new in enumerate(files):
        for old in [*others, *files[:i]]:
            if new.path == old.path == STDOUT or same_target(new.path, old.path):
                where = "stdout" if new.path == STDOUT else typed(new.path)
                raise ValueError(f"{old.what} and {new.what} would both write {where}: give them different files")
        for path in paths:
            if same_target(new.path, path):
                raise ValueError(f"{new.what} is the CSV {path} being read: it would be overwritten; {new.elsewhere}")


def check_outputs(paths, html: Optional[str], chrome_trace: Optional[str], plot_dir: Optional[str] = None) -> None:
    """The page and the trace go to different places, neither over an input CSV nor where the
    ``--plot`` folder is or must be made; nor does stdout (the tables, or a page or trace given as
    ``-``) go into one (``>> in.csv``). Checked before the CSVs are read; the pictures, named by the
    cases read, by ``check_pictures``."""
    _refuse_overlaps(paths, _options(html, chrome_trace))
    if plot_dir is not None:
        folder = target(plot_dir)
        for out in _options(html, chrome_trace):
            if out.path == STDOUT:
                continue
            if target(out.path) == folder:
                raise ValueError(f"{out.what} is the folder --plot {plot_dir} writes the pictures into; name a "
                                 f"file in it, or another")
            if under_file(plot_dir, out.path):
                raise ValueError(f"{out.what} would be a file where --plot {plot_dir} needs a folder; name "
                                 f"another file")
    into = _stdout_input(paths)
    if into is not None:
        given = [f"{option} {typed(out)}" for option, out in (("--html", html), ("--chrome-trace", chrome_trace))
                 if out == STDOUT]
        what = " and ".join(given) if given else "the summary tables"
        raise ValueError(f"stdout is the CSV {into} being read (a > or >> into it): {what} would be written into "
                         f"it; send stdout elsewhere")


def check_pictures(paths, plot_dir: str, pictures: list, html: Optional[str], chrome_trace: Optional[str]) -> None:
    """No picture that ``--plot`` writes (``pictures``: their paths, before any is written) lands on
    another, an input CSV, the page or the trace (``--plot plots --html plots/summary.png``)."""
    named = [OutputFile(f"the picture {Path(path).name} of --plot {plot_dir}", path,
                        "write the pictures into another folder") for path in pictures]
    _refuse_overlaps(paths, named, _options(html, chrome_trace))
    for path in pictures:   # a protected picture is refused as a protected --html is
        if Path(path).is_dir():
            raise ValueError(f"--plot {plot_dir}: {path} is a folder where a picture goes; move it, or write the "
                             f"pictures into another folder")
        check_writable(path, f"--plot {plot_dir}: the picture")


def _stdout_input(paths) -> Optional[str]:
    """The input CSV that stdout is (``report in.csv >> in.csv``), or None."""
    try:
        out = os.fstat(1)
    except OSError:   # closed: nothing is written there
        return None
    if not stat.S_ISREG(out.st_mode):
        return None
    for path in paths:
        try:
            if os.path.samestat(os.stat(path), out):
                return str(path)
        except OSError:   # unreadable: load() says so
            continue
    return None
