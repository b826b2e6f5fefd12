"""How `check` and `bench` cross their options into cases: every list needs a value, and options
that cannot change a case do not repeat it."""
import json

import pytest

from sinkprof.tool.cases import Settings, expand


def test_an_empty_kv_schedule_list_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="--kv-schedule needs at least one value"):
        Settings(kv_schedule=()).validate()


@pytest.mark.parametrize("command", ["check", "bench"])
def test_an_empty_kv_schedule_on_the_command_line_is_a_usage_error_not_a_run_of_no_cases(cli, command):
    res = cli(command, "--kv-schedule", ",", "--format", "json") if command == "check" else \
        cli(command, "--kv-schedule", "")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--kv-schedule needs at least one value" in res.stderr and "Traceback" not in res.stderr


def test_a2a_runs_no_ring_so_its_cases_are_not_repeated_per_kv_schedule():
    settings = Settings(comm=("a2a", "p2p"), softmax=("learnable",), mask=("causal",), dtype=("fp64",),
                        kv_schedule=("ring", "direct", "allgather"), ranks=4, seq_len=64)
    cases = expand(settings)
    a2a = [c for c in cases if c.comm.value == "a2a"]
    p2p = [c for c in cases if c.comm.value == "p2p"]
    assert [c.kv_schedule.value for c in a2a] == ["auto"]
    assert [c.kv_schedule.value for c in p2p] == ["ring", "direct", "allgather"]
    assert len({c.label for c in cases}) == len(cases) == 4


def test_the_kv_schedules_multiply_only_the_ring_cases_of_a_real_check(cli):
    res = cli("check", "--comm", "a2a,p2p", "--softmax", "vanilla", "--mask", "causal", "--dtype", "fp64",
              "--kv-schedule", "ring,direct", "--format", "json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert sorted((c["comm"], c["kv_schedule"]) for c in doc["cases"]) == [("a2a", None), ("p2p", "direct"),
                                                                          ("p2p", "ring")]


def test_a_seed_no_generator_takes_is_refused_from_a_profile_too(tmp_path, cli):
    profile = tmp_path / "p.toml"
    profile.write_text("seed = 99999999999999999999\n")
    res = cli("check", "--profile", str(profile))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--seed 99999999999999999999 is out of range" in res.stderr and "Traceback" not in res.stderr
