"""``sinkprof report --chrome-trace``: one Trace Event Format file of every rank, for Perfetto or
chrome://tracing. Each rank is a process (``pid`` = rank), its compute one thread and each kind of
exchange (kv, dkv, a2a) a communication thread: exchanges of two kinds overlap in time, and the
events of one thread must nest. Exchanges of one kind in flight together (the direct schedule posts
a joined run's messages at once) take further threads of that kind ("communication kv 2", ...),
each exchange the first whose last one has ended. Step 0's compute, where it overlaps the next step's (it ran on a
second stream beside it, ``ring.Beside``), is on a thread of its own, "compute beside". Every row
with start and end times is an ``X`` (complete) event, ``ts`` and ``dur`` in microseconds, an
exchange's ``args`` with the bytes it sent; an arg the CSV has no value for is left out (JSON has no
NaN). The exposed parts of an exchange are child events ``exposed`` inside it. Iterations and cases
follow one another on one time axis: each iteration starts when the slowest rank's previous one
ended (each rank's times count from its own iteration start mark).
"""
from __future__ import annotations

import math

import pandas as pd

from .report import CASE_KEYS, COMM_KINDS, beside, case_row, exposed_spans, label

COMPUTE_TID = 0
COMM_TIDS = {"kv": 1, "dkv": 2, "a2a": 3}   # the first thread of each kind (_comm_tid gives the others)
BESIDE_TID = 4
# Perfetto's order of a rank's threads: compute, each kind's threads, then compute beside
COMM_SORT, BESIDE_SORT = 1000, 10 ** 6   # the n-th thread of kind tid sorts at COMM_SORT * tid + n
GAP_US = 50.0


def _lane(ends: list, ts: float, end: float) -> int:
    """The first of a rank's threads of one kind (``ends``: when each one's last event ends) free at
    ``ts``, a new one if none is; it then ends at ``end``."""
    free = next((n for n, e in enumerate(ends) if e <= ts), len(ends))
    if free == len(ends):
        ends.append(end)
    else:
        ends[free] = end
    return free


def _comm_tid(kind: str, lane: int) -> int:
    """The thread of a rank's ``lane``-th exchanges of ``kind`` (its ids apart from every other's)."""
    return COMM_TIDS[kind] + 10 * lane


def _known(args: dict) -> dict:
    """``args`` without the numbers the CSV has no value for (NaN: a column an older CSV lacks, a
    blank cell): JSON has no NaN, and Perfetto refuses a file that writes one."""
    return {k: v for k, v in args.items() if not (isinstance(v, float) and not math.isfinite(v))}


def _event(name, cat, pid, tid, ts, dur, args=None) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "pid": int(pid), "tid": tid, "ts": round(ts, 3),
            "dur": round(max(dur, 0.0), 3), "args": _known(args or {})}


def trace(df: pd.DataFrame) -> dict:
    events: list = []
    ranks, beside_ranks = set(), set()
    lanes: dict = {}   # (rank, kind) -> the end of each of its threads' last event
    t = 0.0
    for case, rows in df.groupby(CASE_KEYS, sort=False):
        rows = rows.dropna(subset=["start_ms", "end_ms"])
        if rows.empty:
            continue
        first = case_row(rows)
        case_start = t
        for it, its_rows in rows.groupby("iteration"):
            for rank, mine in its_rows.groupby("rank"):
                ranks.add(int(rank))
                computes = {(c["phase"], int(c["step"])): c for _, c in mine[mine["kind"] == "compute"].iterrows()}
                for _, r in mine.sort_values("start_ms", kind="stable").iterrows():
                    pred = bool(r["predicted"])
                    suffix = " (predicted)" if pred else ""
                    ts, dur = t + 1e3 * r["start_ms"], 1e3 * (r["end_ms"] - r["start_ms"])
                    args = {"phase": r["phase"], "step": int(r["step"]), "iteration": int(it), "dur_ms": r["dur_ms"],
                            "predicted": pred}
                    if r["kind"] == "iteration":
                        events.append(_event(f"{r['phase']} iteration {it}{suffix}", "iteration", rank, COMPUTE_TID,
                                             ts, dur, args))
                    elif r["kind"] == "compute":
                        same = [c for (phase, _), c in computes.items() if phase == r["phase"]]
                        tid = BESIDE_TID if beside(r, same) else COMPUTE_TID
                        if tid == BESIDE_TID:
                            beside_ranks.add(int(rank))
                        events.append(_event(f"{r['phase']} step {int(r['step'])} compute{suffix}", "compute", rank,
                                             tid, ts, dur, args))
                    elif r["kind"] in COMM_KINDS:
                        tid = _comm_tid(r["kind"], _lane(lanes.setdefault((int(rank), r["kind"]), []), ts, ts + dur))
                        step = "" if int(r["step"]) < 0 else f" step {int(r['step'])}"
                        args.update(overlap_ms=r["overlap_ms"], exposed_ms=r["exposed_ms"])
                        if math.isfinite(r["bytes"]):  # a CSV older than the column has none
                            args["bytes"] = int(r["bytes"])
                        events.append(_event(f"{r['phase']}{step} {r['kind']}{suffix}", "communication", rank, tid,
                                             ts, dur, args))
                        for a, b in exposed_spans(r, [c for (phase, _), c in computes.items() if phase == r["phase"]]):
                            events.append(_event("exposed", "exposed", rank, tid, t + 1e3 * a, 1e3 * (b - a),
                                                 {"predicted": pred}))
            t += 1e3 * float(its_rows["end_ms"].max()) + GAP_US
        for rank in sorted(rows["rank"].unique()):
            events.append(_event(label(first), "case", rank, COMPUTE_TID, case_start - GAP_US / 4,
                                 t - case_start, {**{k: str(first[k]) for k in CASE_KEYS},
                                                  "predicted": bool(first["predicted"])}))
        t += 4 * GAP_US
    meta = []
    for rank in sorted(ranks):
        meta += [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
                 {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
                 {"name": "thread_name", "ph": "M", "pid": rank, "tid": COMPUTE_TID, "args": {"name": "compute"}}]
        if rank in beside_ranks:
            meta += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": BESIDE_TID,
                      "args": {"name": "compute beside"}},
                     {"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": BESIDE_TID,
                      "args": {"sort_index": BESIDE_SORT}}]
        for kind, first in COMM_TIDS.items():
            for n in range(len(lanes.get((rank, kind), []))):
                tid = _comm_tid(kind, n)
                meta += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                          "args": {"name": f"communication {kind}" + (f" {n + 1}" if n else "")}},
                         {"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                          "args": {"sort_index": COMM_SORT * first + n}}]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"source": "sinkprof report", "runs": sorted(set(df["run_id"]))}}
