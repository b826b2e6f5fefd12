"""`sinkprof bench` and `sinkprof report` on the CPU: the CSV schema, per-step rows, consistency
with the iteration wall time, NVTX ranges, traces, and the rows a crash leaves behind."""
import json
from pathlib import Path

import pandas as pd
import pytest

from sinkprof import profiling
from sinkprof.tool.bench import COLUMNS, BenchOptions, simulate
from sinkprof.tool.cases import Settings
from sinkprof.tool.report import iteration_table, load, report, step_table

pytestmark = pytest.mark.slow


def _assert_consistent(df):
    assert (df["dur_ms"] >= 0).all()
    assert (df["end_ms"] >= df["start_ms"]).all()
    for _, part in df.groupby(["cp", "rank", "iteration"]):
        wall = part[part["kind"] == "iteration"]
        assert len(wall) == 1
        wall_ms = float(wall["dur_ms"].iloc[0])
        compute = part[part["kind"] == "compute"]
        assert compute["dur_ms"].sum() <= wall_ms + 1e-6
        assert (compute["start_ms"] >= -1e-6).all() and (compute["end_ms"] <= wall_ms + 1e-6).all()


def test_bench_csv_schema_rows_and_consistency(cli, tmp_path):
    out = tmp_path / "bench.csv"
    trace = tmp_path / "trace"
    res = cli("bench", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp32", "--warmup", "1",
              "--iters", "3", "--csv", str(out), "--trace", str(trace), "--kv-schedule", "ring")
    assert res.returncode == 0, res.stdout + res.stderr
    df = pd.read_csv(out)
    assert list(df.columns) == COLUMNS
    assert (df["kv_schedule"] == "ring").all()
    assert set(df["rank"]) == {0, 1} and set(df["iteration"]) == {0, 1, 2}
    assert df["run_id"].nunique() == 1 and (df["cp"] == 2).all()
    assert (df["backend"] == "torch").all() and (df["merges"] == "torch").all()   # CPU: no fused kernels
    per = df.groupby(["rank", "iteration", "phase", "step", "kind"]).size()
    assert (per == 1).all()  # one row per (rank, iteration, phase, step, kind)
    kinds = {(p, s, k) for (_, _, p, s, k) in per.index}
    assert kinds == {("fwd", 0, "compute"), ("fwd", 1, "compute"), ("bwd", 0, "compute"), ("bwd", 1, "compute"),
                     ("fwd", 0, "kv"), ("bwd", 0, "kv"), ("bwd", 0, "dkv"), ("bwd", 1, "dkv"),
                     ("fwdbwd", -1, "iteration")}
    comm = df[df["kind"].isin(["kv", "dkv"])]
    shard = 2 * 32 * 2 * 16           # b * s/cp * g * d: a whole K/V shard, in fp32 K/V and dK/dV alike
    assert (comm["bytes"] == 2 * shard * 4).all()
    assert df[df["kind"] == "compute"]["bytes"].isna().all()
    assert (comm["overlap_ms"] >= 0).all()
    assert ((comm["overlap_ms"] + comm["exposed_ms"] - comm["dur_ms"]).abs() < 1e-6).all()
    _assert_consistent(df)
    for rank in (0, 1):
        names = {e.get("name") for e in json.loads((trace / f"rank{rank}.json").read_text())["traceEvents"]}
        assert f"fwd step 1 compute rank {rank}" in names and f"bwd step 0 dkv rank {rank}" in names
    its = iteration_table(load([out]))
    assert len(its) == 1 and its["tflops_per_gpu"].iloc[0] > 0


def test_bench_direct_schedule_rows_carry_the_planned_bytes(cli, tmp_path):
    import torch
    from sinkprof import comm_bytes

    out = tmp_path / "bench.csv"
    res = cli("bench", "--ranks", "3", "--seq-len", "48", "--softmax", "vanilla", "--mask", "causal", "--window", "3,0",
              "--dtype", "bf16", "--kv-schedule", "direct", "--warmup", "0", "--iters", "1", "--csv", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    df = pd.read_csv(out)
    assert (df["kv_schedule"] == "direct").all()
    comm = df[df["kind"].isin(["kv", "dkv"])]
    planned = comm_bytes(s=48, b=2, h=4, g=2, d=16, dtype=torch.bfloat16, cp=3, mask="causal", window=(3, 0),
                         kv_schedule="direct")
    want = {}
    for t in planned:
        if t.messages_sent or t.messages_received:
            key = (t.rank, t.phase, t.step, t.kind)
            want[key] = want.get(key, 0) + t.sent
    got = {(r.rank, r.phase, r.step, r.kind): r.bytes for r in comm.itertuples()}
    assert got == want
    kv_row = 2 * 2 * 2 * 16 * 2                         # K and V rows of b=2, g=2, d=16 in bf16
    assert got[(1, "fwd", 0, "kv")] == 3 * kv_row        # rank 1 sends its halo of 3 rows to rank 2 ...
    assert got[(1, "bwd", 2, "dkv")] == 3 * kv_row       # ... and returns rank 2's halo gradient, in bf16:
    # one tile per row wrote it (fp32 would be twice the bytes)


@pytest.mark.parametrize("phase", ["fwdbwd", "bwd"])
def test_a_crash_mid_run_keeps_the_rows_already_measured(cli, tmp_path, phase):
    """Under --phase bwd the fault never fired (its forward ran without it): exit 0, a whole CSV."""
    out = tmp_path / "bench.csv"
    res = cli("bench", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp32", "--warmup", "1",
              "--iters", "3", "--phase", phase, "--csv", str(out), "--inject", "crash", "--timeout", "10")
    assert res.returncode == 1
    assert not out.exists()
    partial = Path(str(out) + ".partial")
    df = pd.read_csv(partial)
    assert set(df["iteration"]) == {0} and set(df["rank"]) == {0, 1}
    assert set(df.loc[df["kind"] == "iteration", "phase"]) == {phase}
    _assert_consistent(df)


class _CountingNvtx:
    def __init__(self):
        self.pushed = self.popped = self.started = self.ended = 0

    def push_range(self, message, domain=None):
        assert domain == "sinkprof"
        self.pushed += 1

    def pop_range(self, domain=None):
        self.popped += 1

    def start_range(self, message, domain=None):
        self.started += 1
        return self.started

    def end_range(self, handle):
        self.ended += 1


@pytest.mark.parametrize("use_nvtx", [True, False])
def test_simulate_emits_one_nvtx_range_per_step_and_iteration(monkeypatch, tmp_path, use_nvtx):
    fake = _CountingNvtx()
    monkeypatch.setattr(profiling, "nvtx", fake)
    out = tmp_path / "sim.csv"
    settings = Settings(softmax=("learnable",), mask=("causal",), dtype=("fp32",), seq_len=64)
    opts = BenchOptions(warmup=1, iters=2, phase="fwdbwd", csv=str(out), nvtx=use_nvtx, simulate=(2, 4))
    assert simulate([settings], opts, __import__("torch").device("cpu")) == 0
    df = pd.read_csv(out)
    assert list(df.columns) == COLUMNS
    assert not df["kind"].isin(["kv", "dkv", "a2a"]).any() and df["simulated"].all()
    assert set(df[df["cp"] == 4]["rank"]) == {0, 1, 2, 3}
    _assert_consistent(df)
    ranges = sum(2 * cp * (1 + 2 * cp) for cp in (2, 4))  # iters x ranks x (iteration + fwd and bwd steps)
    assert fake.pushed == (ranges if use_nvtx else 0)
    assert fake.popped == fake.pushed
    assert fake.started == fake.ended == 0


def test_report_summarises_and_plots(tmp_path, capsys):
    out = tmp_path / "sim.csv"
    settings = Settings(softmax=("vanilla",), mask=("causal",), dtype=("fp32",), seq_len=64)
    simulate([settings], BenchOptions(warmup=0, iters=2, phase="fwd", csv=str(out), simulate=(2,)),
             __import__("torch").device("cpu"))
    steps = step_table(load([out]))
    assert set(steps["step"]) == {0, 1} and (steps["compute_ms"] > 0).all()
    written = report([out], str(tmp_path / "plots"))
    assert written and all(Path(p).stat().st_size > 1000 for p in written)


def test_simulate_and_report_keep_the_k_v_schedules_apart(tmp_path):
    out = tmp_path / "sim.csv"
    settings = Settings(softmax=("vanilla",), mask=("causal",), dtype=("fp32",), seq_len=64, window=(3, 0),
                        kv_schedule=("ring", "direct"))
    simulate([settings], BenchOptions(warmup=0, iters=1, phase="fwdbwd", csv=str(out), simulate=(4,)),
             __import__("torch").device("cpu"))
    df = load([out])
    assert set(df["kv_schedule"]) == {"ring", "direct"}
    steps = step_table(df)
    assert set(steps["kv_schedule"]) == {"ring", "direct"}
    assert len(steps) == 2 * 2 * 4    # schedule x phase x step


def test_a_case_that_runs_as_an_earlier_one_is_skipped_not_summed_into_it(cli, tmp_path, capsys):
    """``--kv-schedule auto,direct`` where auto runs direct: both cases wrote rows of one case, and
    the summary and report showed twice its bytes and the sum of both timings (exit 0)."""
    out = tmp_path / "real.csv"
    res = cli("bench", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp32", "--kv-schedule", "auto,direct",
              "--warmup", "0", "--iters", "2", "--csv", str(out))
    assert res.returncode == 0, res.stderr
    assert ("sinkprof bench: skipped case 2 (p2p/learnable/causal/bshd/fp32/step0/grad=full/kv=direct): it runs as "
            "case 1 (p2p/learnable/causal/bshd/fp32/step0/grad=full) does") in res.stderr
    df = load([out])
    assert set(df["kv_schedule"]) == {"direct"}
    assert len(df[df["kind"] == "iteration"]) == 2 * 2   # rank x iteration, of one case
    sim = tmp_path / "sim.csv"
    settings = Settings(softmax=("vanilla",), mask=("causal",), dtype=("fp32",), seq_len=64, kv_schedule=("auto", "direct"))
    simulate([settings], BenchOptions(warmup=0, iters=1, phase="fwd", csv=str(sim), simulate=(2, 4)),
             __import__("torch").device("cpu"))
    said = capsys.readouterr().err
    assert said.count("sinkprof bench: skipped case 2") == 2 and "at --simulate 4: it runs as case 1" in said
    df = load([sim])
    assert sorted(df.groupby("cp")["kv_schedule"].unique().map(tuple).tolist()) == [("direct",), ("direct",)]
    assert len(df[df["kind"] == "iteration"]) == 2 + 4   # every rank of each size, once
    # a bias without a sink: the two gradient contracts are two cases (partial skips the bias
    # gradient's all-reduce), told apart by sink_grad, neither skipped
    both = tmp_path / "bias.csv"
    settings = Settings(softmax=("vanilla",), mask=("causal",), dtype=("fp32",), seq_len=64, bias=True,
                        sink_grad=("full", "partial"))
    simulate([settings], BenchOptions(warmup=0, iters=1, phase="bwd", csv=str(both), simulate=(2,)),
             __import__("torch").device("cpu"))
    assert "skipped" not in capsys.readouterr().err
    df = load([both])
    assert sorted(df.loc[df["kind"] == "iteration", "sink_grad"]) == ["full", "full", "partial", "partial"]


def test_report_rejects_a_file_that_is_not_a_bench_csv(tmp_path):
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        load([bad])


def test_bench_csv_to_stdout_keeps_the_summary_off_it(cli, tmp_path):
    import io
    res = cli("bench", "--softmax", "vanilla", "--mask", "causal", "--dtype", "fp32", "--warmup", "0",
              "--iters", "1", "--csv", "-")
    assert res.returncode == 0, res.stderr
    df = pd.read_csv(io.StringIO(res.stdout))
    assert list(df.columns) == COLUMNS and set(df["rank"]) == {0, 1}
    assert "TFLOP" in res.stderr or "step" in res.stderr


def test_the_csv_records_the_full_commit_hash():
    import re
    from sinkprof.tool.bench import _git_sha
    sha = _git_sha()
    assert sha == "unknown" or re.fullmatch(r"[0-9a-f]{40}", sha)


def test_a_dkv_exchange_hides_under_the_next_steps_compute():
    """dK/dV posted after step 0 runs while step 1 computes: overlapped, not exposed; a K/V
    exchange that outlasts its step's compute is exposed for the rest."""
    from sinkprof.profiling import overlap_rows

    def row(kind, step, start, end, phase="bwd"):
        return dict(phase=phase, step=step, kind=kind, start_ms=start, end_ms=end, dur_ms=end - start)
    rows = overlap_rows([row("compute", 0, 0.0, 10.0), row("compute", 1, 12.0, 20.0),
                         row("kv", 0, 1.0, 12.0), row("dkv", 0, 10.5, 18.0),
                         row("compute", 0, 30.0, 40.0, phase="fwd")])
    kv, dkv = rows[2], rows[3]
    assert kv["overlap_ms"] == 9.0 and kv["exposed_ms"] == 2.0          # hidden under step 0 only
    assert dkv["overlap_ms"] == 6.0 and dkv["exposed_ms"] == 1.5        # 10.5-12 waits, 12-18 under step 1



def test_an_exchange_under_two_steps_computing_at_once_overlaps_their_union_once():
    """Step 0 on a second stream beside step 1 (``ring.Beside``): an exchange under both is hidden
    for the union of their spans, not the sum."""
    from sinkprof.profiling import overlap_rows

    def row(kind, step, start, end):
        return dict(phase="bwd", step=step, kind=kind, start_ms=start, end_ms=end, dur_ms=end - start)
    kv, = [r for r in overlap_rows([row("compute", 0, 0.0, 10.0), row("compute", 1, 2.0, 14.0),
                                    row("kv", 1, 1.0, 16.0)]) if r["kind"] == "kv"]
    assert kv["overlap_ms"] == 13.0 and kv["exposed_ms"] == 2.0         # 1-14 under either, 14-16 under none


def test_bench_refuses_a_trace_it_would_not_write_or_that_is_its_csv(tmp_path):
    with pytest.raises(ValueError, match="--simulate run replays them on one process and writes no trace"):
        BenchOptions(trace=str(tmp_path / "traces"), simulate=(2,))
    with pytest.raises(ValueError, match="name the same path"):
        BenchOptions(csv=str(tmp_path / "same"), trace=str(tmp_path / "same"))
    # the CSV where the trace folder's parent must be: the rename failed after the whole run
    with pytest.raises(ValueError, match=r"--trace .*out/traces needs a folder where --csv .*out writes a file"):
        BenchOptions(csv=str(tmp_path / "out"), trace=str(tmp_path / "out" / "traces"))
    BenchOptions(csv=str(tmp_path / "traces" / "b.csv"), trace=str(tmp_path / "traces"))   # a CSV in it is fine
    assert not (tmp_path / "traces").exists() and not (tmp_path / "same").exists()


def test_a_folder_where_a_ranks_trace_file_goes_is_refused_before_any_rank_starts(tmp_path):
    """Before: exit 0, the rank's trace left as rank1.json.tmp beside the folder (torch's profiler
    said so in a line of its own); an empty folder was replaced by the trace."""
    from re import escape

    from sinkprof.tool.bench import check_trace_files
    trace = tmp_path / "traces"
    (trace / "rank1.json").mkdir(parents=True)
    opts = BenchOptions(trace=str(trace))
    check_trace_files(opts, 1)
    with pytest.raises(ValueError, match=escape(f"--trace {trace}: {trace}/rank1.json is a folder, where rank 1's "
                                                   f"trace file goes; move it away or choose another --trace folder")):
        check_trace_files(opts, 2)


def test_a_csv_name_whose_partial_does_not_fit_is_refused_before_any_rank_starts(cli, tmp_path):
    """``FILE.partial`` is 8 bytes longer than ``FILE``: a 252-byte name fit, its .partial did not,
    and rank 0 died with a traceback after the ranks had started (rank 1 then hung in gloo)."""
    out = tmp_path / ("a" * 248 + ".csv")
    res = cli("bench", "--device", "cpu", "--ranks", "2", "--iters", "1", "--warmup", "0", "--csv", str(out),
              timeout=120)
    said = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"--csv {out}: the run writes it first as '.partial' beside it" in said and "at most 247 bytes" in said
    assert "Traceback" not in res.stderr and "rank 0" not in said and "rank 1" not in said
    assert not list(tmp_path.iterdir())


def test_a_trace_folder_that_names_a_descriptor_is_refused_before_the_run(tmp_path):
    """``--trace /dev/stdout | cat``: each rank failed after the run writing its trace into a
    folder made of the pipe's name."""
    import subprocess
    import sys
    res = subprocess.run(f"{sys.executable} -m sinkprof bench --device cpu --ranks 2 --iters 1 --warmup 0 "
                         f"--trace /dev/stdout | cat", shell=True, capture_output=True, text=True, timeout=120)
    said = " ".join(res.stderr.split())
    assert "--trace /dev/stdout: names a file descriptor; name a folder" in said, said
    assert "Traceback" not in said and res.stdout == ""


def test_simulate_under_torchrun_says_so_not_ranks(cli):
    """``bench --simulate`` runs no ranks: under torchrun (WORLD_SIZE=2) it is refused for what it
    is, not as a --ranks the user never gave."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    res = cli("bench", "--simulate", "2", "--device", "cpu", env=env, timeout=120)
    said = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--simulate under torchrun (WORLD_SIZE=2)" in said and "without torchrun" in said
    assert "--ranks" not in said


def test_a_profile_that_cannot_be_read_says_what_to_do(tmp_path, monkeypatch):
    """A permission error said ``--profile 'x': Permission denied`` and no more."""
    import errno
    from typer.testing import CliRunner
    from sinkprof.cli import app
    guarded, unreadable = tmp_path / "locked" / "p.toml", tmp_path / "p.toml"
    unreadable.write_text("ranks = 2\n")
    stat, is_file, read_text = Path.stat, Path.is_file, Path.read_text

    def denied(real):
        def method(self, *args, **kwargs):
            if self in (guarded, unreadable) and (real is read_text or self == guarded):
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real(self, *args, **kwargs)
        return method
    monkeypatch.setattr(Path, "stat", denied(stat))
    monkeypatch.setattr(Path, "is_file", denied(is_file))
    monkeypatch.setattr(Path, "read_text", denied(read_text))
    for profile, says in ((guarded, f"--profile '{guarded}': Permission denied; name a profile file you can read"),
                          (unreadable, f"profile {unreadable}: cannot be read (Permission denied); name a profile "
                                       f"file you can read")):
        res = CliRunner().invoke(app, ["bench", "--profile", str(profile), "--iters", "1", "--warmup", "0"])
        assert res.exit_code == 2, res.output
        assert says in " ".join(res.stderr.split())


@pytest.mark.parametrize("signum", [2, 15])
def test_a_run_stopped_by_a_signal_says_where_its_rows_are_and_leaves_them_whole(tmp_path, signum):
    """Before: "stopped by SIGINT; ended rank(s) 0, 1" alone, the finished cases' rows in
    FILE.partial unmentioned (a crash, by contrast, said where they were)."""
    import csv
    import os
    import subprocess
    import sys
    import time
    out = tmp_path / "b.csv"
    partial = tmp_path / "b.csv.partial"
    proc = subprocess.Popen([sys.executable, "-m", "sinkprof", "bench", "--comm", "a2a,p2p", "--softmax", "learnable",
                             "--mask", "causal", "--dtype", "fp64", "--inject", "stall", "--timeout", "60", "--iters",
                             "3", "--warmup", "0", "--csv", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120   # the a2a case (no ring) finishes; the p2p one stalls
        while time.monotonic() < deadline and not (partial.exists() and "p2p" in partial.read_text()):
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    said = " ".join(err.split())
    assert proc.returncode == 128 + signum, err
    assert f"sinkprof bench: stopped early (the rank was stopped by {'SIGINT' if signum == 2 else 'SIGTERM'}" in said
    assert f"the rows measured so far are in {partial}" in said and "Traceback" not in err
    rows = list(csv.reader(partial.open()))
    assert rows[0] == COLUMNS and {len(r) for r in rows} == {len(COLUMNS)} and not out.exists()
    kinds = {(r[rows[0].index("comm")], r[rows[0].index("kind")]) for r in rows[1:]}
    assert ("a2a", "iteration") in kinds
