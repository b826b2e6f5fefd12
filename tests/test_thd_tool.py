"""Packed sequences (thd) in the tool: `check`, `emulate` and `bench` with `--qkv-format thd`,
`--seqlens` and `--docs`, the same keys in profiles, the doc-leak fault, and every usage error
found before a rank starts."""
import itertools
import json

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from sinkprof import comm_bytes
from sinkprof.cli import app
from sinkprof.faults import Fault
from sinkprof.options import MaskType, make_spec
from sinkprof.tool import launcher, preflight
from sinkprof.tool.bench import COLUMNS, BenchOptions, simulate, useful_flops
from sinkprof.tool.cases import CaseOptions, Settings, expand, random_documents
from sinkprof.tool.profiles import settings_for
from sinkprof.tool.report import iteration_table, load

from conftest import fault_error

runner = CliRunner()


@pytest.fixture
def no_launch(monkeypatch):
    started = []
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: started.append(k) or 0)
    return started


def _refused(args, message, started):
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output   # the usage box wraps long lines
    assert "Traceback" not in res.output
    assert not started
    return res.output


# ---- the pack of a run: explicit, random, default; resolved once, before any rank starts ----

def test_random_documents_are_seeded_multiples_that_fill_the_pack():
    for seed in range(20):
        docs = random_documents(96, 4, 8, seed)
        assert len(docs) == 4 and sum(docs) == 96 and all(n >= 8 and n % 8 == 0 for n in docs)
        assert docs == random_documents(96, 4, 8, seed)
    assert len({random_documents(96, 4, 8, seed) for seed in range(20)}) > 5   # the seed matters
    assert random_documents(64, 1, 4, 0) == (64,)
    assert random_documents(64, 16, 4, 3) == (4,) * 16
    huge = random_documents(10 ** 12, 3, 4, 0)   # drawn in memory of the count: it was a randperm of the units
    assert len(huge) == 3 and sum(huge) == 10 ** 12 and all(n > 0 and n % 4 == 0 for n in huge)


def test_seqlens_set_the_pack_and_docs_draw_it_from_the_seed(no_launch):
    (s,) = settings_for(CaseOptions(qkv_format="thd", seqlens="8,40,16"))
    assert s.seqlens == (8, 40, 16) and s.seq_len == 64
    cases = expand(s)
    assert {c.docs for c in cases} == {(8, 40, 16)} and {c.cu_seqlens == [0, 8, 48, 64] for c in cases} == {True}
    assert all(c.shape.b == 1 and c.shape.s == 64 for c in cases)
    assert "docs=8,40,16" in cases[0].label
    (r,) = settings_for(CaseOptions(qkv_format="thd", docs=5, ranks=4, seq_len=96, seed=7))
    assert len(r.seqlens) == 5 and sum(r.seqlens) == 96 and all(n % 8 == 0 for n in r.seqlens)
    assert r.seqlens == settings_for(CaseOptions(qkv_format="thd", docs=5, ranks=4, seq_len=96, seed=7))[0].seqlens
    # neither: a few random documents; the other formats keep their batch and their bias
    (d,) = settings_for(CaseOptions(qkv_format="all", batch=3, bias=True))
    assert len(d.seqlens) == 3 and sum(d.seqlens) == 64
    shapes = {c.qkv_format.value: (c.shape.b, c.bias, c.docs) for c in expand(d)}
    assert shapes == {"bshd": (3, True, ()), "sbhd": (3, True, ()), "thd": (1, False, d.seqlens)}


def test_simulate_draws_documents_that_split_at_every_simulated_cp(no_launch):
    (s,) = settings_for(CaseOptions(qkv_format="thd", docs=3, seq_len=96), ranks=1, cps=(2, 3, 4))
    assert sum(s.seqlens) == 96 and all(n % 24 == 0 for n in s.seqlens)   # lcm(4, 6, 8)


def test_profile_keys_seqlens_and_docs(no_launch, tmp_path):
    path = tmp_path / "packs.toml"
    path.write_text('qkv_format = ["thd"]\nranks = 2\nseq_len = 32\n[[cases]]\nseqlens = [8, 24]\n'
                    '[[cases]]\ndocs = 4\nseq_len = 64\n')
    one, two = settings_for(CaseOptions(profile=str(path)))
    assert one.seqlens == (8, 24) and one.seq_len == 32
    assert len(two.seqlens) == 4 and two.seq_len == 64
    # the command line's --docs replaces a profile's lengths, and its --seqlens a profile's --seq-len and --docs
    one, two = settings_for(CaseOptions(profile=str(path), docs=2))
    assert len(one.seqlens) == 2 and one.seq_len == 32 and len(two.seqlens) == 2 and two.seq_len == 64
    one, two = settings_for(CaseOptions(profile=str(path), seqlens="4,12"))
    assert one.seqlens == two.seqlens == (4, 12) and one.seq_len == two.seq_len == 16


@pytest.mark.parametrize("text,message", [
    ("seqlens = [8, 0]\n", "seqlens = [8, 0] must be a list of document lengths"),
    ('seqlens = "8,24"\n', "must be a list of document lengths"),
    ("seqlens = [8.0, 24]\n", "must be a list of document lengths"),
    ('docs = "3"\n', "docs = '3' must be an integer"),
    ('qkv_format = "thd"\nseqlens = [8, 24]\ndocs = 2\n', "--seqlens and --docs both given in profile"),
    ('qkv_format = "thd"\nseqlens = [8, 24]\nseq_len = 64\n', "--seqlens 8,24 sums to 32 tokens but --seq-len is 64"),
    ('qkv_format = "thd"\nseqlens = [6, 26]\n', "sinkprof.pad_pack"),
    ("seqlens = [8, 24]\n", "add thd"),
])
def test_profile_pack_values_name_the_file_and_key(no_launch, tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    out = _refused(["check", "--profile", str(path)], message, no_launch)
    assert "bad.toml" in " ".join(out.split())


@pytest.mark.parametrize("args,message", [
    (["check", "--qkv-format", "thd", "--seqlens", "96,abc"], "--seqlens 96,abc: 'abc' is not a document length"),
    (["check", "--qkv-format", "thd", "--seqlens", "0,64"], "--seqlens 0,64: document 0 has 0 tokens"),
    (["check", "--qkv-format", "thd", "--seqlens", ","], "--seqlens needs the documents' lengths"),
    (["check", "--qkv-format", "thd", "--seqlens", "32,32", "--seq-len", "128"],
     "--seqlens 32,32 sums to 64 tokens but --seq-len is 128"),
    (["check", "--qkv-format", "thd", "--seqlens", "30,34"], "pad every document to a multiple of 4 with "
                                                             "sinkprof.pad_pack(x, cu_seqlens, 4)"),
    (["check", "--qkv-format", "thd", "--ranks", "3", "--seqlens", "12,8,28"], "document 1 has 8 tokens"),
    (["check", "--qkv-format", "thd", "--docs", "0"], "--docs 0 must be >= 1"),
    (["check", "--qkv-format", "thd", "--docs", "17"], "--docs 17: 17 documents of at least 4 tokens"),
    (["check", "--qkv-format", "thd", "--seqlens", "32,32", "--docs", "2"], "--seqlens and --docs both given"),
    (["check", "--seqlens", "32,32"], "--seqlens describes the documents of a thd pack"),
    (["check", "--qkv-format", "bshd,sbhd", "--docs", "2"], "add thd (e.g. --qkv-format thd) or drop --docs"),
    (["check", "--qkv-format", "thd", "--batch", "4"], "--batch 4: a thd pack is one sequence of documents"),
    (["check", "--qkv-format", "thd", "--bias"], "--bias: a thd pack takes no bias"),
    (["check", "--qkv-format", "thd", "--seqlens", "32,32", "--window", "0,0", "--inject", "doc-leak"],
     "--inject doc-leak: the fault applies to none"),
    (["check", "--inject", "doc-leak"], "it needs a thd pack of which some rank holds two documents or more"),
    (["check", "--qkv-format", "thd", "--seqlens", "64", "--inject", "doc-leak"], "--inject doc-leak"),
    (["bench", "--qkv-format", "thd", "--seqlens", "4,28,32", "--simulate", "2,4"],
     "--simulate 4: document 0 has 4 tokens"),
    (["bench", "--qkv-format", "thd", "--docs", "3", "--simulate", "2,3"], "--seq-len 64: a thd pack of random "
                                                                           "documents needs a multiple of 2 * cp"),
])
def test_thd_usage_errors_name_the_option_and_start_no_rank(no_launch, args, message):
    _refused(args, message, no_launch)


def test_batch_one_and_mixed_formats_are_accepted(no_launch):
    for args in (["--qkv-format", "thd", "--batch", "1"], ["--qkv-format", "thd,bshd", "--batch", "4"],
                 ["--qkv-format", "all", "--bias"], ["--qkv-format", "thd", "--seqlens", "16,48", "--inject",
                                                     "doc-leak"]):
        res = runner.invoke(app, ["check", *args])
        assert res.exit_code == 0, (args, res.output)
    assert len(no_launch) == 4


def test_doc_leak_applies_exactly_where_the_leaked_keys_are_visible():
    """The preflight's answer agrees with the emulator run under the fault, case by case."""
    seen = set()
    for mask, window, docs, cp, comm, kv in itertools.product(
            ["causal", "no_mask"], [None, (0, 0), (2, 0), (0, 3)], [(8, 40, 16), (64,), (8, 8, 16, 32)],
            [2, 4], ["p2p", "a2a", "a2a+p2p"], ["auto", "allgather"]):
        if mask == "causal" and window is not None and window[1] != 0:
            continue
        s = Settings(softmax=("learnable",), mask=(mask,), window=window, qkv_format=("thd",), seqlens=docs,
                     comm=(comm,), ranks=cp, heads=4, kv_heads=4, head_dim=8, dtype=("fp64",), kv_schedule=(kv,))
        case, err = fault_error(Fault.DOC_LEAK, s, cp, comm)
        applies = preflight.applies(Fault.DOC_LEAK, case, cp)
        assert applies == (err > 1e-6), (mask, window, docs, cp, comm, kv, err)
        seen.add((applies, kv))
    assert seen == {(True, "auto"), (False, "auto"), (True, "allgather"), (False, "allgather")}


# ---- emulate: the replay of a pack, in this process ----

def test_emulate_thd_passes_and_detects_the_every_tile_bug(tmp_path):
    out = tmp_path / "emulate.json"
    res = runner.invoke(app, ["emulate", "--qkv-format", "thd", "--seqlens", "16,40,8", "--cp", "2,4",
                              "--strategy", "all", "--kv-schedule", "all", "--format", "json", "--output", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["docs"] == [16, 40, 8] and doc["shape"]["b"] == 1 and doc["shape"]["s"] == 64
    rows = doc["results"]
    # cp x mask x (strategy x kv schedule, less every-tile under allgather: one tile per row there)
    assert len(rows) == 2 * 2 * (3 * 3 - 1)
    assert {r["kv_schedule"] for r in rows} == {"ring", "direct", "allgather"}
    assert {(r["qkv_format"], tuple(r["docs"])) for r in rows} == {("thd", (16, 40, 8))}
    for r in rows:
        if r["strategy"] == "every-tile":
            assert not r["passed"] and r["ok"] and r["dsink_max_abs_err"] > 1e-3
        else:
            assert r["passed"] and max(r[k] for k in r if k.endswith("max_abs_err")) <= 1e-12


def test_emulate_thd_on_a2a_p2p_and_beside_bshd_with_random_documents():
    res = runner.invoke(app, ["emulate", "--qkv-format", "all", "--docs", "3", "--cp", "2,4", "--comm", "a2a+p2p",
                              "--mask", "causal", "--strategy", "step0", "--window", "9,0", "--format", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    docs = doc["docs"]
    assert len(docs) == 3 and sum(docs) == 64 and all(n % 8 == 0 for n in docs)   # 2 * cp for cp 2 and 4
    assert {r["qkv_format"] for r in doc["results"]} == {"bshd", "sbhd", "thd"}
    assert all(r["passed"] for r in doc["results"])
    assert all(r["docs"] == docs for r in doc["results"] if r["qkv_format"] == "thd")
    assert {(r["docs"], r["pack_layout"]) for r in doc["results"] if r["qkv_format"] != "thd"} == {(None, None)}


@pytest.mark.parametrize("args,message", [
    (["--seqlens", "32,32"], "--seqlens describes the documents of a thd pack"),
    (["--qkv-format", "thd", "--seqlens", "8,56", "--cp", "2,8"], "--seqlens 8,56 at --cp 8: document 0 has 8 tokens"),
    (["--qkv-format", "thd", "--docs", "9", "--cp", "2,4"], "--docs 9: 9 documents of at least 8 tokens"),
    (["--qkv-format", "thd", "--batch", "2"], "--batch 2: a thd pack is one sequence"),
    (["--qkv-format", "thd", "--seqlens", "32,32", "--seq-len", "32"], "sums to 64 tokens but --seq-len is 32"),
    (["--qkv-format", "xyz"], "--qkv-format: 'xyz' is not one of bshd, sbhd, thd"),
])
def test_emulate_thd_usage_errors(args, message):
    res = runner.invoke(app, ["emulate", *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output


# ---- bench --simulate and report: the docs column ----

def test_simulate_writes_the_documents_and_their_flops_and_report_keeps_two_packs_apart(tmp_path):
    out = tmp_path / "sim.csv"
    groups = [Settings(softmax=("learnable",), mask=("causal",), dtype=("fp32",), qkv_format=("thd",), seqlens=p)
              for p in ((16, 48), (32, 32))]
    groups.append(Settings(softmax=("learnable",), mask=("causal",), dtype=("fp32",)))
    assert simulate(groups, BenchOptions(warmup=0, iters=1, phase="fwdbwd", csv=str(out), simulate=(2,)),
                    torch.device("cpu")) == 0
    df = pd.read_csv(out, dtype={"docs": str}).fillna({"docs": ""})
    assert list(df.columns) == COLUMNS
    assert set(df["docs"]) == {"16,48", "32,32", ""}
    assert set(df[df["docs"] != ""]["b"]) == {1} and set(df[df["docs"] == ""]["b"]) == {2}
    # useful FLOPs count each document's causal pairs only: 4 b h d sum(n (n + 1) / 2) x 3.5
    for pack in ((16, 48), (32, 32)):
        flops = set(df[df["docs"] == ",".join(map(str, pack))]["flops"])
        assert flops == {int(4 * 4 * 16 * sum(n * (n + 1) // 2 for n in pack) * 3.5)}
    its = iteration_table(load([out]))
    assert sorted(its["docs"]) == ["", "16,48", "32,32"]      # three cases, not one


def test_report_reads_csvs_without_a_docs_column(tmp_path):
    old = tmp_path / "old.csv"
    pd.DataFrame({"run_id": ["r"] * 2, "rank": [0, 1], "iteration": [0, 0], "phase": ["fwd"] * 2, "step": [-1, -1],
                  "kind": ["iteration"] * 2, "dur_ms": [1.0, 2.0]}).to_csv(old, index=False)
    df = load([old])
    assert set(df["docs"]) == {""}
    assert len(iteration_table(df)) == 1


def test_useful_flops_of_a_pack_are_the_sum_of_its_documents():
    (case,) = expand(Settings(softmax=("vanilla",), mask=("no_mask",), qkv_format=("thd",), seqlens=(8, 24, 32),
                            dtype=("fp64",)))
    assert useful_flops(case, "fwd") == 4 * 1 * 4 * 16 * (8 * 8 + 24 * 24 + 32 * 32)
    spec = make_spec("vanilla", MaskType.NO_MASK, None, "thd", case.cu_seqlens)
    assert spec.docs == (8, 24, 32)


# ---- real ranks over gloo: check and bench ----

# Per cp: unequal documents (one shorter than the window of 20), a single document, many short
# ones; every softmax type, both masks, windows, both K/V schedules and sink strategies in fp64;
# a2a and a2a+p2p in fp64 and bf16. One launch per cp.
PROFILE = """
qkv_format = ["thd"]
softmax = ["vanilla", "off-by-one", "learnable"]
mask = ["causal", "no_mask"]
dtype = ["fp64"]
sink_strategy = ["step0", "post-merge"]
kv_schedule = ["ring", "direct"]
heads = 4
kv_heads = 2
head_dim = 8
[[cases]]
seqlens = {unequal}
[[cases]]
seqlens = {unequal}
mask = ["causal"]
window = [20, 0]
[[cases]]
seqlens = {unequal}
softmax = ["learnable"]
mask = ["no_mask"]
window = [3, 2]
[[cases]]
seqlens = {single}
softmax = ["off-by-one", "learnable"]
sink_grad = ["full", "partial"]
[[cases]]
seqlens = {many}
softmax = ["learnable"]
window = [5, 0]
mask = ["causal"]
"""
COMMS = """
[[cases]]
seqlens = {unequal}
comm = ["a2a", "a2a+p2p"]
kv_heads = 4
softmax = ["learnable"]
dtype = ["fp64", "bf16"]
kv_schedule = ["direct"]
sink_grad = ["full", "partial"]
"""
PACKS = {2: ((8, 36, 20), (64,), (4, 8, 4, 12, 4, 8, 4, 4, 16)),
         3: ((12, 6, 30), (48,), (6, 6, 12, 6, 6, 12)),
         4: ((8, 40, 16), (64,), (8, 8, 16, 8, 8, 16))}


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_check_passes_for_packs_at_cp_2_3_4(cli, tmp_path, cp):
    unequal, single, many = PACKS[cp]
    profile = tmp_path / "thd.toml"
    text = PROFILE + (COMMS if cp != 3 else "")       # a2a+p2p needs an even cp, a2a h and g divisible by cp
    profile.write_text(text.format(unequal=list(unequal), single=list(single), many=list(many)))
    res = cli("check", "--profile", str(profile), "--ranks", str(cp), "--format", "json", "--timeout", "60",
              "--run-timeout", "400", timeout=450)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    doc = json.loads(res.stdout)
    cases = doc["cases"]
    assert doc["passed"] and doc["cp"] == cp and all(c["passed"] for c in cases)
    assert {tuple(c["docs"]) for c in cases} == {unequal, single, many}
    assert all(c["qkv_format"] == "thd" and c["shape"]["b"] == 1 and c["shape"]["s"] == sum(c["docs"])
               for c in cases)
    assert {c["softmax"] for c in cases} == {"vanilla", "off-by-one", "learnable"}
    assert {c["mask"] for c in cases} == {"causal", "no_mask"}
    assert {c["kv_schedule"] for c in cases if c["comm"] == "p2p"} == {"ring", "direct"}
    assert {c["sink_strategy"] for c in cases} == {None, "step0", "post-merge"}
    assert {tuple(c["window"] or ()) for c in cases} == {(), (20, 0), (3, 2), (5, 0)}
    if cp != 3:
        assert {(c["comm"], c["dtype"]) for c in cases if c["comm"] != "p2p"} == {
            (comm, dt) for comm in ("a2a", "a2a+p2p") for dt in ("fp64", "bf16")}
    for c in cases:
        assert c["errors"]["comm"]["passed"] and set(c["errors"]) >= {"out", "dq", "dk", "dv"}
        if c["comm"] == "p2p":      # the byte contract of a pack: exactly what the per-document plan moves
            sh = c["shape"]
            planned = comm_bytes(s=sh["s"], b=1, h=sh["h"], g=sh["g"], d=sh["d"], dtype=torch.float64, cp=cp,
                                 mask=c["mask"], window=c["window"], kv_schedule=c["kv_schedule"],
                                 cu_seqlens=[0, *itertools.accumulate(c["docs"])])
            assert c["traffic"]["total"]["bytes"] == sum(t.sent for t in planned)
        if c["sink_grad"] == "partial" and c["softmax"] == "learnable":
            assert {"d_sink", "d_sink_sum"} <= set(c["errors"])


@pytest.mark.slow
def test_doc_leak_makes_check_fail_and_names_what_failed(cli):
    res = cli("check", "--qkv-format", "thd", "--seqlens", "16,32,16", "--softmax", "learnable", "--mask", "all",
              "--dtype", "fp64", "--inject", "doc-leak", "--format", "json")
    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["passed"] is False and doc["fault"] == "doc-leak" and len(doc["cases"]) == 2
    for case in doc["cases"]:
        assert not case["passed"] and case["docs"] == [16, 32, 16]
        assert not case["errors"]["out"]["passed"] and case["errors"]["out"]["worst"] > 1e3
        assert case["errors"]["comm"]["passed"]           # the leak reads local keys: no byte moves differently
    table = cli("check", "--qkv-format", "thd", "--seqlens", "16,32,16", "--softmax", "learnable", "--mask", "causal",
                "--dtype", "fp64", "--inject", "doc-leak")
    assert table.returncode == 1
    assert "injected fault doc-leak" in table.stdout and "docs=16,32,16" in table.stdout
    assert "FAIL" in table.stdout and "0 passed, 1 failed" in table.stdout


@pytest.mark.slow
def test_check_all_formats_with_random_documents_and_a_long_pack_in_the_table(cli):
    res = cli("check", "--qkv-format", "all", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64,bf16",
              "--seed", "3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "b=2 s=64" in res.stdout and "t=64" in res.stdout and "docs=" in res.stdout
    assert "6 passed, 0 failed" in res.stdout
    many = cli("check", "--qkv-format", "thd", "--docs", "12", "--seq-len", "96", "--softmax", "learnable",
               "--mask", "causal", "--dtype", "fp64")
    assert many.returncode == 0, many.stdout + many.stderr
    assert "docs=12 documents" in many.stdout and "docs=8" not in many.stdout   # the lengths are in --format json


@pytest.mark.slow
def test_bench_thd_writes_the_docs_column_and_the_planned_bytes(cli, tmp_path):
    out = tmp_path / "bench.csv"
    res = cli("bench", "--qkv-format", "thd,bshd", "--seqlens", "8,40,16", "--softmax", "learnable", "--mask", "causal",
              "--window", "3,0", "--dtype", "fp32", "--kv-schedule", "direct", "--warmup", "0", "--iters", "1",
              "--csv", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    df = pd.read_csv(out, dtype={"docs": str}).fillna({"docs": ""})
    assert list(df.columns) == COLUMNS
    assert set(df["docs"]) == {"8,40,16", ""}
    thd = df[df["docs"] == "8,40,16"]
    assert set(thd["b"]) == {1} and set(thd["s"]) == {64} and set(df[df["docs"] == ""]["b"]) == {2}
    planned = comm_bytes(s=64, b=1, h=4, g=2, d=16, dtype=torch.float32, cp=2, mask="causal", window=(3, 0),
                         kv_schedule="direct", cu_seqlens=[0, 8, 48, 64])
    want = {}
    for t in planned:
        if t.messages_sent or t.messages_received:
            key = (t.rank, t.phase, t.step, t.kind)
            want[key] = want.get(key, 0) + t.sent
    comm = thd[thd["kind"].isin(["kv", "dkv"])]
    assert {(r.rank, r.phase, r.step, r.kind): r.bytes for r in comm.itertuples()} == want
    # a window of 3: rank 0 sends rank 1 a halo of each document, 3 rows or the whole chunk if shorter
    kv_row = 2 * 1 * 2 * 16 * 4                          # K and V rows of b=1, g=2, d=16 in fp32
    assert want[(0, "fwd", 0, "kv")] == (2 + 3 + 3) * kv_row
    its = iteration_table(load([out]))
    assert sorted(its["docs"]) == ["", "8,40,16"]


# ---- the README's thd examples run as written ----

def _readme_thd_blocks():
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if 'qkv_format="thd"' in b]


def test_the_readme_single_device_pack_example_prints_what_it_says(capsys):
    single, _ = _readme_thd_blocks()
    exec(compile(single, "README.md", "exec"), {})
    assert capsys.readouterr().out.split("\n")[:2] == ["True", "[0, 96, 248, 504] (504, 8, 64) True"]


@pytest.mark.slow
def test_the_readme_cp_pack_script_runs_under_torchrun(tmp_path):
    import os
    import subprocess
    import sys
    _, script = _readme_thd_blocks()
    (tmp_path / "pack.py").write_text(script)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "pack.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert res.returncode == 0, res.stdout + res.stderr
    err = float(res.stdout.split("max |cp - reference|:")[1].split()[0])
    assert err < 1e-5


# ---- the balanced pack layout in the tool ----

@pytest.mark.parametrize("args,message", [
    (["check", "--pack-layout", "balanced"], "--pack-layout balanced lays out the documents of a thd pack"),
    (["check", "--qkv-format", "thd", "--pack-layout", "balanced", "--comm", "p2p,a2a"],
     "--pack-layout balanced (--comm a2a)"),
    (["check", "--qkv-format", "thd", "--pack-layout", "balanced", "--kv-schedule", "ring,allgather"],
     "--pack-layout balanced (--kv-schedule ring)"),
    (["check", "--qkv-format", "thd", "--pack-layout", "balanced", "--seqlens", "30,33,1"],
     "document 1 has 33 tokens"),
    (["check", "--qkv-format", "thd", "--pack-layout", "diagonal"], "--pack-layout='diagonal' is not supported"),
    (["check", "--ranks", "2", "--qkv-format", "thd", "--seqlens", "2,2", "--pack-layout", "balanced", "--inject",
      "doc-leak"], "some rank holds two documents or more"),
    (["bench", "--qkv-format", "thd", "--pack-layout", "balanced", "--kv-schedule", "direct"],
     "--pack-layout balanced (--kv-schedule direct)"),
])
def test_pack_layout_usage_errors_start_no_rank(no_launch, args, message):
    _refused(args, message, no_launch)


def test_a_profile_takes_the_pack_layout(no_launch, tmp_path):
    path = tmp_path / "balanced.toml"
    path.write_text('qkv_format = ["thd"]\npack_layout = "balanced"\nseqlens = [8, 24]\n')
    settings, = settings_for(CaseOptions(profile=str(path)))
    assert settings.pack_layout == "balanced"
    case, = {c.pack_layout for c in expand(settings)}
    assert case.value == "balanced"
    res = runner.invoke(app, ["check", "--profile", str(path)])
    assert res.exit_code == 0, res.output and len(no_launch) == 1


def test_emulate_replays_the_balanced_layout_under_allgather(tmp_path):
    res = runner.invoke(app, ["emulate", "--qkv-format", "thd", "--seqlens", "32,64,24,8", "--pack-layout",
                              "balanced", "--cp", "2,4", "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["results"]
    # 'all' is every schedule and strategy the layout can show: allgather, and no every-tile (one tile per row)
    assert len(rows) == 2 * 2 * 2
    assert {(r["kv_schedule"], r["pack_layout"]) for r in rows} == {("allgather", "balanced")}
    assert all(r["passed"] and r["out_max_abs_err"] <= 1e-12 for r in rows)
    auto = runner.invoke(app, ["emulate", "--qkv-format", "thd", "--seqlens", "2,4,6,12", "--pack-layout", "balanced",
                               "--cp", "2", "--kv-schedule", "auto", "--format", "json"])
    assert auto.exit_code == 0, auto.output     # auto is allgather there: 'all' strategies leave every-tile out
    assert {r["kv_schedule"] for r in json.loads(auto.output)["results"]} == {"allgather"}
    base = ["emulate", "--pack-layout", "balanced", "--cp", "2"]
    for args, message in ((["--qkv-format", "thd", "--kv-schedule", "ring"], "--pack-layout balanced (--kv-schedule ring)"),
                          (["--qkv-format", "thd", "--comm", "a2a+p2p"], "--pack-layout balanced (--comm a2a+p2p)"),
                          ([], "add thd to --qkv-format")):
        out = runner.invoke(app, base + args)
        assert out.exit_code == 2 and message in " ".join(out.output.split()), out.output


def test_simulate_runs_the_balanced_layout_under_allgather(tmp_path):
    out = tmp_path / "sim.csv"
    res = runner.invoke(app, ["bench", "--qkv-format", "thd", "--seqlens", "16,40,8", "--pack-layout", "balanced",
                              "--softmax", "learnable", "--mask", "causal", "--dtype", "fp32", "--simulate", "2,4",
                              "--warmup", "0", "--iters", "1", "--csv", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out, dtype={"docs": str})
    assert set(df["kv_schedule"]) == {"allgather"} and set(df["cp"]) == {2, 4}
    assert set(df[df["step"] >= 0]["step"]) == {0}     # one step: every key gathered (-1: whole-phase rows)


@pytest.mark.slow
def test_check_passes_in_the_balanced_layout_with_its_byte_contract(cli):
    docs = [48, 8, 30, 10, 32]
    res = cli("check", "--qkv-format", "thd", "--seqlens", ",".join(map(str, docs)), "--pack-layout", "balanced",
              "--ranks", "4", "--softmax", "all", "--mask", "all", "--window", "7,0", "--dtype", "fp64,bf16",
              "--sink-strategy", "all", "--format", "json", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    doc = json.loads(res.stdout)
    cases = doc["cases"]
    assert doc["passed"] and len(cases) == 2 * 2 * (1 + 2 + 2)
    for c in cases:
        assert c["passed"] and c["kv_schedule"] == "allgather" and c["pack_layout"] == "balanced"
        planned = comm_bytes(s=128, b=1, h=4, g=2, d=16, dtype=torch.float64 if c["dtype"] == "fp64" else torch.bfloat16,
                             cp=4, mask=c["mask"], window=c["window"], cu_seqlens=[0, *itertools.accumulate(docs)],
                             pack_layout="balanced")
        assert c["traffic"]["total"]["bytes"] == sum(t.sent for t in planned)
    leak = cli("check", "--qkv-format", "thd", "--seqlens", ",".join(map(str, docs)), "--pack-layout", "balanced",
               "--ranks", "4", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--inject", "doc-leak",
               "--format", "json")
    assert leak.returncode == 1, leak.stdout + leak.stderr
    assert not json.loads(leak.stdout)["cases"][0]["errors"]["out"]["passed"]
