"""The summary numbers of `sinkprof report` and of bench's summary, on constructed CSVs: the
exposed share counts time when two exchanges are both exposed once, FLOP/s print in a unit that
fits, per GPU or per rank, and the MB sent are the slowest rank's sums of ``bytes``."""
import io
import re

import pandas as pd
import pytest
from rich.console import Console

from sinkprof.tool.page import page
from sinkprof.tool.figures import Pictures
from sinkprof.tool.report import (CASE_KEYS, exposed_time, flops_text, iteration_table, load, per_device,
                                  print_summary, step_table, summarize, union_ms)

CASE = {"run_id": "20261203-000000-abcdef", "comm": "p2p", "softmax": "learnable", "sink_strategy": "step0",
        "mask": "causal", "window": "", "dtype": "fp32", "b": 1, "s": 64, "h": 2, "g": 2, "d": 16, "cp": 2,
        "kv_schedule": "ring", "backend": "torch", "simulated": False, "flops": 1e6, "device_name": "cpu"}


def _row(rank, kind, step, start, end, phase="bwd", iteration=0, **extra):
    return dict(CASE, rank=rank, iteration=iteration, phase=phase, step=step, kind=kind, start_ms=start,
                end_ms=end, dur_ms=end - start, **extra)


def _comm(rank, kind, start, end, compute):
    overlap = max(0.0, min(end, compute[1]) - max(start, compute[0]))
    return _row(rank, kind, 0, start, end, overlap_ms=overlap, exposed_ms=end - start - overlap)


def _rows():
    """Rank 0: compute 0-1 ms, kv 0-10 and dkv 0.5-10 (exposed 1-10 both: 9 ms once, 18 summed),
    in a 10 ms iteration. Rank 1: compute 0-4, kv 2-6 (exposed 4-6), an a2a with no times (1 ms)."""
    return [_row(0, "iteration", -1, 0.0, 10.0, phase="fwdbwd"), _row(0, "compute", 0, 0.0, 1.0),
            _comm(0, "kv", 0.0, 10.0, (0.0, 1.0)), _comm(0, "dkv", 0.5, 10.0, (0.0, 1.0)),
            _row(1, "iteration", -1, 0.0, 8.0, phase="fwdbwd"), _row(1, "compute", 0, 0.0, 4.0),
            _comm(1, "kv", 2.0, 6.0, (0.0, 4.0)),
            dict(_row(1, "a2a", -1, float("nan"), float("nan")), dur_ms=1.0, overlap_ms=0.0, exposed_ms=1.0)]


@pytest.fixture
def frame(tmp_path):
    path = tmp_path / "bench.csv"
    pd.DataFrame(_rows()).to_csv(path, index=False)
    return load([path])


def test_union_counts_overlapping_spans_once():
    assert union_ms([]) == 0.0
    assert union_ms([(1.0, 10.0), (1.0, 10.0)]) == 9.0
    assert union_ms([(4.0, 7.0), (0.0, 2.0), (5.0, 9.0), (9.0, 9.5)]) == 2.0 + 5.0 + 0.5


def test_exposed_share_counts_overlapping_exchanges_once(frame):
    assert frame[frame["kind"].isin(["kv", "dkv"]) & (frame["rank"] == 0)]["exposed_ms"].sum() == 18.0
    per_rank = exposed_time(frame)
    assert per_rank.xs(0, level="rank").iloc[0] == 9.0
    assert per_rank.xs(1, level="rank").iloc[0] == 2.0 + 1.0     # the untimed a2a adds its exposed_ms
    its = iteration_table(frame)
    assert len(its) == 1
    assert its["exposed_comm_ms"].iloc[0] == 9.0 and its["wall_ms"].iloc[0] == 10.0
    assert its["exposed_pct"].iloc[0] == pytest.approx(90.0)      # 180% when summed
    console = Console(file=io.StringIO(), width=200, record=True)
    summarize(frame, console)
    text = " ".join(console.export_text().split())
    assert "exposed comm 90.0%" in text, text


def test_an_exchange_is_exposed_only_where_no_compute_of_its_phase_runs(tmp_path):
    """A forward run's messages are labelled with their own steps but posted at the step before the
    run: step 1's K/V (labelled 0) and step 2's (labelled 1) both travel during step 0's compute
    (0-4 ms); step 1 computes nothing (its rows are computed at step 2, 4-9 ms). Only what runs
    past every compute of the phase is exposed: kv 1 runs 3-5 ms, 4-5 inside step 2: none; kv 0
    runs 0-3.5. A backward exchange is not hidden by the forward's compute."""
    rows = [_row(0, "iteration", -1, 0.0, 12.0, phase="fwdbwd"),
            _row(0, "compute", 0, 0.0, 4.0, phase="fwd"), _row(0, "compute", 1, 4.0, 4.0, phase="fwd"),
            _row(0, "compute", 2, 4.0, 9.0, phase="fwd"),
            _row(0, "kv", 0, 0.0, 3.5, phase="fwd", overlap_ms=3.5, exposed_ms=0.0),
            _row(0, "kv", 1, 3.0, 5.0, phase="fwd", overlap_ms=2.0, exposed_ms=0.0),
            _row(0, "dkv", 0, 8.0, 11.0, phase="bwd", overlap_ms=0.0, exposed_ms=3.0)]
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    assert exposed_time(load([path])).iloc[0] == pytest.approx(3.0)


def test_flops_print_in_a_unit_that_fits_per_gpu_or_per_rank():
    assert flops_text(312.0, "GPU") == "312 TFLOP/s per GPU"
    assert flops_text(0.0123, "rank") == "12.3 GFLOP/s per rank"
    assert flops_text(5e-5, "rank") == "50 MFLOP/s per rank"
    assert flops_text(2e-7, "rank") == "0.2 MFLOP/s per rank"
    assert flops_text(2345.6, "GPU") == "2346 TFLOP/s per GPU"
    assert "unknown" in flops_text(float("nan"), "GPU")
    assert per_device(["cpu", "cpu"]) == "rank" and per_device(["NVIDIA H200"]) == "GPU" and per_device([""]) == "rank"


def test_bench_summary_on_the_cpu_says_mflops_per_rank(capsys):
    print_summary(_rows())    # 1e6 FLOPs over 2 ranks in 10 ms
    out = " ".join(capsys.readouterr().out.split())
    assert "50 MFLOP/s per rank" in out and "0.0 TFLOP/s" not in out and "per GPU" not in out
    assert "exposed comm 90.0%" in out


def test_report_on_a_gpu_csv_says_per_gpu(frame):
    gpu = frame.assign(device_name="NVIDIA H200", flops=1e12)
    its = iteration_table(gpu)
    assert its["per"].iloc[0] == "GPU"
    console = Console(file=io.StringIO(), width=200, record=True)
    summarize(gpu, console)
    assert "50 TFLOP/s per GPU" in " ".join(console.export_text().split())


def _byte_rows(blank=float("nan")):
    """Three iterations of 2 ranks, bwd steps 0 and 1. Step 0: rank 0 sends kv 1 MB and dkv 0.5 MB,
    rank 1 kv 2, 3, 1 MB in iterations 0, 1, 2 (slowest-sender per iteration 2, 3, 1.5: median 2).
    Step 1 only computes. Rank 0's a2a (step -1) sends 1 MB: per iteration rank 0 sent 2.5 MB and
    rank 1 2, 3, 1 (max 2.5, 3, 2.5: median 2.5). ``blank``: a compute row's bytes."""
    rows = []
    for it, rank1 in enumerate((2e6, 3e6, 1e6)):
        rows += [_row(r, "iteration", -1, 0.0, 10.0, phase="fwdbwd", iteration=it) for r in (0, 1)]
        rows += [_row(r, "compute", s, 2.0 * s, 2.0 * s + 1.0, iteration=it, bytes=blank)
                 for r in (0, 1) for s in (0, 1)]
        rows += [_row(0, "kv", 0, 0.0, 1.0, iteration=it, bytes=1e6),
                 _row(0, "dkv", 0, 0.0, 1.0, iteration=it, bytes=5e5),
                 _row(1, "kv", 0, 0.0, 1.0, iteration=it, bytes=rank1),
                 _row(0, "a2a", -1, 9.0, 9.5, iteration=it, bytes=1e6)]
    return rows


def _cells(text: str) -> list:
    """The body rows of the Rich tables in ``text``, as lists of cell texts."""
    return [[c.strip() for c in line.strip().strip("│").split("│")] for line in text.splitlines()
            if line.strip().startswith("│")]


def _html_steps(html: str) -> list:
    """The rows of the page's per-step tables (they start with a phase), as lists of cell texts."""
    rows = re.findall(r"<tr>(<td>(?:fwd|bwd)</td>.*?)</tr>", html)
    return [re.findall(r"<td>(.*?)</td>", r) for r in rows]


def _load(tmp_path, rows, drop=()):
    path = tmp_path / "bench.csv"
    pd.DataFrame(rows).drop(columns=list(drop)).to_csv(path, index=False)
    return load([path])


def test_sent_mb_is_the_slowest_senders_sum_median_over_iterations(tmp_path):
    df = _load(tmp_path, _byte_rows())
    steps = step_table(df).set_index(["phase", "step"])["sent_mb"]
    # the a2a exchanges around the ring are a row of their own (step -1, "a2a"): they were left out
    assert steps.to_dict() == {("bwd", -1): pytest.approx(1.0), ("bwd", 0): pytest.approx(2.0), ("bwd", 1): 0.0}
    its = iteration_table(df)
    assert its["sent_mb"].iloc[0] == pytest.approx(2.5)
    console = Console(file=io.StringIO(), width=200, record=True)
    summarize(df, console)
    text = console.export_text()
    assert "sent MB" in text and "sent 2.500 MB/iter" in text
    assert {(r[0], r[1]): r[6] for r in _cells(text)} == {("bwd", "a2a"): "1.000", ("bwd", "0"): "2.000",
                                                            ("bwd", "1"): "0.000"}
    html = page(df, Pictures({tuple(r[k] for k in CASE_KEYS): "case" for _, r in its.iterrows()}), ["bench.csv"])
    assert "<th>sent MB</th>" in html and "sent 2.500 MB/iter" in html
    assert [r[1:7:5] for r in _html_steps(html)] == [["a2a", "1.000"], ["0", "2.000"], ["1", "0.000"]]


def test_bench_summary_reads_blank_bytes_of_compute_rows(capsys):
    print_summary(_byte_rows(blank=""))    # bench's rows: a compute span's bytes is ""
    out = " ".join(capsys.readouterr().out.split())
    assert "sent 2.500 MB/iter" in out and "2.000" in out


def test_a_csv_without_bytes_or_kv_schedule_reports_without_them(tmp_path):
    df = _load(tmp_path, _byte_rows(), drop=("bytes", "kv_schedule"))
    assert step_table(df)["sent_mb"].isna().all() and iteration_table(df)["sent_mb"].isna().all()
    console = Console(file=io.StringIO(), width=200, record=True)
    summarize(df, console)
    text = console.export_text()
    assert "sent MB" in text and "MB/iter" not in text and "kv=" not in text
    assert [r[6] for r in _cells(text)] == ["-", "-", "-"]
    its = iteration_table(df)
    html = page(df, Pictures({tuple(r[k] for k in CASE_KEYS): "case" for _, r in its.iterrows()}), ["bench.csv"])
    assert [r[6] for r in _html_steps(html)] == ["-", "-", "-"] and "most of any rank)</p>" not in html


def _no_nan(text: str) -> bool:
    return not re.search(r"\b(nan|inf)\b", text, re.I)


def test_a_csv_without_overlap_or_times_says_unknown_not_zero(tmp_path):
    """An older CSV without overlap_ms/exposed_ms (nor times) cannot tell hidden from exposed: the
    tables show '-' and the share 'unknown', never 0 (which read as hidden) nor 'nan'."""
    from sinkprof.tool import figures
    df = _load(tmp_path, _rows(), drop=("overlap_ms", "exposed_ms", "start_ms", "end_ms"))
    steps = step_table(df).set_index(["phase", "step"])
    assert steps.loc[("bwd", 0), ["overlap_ms", "exposed_ms"]].isna().all()
    its = iteration_table(df)
    assert its[["exposed_comm_ms", "exposed_pct"]].isna().all(axis=None)
    console = Console(file=io.StringIO(), width=200, record=True)
    summarize(df, console)
    text = console.export_text()
    assert "exposed comm unknown" in " ".join(text.split()) and _no_nan(text), text
    assert [r[4:6] for r in _cells(text)] == [["-", "-"], ["-", "-"]]   # the a2a row, step 0
    html = page(df, Pictures({tuple(r[k] for k in CASE_KEYS): "case" for _, r in its.iterrows()}), ["bench.csv"])
    assert [r[4:6] for r in _html_steps(html)] == [["-", "-"], ["-", "-"]] and _no_nan(html)
    assert "unknown (no exposed_ms)" in html and ">hidden<" not in html
    assert figures.summary(its)[:4] == b"\x89PNG"


def test_exposed_share_from_times_when_the_csv_has_no_exposed_column(tmp_path):
    rows = [r for r in _rows() if r["kind"] != "a2a"]  # every exchange timed
    df = _load(tmp_path, rows, drop=("overlap_ms", "exposed_ms"))
    its = iteration_table(df)
    assert its["exposed_comm_ms"].iloc[0] == 9.0 and its["exposed_pct"].iloc[0] == pytest.approx(90.0)
    assert step_table(df)[["overlap_ms", "exposed_ms"]].isna().all(axis=None)
    # an untimed exchange without exposed_ms leaves its rank, so the slowest rank, unknown
    assert iteration_table(_load(tmp_path, _rows(), drop=("overlap_ms", "exposed_ms")))["exposed_pct"].isna().all()


def test_a_zero_wall_time_gives_no_infinite_rate(tmp_path):
    from sinkprof.tool import figures
    rows = [dict(r, dur_ms=0.0, end_ms=r["start_ms"]) if r["kind"] == "iteration" else r for r in _rows()]
    its = iteration_table(_load(tmp_path, rows))
    assert its[["tflops_per_gpu", "exposed_pct"]].isna().all(axis=None)
    assert figures.summary(its)[:4] == b"\x89PNG"
