"""`sinkprof report` on one small real bench CSV (2 ranks, CPU) and one simulated: case slugs,
timelines and the summary figure, the self-contained HTML page, the Chrome trace, refusals of files
that are not bench CSVs, older CSVs, Rich markup in cells, git_sha as text, predicted rows, and
(marked `browser`) the page as a real headless Chromium renders it."""
import base64
import bz2
import gzip
import json
import lzma
import os
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from sinkprof.tool import figures
from sinkprof.tool.bench import BenchOptions, simulate
from sinkprof.tool.cases import Settings
from sinkprof.tool.report import (CASE_KEYS, REQUIRED_COLUMNS, iteration_table, label, load, report, slugs,
                                  step_table)

from conftest import run_cli
from typer.testing import CliRunner

from sinkprof.cli import app


def _report(*args):
    """``sinkprof report ARGS`` in this process (a subprocess would import torch again)."""
    return CliRunner().invoke(app, ["report", *map(str, args)])

SLUG = "p2p-learnable-step0-causal-fp32-cp2"
SIM_SLUG = "p2p-learnable-step0-causal-fp32-cp4-sim"


@pytest.fixture(scope="module")
def csvs(tmp_path_factory):
    """A real 2-rank fwdbwd run (with communication) and a simulated cp=4 fwd run."""
    d = tmp_path_factory.mktemp("bench")
    real, sim = d / "real.csv", d / "sim.csv"
    res = run_cli("bench", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp32", "--warmup", "0",
                  "--iters", "2", "--csv", str(real))
    assert res.returncode == 0, res.stdout + res.stderr
    settings = Settings(softmax=("learnable",), mask=("causal",), dtype=("fp32",), seq_len=64)
    simulate([settings], BenchOptions(warmup=0, iters=2, phase="fwd", csv=str(sim), simulate=(4,)),
             __import__("torch").device("cpu"))
    return real, sim


@pytest.fixture(scope="module")
def written(csvs, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    paths = report(list(csvs), str(out / "plots"), html=str(out / "report.html"),
                   chrome_trace=str(out / "trace.json"))
    return out, paths


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _has_colour(path: Path, hex_colour: str) -> bool:
    import matplotlib.image
    rgb = matplotlib.image.imread(path)[..., :3]
    want = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return bool((abs(rgb - want).max(axis=-1) < 0.02).any())


def test_pictures_are_named_by_case_and_phase_and_show_the_ring(written):
    out, paths = written
    names = sorted(Path(p).name for p in paths if p.endswith(".png"))
    assert names == sorted([f"{SLUG}-fwd.png", f"{SLUG}-bwd.png", f"{SIM_SLUG}-fwd.png", "summary.png"])
    for name in names:
        w, h = _png_size((out / "plots" / name).read_bytes())
        assert w > 800 and h > 250, (name, w, h)
    for phase in ("fwd", "bwd"):  # compute bars, and communication hidden or exposed
        path = out / "plots" / f"{SLUG}-{phase}.png"
        assert _has_colour(path, figures.COMPUTE)
        assert _has_colour(path, figures.EXPOSED) or _has_colour(path, figures.HIDDEN)
    sim = out / "plots" / f"{SIM_SLUG}-fwd.png"
    assert _has_colour(sim, figures.COMPUTE) and not _has_colour(sim, figures.EXPOSED)
    assert _png_size(sim.read_bytes())[1] > 250


def test_slugs_add_only_what_tells_cases_apart():
    base = {k: "" for k in CASE_KEYS}
    base.update(run_id="20261203-075527-040e0d", comm="a2a+p2p", softmax="off-by-one", mask="no_mask",
                dtype="bf16", b=2, s=64, h=4, g=2, d=16, cp=8, backend="torch", simulated=False)
    rows = pd.DataFrame([base, dict(base, s=128), dict(base, softmax="vanilla", window="128,-1"),
                         dict(base, run_id="20261203-080000-abcdef", s=128)])
    named = sorted(slugs(rows).values())
    assert named == ["a2a-p2p-off-by-one-no-mask-bf16-cp8-s128-040e0d", "a2a-p2p-off-by-one-no-mask-bf16-cp8-s128-abcdef",
                     "a2a-p2p-off-by-one-no-mask-bf16-cp8-s64", "a2a-p2p-vanilla-no-mask-w128-inf-bf16-cp8"]


def _case(**changes) -> dict:
    row = {k: "" for k in CASE_KEYS}
    row.update(run_id="20261203-075527-040e0d", comm="p2p", softmax="learnable", sink_strategy="step0",
               mask="causal", window="127,0", dtype="fp32", b=1, s=1024, h=8, g=2, d=64, cp=4, kv_schedule="ring",
               backend="torch", simulated=False)
    return dict(row, **changes)


def test_label_says_the_kv_schedule():
    ring, direct = label(_case()), label(_case(kv_schedule="direct"))
    assert "kv=ring" in ring and "kv=direct" in direct and ring != direct
    assert "kv=" not in label(_case(kv_schedule=""))  # a CSV older than the column, or no ring


def test_label_leaves_out_what_an_older_csv_left_blank():
    blank = _case(comm="", softmax="", sink_strategy="", mask="", window="", dtype="", b="", s="", h="", g="",
                  d="", kv_schedule="", backend="")
    assert label(blank) == "cp=4"  # not "////cp=4 b= s= h= g= d= ()"
    assert label(dict(blank, s=64, backend="torch")) == "cp=4 s=64 (torch)"
    _, common = figures.case_labels(pd.DataFrame([dict(blank, phase="fwd", predicted=False)]))
    assert "b=" not in common and "cp=4" in common


def test_slugs_tell_the_kv_schedules_apart_only_when_they_must():
    rows = pd.DataFrame([_case(), _case(kv_schedule="direct")])
    named = slugs(rows)
    assert sorted(named.values()) == ["p2p-learnable-step0-causal-w127-0-fp32-cp4-kv-direct",
                                      "p2p-learnable-step0-causal-w127-0-fp32-cp4-kv-ring"]
    assert list(slugs(rows.iloc[:1]).values()) == ["p2p-learnable-step0-causal-w127-0-fp32-cp4"]
    # differing by schedule and shape: the schedule first, the shape where it still clashes
    four = pd.DataFrame([_case(), _case(kv_schedule="direct"), _case(s=2048), _case(s=2048, kv_schedule="direct")])
    assert sorted(slugs(four).values()) == sorted(f"p2p-learnable-step0-causal-w127-0-fp32-cp4-kv-{kv}-s{s}"
                                                  for kv in ("direct", "ring") for s in (1024, 2048))
    # a case without a schedule (an older CSV) next to one with: no empty part
    assert sorted(slugs(pd.DataFrame([_case(kv_schedule=""), _case()])).values()) == [
        "p2p-learnable-step0-causal-w127-0-fp32-cp4", "p2p-learnable-step0-causal-w127-0-fp32-cp4-kv-ring"]


def test_summary_labels_cases_by_kv_schedule():
    its = pd.DataFrame([dict(_case(), phase="fwdbwd", predicted=False),
                        dict(_case(kv_schedule="direct"), phase="fwdbwd", predicted=False)])
    labels, common = figures.case_labels(its)
    assert labels == ["kv=ring", "kv=direct"]
    assert "kv=" not in common and "cp=4" in common
    labels, common = figures.case_labels(its.iloc[:1])
    assert "kv=ring" in common


def test_summary_words_the_bias_sink_gradient_pack_and_a2a_size():
    """The summary's title said ``False`` for the bias and ``full`` for the sink gradient, bare."""
    rows = [dict(_case(bias=False, sink_grad="full", a2a_size="", docs="", pack_layout=""), phase="fwd",
                 predicted=False),
            dict(_case(bias=True, sink_grad="partial", a2a_size="2", docs="8,40,16", pack_layout="balanced"),
                 phase="fwd", predicted=False)]
    labels, common = figures.case_labels(pd.DataFrame(rows))
    assert labels == ["sink_grad=full no bias", "sink_grad=partial bias a2a_size=2 docs=8,40,16 layout=balanced"]
    labels, common = figures.case_labels(pd.DataFrame(rows[:1]))
    assert "no bias" in common and "sink_grad=full" in common and "False" not in common


def test_summary_labels_cases_by_what_differs(csvs):
    its = iteration_table(load(list(csvs)))
    labels, common = figures.case_labels(its)
    # the rows come in run_id order: a timestamp to the second, then a random suffix, so two runs of
    # one second come in either order
    real, sim = sorted(labels, key=lambda label: "simulated" in label)
    assert len(labels) == 2 and "cp=2" in real and "cp=4" in sim and "simulated" in sim and "simulated" not in real
    assert "p2p" in common and "fp32" in common and "cp=" not in common


def test_html_is_self_contained_and_embeds_every_picture(written):
    out, _ = written
    text = (out / "report.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert "<link" not in text and "<script" not in text
    embedded = {base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)}
    files = {p.read_bytes() for p in (out / "plots").glob("*.png")}
    assert embedded == files and len(files) == 4
    assert f"id='{SLUG}'" in text and "exposed ms" in text


def test_html_names_where_each_run_ran_when_the_runs_differ(csvs, tmp_path):
    """Before: the first row's device, torch and commit headed a page of runs from other machines."""
    other = tmp_path / "other.csv"
    df = pd.read_csv(csvs[0])
    df["run_id"], df["device_name"], df["torch"], df["git_sha"] = "20261208-999999-abcdef", "NVIDIA H200", "2.11", "f00"
    df.to_csv(other, index=False)
    mine = pd.read_csv(csvs[0]).iloc[0]
    for inputs, want in (((csvs[0],), f"runs {mine['run_id']}; device {mine['device_name']}, torch {mine['torch']}"),
                         ((csvs[0], other), f"runs {mine['run_id']}: device {mine['device_name']}, torch "
                                            f"{mine['torch']}, sinkprof {mine['sinkprof']} (git {mine['git_sha']}); "
                                            f"20261208-999999-abcdef: device NVIDIA H200, torch 2.11, sinkprof "
                                            f"{mine['sinkprof']} (git f00)")):
        res = _report(*inputs, "--html", "-")
        assert res.exit_code == 0, res.output
        assert want in res.stdout


def test_html_to_stdout_leaves_the_tables_out(csvs):
    res = _report(csvs[0], "--html", "-")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("<!DOCTYPE html>") and res.stdout.rstrip().endswith("</html>")


def test_chrome_trace_has_every_rank_as_a_process_with_compute_and_communication(written, csvs):
    out, _ = written
    doc = json.loads((out / "trace.json").read_text())
    events = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {r: f"rank {r}" for r in range(4)}  # the real run's 2 ranks and the simulated 4
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for rank in (0, 1):
        assert {(rank, "compute"), (rank, "communication kv"), (rank, "communication dkv")} <= threads
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in spans)
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    real = pd.read_csv(csvs[0])
    computes = [e for e in spans if e["cat"] == "compute"]
    sim = pd.read_csv(csvs[1])
    assert len(computes) == (real["kind"] == "compute").sum() + (sim["kind"] == "compute").sum()
    comm = [e for e in spans if e["cat"] == "communication"]
    assert len(comm) == real["kind"].isin(["kv", "dkv"]).sum()
    assert sorted(e["args"]["bytes"] for e in comm) == sorted(real[real["kind"].isin(["kv", "dkv"])]["bytes"])
    for e in (e for e in spans if e["cat"] == "exposed"):  # inside an exchange of its thread
        assert any(c["pid"] == e["pid"] and c["tid"] == e["tid"] and c["ts"] - 1e-3 <= e["ts"]
                   and e["ts"] + e["dur"] <= c["ts"] + c["dur"] + 1e-3 for c in comm)
    for rank in (0, 1):  # one rank's compute never overlaps itself
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in computes if e["pid"] == rank)
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(mine, mine[1:]))


@pytest.mark.parametrize("content, says", [
    (b"", "empty file"),
    (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0", "binary file"),
    (b"name,age\nx,3\n", "missing columns run_id, rank, iteration, phase, step, kind, dur_ms"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,zero,0,fwd,0,compute,1.0\n", "column rank"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,compute,inf\n", "column dur_ms"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,compute,\n", "column dur_ms of data row 1 is empty"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms,start_ms\nr,0,0,fwd,0,compute,1,-Infinity\n", "column start_ms"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,-3,0,fwd,0,compute,1\n", "column rank of data row 1 is -3"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,compute,-0.5\n", "column dur_ms of data row 1 is -0.5"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,compute,1\nr,0,0,fwd,0,kv,1\nr,0,0,sideways,0,kv,1\n",
     "column phase of data row 3 is 'sideways'"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,nap,1\n", "column kind of data row 1 is 'nap'"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0.5,compute,1\n", "column step of data row 1 is 0.5, not a whole number"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms,b,s\nr,0,0,fwd,0,compute,1,2,64\nr,0,0,fwd,0,kv,1,2\n",
     "data row 2 has 8 of the 9 columns (a file cut short?"),
    # a line of spaces and tabs is no row (pandas skips it): the short row after it is data row 2
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,compute,1\n  \t \nr,0,0,fwd,0,kv\n",
     "data row 2 has 6 of the 7 columns"),
    # ... but a quoted blank cell is a row, for pandas and for the message
    (b'run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,compute,1\n"  "\nr,0,0,fwd,0,kv,1\n',
     "data row 2 has 1 of the 7 columns"),
    # whole numbers beyond int64, named as written (pandas wrapped them round: -9.22337e+18, or -1)
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,compute,1\nr,1e19,0,fwd,0,compute,1\n",
     "column rank of data row 2 is 1e19, outside the 64-bit whole numbers (-9223372036854775808 to "
     "9223372036854775807)"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,compute,1\nr,18446744073709551615,0,fwd,0,kv,1\n",
     "column rank of data row 2 is 18446744073709551615, outside the 64-bit whole numbers"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,compute,1\nr,0,0,fwd,9223372036854775808,kv,1\n",
     "column step of data row 2 is 9223372036854775808, outside the 64-bit whole numbers"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,1e300,fwd,0,compute,1\n",
     "column iteration of data row 1 is 1e300, outside the 64-bit whole numbers"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,0,compute,1\n"
     b"r,0,0,fwd,18446744073709551615,iteration,5\n", "column step of data row 2 is 18446744073709551615, outside"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms\nr,0,0,fwd,1_0,compute,1\n",
     "column step of data row 1 is '1_0', not a whole number"),
    # a column named twice: pandas read the second as dur_ms.1, and the report used the first, exit 0
    (b"run_id,rank,iteration,phase,step,kind,dur_ms,dur_ms\nr,0,0,fwd,0,compute,1,100\n",
     "the header names column dur_ms 2 times; a bench CSV names each column once"),
    # finite, but past what any run has: TFLOP/s and the trace's microseconds overflowed (a matplotlib
    # traceback, exit 1; JSON's "Out of range float values", naming no file)
    (b"run_id,rank,iteration,phase,step,kind,dur_ms,flops\nr,0,0,fwd,0,compute,1,1e308\n",
     "column flops of data row 1 is 1e+308, above its most value 1e+30"),
    (b"run_id,rank,iteration,phase,step,kind,dur_ms,start_ms,end_ms\nr,0,0,fwd,0,compute,1,0,1e306\n",
     "column end_ms of data row 1 is 1e+306, above its most value 1e+13"),
    (gzip.compress(b"run_id,rank,iteration,phase,step,kind,dur_ms\n")[:20],
     "a gzip file that cannot be decompressed"),
])
def test_report_refuses_what_is_not_a_bench_csv_naming_the_file(tmp_path, content, says):
    bad = tmp_path / "not-bench.csv"
    bad.write_bytes(content)
    res = _report(bad)
    assert res.exit_code == 2
    message = " ".join(res.stderr.split())
    assert str(bad) in message and says in message


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)])
def test_a_compressed_csv_reads_as_pandas_reads_it(csvs, tmp_path, suffix, compress):
    """Before: "a binary file, not a sinkprof bench CSV", where pandas.read_csv reads it."""
    packed = tmp_path / f"bench.csv{suffix}"
    packed.write_bytes(compress(Path(csvs[0]).read_bytes()))
    assert load([packed]).equals(load([csvs[0]]))


def test_report_reads_a_csv_of_an_older_version(csvs, tmp_path):
    old = tmp_path / "old.csv"
    keep = list(REQUIRED_COLUMNS) + ["start_ms", "end_ms", "comm", "softmax", "mask", "dtype"]
    pd.read_csv(csvs[0])[keep].to_csv(old, index=False)
    df = load([old])
    assert (df["cp"] == 2).all() and not df["predicted"].any() and (df["git_sha"] == "").all()
    paths = report([old], str(tmp_path / "plots"))
    assert sorted(Path(p).name for p in paths) == ["p2p-learnable-causal-fp32-cp2-bwd.png",
                                                   "p2p-learnable-causal-fp32-cp2-fwd.png", "summary.png"]
    res = _report(old, "--html", tmp_path / "old.html", "--chrome-trace", tmp_path / "old.json")
    assert res.exit_code == 0, res.output
    assert "sent MB" in res.stdout and "MB/iter" not in res.stdout and "kv=" not in res.stdout
    events = json.loads((tmp_path / "old.json").read_text())["traceEvents"]
    comm = [e for e in events if e.get("cat") == "communication"]
    assert comm and not any("bytes" in e["args"] for e in comm)


def test_an_older_csv_beside_a_current_one_gets_its_own_cp_and_a_simulation_without_cp_is_refused(csvs, tmp_path):
    """An old CSV without ``cp`` given with one that has it: its rows kept NaN (another file had
    the column), and report ended in a traceback. A --simulate CSV without ``cp`` was filled with
    its ranks' count, 4 for every size: the cp 2 and cp 4 cases read as one, exit 0."""
    old = _minimal(csvs[0], tmp_path / "old.csv")
    df = load([old, csvs[1]])
    assert df.loc[df["run_id"].isin(pd.read_csv(old)["run_id"]), "cp"].tolist() == [2] * len(pd.read_csv(old))
    assert set(df["cp"]) == {2, 4}
    res = _report(old, csvs[1])
    assert res.exit_code == 0, res.output
    assert "cp=2" in res.stdout and "cp=4" in res.stdout
    sim = tmp_path / "sim.csv"
    pd.read_csv(csvs[1]).drop(columns=["cp"]).to_csv(sim, index=False)
    res = _report(sim)
    assert res.exit_code == 2 and "sim.csv: rows of a --simulate run but no cp column" in " ".join(res.output.split())


def test_csvs_joined_with_cat_say_a_header_repeats_and_blank_flops_are_not_called_a_missing_column(csvs, tmp_path):
    joined = tmp_path / "joined.csv"
    joined.write_text(Path(csvs[0]).read_text() + Path(csvs[0]).read_text())
    res = _report(joined)
    assert res.exit_code == 2 and "the header's: a second header line (CSVs joined with cat?)" in \
        " ".join(res.output.split()), res.output
    blank = tmp_path / "blank.csv"
    df = pd.read_csv(csvs[0], dtype=str, keep_default_na=False)
    df["flops"] = ""
    df.to_csv(blank, index=False)
    res = _report(blank)
    assert res.exit_code == 0 and "unknown (no flops in the CSV)" in " ".join(res.stdout.split()), res.output


def test_the_same_case_from_two_runs_is_titled_with_its_run(csvs, tmp_path):
    """Two runs of one case printed two blocks under the same title."""
    again = tmp_path / "again.csv"
    df = pd.read_csv(csvs[0], dtype=str, keep_default_na=False)
    df["run_id"] = "20261207-000000-aaaaaa"
    df.to_csv(again, index=False)
    res = _report(csvs[0], again)
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    first = pd.read_csv(csvs[0], dtype=str)["run_id"].iloc[0]
    assert f"run {first}: fwdbwd" in text and "run 20261207-000000-aaaaaa: fwdbwd" in text
    assert " run " not in " ".join(_report(csvs[0]).stdout.split())


def test_markup_in_cells_prints_as_written_and_git_sha_keeps_its_zeros(csvs, tmp_path):
    df = pd.read_csv(csvs[0], dtype={"git_sha": str})
    df["device_name"] = "[link=https://example.com]x[/link]"
    df["git_sha"] = "0012abc"
    odd = tmp_path / "odd.csv"
    df.to_csv(odd, index=False)
    assert (load([odd])["git_sha"] == "0012abc").all()
    res = _report(odd, "--html", tmp_path / "odd.html")
    assert res.exit_code == 0, res.output
    page = (tmp_path / "odd.html").read_text()
    assert "git 0012abc" in page and "[link=https://example.com]x[/link]" in page and "<a " not in page
    # a case column holds what bench writes: markup there is refused, and the message shows it as written
    for col, cell in (("backend", "[/]"), ("dtype", "[link=https://example.com]x[/link]")):
        pd.read_csv(csvs[0]).assign(**{col: cell}).to_csv(odd, index=False)
        res = _report(odd)
        assert res.exit_code == 2, res.output
        assert f"column {col} of data row 1 is {cell!r}" in " ".join(res.stderr.split()) and "\x1b]8;" not in res.stderr


def test_predicted_rows_are_labelled_as_predictions(csvs, tmp_path):
    df = pd.read_csv(csvs[0])
    df["predicted"] = df["kind"].isin(["kv", "dkv", "iteration"])
    pred = tmp_path / "pred.csv"
    df.to_csv(pred, index=False)
    loaded = load([pred])
    assert iteration_table(loaded)["predicted"].all()
    steps = step_table(loaded)
    assert steps.set_index(["phase", "step"])["predicted"].to_dict() == {
        ("fwd", 0): True, ("fwd", 1): False, ("bwd", 0): True, ("bwd", 1): True}
    res = _report(pred, "--plot", tmp_path / "plots", "--html", tmp_path / "p.html")
    assert res.exit_code == 0, res.output
    assert "PREDICTION" in res.stdout and "predicted" in res.stdout and "measured" in res.stdout
    assert (tmp_path / "plots" / f"{SLUG}-pred-fwd.png").is_file()
    assert 'class="prediction"' in (tmp_path / "p.html").read_text()


def _chromium():
    return shutil.which("chromium-headless-shell") or shutil.which("chromium")


PROBE = """<script>window.addEventListener('load', () => {
  const imgs = [...document.images];
  document.body.setAttribute('data-probe', JSON.stringify(imgs.map(i => [i.naturalWidth, i.complete])));
});</script>"""


@pytest.mark.browser
@pytest.mark.skipif(_chromium() is None, reason="needs chromium-headless-shell or chromium")
def test_the_page_renders_its_pictures_in_a_real_browser(written, tmp_path):
    out, _ = written
    page = (out / "report.html").read_text()
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"))
    flags = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--virtual-time-budget=5000"]
    dom = subprocess.run(flags + ["--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=60)
    found = re.search(r"data-probe=\"([^\"]*)\"", dom.stdout)
    assert found, dom.stderr[-2000:]
    sizes = json.loads(found.group(1).replace("&quot;", '"'))
    assert len(sizes) == 4 and all(w > 800 and done for w, done in sizes)
    shot = tmp_path / "shot.png"
    subprocess.run(flags + ["--window-size=1280,1600", f"--screenshot={shot}", (out / "report.html").as_uri()],
                   capture_output=True, timeout=60, check=True)
    assert _png_size(shot.read_bytes()) == (1280, 1600)
    assert _has_colour(shot, figures.COMPUTE)  # the pictures are on the screen, not only in the DOM


def _minimal(csv, path, extra=()):
    """``csv`` cut to the required columns (and ``extra``): a bench CSV of the oldest version read."""
    pd.read_csv(csv)[list(REQUIRED_COLUMNS) + list(extra)].to_csv(path, index=False)
    return path


@pytest.mark.parametrize("times", ["absent", "blank"])
def test_a_csv_without_times_reports_without_timelines_and_says_so(csvs, tmp_path, times):
    old = _minimal(csvs[0], tmp_path / "min.csv", extra=("start_ms", "end_ms") if times == "blank" else ())
    if times == "blank":  # the columns, every cell empty
        pd.read_csv(old).assign(start_ms="", end_ms="").to_csv(old, index=False)
    res = _report(old, "--plot", tmp_path / "plots", "--html", tmp_path / "min.html")
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["summary.png"]
    notes = [line for line in res.stderr.splitlines() if "start_ms" in line]
    assert len(notes) == 1 and "end_ms" in notes[0] and "timeline" in notes[0], res.stderr
    named = str(old) if times == "absent" else pd.read_csv(csvs[0])["run_id"].iloc[0]
    assert named in notes[0]
    page = (tmp_path / "min.html").read_text()
    assert page.rstrip().endswith("</html>") and page.count("<img") == 1  # the summary figure only


def test_a_csv_of_iteration_rows_only_reports_its_iterations_and_says_why_there_are_no_steps(csvs, tmp_path):
    full = pd.read_csv(csvs[0])
    only = tmp_path / "iterations.csv"
    full[full["kind"] == "iteration"].to_csv(only, index=False)
    res = _report(only, csvs[1], "--plot", tmp_path / "plots", "--chrome-trace", tmp_path / "trace.json")
    assert res.exit_code == 0, res.output
    notes = [line for line in res.stderr.splitlines() if "iteration rows only" in line]
    assert notes == [f"sinkprof report: {only} has 1 case with iteration rows only, no per-step rows (kind compute, "
                     f"kv, dkv or a2a, which sinkprof bench --csv writes for every ring step): its per-step table, "
                     f"timelines and Chrome trace events are left out, and its exposed communication is unknown; the "
                     f"rest of the report is written"], res.stderr
    assert "start_ms" not in res.stderr           # not the note of a CSV without times
    text = " ".join(res.stdout.split())
    assert "fwdbwd" in text and "exposed comm unknown" in text      # the iterations' case, not 0.0% exposed
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [f"{SIM_SLUG}-fwd.png", "summary.png"]
    its = iteration_table(load([only]))
    assert len(its) == 1 and its["wall_ms"].iloc[0] > 0 and its["exposed_comm_ms"].isna().all()
    # with its step rows the case has no such note, and the exposed share is known
    res = _report(csvs[0])
    assert res.exit_code == 0 and "iteration rows only" not in res.stderr, res.stderr
    assert iteration_table(load([csvs[0]]))["exposed_comm_ms"].notna().all()


def _strict_json(text: str):
    """``json.loads`` that refuses NaN and Infinity (RFC 8259; Perfetto rejects them too)."""
    return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


@pytest.mark.parametrize("extra", [None, ("start_ms", "end_ms"), ()], ids=["full", "times", "minimal"])
def test_chrome_trace_is_strict_json_whatever_columns_the_csv_has(csvs, tmp_path, extra):
    csv = csvs[0] if extra is None else _minimal(csvs[0], tmp_path / "cut.csv", extra)
    res = _report(csv, "--chrome-trace", tmp_path / "trace.json")
    assert res.exit_code == 0, res.output
    doc = _strict_json((tmp_path / "trace.json").read_text())
    comm = [e for e in doc["traceEvents"] if e.get("cat") == "communication"]
    if extra == ():  # no times: no events to place, and a note that says so
        assert not [e for e in doc["traceEvents"] if e["ph"] == "X"]
        assert "Chrome trace" in res.stderr and "start_ms" in res.stderr
        return
    assert comm and "Chrome trace" not in res.stderr
    for e in comm:  # an arg the CSV has no value for is left out, not NaN
        assert ("overlap_ms" in e["args"]) == (extra is None) and ("exposed_ms" in e["args"]) == (extra is None)


def test_packs_are_named_by_their_documents():
    a, b = _case(docs="96,160,256"), _case(docs="64,64,384")
    assert "docs=96,160,256" in label(a) and label(a) != label(b)
    assert "docs=12 documents" in label(_case(docs=",".join(["32"] * 12)))
    assert "docs=" not in label(_case())
    assert sorted(slugs(pd.DataFrame([a, b])).values()) == [
        "p2p-learnable-step0-causal-w127-0-thd3docs-fp32-cp4-docs-64-64-384",
        "p2p-learnable-step0-causal-w127-0-thd3docs-fp32-cp4-docs-96-160-256"]


def test_step_0_beside_the_next_step_counts_once_in_a_ranks_compute_and_is_drawn_apart(csvs, monkeypatch):
    """Where step 0 ran on a second stream beside step 1 (``ring.Beside``), the rank's compute
    time is the union of its spans, not their sum, the trace draws step 0 on "compute beside", and
    the timeline in the upper half of the rank's compute lane, its other steps in the lower half."""
    from sinkprof.tool.chrome_trace import BESIDE_TID, COMPUTE_TID, trace
    from sinkprof.tool.report import rank_table
    df = load([csvs[0]])
    first = df["iteration"] == df["iteration"].min()
    mine = (df["kind"] == "compute") & (df["phase"] == "bwd") & (df["rank"] == 0) & first
    steps = df[mine].set_index("step")
    s1, e1 = steps.loc[1, "start_ms"], steps.loc[1, "end_ms"]
    zero = mine & (df["step"] == 0)   # starts first, ends a quarter into step 1
    df.loc[zero, "start_ms"], df.loc[zero, "end_ms"] = s1 - 0.5 * (e1 - s1), s1 + 0.25 * (e1 - s1)
    df.loc[mine, "dur_ms"] = df.loc[mine, "end_ms"] - df.loc[mine, "start_ms"]
    want = df.loc[mine, "dur_ms"].sum() - 0.25 * (e1 - s1)
    ranks = rank_table(df[first])
    got = ranks[(ranks["phase"] == "bwd") & (ranks["rank"] == 0)]["compute_ms"].item()
    assert got == pytest.approx(want)
    events = trace(df[first])["traceEvents"]
    computes = {e["name"]: e["tid"] for e in events if e["ph"] == "X" and e["cat"] == "compute" and e["pid"] == 0}
    assert computes["bwd step 0 compute"] == BESIDE_TID and computes["bwd step 1 compute"] == COMPUTE_TID
    assert computes["fwd step 0 compute"] == COMPUTE_TID   # the forward's spans did not move
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert (0, "compute beside") in names and (1, "compute beside") not in names
    from matplotlib.axes import Axes
    bars = []
    barh = Axes.barh

    def spy(self, y, width, *args, **kwargs):
        if kwargs.get("color") == figures.COMPUTE:
            bars.append((y, kwargs["left"], kwargs["height"]))
        return barh(self, y, width, *args, **kwargs)
    monkeypatch.setattr(Axes, "barh", spy)
    assert figures.timeline(df[first], "bwd") is not None
    lanes = 2   # compute and communication lanes a rank
    rank0 = {left: (y, height) for y, left, height in bars if abs(y) < 0.5}
    assert rank0[s1 - 0.5 * (e1 - s1)] == (pytest.approx(-0.2), 0.4)   # step 0
    assert all(v == (pytest.approx(0.2), 0.4) for left, v in rank0.items() if left != s1 - 0.5 * (e1 - s1))
    assert {height for y, _, height in bars if abs(y - lanes) < 0.5} == {0.8}   # rank 1: one bar a step


def test_exchanges_of_one_kind_in_flight_together_take_threads_of_their_own_and_every_thread_nests(csvs):
    """Under the direct schedule a joined run's messages are in flight at once: two kv exchanges of
    a rank overlapped on its one kv thread (18 such pairs in a cp 3 direct run), which the Trace
    Event Format does not allow (Perfetto draws them cut or stacked wrong)."""
    from sinkprof.tool.chrome_trace import COMM_TIDS, trace
    df = load([csvs[0]])
    first = df[df["iteration"] == df["iteration"].min()].copy()
    kv = first[(first["kind"] == "kv") & (first["rank"] == 0)].sort_values("start_ms")   # fwd's, then bwd's
    a, b = kv.index[:2]
    first.loc[b, "start_ms"] = first.loc[a, "start_ms"] + 0.5 * (first.loc[a, "end_ms"] - first.loc[a, "start_ms"])
    first.loc[b, "end_ms"] = max(first.loc[b, "end_ms"], first.loc[a, "end_ms"] + 0.01)
    events = trace(first)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    tids = {e["name"]: e["tid"] for e in spans if e["pid"] == 0 and e["cat"] == "communication"}
    step_a, step_b = (f"{first.loc[i, 'phase']} step {int(first.loc[i, 'step'])} kv" for i in (a, b))
    assert tids[step_a] == COMM_TIDS["kv"] and tids[step_b] == COMM_TIDS["kv"] + 10
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[(0, COMM_TIDS["kv"] + 10)] == "communication kv 2" and (1, COMM_TIDS["kv"] + 10) not in names
    for key in {(e["pid"], e["tid"]) for e in spans}:   # on each thread, two events are apart or one holds the other
        mine = sorted(((e["ts"], e["ts"] + e["dur"]) for e in spans if (e["pid"], e["tid"]) == key),
                      key=lambda se: (se[0], -se[1]))
        for i, (s0, e0) in enumerate(mine):
            for s1, e1 in mine[i + 1:]:
                assert s1 >= e0 - 1e-3 or e1 <= e0 + 1e-3, (key, (s0, e0), (s1, e1))


def test_one_csv_given_twice_or_as_a_copy_is_refused_not_counted_twice(csvs, tmp_path):
    """Each step's times would otherwise be summed over both: every number doubled."""
    real = csvs[0]
    link, copy = tmp_path / "link.csv", tmp_path / "copy.csv"
    link.symlink_to(real)
    shutil.copy(real, copy)
    for args, says in (((real, real), "are the same file"), ((real, link), "are the same file"),
                       ((real, copy), "(a copy?)")):
        res = _report(*args)
        assert res.exit_code == 2, res.output
        assert says in " ".join(res.stderr.split())


def test_the_page_and_the_trace_never_overwrite_an_input_or_each_other(csvs, tmp_path):
    mine = tmp_path / "mine.csv"
    shutil.copy(csvs[0], mine)
    before = mine.read_bytes()
    for args, says in ((("--html", mine), "--html"), (("--chrome-trace", mine), "--chrome-trace"),
                       (("--html", tmp_path / "x", "--chrome-trace", tmp_path / "x"), "would both write")):
        res = _report(mine, *args)
        assert res.exit_code == 2, res.output
        assert says in res.stderr
    assert mine.read_bytes() == before and not (tmp_path / "x").exists()


def test_the_files_are_written_before_the_tables(csvs, tmp_path):
    """A pipe that closes after the first line (``| head -1``) still leaves the page and the trace."""
    res = subprocess.run(f"{__import__('sys').executable} -m sinkprof report {csvs[0]} --html {tmp_path / 'p.html'} "
                         f"--chrome-trace {tmp_path / 't.json'} | head -1; exit ${{PIPESTATUS[0]}}",
                         shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert res.returncode in (0, 1), res.stderr   # 1: the pipe closed before the tables were out
    assert (tmp_path / "p.html").stat().st_size > 0 and json.loads((tmp_path / "t.json").read_text())
    assert "Traceback" not in res.stderr, res.stderr


def test_a_csv_from_a_pipe_is_read_once_and_a_folder_is_named_as_one(csvs, tmp_path):
    """``report <(zcat run.csv.gz)``: the file is a pipe, which cannot be read a second time."""
    import os
    import threading
    fifo = tmp_path / "run.csv"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(Path(csvs[0]).read_bytes()))
    writer.start()
    res = _report(fifo)
    writer.join(10)
    assert res.exit_code == 0, res.output
    assert "compute ms per rank" in res.stdout
    res = _report(tmp_path)
    assert res.exit_code == 2 and "a folder, not a CSV file" in res.stderr


def test_whole_numbers_are_read_exactly_however_written(tmp_path):
    """``2.0`` and ``1e1`` are whole numbers; a step of 2**62 + 1 stays that (no float between)."""
    path = tmp_path / "exact.csv"
    path.write_text("run_id,rank,iteration,phase,step,kind,dur_ms\nr,1.0,1e1,fwd,0,compute,1\n"
                    "r,0,0,fwd,4611686018427387905,kv,1\n  \nr,+1,0,fwd,-1,iteration,2\n")
    df = load([path])
    assert df["rank"].tolist() == [1, 0, 1] and df["iteration"].tolist() == [10, 0, 0]
    assert df["step"].tolist() == [0, 2 ** 62 + 1, -1] and str(df["step"].dtype) == "int64"


def _long_packs(csv: Path, tmp_path: Path) -> Path:
    """The run of ``csv`` as two cases, thd packs of 91 documents that differ in the last one only:
    slugs that tell them apart list every length."""
    rows = pd.read_csv(csv, dtype=str, keep_default_na=False)
    packs = []
    for last in (64, 192):
        lengths = [64] * 90 + [last]
        packs.append(rows.assign(docs=",".join(map(str, lengths)), s=str(sum(lengths))))
    out = tmp_path / "long.csv"
    pd.concat(packs).to_csv(out, index=False)
    return out


def test_pictures_of_packs_of_many_documents_get_bounded_names(csvs, tmp_path):
    """Their slugs listed all 91 lengths: ``OSError: File name too long`` (a traceback). A slug over
    SLUG_MAX keeps its start and ends in a hash of the whole, so the two cases keep apart."""
    from sinkprof.tool.report import SLUG_MAX
    res = _report(_long_packs(csvs[0], tmp_path), "--plot", tmp_path / "plots")
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    timelines = [n for n in names if n != "summary.png"]
    assert len(names) == 5 and len(timelines) == 4, names
    assert all(len(n.encode()) <= SLUG_MAX + len("-fwd.png") for n in names)
    assert all(n.startswith("p2p-learnable-step0-causal-thd91docs-fp32-cp2-docs-64-64-") for n in timelines)
    assert len({n.rsplit("-", 1)[0] for n in timelines}) == 2   # two cases, each a fwd and a bwd picture
    assert all(f"wrote {tmp_path / 'plots' / n}" in " ".join(res.stdout.split()) for n in names)


def test_a_picture_that_cannot_be_written_is_named(csvs, tmp_path):
    """A failed write of a PNG was ``write error: File too large`` (``ulimit -f``), which reads like
    stdout's; it names the picture now (a folder in its place is refused before any is written:
    ``test_the_page_or_trace_where_the_plot_folder_goes_is_refused_before_any_picture``)."""
    limited = tmp_path / "limited"
    res = subprocess.run(f"ulimit -f 20; {__import__('sys').executable} -m sinkprof report {csvs[0]} --plot {limited}",
                         shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    said = " ".join(res.stderr.split())
    assert res.returncode == 1 and re.search(rf"sinkprof: cannot write {limited}/\S+\.png: File too large", said), said


def _cli(*args, **kwargs) -> subprocess.CompletedProcess:
    """``python -m sinkprof ARGS`` by the shell (its descriptors as the redirects in ``args`` say)."""
    return subprocess.run(f"{__import__('sys').executable} -m sinkprof " + " ".join(map(str, args)), shell=True,
                          capture_output=True, text=True, timeout=120, **kwargs)


def test_pictures_into_a_descriptor_are_refused_as_the_other_outputs_are(csvs):
    for args in (("--plot", "/dev/stdout", "| cat"), ("--plot", "/proc/self/fd/7")):
        res = _cli("report", csvs[0], *args)
        said = " ".join(res.stderr.split())
        assert f"--plot {args[1]}: names a file descriptor; name a folder" in said, said
        assert "Traceback" not in said and "wrote" not in res.stdout


def test_two_names_of_stdout_are_named_as_typed(csvs):
    """``--html /dev/stdout --chrome-trace /dev/fd/1`` said ``--html - and --chrome-trace -``."""
    res = _cli("report", csvs[0], "--html", "/dev/stdout", "--chrome-trace", "/dev/fd/1", "| cat")
    said = " ".join(res.stderr.split())
    assert "--html /dev/stdout and --chrome-trace /dev/fd/1 would both write stdout" in said, said


def test_stdout_into_an_input_csv_is_refused(csvs, tmp_path):
    """``report in.csv --chrome-trace /dev/stdout >> in.csv`` appended the trace to its input; the
    tables alone (``report in.csv >> in.csv``) corrupted it as well."""
    mine = tmp_path / "in.csv"
    shutil.copy(csvs[0], mine)
    before = mine.read_bytes()
    for args, what in ((("--chrome-trace", "/dev/stdout"), "--chrome-trace /dev/stdout"),
                       (("--html", "-"), "--html -"), ((), "the summary tables")):
        res = _cli("report", mine, *args, f">> {mine}")
        said = " ".join(res.stderr.split())
        assert res.returncode == 2, said
        assert f"stdout is the CSV {mine} being read (a > or >> into it): {what} would be written into it" in said
    assert mine.read_bytes() == before
    res = _cli("report", mine, "--chrome-trace", "/dev/stdout", f"> {tmp_path / 'trace.json'}")
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


@pytest.fixture(scope="module")
def a2a_csv(tmp_path_factory):
    """A real 2-rank a2a run: its a2a rows (step -1) repeat rank, iteration, phase, step and kind."""
    path = tmp_path_factory.mktemp("a2a") / "a2a.csv"
    res = run_cli("bench", "--comm", "a2a", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp32",
                  "--seq-len", "64", "--warmup", "0", "--iters", "2", "--csv", str(path))
    assert res.returncode == 0, res.stdout + res.stderr
    return path


def _cells(csv, path: Path, row: int = 2, **cells) -> Path:
    """``csv`` with ``cells`` (column -> text) set in the data row ``row`` (0-based; every row for
    None), each other cell as written."""
    df = pd.read_csv(csv, dtype=str, keep_default_na=False)
    for col, value in cells.items():
        df.loc[slice(None) if row is None else row, col] = value
    df.to_csv(path, index=False)
    return path


# A cell bench never writes (column -> text, in data row 3), and what the refusal says of it.
BAD_CELLS = [
    ({"h": "two"}, "column h of data row 3 is 'two', not a whole number"),
    ({"cp": "abc"}, "column cp of data row 3 is 'abc', not a whole number"),
    ({"b": "0"}, "column b of data row 3 is 0, below its least value 1"),
    ({"s": "-64"}, "column s of data row 3 is -64, below its least value 1"),
    ({"g": ""}, "column g of data row 3 is empty, not a whole number"),
    ({"window": "wide"}, "column window of data row 3 is 'wide', not a window of mask causal: window='wide' must be "
                         "a pair LEFT,RIGHT of ints"),
    ({"window": "128,5"}, "column window of data row 3 is '128,5', not a window of mask causal: window right=5 "
                          "contradicts mask='causal'"),
    ({"dtype": "fp33"}, "column dtype of data row 3 is 'fp33', not one of fp64, fp32, bf16, fp16"),
    ({"comm": "p3p"}, "column comm of data row 3 is 'p3p', not one of p2p, a2a, a2a+p2p"),
    ({"softmax": ""}, "column softmax of data row 3 is empty, not one of vanilla, off-by-one, learnable"),
    ({"mask": "Causal"}, "column mask of data row 3 is 'Causal', not one of causal, no_mask"),
    ({"sink_strategy": "every-tile"}, "column sink_strategy of data row 3 is 'every-tile', not one of step0, "
                                      "post-merge (or empty)"),
    ({"kv_schedule": "auto"}, "column kv_schedule of data row 3 is 'auto', not one of ring, direct, allgather "
                              "(or empty)"),
    ({"backend": "te"}, "column backend of data row 3 is 'te', not one of torch, cudnn, fa4"),
    ({"simulated": "maybe"}, "column simulated of data row 3 is 'maybe', not True or False"),
    ({"run_id": ""}, "column run_id of data row 3 is empty, not a run id"),
    ({"rank": "5"}, "column rank of data row 3 is 5, not a rank of its run: column cp says 2 ranks, 0 to 1"),
    ({"start_ms": "1e6"}, "data row 3 ends before it starts: column start_ms is 1000000.0"),
    ({"overlap_ms": "-1"}, "column overlap_ms of data row 3 is -1, below its least value 0"),
    ({"exposed_ms": "-0.5"}, "column exposed_ms of data row 3 is -0.5, below its least value 0"),
]


@pytest.mark.parametrize("cells, says", BAD_CELLS,
                         ids=["-".join(f"{k}={v}" for k, v in cells.items()) for cells, _ in BAD_CELLS])
def test_a_case_cell_bench_never_writes_is_named_not_split_off_into_a_case_of_its_own(csvs, tmp_path, cells, says):
    """Such a row was a case of its own, dropped from the tables (exit 0, its case's numbers changed)."""
    bad = _cells(csvs[0], tmp_path / "bad.csv", **cells)
    res = _report(bad)
    message = " ".join(res.stderr.split())
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"{bad}: {says}" in message, message
    assert "ms/iter" not in res.stdout   # no numbers at all, rather than wrong ones


@pytest.mark.parametrize("cp, says", [("0", "column cp of data row 1 is 0, below its least value 1"),
                                      ("abc", "column cp of data row 1 is 'abc', not a whole number")])
def test_a_cp_column_of_no_ranks_is_named_not_infinite_throughput(csvs, tmp_path, cp, says):
    """``cp`` 0 in every row printed ``inf TFLOP/s`` (and --plot failed on infinite axis limits);
    ``abc`` said ``could not convert string to float`` without the file or the column."""
    bad = _cells(csvs[0], tmp_path / "bad.csv", row=None, cp=cp)
    res = _report(bad, "--plot", tmp_path / "plots")
    assert res.exit_code == 2 and f"{bad}: {says}" in " ".join(res.stderr.split()), res.output
    assert "inf" not in res.stdout and "Warning" not in res.output and not (tmp_path / "plots").exists()


def test_a_span_given_twice_is_refused_not_counted_twice(csvs, a2a_csv, tmp_path):
    """A file appended to itself (``(cat a.csv; tail -n +2 a.csv)``) doubled every step's compute,
    communication and MB sent, exit 0. An a2a step's messages share rank, iteration, phase, step
    and kind; their starts tell them apart."""
    text = Path(csvs[0]).read_text()
    rows = len(text.splitlines()) - 1
    twice = tmp_path / "twice.csv"
    twice.write_text(text + "".join(text.splitlines(keepends=True)[1:]))
    res = _report(twice)
    assert res.exit_code == 2, res.output
    assert (f"{twice}: data rows 1 and {rows + 1} are one span twice (run {pd.read_csv(csvs[0])['run_id'][0]}, "
            f"rank 0, iteration 0, fwd step 0 compute from ") in " ".join(res.stderr.split())
    a2a = pd.read_csv(a2a_csv)
    messages = a2a[a2a["kind"] == "a2a"]
    assert messages.duplicated(["rank", "iteration", "phase", "step", "kind"]).any()   # the case this guards
    res = _report(a2a_csv)
    assert res.exit_code == 0, res.output
    one_more = tmp_path / "a2a.csv"
    pd.concat([a2a, messages.iloc[[1]]]).to_csv(one_more, index=False)
    res = _report(one_more)
    assert res.exit_code == 2, res.output
    assert f"data rows {messages.index[1] + 1} and {len(a2a) + 1} are one span twice" in " ".join(res.stderr.split())
    untimed = _minimal(a2a_csv, tmp_path / "untimed.csv")   # no start_ms: told apart by their durations
    assert _report(untimed).exit_code == 0


def test_a_csv_of_step_rows_only_reports_its_steps_and_says_why_there_are_no_iterations(csvs, a2a_csv, tmp_path):
    """Without iteration rows the report was empty, exit 0 (and --plot left summary.png out
    silently); next to a case with them, the case was left out of the tables and --plot failed
    with a KeyError."""
    full = pd.read_csv(csvs[0])
    steps = tmp_path / "steps.csv"
    full[full["kind"] != "iteration"].to_csv(steps, index=False)
    res = _report(steps, "--plot", tmp_path / "plots")
    assert res.exit_code == 0, res.output
    notes = [line for line in res.stderr.splitlines() if "no iteration rows" in line]
    assert notes == [f"sinkprof report: {steps} has 1 case with per-step rows only, no iteration rows (kind "
                     f"iteration, which sinkprof bench --csv writes for every rank and iteration): its wall time, "
                     f"FLOP/s and exposed share are unknown, and no summary figure is drawn; the rest of the report "
                     f"is written"], res.stderr
    text = " ".join(res.stdout.split())
    assert "no iteration rows (wall time, FLOP/s and exposed share unknown)" in text and "compute ms per rank" in text
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [f"{SLUG}-bwd.png", f"{SLUG}-fwd.png"]
    a2a = pd.read_csv(a2a_csv)
    a2a_steps = tmp_path / "a2a-steps.csv"
    a2a[a2a["kind"] != "iteration"].to_csv(a2a_steps, index=False)
    res = _report(csvs[0], a2a_steps, "--plot", tmp_path / "both", "--html", tmp_path / "both.html")
    assert res.exit_code == 0, res.output
    assert "left out of the summary figure" in res.stderr
    text = " ".join(res.stdout.split())
    assert "ms/iter" in text and text.count("compute ms per rank") == 2
    names = {p.name for p in (tmp_path / "both").iterdir()}
    assert "summary.png" in names and any(n.startswith("a2a-") for n in names), names
    assert (tmp_path / "both.html").read_text().count("<h2") == 2


def test_an_empty_path_and_stdin_are_named_as_what_they_are(tmp_path):
    """``report ""`` read the current folder (``: a folder, not a CSV file``); ``report -`` said
    ``-: no such CSV file``."""
    for arg, says in (("", "'': an empty path, not a CSV file; name the bench CSV"),
                      ("-", "-: report reads no CSV from stdin; name the CSV file")):
        res = _report(arg)
        assert res.exit_code == 2 and says in " ".join(res.stderr.split()), res.output


def test_no_picture_overwrites_the_page_the_trace_or_an_input(csvs, tmp_path):
    """``--plot p --html p/summary.png`` left the page where the summary picture was (exit 0)."""
    mine = tmp_path / "mine.csv"
    shutil.copy(csvs[0], mine)
    before = mine.read_bytes()
    plots = tmp_path / "plots"
    for args, says in (
            (("--html", plots / "summary.png"), f"--html {plots / 'summary.png'} and the picture summary.png of "
                                                f"--plot {plots} would both write {plots / 'summary.png'}"),
            (("--chrome-trace", plots / f"{SLUG}-fwd.png"), f"--chrome-trace {plots / f'{SLUG}-fwd.png'} and the "
                                                            f"picture {SLUG}-fwd.png of --plot {plots} would both "
                                                            f"write")):
        res = _report(mine, "--plot", plots, *args)
        assert res.exit_code == 2, res.output
        assert says in " ".join(res.stderr.split())
        assert not plots.exists() or not list(plots.iterdir())   # nothing written
    plots.mkdir(exist_ok=True)
    (plots / "summary.png").symlink_to(mine)
    res = _report(mine, "--plot", plots)
    assert res.exit_code == 2, res.output
    assert (f"the picture summary.png of --plot {plots} is the CSV {mine} being read: it would be overwritten; "
            f"write the pictures into another folder") in " ".join(res.stderr.split())
    assert mine.read_bytes() == before and [p.name for p in plots.iterdir()] == ["summary.png"]


def test_the_page_or_trace_where_the_plot_folder_goes_is_refused_before_any_picture(csvs, tmp_path):
    """``--plot p --html p`` wrote every picture into p, then failed on the page (``cannot write p:
    Is a directory``, exit 1); a folder or a protected file where a picture goes is refused first."""
    plots = tmp_path / "plots"
    for args, says in (
            (("--plot", plots, "--html", plots), f"--html {plots} is the folder --plot {plots} writes the "
                                                 f"pictures into"),
            (("--plot", plots / "deeper", "--chrome-trace", plots), f"--chrome-trace {plots} would be a file "
                                                                    f"where --plot {plots / 'deeper'} needs a folder")):
        res = _report(csvs[0], *args)
        assert res.exit_code == 2, res.output
        assert says in " ".join(res.stderr.split()), res.stderr
        assert not plots.exists()
    (plots / "summary.png").mkdir(parents=True)
    res = _report(csvs[0], "--plot", plots)
    assert res.exit_code == 2, res.output
    assert (f"--plot {plots}: {plots / 'summary.png'} is a folder where a picture goes; move it, or write the "
            f"pictures into another folder") in " ".join(res.stderr.split())
    assert [p.name for p in plots.iterdir()] == ["summary.png"]   # no picture written
    (plots / "summary.png").rmdir()
    kept = plots / f"{SLUG}-fwd.png"
    kept.write_bytes(b"protected")
    real_access = os.access
    with pytest.MonkeyPatch.context() as mp:   # as for a user without root's override
        mp.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == kept and mode & os.W_OK
                   else real_access(p, mode, **kw))
        res = _report(csvs[0], "--plot", plots)
    assert res.exit_code == 2, res.output
    assert f"the picture {kept}: cannot be written (permission denied)" in " ".join(res.stderr.split())
    assert [p.name for p in plots.iterdir()] == [kept.name] and kept.read_bytes() == b"protected"


def test_cases_that_differ_in_layout_sink_grad_or_bias_are_reported_apart(tmp_path):
    """bench writes qkv_format, sink_grad and bias: without them, the bshd and sbhd cases of one run
    shared every column and were summed into one case (twice the compute, exit 0)."""
    csv = tmp_path / "two.csv"
    res = run_cli("bench", "--ranks", "2", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp32",
                  "--qkv-format", "bshd,sbhd", "--sink-grad", "full,partial", "--warmup", "0", "--iters", "1",
                  "--csv", str(csv))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = pd.read_csv(csv)
    assert set(rows["qkv_format"]) == {"bshd", "sbhd"} and set(rows["sink_grad"]) == {"full", "partial"}
    assert set(rows["bias"]) == {False}
    out = _report(csv, "--plot", tmp_path / "plots")
    assert out.exit_code == 0, out.output
    its = iteration_table(load([csv]))
    titles = [label(row) for _, row in its.iterrows()]
    assert len(titles) == 4 and len(set(titles)) == 4, titles
    assert sum("sbhd" in t for t in titles) == 2 and sum("sink_grad=partial" in t for t in titles) == 2
    assert out.output.count("ms/iter") == 4
    pictures = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert len([p for p in pictures if p.endswith("-fwd.png")]) == 4, pictures
    assert not any(re.search(r"-\d\.png$", p) for p in pictures), pictures   # told apart, not numbered
