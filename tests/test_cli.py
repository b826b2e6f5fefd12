"""The command line through Typer's runner and through a real subprocess."""
import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from sinkprof import __version__
from sinkprof.cli import app

runner = CliRunner()


def test_version_and_help_on_every_command():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and __version__ in res.output
    for cmd in ([], ["emulate"], ["check"], ["profiles"]):
        res = runner.invoke(app, [*cmd, "--help"])
        assert res.exit_code == 0, res.output
        assert "Usage" in res.output


def test_emulate_json_schema_and_exit_code():
    res = runner.invoke(app, ["emulate", "--cp", "2,3", "--seq-len", "48", "--mask", "causal", "--format", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["passed"] is True
    keys = {"cp", "mask", "strategy", "out_max_abs_err", "dq_max_abs_err", "dk_max_abs_err", "dv_max_abs_err",
            "dsink_max_abs_err", "dsink_ratio_min", "dsink_ratio_max"}
    # cp x K/V schedule (ring, direct and allgather by default) x strategy, less every-tile under allgather
    # (each row's keys are one tile there: the bug cannot change a result)
    assert len(doc["results"]) == 2 * (3 * 2 + 2)
    assert {r["kv_schedule"] for r in doc["results"]} == {"ring", "direct", "allgather"}
    assert {r["strategy"] for r in doc["results"] if r["kv_schedule"] == "allgather"} == {"step0", "post-merge"}
    for row in doc["results"]:
        assert keys <= set(row)
    bug = [r for r in doc["results"] if r["strategy"] == "every-tile"]
    assert bug and all(not r["passed"] and r["dsink_max_abs_err"] > 1e-3 for r in bug)
    good = [r for r in doc["results"] if r["strategy"] != "every-tile"]
    assert all(r["passed"] and r["dsink_max_abs_err"] < 1e-12 for r in good)


def test_emulate_csv_reads_back_with_pandas(tmp_path):
    import pandas as pd
    out = tmp_path / "emu.csv"
    res = runner.invoke(app, ["emulate", "--cp", "2", "--format", "csv", "--output", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out)
    assert set(df["strategy"]) == {"step0", "post-merge", "every-tile"}
    assert (df.loc[df.strategy != "every-tile", "out_max_abs_err"] < 1e-12).all()


@pytest.mark.parametrize("args,message", [
    (["emulate", "--cp", "3"], "divisible by 2 * cp = 6"),
    (["emulate", "--mask", "bogus"], "--mask"),
    (["emulate", "--strategy", "nope"], "--strategy"),
    (["emulate", "--cp", "0"], "--cp"),
    (["emulate", "--window", "3"], "--window"),
    (["emulate", "--heads", "4", "--kv-heads", "3"], "--heads 4 must be a multiple of --kv-heads 3"),
    (["check", "--softmax", "bogus"], "softmax"),
    (["check", "--dtype", "fp8"], "dtype"),
    (["check", "--seq-len", "66"], "divisible by 2 * cp = 4"),
    (["check", "--inject", "nope"], "--inject"),
    (["check", "--profile", "no-such-profile"], "unknown"),
    (["check", "--mask", "causal", "--window", "3,2"], "contradicts"),
])
def test_bad_options_exit_2_with_a_message_naming_them(args, message):
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert message in res.output


@pytest.mark.parametrize("args,message", [
    (["--comm", "a2a+p2p", "--a2a-size", "2", "--cp", "2,4"],
     "--strategy every-tile: --cp 2 with --comm a2a+p2p --a2a-size 2 runs a p2p ring of one rank (cp / a2a-size), "
     "so the bug (the sink counted once per tile) cannot change a result and the replay cannot detect it; give "
     "every --cp at least 4 (2 * --a2a-size), or leave every-tile out (--strategy step0,post-merge)"),
    (["--comm", "a2a+p2p", "--a2a-size", "4", "--cp", "4", "--kv-heads", "4", "--strategy", "every-tile",
      "--qkv-format", "thd", "--seqlens", "24,40"], "--cp 4 with --comm a2a+p2p --a2a-size 4 runs a p2p ring of one"),
    (["--cp", "1,2", "--strategy", "every-tile"], "--cp 1 runs a ring of one rank"),
    (["--cp", "4", "--window", "0,0", "--mask", "causal"], "--window 0,0 (--mask causal) puts each row's keys in one tile"),
])
def test_emulate_refuses_every_tile_where_it_cannot_change_a_result(args, message):
    res = runner.invoke(app, ["emulate", *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output
    assert "Traceback" not in res.output


def test_emulate_names_a2a_size_and_cp_when_the_groups_do_not_tile_the_ring():
    res = runner.invoke(app, ["emulate", "--comm", "a2a+p2p", "--a2a-size", "4", "--cp", "8,2"])
    assert res.exit_code == 2, res.output
    assert ("--a2a-size 4 must divide every --cp, and --cp 2 is not a multiple of it; give --cp multiples of 4 or a "
            "smaller --a2a-size") in " ".join(res.output.split()), res.output


def test_emulate_a2a_p2p_without_every_tile_at_cp_equal_to_a2a_size_and_with_it_on_a_ring_of_two():
    res = runner.invoke(app, ["emulate", "--comm", "a2a+p2p", "--a2a-size", "2", "--cp", "2", "--strategy",
                              "step0,post-merge", "--format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["passed"] is True
    res = runner.invoke(app, ["emulate", "--comm", "a2a+p2p", "--a2a-size", "2", "--cp", "4", "--format", "json"])
    assert res.exit_code == 0, res.output
    bug = [r for r in json.loads(res.stdout)["results"] if r["strategy"] == "every-tile"]
    assert bug and all(not r["passed"] and r["ok"] for r in bug)


def test_emulate_in_a_real_subprocess(cli):
    res = cli("emulate", "--cp", "2", "--mask", "no_mask", "--format", "json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["passed"] is True
    res = cli("emulate", "--cp", "5")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's report")
def test_doctor_on_the_cpu_says_why_cudnn_and_the_fused_kernels_cannot_run(cli):
    res = cli("doctor", "--format", "json", env={"SINKPROF_FUSED": "0"})
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    env = doc["environment"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"
    assert env["fused sink kernels (triton)"] == "off: SINKPROF_FUSED=0"
    assert env["fa4 backward across tiles (fa4_rows)"] == "off: flash-attn-4 is not importable"
    cells = doc["capabilities"]
    cudnn = [c for c in cells if c["backend"] == "cudnn"]
    assert cudnn and not any(c["ok"] for c in cudnn)
    assert all("CUDA device" in c["reason"] for c in cudnn)
    torch_cells = [c for c in cells if c["backend"] == "torch" and c["dtype"] in ("fp64", "fp32")]
    assert torch_cells and all(c["ok"] for c in torch_cells)


def test_doctor_prints_its_reasons_and_environment_as_text_not_markup():
    """Before: rich read "[gpu]" in "pip install 'sinkprof[gpu]'" as markup and dropped it."""
    import io

    from rich.console import Console

    from sinkprof.tool.doctor import Cell, Report, render
    reason = "flash-attn-4 is not importable; pip install 'sinkprof[gpu]'"
    out = io.StringIO()
    render(Report({"device": "cuda", "extras": "[gpu] [red]"},
                  [Cell(comm, "learnable", "fa4", "bf16", "bshd", False, reason) for comm in ("p2p", "a2a", "a2a+p2p")]),
           Console(file=out, width=200))
    text = out.getvalue()
    assert f"(1) {reason}" in text and "[gpu] [red]" in text and "(2)" not in text


def _sinkprof_options():
    """(command, option) for every option of every command, as click sees them."""
    import typer.main
    group = typer.main.get_command(app)
    root = group.make_context("sinkprof", [], resilient_parsing=True)
    for name, cmd in [("", group), *group.commands.items()]:
        ctx = root if cmd is group else cmd.make_context(name, [], parent=root, resilient_parsing=True)
        for param in cmd.get_params(ctx):
            for opt in [*param.opts, *getattr(param, "secondary_opts", [])]:
                if opt.startswith("-"):
                    yield name, opt


def test_no_option_is_equal_to_or_a_prefix_of_a_torchrun_option():
    """torchrun's parser classifies every word after the script too: an option of sinkprof that is
    a prefix of one of torchrun's (``--s`` of ``--standalone``) makes it exit before sinkprof runs."""
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()
    theirs = {s for action in parser._actions for s in action.option_strings}
    helps = {"-h", "--help"}   # the same meaning in both; the parse below shows they reach sinkprof
    seen = 0
    for command, opt in _sinkprof_options():
        seen += 1
        if opt not in helps:
            clash = [t for t in theirs if t.startswith(opt)]
            assert not clash, f"sinkprof {command} {opt} is a prefix of torchrun's {clash}"
        args = parser.parse_args(["--standalone", "--nproc-per-node", "2", "--no-python", "sinkprof",
                                  *([command] if command else []), opt, "1"])
        assert args.training_script == "sinkprof" and args.training_script_args[-2:] == [opt, "1"]
    assert seen > 40


def test_the_readme_torchrun_lines_parse_in_torchrun():
    import re
    import shlex
    from pathlib import Path
    from torch.distributed.run import get_args_parser
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in readme.splitlines() if line.strip().startswith("torchrun ")]
    assert len(lines) >= 2
    for line in lines:
        words = shlex.split(line.split("#")[0])[1:]
        args = get_args_parser().parse_args(words)
        script = [args.training_script, *args.training_script_args]
        i = script.index("sinkprof")
        assert script[i + 1] in ("check", "bench"), line
        res = runner.invoke(app, [*script[i + 1:], "--help"])
        assert res.exit_code == 0, (line, res.output)
        assert re.search(r"--seq-len", line) or "check" in line


def test_the_profiles_ship_in_the_wheel(tmp_path):
    """A plain (non-editable) install finds the profiles: they are package data."""
    import subprocess
    import sys
    import zipfile
    from importlib import resources
    from pathlib import Path
    shipped = {p.name for p in resources.files("sinkprof").joinpath("profiles").iterdir()}
    assert {"cpu-default.toml", "te-sink.toml", "gpt-oss-120b.toml"} <= shipped
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(root)],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    wheel = next(tmp_path.glob("sinkprof-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"sinkprof/profiles/{n}" for n in shipped} <= names


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    csv = tmp_path / "x.csv"
    csv.write_text("a\n")
    res = runner.invoke(app, ["report", str(csv), "--plot", str(tmp_path / "plots")])
    assert res.exit_code == 2 and "sinkprof[plots]" in res.output


@pytest.mark.parametrize("env,message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK=0 and WORLD_SIZE=2 are set (a torchrun run) but MASTER_ADDR and "
                                       "MASTER_PORT are not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "but MASTER_PORT is not"),
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be an integer >= 1"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' must be an integer in 0..1"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 must be in 0..1 (WORLD_SIZE - 1 = 1)"),
    ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4 is set but RANK is not: torchrun sets both"),
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "abc"}, "LOCAL_WORLD_SIZE='abc' must be an integer in 1..2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0 must be in 1..2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "nowhere.invalid", "MASTER_PORT": "29555"},
     "MASTER_ADDR='nowhere.invalid' does not resolve"),
])
@pytest.mark.parametrize("command", ["check", "bench"])
def test_a_broken_torchrun_environment_is_a_usage_error_naming_the_variable(monkeypatch, env, message, command):
    """It was a traceback (no MASTER_ADDR; RANK >= WORLD_SIZE after --timeout), "invalid literal for
    int()", "--ranks 0 must be >= 1" though --ranks was never given, or a self-launched run of 2."""
    from sinkprof.tool import launcher
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a rank started"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    res = runner.invoke(app, [command, "--seq-len", "64"])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output


def test_ctrl_c_before_the_ranks_start_is_exit_130_in_one_line(monkeypatch):
    from sinkprof.tool import profiles

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(profiles, "settings_for", interrupted)
    res = runner.invoke(app, ["check"])
    assert res.exit_code == 130
    assert res.output.strip() == "sinkprof: stopped by SIGINT"


def _closed_pipe(*args):
    """``sinkprof ARGS`` with its stdout a pipe whose reader is gone (``| head -1`` once head ended)."""
    proc = subprocess.Popen([sys.executable, "-m", "sinkprof", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=120), err


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_emulate_into_a_full_disk_or_a_closed_pipe_ends_without_a_traceback(fmt):
    """``emulate > /dev/full`` was an OSError traceback."""
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "sinkprof", "emulate", "--cp", "2", "--format", fmt],
                             stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert res.returncode == 1
    assert res.stderr.strip() == "sinkprof: write error: No space left on device"
    code, err = _closed_pipe("emulate", "--cp", "2", "--format", fmt)
    assert (code, err) == (1, "")


def test_a_closed_stdout_is_one_line_before_any_rank_starts():
    """With fd 1 closed (``>&-``) rank 0 died on 'NoneType' object has no attribute 'isatty', and
    rank 1 with a traceback from its barrier."""
    for args in (["check", "--seq-len", "64"], ["emulate", "--cp", "2"], ["doctor"]):
        res = subprocess.run([sys.executable, "-m", "sinkprof", *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1))
        assert res.returncode == 1, (args, res.stderr)
        assert res.stderr.strip().startswith("sinkprof: stdout is closed (>&-): the result has nowhere to go")
        assert len(res.stderr.strip().splitlines()) == 1


def test_a_value_error_is_a_usage_error_only_where_sinkprof_raised_it(tmp_path, monkeypatch):
    """An option sinkprof checks is exit 2 naming it; a ValueError from inside pandas (a bug of
    the report, not the user's) is not dressed as a usage error: it shows as the bug it is."""
    import pandas as pd

    from sinkprof.options import SoftmaxType
    from sinkprof.tool import errors, report
    from sinkprof.tool.cases import parse_seqlens

    def caught(fn):
        try:
            fn()
        except ValueError as exc:
            return exc
        raise AssertionError("no ValueError")

    own = caught(lambda: parse_seqlens("x,2"))
    assert errors.describe(own) == (str(own), errors.EXIT_USAGE)
    assert errors.raised_by_sinkprof(caught(lambda: SoftmaxType("softer")))   # the standard library's enum
    inside = caught(lambda: pd.DataFrame({"a": [1, 2]}).set_axis([1, 2, 3]))
    assert not errors.raised_by_sinkprof(inside) and errors.describe(inside) is None
    assert errors.raised_by_sinkprof(ValueError("made, never raised"))

    def broken_load(paths):
        return pd.DataFrame({"a": [1, 2]}).set_axis([1, 2, 3])
    monkeypatch.setattr(report, "load", broken_load)
    res = runner.invoke(app, ["report", str(tmp_path / "any.csv")])
    assert res.exit_code != 2, res.output
    assert isinstance(res.exception, ValueError) and "Length mismatch" in str(res.exception)
