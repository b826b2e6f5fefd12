"""`sinkprof check` end to end: real ranks over gloo on the CPU."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _json(res):
    assert "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout)


def test_embedded_default_passes_and_covers_p2p_softmax_types_and_masks(cli, tmp_path):
    out = tmp_path / "check.json"
    res = cli("check", "--format", "json", "--output", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(out.read_text())
    assert doc["passed"] is True and doc["cp"] == 2
    seen = {(c["comm"], c["softmax"], c["mask"]) for c in doc["cases"]}
    assert seen == {("p2p", s, m) for s in ("vanilla", "off-by-one", "learnable") for m in ("causal", "no_mask")}
    for case in doc["cases"]:
        assert case["passed"] and set(case["errors"]) >= {"out", "dq", "dk", "dv"}
        assert case["tolerance"]["atol"] in (1e-10, 2.5e-2 * 2)
    learnable = [c for c in doc["cases"] if c["softmax"] == "learnable"]
    assert all("d_sink" in c["errors"] for c in learnable)


def test_cp3_windows_bias_gqa_sbhd_both_strategies_both_contracts_fp64_fp32(cli):
    res = cli("check", "--ranks", "3", "--seq-len", "48", "--softmax", "learnable,off-by-one", "--mask", "all",
              "--qkv-format", "all", "--dtype", "fp64,fp32", "--sink-strategy", "all", "--sink-grad", "all",
              "--window", "5,0", "--bias", "--format", "json")
    doc = _json(res)
    assert res.returncode == 0, res.stdout
    assert doc["cp"] == 3 and len(doc["cases"]) == 2 * 2 * 2 * 2 * 2 * 2
    partial = [c for c in doc["cases"] if c["sink_grad"] == "partial" and c["softmax"] == "learnable"]
    assert partial and all({"d_sink", "d_sink_sum", "d_bias", "d_bias_sum"} <= set(c["errors"]) for c in partial)


def test_cp4_all_softmax_types_both_strategies_and_contracts(cli):
    res = cli("check", "--ranks", "4", "--seq-len", "64", "--softmax", "all", "--mask", "all", "--dtype", "fp64",
              "--sink-strategy", "all", "--sink-grad", "all", "--format", "json")
    doc = _json(res)
    assert res.returncode == 0, res.stdout
    assert doc["cp"] == 4 and all(c["passed"] for c in doc["cases"])


@pytest.mark.parametrize("fault,broken", [
    ("sink-every-tile", "d_sink"), ("no-sink-reduce", "d_sink"), ("aliased-reference", "reference"),
    ("vanilla-fallback", "out")])
def test_every_injected_fault_makes_check_fail(cli, fault, broken):
    res = cli("check", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--inject", fault,
              "--format", "json")
    assert res.returncode == 1, res.stdout + res.stderr
    doc = _json(res)
    assert doc["passed"] is False and doc["fault"] == fault
    assert not doc["cases"][0]["errors"][broken]["passed"]


def test_partial_contract_without_reduction_is_what_no_sink_reduce_looks_like(cli):
    # With the partial contract the missing all-reduce is the contract itself, so the check passes.
    res = cli("check", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--sink-grad", "partial",
              "--inject", "no-sink-reduce", "--format", "json")
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("fault", ["stall", "crash"])
def test_a_stuck_or_dead_rank_fails_the_run_within_its_timeout(cli, fault):
    start = time.monotonic()
    res = cli("check", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--inject", fault,
              "--timeout", "5", "--run-timeout", "60", timeout=120)
    elapsed = time.monotonic() - start
    assert res.returncode == 1
    assert elapsed < 60
    assert "fwd step 0 kv exchange" in res.stderr and "learnable/causal" in res.stderr


def test_under_torchrun(tmp_path):
    script = shutil.which("sinkprof") or str(Path(sys.executable).parent / "sinkprof")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--standalone", "--no-python", script, "check", "--softmax", "learnable",
                          "--dtype", "fp64", "--format", "json"],
                         capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["passed"] and doc["cp"] == 2 and len(doc["cases"]) == 2
