"""The summary numbers of `sinkprof report` and of bench's summary, on constructed CSVs: the
exposed share counts time when two exchanges are both exposed once, and FLOP/s print in a unit that
fits, per GPU or per rank."""
import io

import pandas as pd
import pytest
from rich.console import Console

from sinkprof.tool.report import (exposed_time, flops_text, iteration_table, load, per_device, print_summary,
                                  summarize, union_ms)

CASE = {"run_id": "20261203-000000-abcdef", "comm": "p2p", "softmax": "learnable", "sink_strategy": "step0",
        "mask": "causal", "window": "", "dtype": "fp32", "b": 1, "s": 64, "h": 2, "g": 2, "d": 16, "cp": 2,
        "kv_schedule": "ring", "backend": "torch", "simulated": False, "flops": 1e6, "device_name": "cpu"}


def _row(rank, kind, step, start, end, phase="bwd", **extra):
    return dict(CASE, rank=rank, iteration=0, phase=phase, step=step, kind=kind, start_ms=start, end_ms=end,
                dur_ms=end - start, **extra)


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
