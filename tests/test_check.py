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
              "--qkv-format", "bshd,sbhd", "--dtype", "fp64,fp32", "--sink-strategy", "all", "--sink-grad", "all",
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


def test_a_case_that_runs_as_an_earlier_one_is_checked_once(cli):
    """``--kv-schedule auto,direct,ring`` where auto runs direct checked direct twice, and a run
    without a ring each schedule."""
    res = cli("check", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--kv-schedule",
              "auto,direct,ring", "--format", "json")
    doc = _json(res)
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("sinkprof check: skipped p2p/learnable/causal/bshd/fp64/step0/grad=full/kv=direct: it runs as "
            "p2p/learnable/causal/bshd/fp64/step0/grad=full does") in res.stderr
    assert sorted(c["kv_schedule"] for c in doc["cases"]) == ["direct", "ring"]
    # no ring (one rank): every schedule is the same case
    res = cli("check", "--ranks", "1", "--softmax", "vanilla", "--mask", "causal", "--dtype", "fp64", "--kv-schedule",
              "auto,direct,ring", "--seq-len", "16", "--format", "json")
    assert res.returncode == 0 and len(_json(res)["cases"]) == 1, res.stdout + res.stderr
    assert res.stderr.count("sinkprof check: skipped") == 2


def test_a_ring_of_more_steps_than_result_buffers_passes(cli):
    """10 ranks: 9 later tiles fill the forward's 8 buffers of later results, which then merge
    through the fp32 accumulator before the last pass (plan.PARTS, ring.ForwardState)."""
    res = cli("check", "--ranks", "10", "--seq-len", "40", "--softmax", "learnable", "--mask", "all", "--dtype",
              "fp64", "--sink-strategy", "all", "--format", "json")
    doc = _json(res)
    assert res.returncode == 0, res.stdout
    assert doc["cp"] == 10 and len(doc["cases"]) == 4 and all(c["passed"] for c in doc["cases"])


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
    """With the partial contract the missing all-reduce is the contract itself: its case passes
    under the fault, the full contract's fails; a run of partial cases alone is refused (exit 2),
    as a fault that applies to no case is."""
    res = cli("check", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--sink-grad", "full,partial",
              "--inject", "no-sink-reduce", "--format", "json")
    assert res.returncode == 1, res.stdout + res.stderr
    assert [(c["sink_grad"], c["passed"]) for c in json.loads(res.stdout)["cases"]] == [("full", False),
                                                                                       ("partial", True)]
    res = cli("check", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--sink-grad", "partial",
              "--inject", "no-sink-reduce")
    assert res.returncode == 2 and "--inject no-sink-reduce: the fault applies to none" in res.stderr


@pytest.mark.parametrize("fault", ["stall", "crash"])
def test_a_stuck_or_dead_rank_fails_the_run_within_its_timeout(cli, fault):
    start = time.monotonic()
    res = cli("check", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--inject", fault,
              "--timeout", "5", "--run-timeout", "60", timeout=120)
    elapsed = time.monotonic() - start
    assert res.returncode == 1
    assert elapsed < 60
    assert "fwd step 0 kv exchange" in res.stderr and "learnable/causal" in res.stderr


def test_a_run_that_stops_at_a_failed_exchange_reports_the_cases_it_finished(cli):
    """a2a runs no ring, so its case finishes; the p2p case after it stalls in its first exchange."""
    res = cli("check", "--comm", "a2a,p2p", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64",
              "--inject", "stall", "--timeout", "15", "--run-timeout", "60", "--format", "json")
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["passed"] is False
    assert [(c["comm"], c["passed"]) for c in doc["cases"]] == [("a2a", True)]
    stopped = doc["stopped"]
    assert (stopped["number"], stopped["of"]) == (2, 2) and stopped["case"].startswith("p2p/learnable")
    assert "fwd step 0 kv exchange" in stopped["reason"] and "timeout 15s" in stopped["reason"]


def test_a_run_that_outlives_its_run_timeout_reports_the_cases_it_finished_to_its_output(cli, tmp_path):
    """The watchdog ends the run; rank 0 writes its report of the finished case first (or the rank
    whose exchange broke when a peer's watchdog ended that peer does)."""
    out = tmp_path / "check.txt"
    res = cli("check", "--comm", "a2a,p2p", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64",
              "--inject", "stall", "--timeout", "60", "--run-timeout", "15", "--output", str(out))
    assert res.returncode == 1
    text = out.read_text()
    assert "1 passed, 0 failed" in text and "stopped at case 2 of 2 (p2p/learnable" in text
    # the run's timeout, whichever rank's watchdog fired first (a peer's broken exchange is not the reason)
    assert "(--run-timeout)" in text and "run timed out after 15s" in text, text
    assert "FAILED (stopped at case 2 of 2" in res.stdout
    assert "Traceback" not in res.stderr, res.stderr


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


# Every mask and window the byte tests cover (chunk c = 4 rows: s = 8 * cp), both K/V schedules,
# both sink strategies: one launch per cp. b = 1: the direct forward joins its runs of steps (rows outermost).
SCHEDULE_PROFILE = """
softmax = ["learnable"]
dtype = ["fp64"]
sink_strategy = ["step0", "post-merge"]
kv_schedule = ["ring", "direct", "allgather"]
batch = 1
heads = 2
kv_heads = 1
head_dim = 8
[[cases]]
mask = ["causal"]
[[cases]]
mask = ["no_mask"]
[[cases]]
mask = ["causal"]
window = [2, 0]
[[cases]]
mask = ["causal"]
window = [4, 0]
[[cases]]
mask = ["causal"]
window = [9, 0]
[[cases]]
mask = ["no_mask"]
window = [3, 2]
"""


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_every_kv_schedule_passes_and_moves_exactly_the_planned_bytes(cli, tmp_path, cp):
    import torch
    from sinkprof import comm_bytes

    profile = tmp_path / "schedules.toml"
    profile.write_text(SCHEDULE_PROFILE)
    res = cli("check", "--profile", str(profile), "--ranks", str(cp), "--seq-len", str(8 * cp), "--format", "json",
              "--timeout", "60", "--run-timeout", "400", timeout=450)
    doc = _json(res)
    assert res.returncode == 0, res.stdout
    assert len(doc["cases"]) == 6 * 2 * 3
    for case in doc["cases"]:
        assert case["passed"] and case["errors"]["comm"]["passed"], case
        kv = case["kv_schedule"]
        sh = case["shape"]
        planned = comm_bytes(s=sh["s"], b=sh["b"], h=sh["h"], g=sh["g"], d=sh["d"], dtype=torch.float64, cp=cp,
                             mask=case["mask"], window=case["window"], kv_schedule=case["kv_schedule"])
        for phase, kinds in (("fwd", ("kv",)), ("bwd", ("kv", "dkv"))):
            for kind in kinds:
                sent = [t for t in planned if (t.phase, t.kind) == (phase, kind)]
                assert case["traffic"][phase][kind] == {"messages": sum(t.messages_sent for t in sent),
                                                        "bytes": sum(t.sent for t in sent)}, (phase, kind, kv)
        assert case["traffic"]["total"]["bytes"] == sum(t.sent for t in planned)
    schedules = {c["kv_schedule"] for c in doc["cases"]}
    assert schedules == {"ring", "direct", "allgather"}


def test_drop_halo_makes_check_fail_and_is_refused_where_it_cannot_apply(cli):
    res = cli("check", "--softmax", "learnable", "--mask", "causal", "--window", "3,0", "--dtype", "fp64",
              "--kv-schedule", "direct", "--inject", "drop-halo", "--format", "json")
    assert res.returncode == 1, res.stdout + res.stderr
    doc = _json(res)
    assert doc["passed"] is False and doc["fault"] == "drop-halo"
    (case,) = doc["cases"]
    assert not case["errors"]["comm"]["passed"] and not case["errors"]["out"]["passed"]
    for args in (["--kv-schedule", "ring"], ["--comm", "a2a", "--kv-schedule", "direct"]):
        res = cli("check", "--softmax", "learnable", "--mask", "causal", "--window", "3,0", "--dtype", "fp64",
                  "--inject", "drop-halo", *args)
        assert res.returncode == 2 and "drop-halo" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_a2a_p2p_runs_every_kv_schedule_over_its_ring_of_groups(cli):
    import torch
    from sinkprof import comm_bytes

    res = cli("check", "--ranks", "4", "--comm", "a2a+p2p", "--a2a-size", "2", "--seq-len", "32", "--softmax", "learnable",
              "--mask", "causal", "--window", "3,0", "--dtype", "fp64,bf16", "--kv-schedule", "all",
              "--format", "json")
    doc = _json(res)
    assert res.returncode == 0, res.stdout
    assert {(c["kv_schedule"], c["dtype"]) for c in doc["cases"]} == {(k, d) for k in ("ring", "direct", "allgather")
                                                                       for d in ("fp64", "bf16")}
    for case in doc["cases"]:
        planned = comm_bytes(s=32, b=2, h=4, g=2, d=16, dtype={"fp64": torch.float64, "bf16": torch.bfloat16}[case["dtype"]],
                             cp=4, mask="causal", window=(3, 0), comm="a2a+p2p", a2a_size=2,
                             kv_schedule=case["kv_schedule"])
        assert case["traffic"]["total"]["bytes"] == sum(t.sent for t in planned)
        assert case["traffic"]["fwd"]["a2a"]["messages"] == 4 * 3


def test_the_json_has_each_cases_seed_and_a2a_size_and_the_table_tells_seeds_apart(cli, tmp_path):
    """Before: the JSON's one seed was the first settings group's, and an a2a+p2p case's a2a size was
    missing (the table showed it); two groups differing in seed alone gave two identical rows."""
    profile = tmp_path / "two.toml"
    profile.write_text('description = "two groups"\nranks = 2\nseq_len = 64\nheads = 2\nkv_heads = 2\nhead_dim = 8\n'
                       'dtype = "fp64"\nsoftmax = "learnable"\nmask = "causal"\n'
                       '[[cases]]\nseed = 1\ncomm = "a2a+p2p"\na2a_size = 1\n'
                       '[[cases]]\nseed = 7\ncomm = "a2a+p2p"\na2a_size = 2\n'
                       '[[cases]]\nseed = 7\ncomm = "p2p"\n')
    res = cli("check", "--profile", str(profile), "--format", "json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["seed"] is None
    assert [(c["comm"], c["a2a_size"], c["seed"]) for c in doc["cases"]] == [("a2a+p2p", 1, 1), ("a2a+p2p", 2, 7),
                                                                              ("p2p", None, 7)]
    res = cli("check", "--profile", str(profile))
    rows = [line for line in res.stdout.splitlines() if "a2a+p2p(" in line or " p2p " in line]
    assert len(rows) == 3 and "seed=1" in rows[0] and "seed=7" in rows[1] and "seed=7" in rows[2], res.stdout
    res = cli("check", "--profile", str(profile), "--seed", "3", "--format", "json")
    assert json.loads(res.stdout)["seed"] == 3
