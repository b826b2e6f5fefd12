"""``sinkprof report --html``: one self-contained page (no network: the pictures are inline PNGs,
the style is inline) that shows a run at a glance: the summary across cases, then per case its
numbers (with the MB sent), its timelines and its per-step table."""
from __future__ import annotations

import base64
import datetime
from html import escape

import pandas as pd

from .figures import Pictures
from .report import (CASE_KEYS, case_key, case_rows, flops_text, iteration_table, label, mb_text, num_text,
                     rank_table, select, sent_text, step_name, step_table)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1250px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 2em; border-top: 1px solid #ccc; padding-top: .8em; }
table { border-collapse: collapse; margin: .6em 0; font-size: .85em; }
th, td { border: 1px solid #ccc; padding: .2em .6em; text-align: right; }
th { background: #f0f0f0; } td.text { text-align: left; }
img { max-width: 100%; display: block; margin: .6em 0; }
.prediction { background: #fff3cd; border: 1px solid #e0c060; padding: .1em .5em; font-weight: bold; }
.exposed { color: #b22; font-weight: bold; } .hidden { color: #282; }
.meta { color: #555; font-size: .85em; }
"""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(header: list, rows: list, text_cols: int = 0) -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td{" class=text" if i < text_cols else ""}>{escape(str(c))}</td>'
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _hidden(s) -> str:
    """Whether a step's communication was hidden, in words (a share of 5% or less counts as hidden)."""
    if s["comm_ms"] <= 0:
        return "no communication"
    if s["exposed_ms"] != s["exposed_ms"]:
        return "unknown (no exposed_ms)"
    share = s["exposed_ms"] / s["comm_ms"]
    if share <= 0.05:
        return '<span class="hidden">hidden</span>'
    return f'<span class="exposed">exposed {100 * share:.0f}%</span>'


def _runs(df: pd.DataFrame) -> str:
    """The runs and where each ran (device, torch, sinkprof and its commit): said once when every
    run ran alike, else run by run."""
    where = {run: f"device {r['device_name']}, torch {r['torch']}, sinkprof {r['sinkprof']} (git {r['git_sha']})"
             for run, r in df.groupby("run_id", sort=True).first().iterrows()}
    if len(set(where.values())) == 1:
        return f"runs {', '.join(where)}; {next(iter(where.values()))}"
    return "runs " + "; ".join(f"{run}: {text}" for run, text in where.items())


def page(df: pd.DataFrame, pictures: Pictures, sources: list) -> str:
    its, steps, ranks = iteration_table(df), step_table(df), rank_table(df)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>sinkprof report</title>"
             f"<style>{STYLE}</style></head><body>",
             "<h1>sinkprof report</h1>",
             f"<p class=meta>{escape(', '.join(sources))}: {len(df)} rows, {escape(_runs(df))}; "
             f"written {datetime.datetime.now():%Y-%m-%d %H:%M}</p>",
             "<p>Timelines: one iteration of every rank, a lane for compute and one for communication; "
             "each ring step is a bar with its number on it. <span class=hidden>Green</span> communication "
             "ran under its step's compute (hidden), <span class=exposed>red</span> communication was "
             "exposed. Hatched bars and yellow labels are predictions, not measurements.</p>"]
    if pictures.summary:
        parts.append(_img(pictures.summary, "summary across cases"))
    if not its.empty:
        parts.append(_table(["case", "phase", "ms/iter", "FLOP/s", "exposed comm ms", "exposed %",
                             "sent MB/iter (most of any rank)"],
                            [[("PREDICTION " if r["predicted"] else "") + label(r).removeprefix("PREDICTION "),
                              r["phase"], f"{r['wall_ms']:.3f}", flops_text(r["tflops_per_gpu"], r["per"]),
                              num_text(r["exposed_comm_ms"]), num_text(r["exposed_pct"], ".1f"), mb_text(r["sent_mb"])]
                             for _, r in its.iterrows()], text_cols=1))
    for _, row in case_rows(df, its).iterrows():
        key = case_key(row)
        case = tuple(row[k] for k in CASE_KEYS)
        badge = '<span class="prediction">prediction</span> ' if row.get("predicted", False) else ""
        parts.append(f"<h2 id='{escape(pictures.slugs[case])}'>{badge}"
                     f"{escape(label(row).removeprefix('PREDICTION '))}</h2>")
        if pd.notna(row.get("wall_ms")):
            exposed = ("unknown (no exposed_ms or times)" if row["exposed_comm_ms"] != row["exposed_comm_ms"] else
                       f"{row['exposed_comm_ms']:.3f} ms ({num_text(row['exposed_pct'], '.1f')}%)")
            parts.append(f"<p>{escape(str(row['phase']))}: {row['wall_ms']:.3f} ms per iteration (slowest rank), "
                         f"{flops_text(row['tflops_per_gpu'], row['per'])}, exposed communication "
                         f"{exposed}{sent_text(row['sent_mb'])}</p>")
        for phase in ("fwd", "bwd"):
            if (case, phase) in pictures.timelines:
                parts.append(_img(pictures.timelines[(case, phase)], f"timeline {pictures.slugs[case]} {phase}"))
        sel = select(steps, key)
        if not sel.empty:
            header = ["phase", "step", "compute ms", "comm ms", "overlap ms", "exposed ms", "sent MB", "communication"]
            header += ["source"] if sel["predicted"].any() else []
            body = []
            for _, s in sel.iterrows():
                cells = [escape(str(s["phase"])), step_name(s["step"]), f"{s['compute_ms']:.3f}",
                         f"{s['comm_ms']:.3f}", num_text(s["overlap_ms"]), num_text(s["exposed_ms"]),
                         mb_text(s["sent_mb"]), _hidden(s)]
                cells += (["predicted" if s["predicted"] else "measured"] if sel["predicted"].any() else [])
                body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
            parts.append("<table><tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>" + "".join(body)
                         + "</table>")
        rsel = select(ranks, key)
        if not rsel.empty:
            per = rsel.groupby("rank")["compute_ms"].sum()
            parts.append(f"<p class=meta>compute ms per rank: "
                         f"{', '.join(f'{r}: {v:.3f}' for r, v in per.items())} "
                         f"(max/mean {per.max() / per.mean():.3f})</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
