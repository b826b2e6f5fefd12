"""``sinkprof emulate``'s usage errors: exit 2, a message in the options' words, no traceback,
before the replay allocates anything."""
import pytest
from typer.testing import CliRunner

from sinkprof.cli import app
from sinkprof.options import KVSchedule, QKVFormat
from sinkprof.testing import Shape
from sinkprof.tool import preflight
from sinkprof.tool.emulate import replay_spec

runner = CliRunner()


def _refused(args: list) -> str:
    """The one-line message of an emulate run that must end as a usage error."""
    res = runner.invoke(app, ["emulate", *args])
    assert res.exit_code == 2, (res.output, res.exception)
    assert "Traceback" not in res.output
    return " ".join(res.output.split())


@pytest.mark.parametrize("args,message", [
    # the CPU allocator's RuntimeError (exit 1, a traceback) before
    (["--cp", "2", "--head-dim", "1000000000000"], "lower --seq-len, --batch, --heads, --kv-heads or --head-dim"),
    (["--cp", "2", "--batch", "100000", "--seq-len", "100000"], "lower --seq-len, --batch"),
    (["--cp", "2", "--qkv-format", "thd", "--seqlens", "400000,400000", "--heads", "64", "--head-dim", "128"],
     "shorten the pack or its longest document (--seqlens"),
])
def test_a_replay_that_cannot_fit_is_refused_with_the_options_to_lower(args, message):
    text = _refused(args)
    assert "this run needs up to about" in text and "of host memory" in text
    assert message in text


@pytest.mark.parametrize("args,message", [
    (["--cp", "2", "--heads", "3", "--kv-heads", "2"], "--heads 3 must be a multiple of --kv-heads 2 (GQA)"),
    (["--cp", "2", "--window", "-5,0"], "--window -5,0: window left=-5 must be >= 0, or -1 for unbounded"),
    (["--cp", "2", "--mask", "no_mask", "--window", "3,-2"], "--window 3,-2: window right=-2 must be >= 0"),
    (["--cp", "2", "--mask", "causal", "--window", "3,5"],
     "--window 3,5: right 5 contradicts --mask causal (it implies right = 0); use --window 3,0 or --mask no_mask"),
    (["--cp", "2", "--window", "3,5"], "contradicts --mask causal"),   # --mask all holds causal
    (["--cp", "4", "--comm", "a2a+p2p", "--a2a-size", "2", "--heads", "3", "--kv-heads", "3"],
     "--comm a2a+p2p --a2a-size 2 splits the heads over each a2a group: --heads 3 and --kv-heads 3 must both be "
     "divisible by 2; use --comm p2p"),
    (["--cp", "4,8", "--comm", "a2a+p2p", "--a2a-size", "4", "--heads", "4", "--kv-heads", "2"],
     "--kv-heads 2 must both be divisible by 4; use --a2a-size 2, which divides both and every --cp"),
])
def test_usage_errors_name_the_option_and_the_fix(args, message):
    text = _refused(args)
    assert message in text
    assert "window=(" not in text and "mask='" not in text and "h=" not in text   # the library's argument names


def test_usage_errors_in_a_real_process_print_no_traceback(cli):
    for args in (["--cp", "2", "--head-dim", "1000000000000"], ["--cp", "2", "--mask", "causal", "--window", "3,5"],
                 ["--cp", "2", "--heads", "3", "--kv-heads", "2"]):
        res = cli("emulate", *args)
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr and "--" in res.stderr


def test_the_replay_estimate_refuses_what_does_not_fit_and_grows_with_the_shape():
    spec = replay_spec(QKVFormat.BSHD, "causal", None, ())
    small, big = Shape(2, 64, 4, 2, 16), Shape(2, 128, 4, 2, 16)
    kinds = [KVSchedule.RING, KVSchedule.DIRECT]
    need = [preflight.replay_need(s, spec, 2, 1, kinds, preflight._replay_result(s, spec)) for s in (small, big)]
    assert 2 * need[0] <= need[1]
    preflight.check_replay_memory(small, [spec], [2, 4], 1, kinds, host_free=need[0])
    with pytest.raises(ValueError, match=r"this run needs up to about .* --qkv-format bshd at --cp 2, s=64"):
        preflight.check_replay_memory(small, [spec], [2, 4], 1, kinds, host_free=need[0] - 1)


def test_auto_and_the_schedule_it_runs_give_one_row_and_the_json_writes_numbers_as_check_does():
    """``--kv-schedule auto,ring,direct`` wrote two identical direct rows; the JSON's window was the
    option's text (" 4, 0") and a row's docs a string ("32,8,8") where check writes lists."""
    import csv
    import io
    import json
    base = ["emulate", "--cp", "2", "--mask", "causal", "--heads", "2", "--kv-heads", "1", "--strategy", "step0"]
    res = runner.invoke(app, base + ["--kv-schedule", "auto,ring,direct", "--window", " 4, 0", "--format", "csv"])
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert sorted(r["kv_schedule"] for r in rows) == ["direct", "ring"]
    assert {r["window"] for r in rows} == {"4,0"}
    assert "--kv-schedule direct runs as auto does at cp 2 (bshd, causal, step0): one row for both" in res.stderr
    # a ring of one rank (a2a+p2p over one group) runs no schedule: one row, its schedule empty
    res = runner.invoke(app, ["emulate", "--cp", "2", "--comm", "a2a+p2p", "--a2a-size", "2", "--kv-schedule",
                              "auto,direct,ring", "--mask", "causal", "--strategy", "step0", "--heads", "2",
                              "--kv-heads", "2", "--format", "csv"])
    assert res.exit_code == 0, res.output
    assert [r["kv_schedule"] for r in csv.DictReader(io.StringIO(res.stdout))] == [""]
    res = runner.invoke(app, base + ["--window", " 4, 0", "--format", "json"])
    doc = json.loads(res.stdout)
    assert doc["window"] == [4, 0] and doc["results"][0]["window"] == [4, 0]
    res = runner.invoke(app, ["emulate", "--cp", "2,4", "--qkv-format", "thd", "--docs", "3", "--seq-len", "48",
                              "--heads", "2", "--kv-heads", "1", "--strategy", "step0", "--format", "json"])
    doc = json.loads(res.stdout)
    assert all(r["docs"] == doc["docs"] and r["window"] is None for r in doc["results"]) and sum(doc["docs"]) == 48


@pytest.mark.parametrize("window", ["1_0,0", "\uff14,0", "2.5,0"])
def test_a_window_is_ascii_digits_as_every_other_number_option(window):
    """int() took "1_0" as 10 and a full-width digit as 4."""
    res = runner.invoke(app, ["emulate", "--cp", "2", "--window", window])
    assert res.exit_code == 2 and "must be a pair LEFT,RIGHT of ints" in res.output, res.output


def test_the_balanced_pack_layout_narrows_the_thd_replays_alone():
    """``--pack-layout balanced`` concerns thd packs: with bshd beside thd, ``--kv-schedule all``
    (the default) replayed bshd under allgather alone, two rows where zigzag gives eight (ring,
    direct, allgather, every-tile's bug rows), and said nothing."""
    import csv
    import io
    args = ["emulate", "--cp", "2", "--seqlens", "16,48", "--mask", "causal", "--head-dim", "8", "--format", "csv"]
    rows = {}
    for layout in ("zigzag", "balanced"):
        res = runner.invoke(app, args + ["--qkv-format", "bshd,thd", "--pack-layout", layout])
        assert res.exit_code == 0, res.output
        rows[layout] = [(r["qkv_format"], r["kv_schedule"], r["strategy"]) for r in csv.DictReader(io.StringIO(res.stdout))]
    bshd = [r for r in rows["zigzag"] if r[0] == "bshd"]
    assert len(bshd) == 8 and [r for r in rows["balanced"] if r[0] == "bshd"] == bshd
    assert {r[1] for r in rows["balanced"] if r[0] == "thd"} == {"allgather"}
    assert sorted(r[2] for r in rows["balanced"] if r[0] == "thd") == ["post-merge", "step0"]
    res = runner.invoke(app, args + ["--qkv-format", "thd", "--pack-layout", "balanced"])
    assert res.exit_code == 0, res.output
    assert [r[2] for r in rows["balanced"] if r[0] == "thd"] == [
        r["strategy"] for r in csv.DictReader(io.StringIO(res.stdout))]
    assert "--pack-layout balanced (--kv-schedule ring)" in _refused(args[1:] + ["--qkv-format", "bshd,thd", "--pack-layout",
                                                                             "balanced", "--kv-schedule", "ring"])


def test_the_json_says_no_schedule_as_check_does():
    """A ring of one rank runs no K/V schedule: check's JSON says null, emulate's said ""."""
    import json
    res = runner.invoke(app, ["emulate", "--cp", "2", "--comm", "a2a+p2p", "--a2a-size", "2", "--mask", "causal",
                              "--strategy", "step0", "--heads", "2", "--kv-heads", "2", "--format", "json"])
    assert res.exit_code == 0, res.output
    assert [r["kv_schedule"] for r in json.loads(res.stdout)["results"]] == [None]
