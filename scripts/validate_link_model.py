"""Validate the link model (``sinkprof/tool/linkmodel.py``) on this machine: gloo over loopback.

1. Measure the link: two local gloo ranks exchange 1 KiB .. 4 MiB at once both ways (the ring's
   exchange); fit ``t = L + n / B``.
2. Predict: ``sinkprof bench --simulate CP --link B,L`` (every rank's compute on one process).
3. Measure: ``sinkprof bench --ranks CP`` (real gloo communication), the same case.
4. Compare per (phase, step, kind) the communication rows (medians over iterations and ranks;
   the measured row runs from the post to the end of its wait, so where the model says the
   exchange hides under compute the measured row is the compute, not the link: both are shown),
   and the iteration wall time of the slowest rank.

    python scripts/validate_link_model.py [--cp 2] [--seq-len 2048] [--out DIR]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from sinkprof.tool.linkmodel import measure_gloo_loopback


def bench(out: Path, cp: int, seq_len: int, extra: list) -> pd.DataFrame:
    cmd = [sys.executable, "-m", "sinkprof", "bench", "--device", "cpu", "--softmax", "learnable", "--mask", "causal",
           "--dtype", "fp32", "--seq-len", str(seq_len), "--heads", "4", "--kv-heads", "4", "--head-dim", "64",
           "--batch", "1", "--warmup", "2", "--iters", "5", "--kv-schedule", "ring", "--csv", str(out), *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return pd.read_csv(out)


def per_step(df: pd.DataFrame) -> pd.DataFrame:
    steps = df[df["step"] >= 0]
    comp = steps[steps["kind"] == "compute"].groupby(["phase", "step"])["dur_ms"].median().rename("compute_ms")
    comm = steps[steps["kind"].isin(["kv", "dkv"])].groupby(["phase", "step", "kind"]).agg(
        comm_ms=("dur_ms", "median"), exposed_ms=("exposed_ms", "median"), bytes=("bytes", "first"))
    return comm.join(comp, on=["phase", "step"])


def wall(df: pd.DataFrame) -> float:
    it = df[df["kind"] == "iteration"]
    return float(it.groupby("iteration")["dur_ms"].max().median())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--out", default=None, help="Keep the two CSVs here.")
    args = ap.parse_args()
    link, seconds = measure_gloo_loopback()
    print(f"gloo loopback, exchange both ways at once: {link.gbps:.2f} GB/s per direction, "
          f"{link.latency_us:.1f} us per message")
    for n, s in seconds.items():
        print(f"  {n:>8} B: measured {s * 1e3:.3f} ms, fitted {(link.latency_us * 1e-6 + n / link.gbps / 1e9) * 1e3:.3f} ms")
    folder = Path(args.out or tempfile.mkdtemp(prefix="sinkprof-validate-"))
    folder.mkdir(parents=True, exist_ok=True)
    predicted = bench(folder / "predicted.csv", args.cp, args.seq_len,
                      ["--simulate", str(args.cp), "--link", f"{link.gbps:.4f},{link.latency_us:.2f}"])
    measured = bench(folder / "measured.csv", args.cp, args.seq_len, ["--ranks", str(args.cp)])
    m, p = per_step(measured), per_step(predicted)
    table = pd.merge(m, p, left_index=True, right_index=True, suffixes=("_measured", "_predicted"))
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    print(table.round(3).to_string())
    last = table.xs(("bwd", args.cp - 1, "dkv"))   # posted after the last compute, waited at once: the link alone
    print(f"last dK/dV exchange (nothing to hide under; {int(last['bytes_measured'])} B): measured "
          f"{last['comm_ms_measured']:.3f} ms, predicted {last['comm_ms_predicted']:.3f} ms, ratio "
          f"{last['comm_ms_measured'] / last['comm_ms_predicted']:.2f}")
    comp = lambda df: df[df["kind"] == "compute"].groupby(["rank", "iteration"])["dur_ms"].sum().median()
    w_m, w_p = wall(measured), wall(predicted)
    print(f"compute per rank and iteration (median): real run {comp(measured):.3f} ms, simulated {comp(predicted):.3f} ms")
    print(f"iteration wall (slowest rank, median): measured {w_m:.3f} ms, predicted {w_p:.3f} ms, "
          f"ratio {w_m / w_p:.2f}")
    print(f"CSVs in {folder}")


if __name__ == "__main__":
    main()
