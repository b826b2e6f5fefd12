"""``sinkprof report``: pandas summaries and plots of ``sinkprof bench`` CSVs.

One summary per run and case: per phase and ring step, the compute time, the communication time,
how much of it overlapped compute and how much was exposed (medians over iterations, the slowest
rank); per iteration the wall time of the slowest rank and the TFLOP/s per GPU from the useful
FLOPs (causal counted once).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from .output import Output, atomic_path

CASE_KEYS = ["run_id", "comm", "softmax", "sink_strategy", "mask", "window", "dtype", "b", "s", "h", "g", "d", "cp",
             "kv_schedule", "backend", "simulated"]
COMM_KINDS = ("kv", "dkv", "a2a")


def load(paths) -> pd.DataFrame:
    frames = []
    for p in paths:
        if not Path(p).is_file():
            raise ValueError(f"{p}: no such CSV file")
        frames.append(pd.read_csv(p, keep_default_na=False, na_values=[""]))
    df = pd.concat(frames, ignore_index=True)
    missing = {"run_id", "rank", "iteration", "phase", "step", "kind", "dur_ms"} - set(df.columns)
    if missing:
        raise ValueError(f"not a sinkprof bench CSV: missing columns {sorted(missing)}")
    for col in CASE_KEYS:
        if col not in df.columns:
            df[col] = ""
    df[CASE_KEYS] = df[CASE_KEYS].astype(object).fillna("")
    return df


def step_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (case, phase, step): compute, comm, overlap and exposed ms; medians over iterations of
    the slowest rank."""
    steps = df[df["step"] >= 0]
    if steps.empty:
        return pd.DataFrame()
    comp = steps[steps["kind"] == "compute"].groupby(CASE_KEYS + ["phase", "step", "iteration", "rank"])["dur_ms"].sum()
    comm = steps[steps["kind"].isin(COMM_KINDS)].groupby(CASE_KEYS + ["phase", "step", "iteration", "rank"])[
        ["dur_ms", "overlap_ms", "exposed_ms"]].sum()
    per = pd.concat([comp.rename("compute_ms"), comm.rename(columns={"dur_ms": "comm_ms"})], axis=1).fillna(0.0)
    worst = per.groupby(level=CASE_KEYS + ["phase", "step", "iteration"]).max()
    return worst.groupby(level=CASE_KEYS + ["phase", "step"]).median().reset_index()


def iteration_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per case and phase: wall ms of the slowest rank (median over iterations) and TFLOP/s per GPU."""
    it = df[df["kind"] == "iteration"]
    if it.empty:
        return pd.DataFrame()
    worst = it.groupby(CASE_KEYS + ["phase", "iteration"]).agg(wall_ms=("dur_ms", "max"), flops=("flops", "first"))
    out = worst.groupby(level=CASE_KEYS + ["phase"]).agg(wall_ms=("wall_ms", "median"), flops=("flops", "first"),
                                                         iterations=("wall_ms", "size")).reset_index()
    out["tflops_per_gpu"] = out["flops"] / out["cp"].astype(float) / (out["wall_ms"] * 1e-3) / 1e12
    # A run measures one phase (fwd, bwd or fwdbwd): its communication rows belong to that phase.
    comm = df[df["kind"].isin(COMM_KINDS)].groupby(CASE_KEYS + ["iteration", "rank"])["exposed_ms"].sum()
    if not comm.empty:
        exposed = comm.groupby(level=CASE_KEYS + ["iteration"]).max().groupby(
            level=CASE_KEYS).median().rename("exposed_comm_ms").reset_index()
        out = out.merge(exposed, on=CASE_KEYS, how="left")
    else:
        out["exposed_comm_ms"] = 0.0
    out["exposed_pct"] = 100.0 * out["exposed_comm_ms"].fillna(0.0) / out["wall_ms"]
    return out


def rank_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per case, phase and rank: median compute ms over iterations (load balance)."""
    comp = df[df["kind"] == "compute"].groupby(CASE_KEYS + ["phase", "iteration", "rank"])["dur_ms"].sum()
    if comp.empty:
        return pd.DataFrame()
    return comp.groupby(level=CASE_KEYS + ["phase", "rank"]).median().rename("compute_ms").reset_index()


def _label(row) -> str:
    parts = [str(row["comm"]), str(row["softmax"]), str(row["mask"]), str(row["dtype"]), f"cp={row['cp']}"]
    if str(row.get("sink_strategy", "")):
        parts.insert(2, str(row["sink_strategy"]))
    if str(row.get("window", "")):
        parts.append(f"window={row['window']}")
    if str(row["simulated"]).lower() == "true":
        parts.append("simulated")
    return "/".join(parts) + f" b={row['b']} s={row['s']} h={row['h']} g={row['g']} d={row['d']} ({row['backend']})"


def summarize(df: pd.DataFrame, console) -> None:
    """Print the per-case tables onto ``console``."""
    from rich.table import Table
    its = iteration_table(df)
    steps = step_table(df)
    ranks = rank_table(df)
    for _, row in its.iterrows():
        key = {k: row[k] for k in CASE_KEYS}
        table = Table(title=f"{_label(row)}: {row['phase']} {row['wall_ms']:.3f} ms/iter (slowest rank), "
                            f"{row['tflops_per_gpu']:.1f} TFLOP/s per GPU, exposed comm {row['exposed_pct']:.1f}%")
        for col in ("phase", "step", "compute ms", "comm ms", "overlap ms", "exposed ms"):
            table.add_column(col, justify="right")
        sel = steps
        for k, v in key.items():
            sel = sel[sel[k] == v] if not sel.empty else sel
        for _, s in sel.iterrows():
            if row["phase"] != "fwdbwd" and s["phase"] != row["phase"]:
                continue
            table.add_row(str(s["phase"]), str(int(s["step"])), f"{s['compute_ms']:.3f}",
                          f"{s.get('comm_ms', 0.0):.3f}", f"{s.get('overlap_ms', 0.0):.3f}",
                          f"{s.get('exposed_ms', 0.0):.3f}")
        console.print(table)
        rsel = ranks
        for k, v in key.items():
            rsel = rsel[rsel[k] == v] if not rsel.empty else rsel
        if not rsel.empty:
            per = rsel.groupby("rank")["compute_ms"].sum()
            console.print("compute ms per rank: " + ", ".join(f"{r}: {v:.3f}" for r, v in per.items())
                          + f" (max/mean {per.max() / per.mean():.3f})")


def print_summary(rows: list) -> None:
    """The summary of the rows a bench run measured, on stdout."""
    if not rows:
        print("sinkprof bench: no rows measured")
        return
    df = pd.DataFrame(rows)
    for col in ("overlap_ms", "exposed_ms"):
        if col not in df.columns:
            df[col] = float("nan")
    df[CASE_KEYS] = df[CASE_KEYS].astype(object).fillna("")
    Output().emit(table=lambda console: summarize(df, console))


def plot(df: pd.DataFrame, out_dir: str) -> list:
    """One PNG per case and phase: compute and exposed communication per ring step and rank."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = []
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    steps = df[df["step"] >= 0]
    for i, (key, part) in enumerate(steps.groupby(CASE_KEYS + ["phase"])):
        comp = part[part["kind"] == "compute"].groupby(["rank", "step"])["dur_ms"].median().unstack(0)
        fig, ax = plt.subplots(figsize=(8, 4))
        comp.plot(kind="bar", ax=ax, alpha=0.8)
        exposed = part[part["kind"].isin(COMM_KINDS)]
        if not exposed.empty and "exposed_ms" in exposed:
            ex = exposed.groupby(["rank", "step"])["exposed_ms"].median().unstack(0)
            ex.add_prefix("exposed comm, rank ").plot(ax=ax, marker="o", linestyle="--")
        row = dict(zip(CASE_KEYS + ["phase"], key))
        ax.set_title(f"{_label(row)}\n{row['phase']}: compute per step and rank (median ms)", fontsize=8)
        ax.set_xlabel("ring step")
        ax.set_ylabel("ms")
        name = Path(out_dir) / f"case{i}_{row['phase']}.png"
        with atomic_path(name) as tmp:
            fig.savefig(tmp, dpi=110, bbox_inches="tight")
        plt.close(fig)
        out.append(str(name))
    return out


def report(paths, plot_dir: Optional[str] = None, output: Output = Output()) -> list:
    """Summarise the CSVs through ``output``; with ``plot_dir`` also write the plots and return
    their paths."""
    df = load(paths)
    output.emit(table=lambda console: summarize(df, console))
    return plot(df, plot_dir) if plot_dir else []
