"""The pictures of ``sinkprof report``: a timeline per case and phase, one summary across cases.

A timeline shows one iteration (the median one by wall time) of every rank: a lane for its compute
and a lane for its communication, each ring step a bar with its number on it, the part of an
exchange that no compute of its step overlapped (the exposed communication, as the CSV's
``exposed_ms`` counts it) in red, the hidden part in green; times in ms from each rank's iteration
start (a step 0 that ran beside a later step, on a second stream, in the upper half of the compute
lane, the other steps in the lower half). The summary puts FLOP/s per GPU (per rank on the CPU) and
the exposed share side by side, each case labelled by what differs between the cases. Rows that are
predictions (``predicted``) are hatched and titled so.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Optional

import pandas as pd

from .report import (CASE_KEYS, COMM_KINDS, STEP_KINDS, TIME_COLUMNS, TRUE, beside, case_row, case_rows, docs_text,
                     exposed_spans, flops_unit, iteration_table, label, run_part, slugs)

COMPUTE = "#4C72B0"
HIDDEN = "#55A868"
EXPOSED = "#C44E52"
DPI = 110
WIDTH_IN = 11.0


@dataclass
class Pictures:
    """PNG bytes: ``timelines[(case, phase)]`` (case = the tuple of CASE_KEYS), ``summary``."""

    slugs: dict
    timelines: dict = field(default_factory=dict)
    summary: bytes = b""

    def files(self) -> dict:
        """File name -> PNG: ``<slug>-<phase>.png`` per timeline, ``summary.png``."""
        out = {f"{self.slugs[case]}-{phase}.png": png for (case, phase), png in self.timelines.items()}
        if self.summary:
            out["summary.png"] = self.summary
        return out


def draw(df: pd.DataFrame) -> Pictures:
    import matplotlib
    matplotlib.use("Agg")
    its = iteration_table(df)
    pictures = Pictures(slugs(case_rows(df, its)))
    for case, rows in df.groupby(CASE_KEYS, sort=False):
        # A timeline places spans by their times: rows without them (an older CSV) are not drawn.
        steps = rows[rows["kind"].isin(STEP_KINDS)].dropna(subset=list(TIME_COLUMNS))
        for phase in [p for p in ("fwd", "bwd") if (steps["phase"] == p).any()]:
            png = timeline(rows, phase)
            if png is not None:
                pictures.timelines[(case, phase)] = png
    if not its.empty:
        pictures.summary = summary(its)
    return pictures


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def median_iteration(rows: pd.DataFrame) -> tuple[int, int]:
    """(the iteration whose slowest-rank wall time is the median, how many there are)."""
    walls = rows[rows["kind"] == "iteration"].groupby("iteration")["dur_ms"].max().sort_values(kind="stable")
    if walls.empty:
        its = sorted(rows["iteration"].unique())
        return int(its[0]), len(its)
    return int(walls.index[(len(walls) - 1) // 2]), len(walls)


def timeline(rows: pd.DataFrame, phase: str) -> Optional[bytes]:
    """One case's timeline of ``phase`` (rows: every row of the case); None when the median
    iteration has no span with start and end times to draw."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    it, n_its = median_iteration(rows)
    part = rows[(rows["iteration"] == it) & (rows["phase"] == phase)
                & rows["kind"].isin(STEP_KINDS)].dropna(subset=list(TIME_COLUMNS))
    if part.empty:
        return None
    ranks = sorted(part["rank"].unique())
    kinds = [k for k in COMM_KINDS if (part["kind"] == k).any()]
    lanes_per_rank = 2 if kinds else 1
    lanes = len(ranks) * lanes_per_rank
    lane_in = 0.42 if lanes <= 16 else max(0.16, 6.7 / lanes)
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 1.3 + lanes * lane_in))
    t0, t1 = float(part["start_ms"].min()), float(part["end_ms"].max())
    span = max(t1 - t0, 1e-9)
    ax.set_xlim(t0 - 0.01 * span, t1 + 0.01 * span)
    axes_px = 0.8 * WIDTH_IN * DPI
    fs = 7 if lanes <= 24 else 5

    def text_on(x0, x1, y, text, color):
        for candidate in (text, text.split()[-1]):  # "kv 3", else "3"
            if (x1 - x0) / span * axes_px > 5.5 * len(candidate) + 4:
                ax.text((x0 + x1) / 2, y, candidate, ha="center", va="center", fontsize=fs, color=color)
                return

    yticks, ylabels = [], []
    predicted_any = bool(part["predicted"].any())
    for i, rank in enumerate(ranks):
        mine = part[part["rank"] == rank]
        y_comp = i * lanes_per_rank
        yticks.append(y_comp)
        ylabels.append(f"rank {rank} compute")
        computes = {int(c["step"]): c for _, c in mine[mine["kind"] == "compute"].iterrows()}
        halves = any(beside(c, computes.values()) for c in computes.values())
        for step, c in computes.items():
            # step 0 beside a later step (a second stream): the lane's upper half, every step the lower
            y, height = (y_comp, 0.8) if not halves else (y_comp - 0.2, 0.4) if step == 0 else (y_comp + 0.2, 0.4)
            hatch = "//" if c["predicted"] else None
            ax.barh(y, c["end_ms"] - c["start_ms"], left=c["start_ms"], height=height, color=COMPUTE,
                    hatch=hatch, edgecolor="white", linewidth=0.5)
            text_on(c["start_ms"], c["end_ms"], y, f"step {step}", "white")
        if not kinds:
            continue
        y_comm = y_comp + 1
        yticks.append(y_comm)
        ylabels.append(f"rank {rank} comm" + (f" ({' / '.join(kinds)})" if len(kinds) > 1 else f" ({kinds[0]})"))
        sub = 0.8 / len(kinds)
        for _, r in mine[mine["kind"].isin(kinds)].iterrows():
            y = y_comm - 0.4 + sub * (kinds.index(r["kind"]) + 0.5)
            hatch = "//" if r["predicted"] else None
            ax.barh(y, r["end_ms"] - r["start_ms"], left=r["start_ms"], height=sub * 0.9, color=HIDDEN,
                    hatch=hatch, edgecolor="white", linewidth=0.5)
            for a, b in exposed_spans(r, computes.values()):
                ax.barh(y, b - a, left=a, height=sub * 0.9, color=EXPOSED, hatch=hatch, edgecolor="white",
                        linewidth=0.5)
            step = "" if int(r["step"]) < 0 else f" {int(r['step'])}"
            text_on(r["start_ms"], r["end_ms"], y, f"{r['kind']}{step}", "black")
        if i + 1 < len(ranks):
            ax.axhline(y_comm + 0.5, color="#bbbbbb", linewidth=0.6)
    ax.set_yticks(yticks, ylabels, fontsize=8 if lanes <= 24 else 5)
    ax.set_ylim(lanes - 0.5, -0.5)
    ax.set_xlabel("ms from each rank's iteration start")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    first = case_row(rows)
    comm_note = "" if kinds else "; no communication (simulated)" if first["simulated"] else "; no communication"
    ax.set_title(f"{label(first)}\n{phase}: iteration {it} (the median of {n_its} by wall time){comm_note}",
                 fontsize=9)
    handles = [Patch(color=COMPUTE, label="compute (step number on the bar)")]
    if kinds:
        handles += [Patch(color=HIDDEN, label="communication hidden under its step's compute"),
                    Patch(color=EXPOSED, label="communication exposed")]
    if predicted_any:
        handles.append(Patch(facecolor="#999999", hatch="//", edgecolor="white", label="predicted"))
    axes_h = lanes * lane_in
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.36 / axes_h), ncol=len(handles),
              frameon=False, fontsize=8)
    return _png(fig)


def _show(key: str, value) -> str:
    if key == "run_id":
        return f"run {run_part(value)}"
    if key in ("b", "s", "h", "g", "d", "cp"):
        return f"{key}={value}" if str(value) else ""
    if key == "window":
        return f"window={value}" if str(value) else "no window"
    if key == "simulated":
        return "simulated" if value else "real ring"
    if key == "predicted":
        return "predicted" if value else ""
    if key == "link":
        return f"over {value}" if str(value) else ""
    if key == "sink_strategy":
        return str(value) or "no sink"
    if key == "kv_schedule":
        return f"kv={value}" if str(value) else ""
    if key in ("sink_grad", "a2a_size"):   # as ``report.label`` words them
        return f"{key}={value}" if str(value) else ""
    if key == "docs":
        return f"docs={docs_text(value)}" if str(value) else ""
    if key == "pack_layout":
        return f"layout={value}" if str(value) else ""
    if key == "bias":
        return "bias" if str(value).strip().lower() in TRUE else "no bias"
    return str(value)


def case_labels(its: pd.DataFrame) -> tuple[list[str], str]:
    """(a label per row of the iteration table from the keys that differ between rows, the keys
    they share in words)."""
    keys = [k for k in CASE_KEYS if k != "run_id"] + ["predicted", "phase", "run_id"]
    differ = [k for k in keys if its[k].astype(str).nunique() > 1]
    same = [k for k in keys if k not in differ and k != "run_id"]
    labels = [" ".join(filter(None, (_show(k, row[k]) for k in differ))) or str(row["phase"])
              for _, row in its.iterrows()]
    return labels, ", ".join(filter(None, (_show(k, its.iloc[0][k]) for k in same)))


def summary(its: pd.DataFrame) -> bytes:
    """FLOP/s per GPU (or rank) and the exposed share of the wall time, per case and phase, side by side."""
    import matplotlib.pyplot as plt
    labels, common = case_labels(its)
    n = len(its)
    height = 1.7 + 0.38 * n
    fig, (left, right) = plt.subplots(1, 2, sharey=True, figsize=(WIDTH_IN, height))
    fig.subplots_adjust(top=1 - 0.6 / height)
    ys = list(range(n))
    hatches = ["//" if p else None for p in its["predicted"]]
    # NaN (no flops column, an unknown exposed share): no bar, "unknown" written where it would be
    scale, unit = flops_unit(float(its["tflops_per_gpu"].fillna(0.0).max()))
    known_flops, known_exposed = its["tflops_per_gpu"].notna().to_numpy(), its["exposed_pct"].notna().to_numpy()
    tflops = its["tflops_per_gpu"].fillna(0.0).to_numpy() * scale
    exposed = its["exposed_pct"].fillna(0.0).to_numpy()
    for y, v, h in zip(ys, tflops, hatches):
        left.barh(y, v, height=0.7, color=COMPUTE, hatch=h, edgecolor="white")
    for y, v, h in zip(ys, exposed, hatches):
        right.barh(y, v, height=0.7, color=EXPOSED, hatch=h, edgecolor="white")
    tmax = max(float(tflops.max()), 1e-12) if known_flops.any() else 1.0
    left.set_xlim(0, tmax * 1.25)
    if not known_flops.any():  # no scale to show
        left.set_xticks([])
    right.set_xlim(0, max(115.0, float(exposed.max()) * 1.15))
    for y, v, known in zip(ys, tflops, known_flops):
        left.text(v + tmax * 0.01, y, f"{v:.3g}" if known else "unknown (no flops)", va="center", fontsize=8)
    for y, (v, has_comm, known) in enumerate(zip(exposed, its["has_comm"], known_exposed)):
        right.text(v + 1, y, "no communication" if not has_comm else f"{v:.1f}%" if known else "unknown",
                   va="center", fontsize=8)
    left.set_yticks(ys, [f"{lab} (predicted)" if p else lab for lab, p in zip(labels, its["predicted"])],
                    fontsize=8)
    left.set_ylim(n - 0.5, -0.5)
    left.set_xlabel(f"{unit} per {' or '.join(sorted(set(its['per'])))}")
    right.set_xlabel("exposed communication, % of the wall time")
    for ax in (left, right):
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
    fig.suptitle((f"All cases: {common}\n" if common else "")
                 + "useful FLOPs over the slowest rank's median iteration; exposed time: the union of the "
                 "exchanges' exposed parts (kv and dkv overlapping counted once)", fontsize=9)
    return _png(fig)
