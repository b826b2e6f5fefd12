"""The command line through Typer's runner and through a real subprocess."""
import json

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
    res = runner.invoke(app, ["emulate", "--cp", "2,3", "--s", "48", "--mask", "causal", "--format", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["passed"] is True
    keys = {"cp", "mask", "strategy", "out_max_abs_err", "dq_max_abs_err", "dk_max_abs_err", "dv_max_abs_err",
            "dsink_max_abs_err", "dsink_ratio_min", "dsink_ratio_max"}
    assert len(doc["results"]) == 2 * 3 * 2   # cp x strategy x K/V schedule (ring and direct by default)
    assert {r["kv_schedule"] for r in doc["results"]} == {"ring", "direct"}
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
    (["emulate", "--h", "4", "--g", "3"], "multiple of g"),
    (["check", "--softmax", "bogus"], "softmax"),
    (["check", "--dtype", "fp8"], "dtype"),
    (["check", "--s", "66"], "divisible by 2 * cp = 4"),
    (["check", "--inject", "nope"], "--inject"),
    (["check", "--profile", "no-such-profile"], "unknown"),
    (["check", "--mask", "causal", "--window", "3,2"], "contradicts"),
])
def test_bad_options_exit_2_with_a_message_naming_them(args, message):
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert message in res.output


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
    cells = doc["capabilities"]
    cudnn = [c for c in cells if c["backend"] == "cudnn"]
    assert cudnn and not any(c["ok"] for c in cudnn)
    assert all("CUDA device" in c["reason"] for c in cudnn)
    torch_cells = [c for c in cells if c["backend"] == "torch" and c["dtype"] in ("fp64", "fp32")]
    assert torch_cells and all(c["ok"] for c in torch_cells)
