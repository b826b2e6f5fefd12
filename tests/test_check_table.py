"""`sinkprof check`'s table and progress, rendered without running ranks: readable at 80 columns,
every case's options present, progress only on a terminal."""
import dataclasses
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

import torch
from rich.console import Console

from sinkprof.testing import Error, Tolerance
from sinkprof.tool.cases import Settings, expand
from sinkprof.tool.check import (CaseProgress, CaseResult, ReportOnce, Stopped, case_parts, render_table, report,
                                 split_parts)
from sinkprof.tool.launcher import RankInfo
from sinkprof.tool.output import Format, Output


def _results():
    """Cases of two settings groups (different windows and shapes) that vary in most options, the
    widest labels included (``a2a+p2p(2)/learnable/causal/bshd/fp32/post-merge/grad=full/window=16,0``);
    case 4 fails on d_sink, case 6 on the byte contract."""
    wide = Settings(comm=("p2p", "a2a+p2p"), softmax=("vanilla", "learnable"), mask=("causal",),
                    dtype=("fp32", "bf16"), sink_strategy=("post-merge",), window=(16, 0), ranks=4)
    other = dataclasses.replace(wide, comm=("a2a", "p2p"), softmax=("off-by-one",), dtype=("fp64",), window=None,
                                bias=True, seq_len=128, kv_schedule=("direct",))
    results = []
    for i, case in enumerate(expand(wide) + expand(other)):
        errors = {n: Error(1.234e-5 * (i + 1), 0.0123 * (i + 1), True) for n in ("out", "dq", "dk", "dv")}
        if case.softmax.has_sink:
            errors["d_sink"] = Error(3.1e-3, 1.7 if i == 3 else 0.25, i != 3)
        errors["comm"] = Error(0.0, 0.0, i != 5)
        results.append(CaseResult(case, 4, all(e.passed for e in errors.values()), errors,
                                  Tolerance(1e-5, 1e-5), 0.125 * i, ["rank 1: a note with [/] in it"] if i == 5 else []))
    return results


def _render(results, width=80):
    console = Console(width=width, record=True, file=io.StringIO())
    render_table(results, "sinkprof check: cp=4 on cpu (gloo)", console)
    return console.export_text()


def test_table_reads_at_80_columns_with_every_case_option():
    results = _results()
    text = _render(results)
    lines = text.splitlines()
    assert "…" not in text
    assert max(map(len, lines)) <= 80
    common, applying, varying = split_parts([r.case for r in results])
    assert common == ["causal", "bshd"] and applying == ["post-merge", "grad=full"]   # the sink cases
    every = next(line for line in lines if line.startswith("every case:"))
    assert every == "every case: causal, bshd" and "where they apply: post-merge, grad=full" in lines
    # Each case's varying options are on its row (or the lines it wraps onto), whole.
    rows = [i for i, line in enumerate(lines) if line.split("│")[0].strip().isdigit()]
    assert len(rows) == len(results)
    for n, (start, parts) in enumerate(zip(rows, varying)):
        end = rows[n + 1] if n + 1 < len(rows) else start + 3
        cell = " ".join(line.split("│")[1].strip() for line in lines[start:end] if "│" in line)
        for part in parts:
            assert part in cell, (part, cell)
        assert set(case_parts(results[n].case).values()) - set(applying) == set(common) | set(parts)
    assert "a2a+p2p(2)" in text and "window=16,0" in text and "kv=direct" in text
    # The worst error per case as a ratio to the tolerance, naming the tensor; failures say what.
    assert "1.7 d_sink" in lines[rows[3]] and "FAIL" in lines[rows[3]]
    assert "comm FAIL" in lines[rows[5]]
    assert "0.012 out" in lines[rows[0]]
    assert "fp32 1e-05/1e-05" in " ".join(lines)
    assert "note: rank 1: a note with [/] in it" in text    # notes print as written, not as markup
    assert lines[-1] == f"{len(results) - 2} passed, 2 failed"


def test_the_embedded_default_reads_at_80_columns_with_the_sink_options_where_they_apply(cli):
    """``step0`` and ``grad=full``, which vanilla cases lack, were on every sink case's row: the
    default check's table was 88 columns wide."""
    res = cli("check", "--seq-len", "32")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(map(len, lines)) <= 80, res.stdout
    assert "where they apply: step0, grad=full" in lines
    assert "off-by-one causal fp64" in res.stdout and "fp64 step0" not in res.stdout


def test_a_single_case_prints_its_options_once():
    text = _render(_results()[:1])
    assert "every case: p2p, vanilla, causal, bshd, fp32, window=16,0, b=2 s=64 h=4 g=2 d=16" in text
    assert "case" not in text.split("every case:")[1].splitlines()[1]   # no column of nothing


def test_json_report_keeps_every_tensor_error(capsys):
    results = _results()
    info = RankInfo(rank=0, world=4, local_rank=0, device=torch.device("cpu"), backend="gloo")
    report(results, False, info, 0, None, Output(Format.JSON))
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"passed", "cp", "device", "dist_backend", "fault", "seed", "stopped", "cases"}
    assert doc["stopped"] is None
    assert doc["cases"][3]["errors"]["d_sink"] == {"max_abs": 3.1e-3, "worst": 1.7, "passed": False}
    assert doc["cases"][0]["errors"]["out"]["max_abs"] == 1.234e-5
    assert doc["cases"][0]["tolerance"] == {"atol": 1e-5, "rtol": 1e-5}


def test_a_report_of_a_run_that_stopped_says_where_and_why(capsys, tmp_path):
    results = _results()[:2]
    info = RankInfo(rank=0, world=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    stopped = Stopped("p2p/learnable/x", 3, 7, "a reason with [/] in it")
    report(results, False, info, 0, None, Output(Format.JSON), stopped=stopped)
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is False and len(doc["cases"]) == 2
    assert doc["stopped"] == {"case": "p2p/learnable/x", "number": 3, "of": 7, "reason": "a reason with [/] in it"}
    out = tmp_path / "report.txt"
    report([], False, info, 0, None, Output(Format.TABLE, str(out)), stopped=stopped)
    lines = out.read_text().splitlines()
    assert lines[1:] == ["0 passed, 0 failed", "stopped at case 3 of 7 (p2p/learnable/x): a reason with [/] in it"]
    assert "FAILED (stopped at case 3 of 7" in capsys.readouterr().out
    assert Stopped(None, 8, 7, "late").line() == "stopped after its last case (7): late"


def test_one_report_whichever_thread_asks_first():
    """The second caller waits for the first's report and makes none."""
    import threading
    made, release = [], threading.Event()

    def emit(done, stopped):
        release.wait(5)
        made.append((list(done), stopped))
    once = ReportOnce(emit)
    first = threading.Thread(target=lambda: once.write([1], "stopped"))
    first.start()
    time.sleep(0.1)
    waiter = threading.Thread(target=lambda: made.append(("second", once.write([1, 2], None))))
    waiter.start()
    time.sleep(0.1)
    assert made == []                # the second caller waits while the first writes
    release.set()
    first.join(5)
    waiter.join(5)
    assert made == [([1], "stopped"), ("second", False)]


def test_progress_on_a_terminal_counts_cases_and_names_the_one_running():
    buf = io.StringIO()
    labels = [r.case.label for r in _results()[:3]]
    with CaseProgress(len(labels), Console(file=buf, force_terminal=True, width=120)) as progress:
        for n, label in enumerate(labels):
            progress.start(label)
            progress._bar.refresh()
            assert f"{n}/3" in buf.getvalue() and label in buf.getvalue()
            progress.done()
    assert "3/3" in buf.getvalue()


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_only_for_rank0_tables_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Stream(True))
    assert CaseProgress.for_run(3, 0, Output(Format.TABLE)).console is not None
    assert CaseProgress.for_run(3, 1, Output(Format.TABLE)).console is None
    assert CaseProgress.for_run(3, 0, Output(Format.JSON)).console is None
    monkeypatch.setattr(sys, "stderr", _Stream(False))
    assert CaseProgress.for_run(3, 0, Output(Format.TABLE)).console is None
    with CaseProgress.for_run(3, 0, Output(Format.TABLE)) as progress:   # no console: does nothing
        progress.start("p2p/vanilla")
        progress.done()
    assert sys.stderr.getvalue() == ""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a terminal")
def test_check_on_a_terminal_shows_progress_and_in_a_pipe_does_not(cli, tmp_path):
    args = ["check", "--softmax", "vanilla", "--mask", "causal,no_mask", "--dtype", "fp64"]
    log = tmp_path / "tty.log"
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "sinkprof", *args])
    res = subprocess.run(["script", "-qec", command, str(log)], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "COLUMNS": "80", "LINES": "24", "TERM": "xterm"})
    assert res.returncode == 0, res.stdout + res.stderr
    seen = log.read_text(errors="replace")
    assert "2/2" in seen and "p2p/vanilla/no_mask/bshd/fp64" in seen, seen
    piped = cli(*args)
    assert piped.returncode == 0, piped.stdout + piped.stderr
    assert piped.stderr == "" and "2/2" not in piped.stdout and "2 passed, 0 failed" in piped.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a terminal")
def test_bench_on_a_terminal_draws_its_progress_on_stderr_and_leaves_a_csv_on_stdout_whole(tmp_path):
    """Before: the bar went to stdout, which the CSV took (``--csv - > file``): a blank line in the
    CSV at every case, and no bar on the terminal."""
    csv = tmp_path / "bench.csv"
    args = [sys.executable, "-m", "sinkprof", "bench", "--softmax", "vanilla", "--mask", "causal,no_mask", "--dtype",
            "fp64", "--iters", "2", "--warmup", "0", "--seq-len", "64", "--heads", "2", "--head-dim", "8", "--csv", "-"]
    command = " ".join(shlex.quote(a) for a in args) + f" > {shlex.quote(str(csv))}"
    res = subprocess.run(["script", "-qec", command, str(tmp_path / "tty.log")], capture_output=True, text=True,
                         timeout=240, env={**os.environ, "COLUMNS": "80", "LINES": "24", "TERM": "xterm"})
    assert res.returncode == 0, res.stdout + res.stderr
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("run_id,") and len(lines) > 10 and all(line.strip() for line in lines)
    assert all(line.count(",") == lines[0].count(",") for line in lines if '"' not in line)
