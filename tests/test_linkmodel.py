"""The link model of `bench --simulate N --link LINK` (sinkprof/tool/linkmodel.py): its arithmetic
on hand-computed cases, the exposed time of known compute/communication pairs, `--link` parsing,
predicted rows in the CSV and in `report`, and (slow, very loose) the model against gloo over
loopback."""
import math

import pandas as pd
import pytest
import torch

from sinkprof import comm_bytes
from sinkprof.schedule import Transfer
from sinkprof.tool.bench import COLUMNS, BenchOptions, simulate
from sinkprof.tool.cases import Settings
from sinkprof.tool.linkmodel import PRESETS, Link, exchange_times, fit, parse_link, predict
from sinkprof.tool.report import load, report, step_table

LINK = Link("test", 1.0, 2.0)   # 1 GB/s = 1e6 bytes per ms, 2 us per message


def _t(peer=1, sent=0, received=0, ms=1, mr=1, phase="fwd", step=0, kind="kv"):
    return Transfer(0, phase, step, kind, peer, sent, received, ms if sent else 0, mr if received else 0)


def test_one_message_each_way_costs_latency_plus_bytes_over_bandwidth():
    assert LINK.exchange_ms([_t(sent=1_000_000, received=500_000)]) == pytest.approx(0.002 + 1.0)
    assert LINK.exchange_ms([_t(sent=1_000, received=3_000_000)]) == pytest.approx(0.002 + 3.0)
    assert LINK.exchange_ms([]) == 0.0


def test_messages_to_one_peer_queue_and_peers_share_the_bandwidth():
    # two messages to one peer: two latencies
    assert LINK.exchange_ms([_t(sent=2_000_000, ms=2)]) == pytest.approx(2 * 0.002 + 2.0)
    # two peers in parallel: one latency, the bytes of both over the one injection bandwidth
    assert LINK.exchange_ms([_t(peer=1, sent=1_000_000), _t(peer=2, sent=3_000_000)]) == pytest.approx(0.002 + 4.0)


def test_ring_exchange_of_the_plan_is_one_shard_over_the_link():
    # b=1, g=2, d=16, fp32, cp=4, s=64: a shard is 2 chunks of 8 rows; one K+V row is 2*2*16*4 = 256 B
    transfers = [t for t in comm_bytes(s=64, b=1, h=4, g=2, d=16, dtype=torch.float32, cp=4, mask="causal",
                                       kv_schedule="ring") if t.rank == 1]
    times = exchange_times(transfers, LINK)
    shard = 16 * 256
    assert times[("fwd", 0, "kv")] == (pytest.approx(0.002 + shard / 1e6), shard)
    assert times[("bwd", 3, "dkv")] == (pytest.approx(0.002 + shard / 1e6), shard)   # dK/dV in fp32: same bytes
    assert ("fwd", 3, "kv") not in times and len([k for k in times if k[2] == "kv"]) == 6


def _rows(phase_steps, iteration_ms):
    rows = [dict(rank=0, iteration=0, phase=p, step=i, kind="compute", start_ms=a, end_ms=b, dur_ms=b - a, bytes="")
            for p, i, a, b in phase_steps]
    rows.append(dict(rank=0, iteration=0, phase="fwdbwd", step=-1, kind="iteration", start_ms=0.0,
                     end_ms=iteration_ms, dur_ms=iteration_ms, bytes=""))
    return rows


def _by(out, kind):
    return {(r["phase"], r["step"]): r for r in out if r["kind"] == kind}


def test_forward_exposes_what_the_step_does_not_hide():
    # compute 1 ms per step; K/V of 1.5 ms (1.5e6 B, no latency) in flight during steps 0 and 1
    link = Link("x", 1.0, 0.0)
    rows = _rows([("fwd", 0, 0.0, 1.0), ("fwd", 1, 1.0, 2.0), ("fwd", 2, 2.0, 3.0)], 3.0)
    kv = [_t(sent=1_500_000, received=1_500_000, step=i) for i in (0, 1)]
    out = predict(rows, kv, link)
    comm, comp = _by(out, "kv"), _by(out, "compute")
    assert [comm[("fwd", i)]["exposed_ms"] for i in (0, 1)] == [pytest.approx(0.5)] * 2
    assert [comm[("fwd", i)]["overlap_ms"] for i in (0, 1)] == [pytest.approx(1.0)] * 2
    assert comp[("fwd", 1)]["start_ms"] == pytest.approx(1.5) and comp[("fwd", 2)]["start_ms"] == pytest.approx(3.0)
    assert comp[("fwd", 2)]["dur_ms"] == 1.0   # measured compute kept
    it = [r for r in out if r["kind"] == "iteration"][0]
    assert it["dur_ms"] == pytest.approx(4.0) and it["predicted"] is True
    assert all(r["predicted"] is True and r["bytes"] == 1_500_000 for r in comm.values())


def test_backward_dkv_travels_behind_and_the_last_one_is_exposed():
    # compute 1 ms per step, K/V 0.5 ms at steps 0, 1; dK/dV 2 ms after every step (the ring)
    link = Link("x", 1.0, 0.0)
    rows = _rows([("bwd", 0, 0.0, 1.0), ("bwd", 1, 1.0, 2.0), ("bwd", 2, 2.0, 3.0)], 3.0)
    transfers = [_t(sent=500_000, received=500_000, phase="bwd", step=i) for i in (0, 1)]
    transfers += [_t(sent=2_000_000, received=2_000_000, phase="bwd", step=i, kind="dkv") for i in (0, 1, 2)]
    out = predict(rows, transfers, link)
    dkv, kv = _by(out, "dkv"), _by(out, "kv")
    # dK/dV of step 0 posted at 1, lands at 3, step 1 ends at 2: 1 ms exposed; so is step 1's
    # (posted at 3, step 2 runs 3..4, lands at 5); the last is waited at once: 2 ms
    assert [dkv[("bwd", i)]["exposed_ms"] for i in range(3)] == [pytest.approx(1.0), pytest.approx(1.0),
                                                                  pytest.approx(2.0)]
    assert [dkv[("bwd", i)]["start_ms"] for i in range(3)] == [pytest.approx(1.0), pytest.approx(3.0),
                                                                pytest.approx(5.0)]
    assert [kv[("bwd", i)]["exposed_ms"] for i in (0, 1)] == [0.0, 0.0]
    it = [r for r in out if r["kind"] == "iteration"][0]
    assert it["dur_ms"] == pytest.approx(3.0 + 4.0)
    comp = sum(r["dur_ms"] for r in out if r["kind"] == "compute")
    exposed = sum(r["exposed_ms"] for r in out if r["kind"] in ("kv", "dkv"))
    assert comp + exposed == pytest.approx(it["dur_ms"])


def test_a_message_in_the_host_gap_between_steps_is_exposed_as_in_a_measured_run():
    """dK/dV of step 0 (1 ms) runs 1..2, in the gap 1..1.5 before step 1 computes 1.5..2.5: it
    stalls nothing (it lands before step 1 ends), yet 0.5 ms of it lies under no compute. The rows
    said 0 exposed (the model's stall) while report, the pictures and the trace, which count what
    no compute hides, as for a measured run, said 0.5: the title's share was 3x the rows'."""
    link = Link("x", 1.0, 0.0)
    rows = _rows([("bwd", 0, 0.0, 1.0), ("bwd", 1, 1.5, 2.5)], 2.5)
    out = predict(rows, [_t(sent=1_000_000, received=1_000_000, phase="bwd", step=0, kind="dkv")], link)
    dkv = _by(out, "dkv")[("bwd", 0)]
    assert (dkv["start_ms"], dkv["end_ms"]) == (pytest.approx(1.0), pytest.approx(2.0))
    assert (dkv["overlap_ms"], dkv["exposed_ms"]) == (pytest.approx(0.5), pytest.approx(0.5))
    it = [r for r in out if r["kind"] == "iteration"][0]
    assert it["dur_ms"] == pytest.approx(2.5)   # no stall: the iteration is as measured


def test_allgather_waits_for_its_kv_before_its_one_step_and_exposes_all_of_it():
    # one step of 1 ms per phase; K/V 1.5 ms before it; dK/dV 2 ms after it, waited at once
    link = Link("x", 1.0, 0.0)
    rows = _rows([("fwd", 0, 0.0, 1.0), ("bwd", 0, 1.0, 2.0)], 2.0)
    transfers = [_t(sent=1_500_000, received=1_500_000, phase=p, step=0) for p in ("fwd", "bwd")]
    transfers += [_t(sent=2_000_000, received=2_000_000, phase="bwd", step=0, kind="dkv")]
    out = predict(rows, transfers, link, blocking_kv=True)
    kv, dkv, comp = _by(out, "kv"), _by(out, "dkv"), _by(out, "compute")
    assert [kv[(p, 0)]["exposed_ms"] for p in ("fwd", "bwd")] == [pytest.approx(1.5)] * 2
    assert comp[("fwd", 0)]["start_ms"] == pytest.approx(1.5) and comp[("bwd", 0)]["start_ms"] == pytest.approx(4.0)
    assert dkv[("bwd", 0)]["exposed_ms"] == pytest.approx(2.0)
    it = [r for r in out if r["kind"] == "iteration"][0]
    assert it["dur_ms"] == pytest.approx(2.0 + 1.5 + 1.5 + 2.0)
    # the ring's timing of the same messages hides the K/V behind the step
    assert _by(predict(rows, transfers, link), "kv")[("fwd", 0)]["exposed_ms"] == pytest.approx(0.5)


def test_fwdbwd_backward_starts_after_the_forward_stalls():
    link = Link("x", 1.0, 0.0)
    rows = _rows([("fwd", 0, 0.0, 1.0), ("fwd", 1, 1.0, 2.0), ("bwd", 0, 2.5, 3.5), ("bwd", 1, 3.5, 4.5)], 5.0)
    out = predict(rows, [_t(sent=3_000_000, received=3_000_000, step=0)], link)
    comp = _by(out, "compute")
    assert comp[("fwd", 1)]["start_ms"] == pytest.approx(3.0)       # 2 ms stall after step 0
    assert comp[("bwd", 0)]["start_ms"] == pytest.approx(4.5)       # everything after it moves
    assert [r for r in out if r["kind"] == "iteration"][0]["dur_ms"] == pytest.approx(7.0)


@pytest.mark.parametrize("text,gbps,lat", [("nvlink", 450.0, 5.0), ("H200-NVLINK", 450.0, 5.0),
                                           ("h100-nvlink", 450.0, 5.0), ("ib", 50.0, 10.0),
                                           ("400,5", 400.0, 5.0), (" 25 ", 25.0, 0.0), ("1.5,0", 1.5, 0.0)])
def test_link_parses_presets_and_custom_figures(text, gbps, lat):
    link = parse_link(text)
    assert (link.gbps, link.latency_us) == (gbps, lat)


@pytest.mark.parametrize("text", ["fast", "0", "-1,2", "1,2,3", "1,-1", "nan", ",5", "inf"])
def test_link_refuses_bad_values_naming_the_option(text):
    with pytest.raises(ValueError, match="--link"):
        parse_link(text)


def test_presets_are_the_documented_figures():
    assert {n: (l.gbps, l.latency_us) for n, l in PRESETS.items()} == {
        "nvlink": (450.0, 5.0), "h100-nvlink": (450.0, 5.0), "h200-nvlink": (450.0, 5.0),
        "ib": (50.0, 10.0), "ib-ndr": (50.0, 10.0)}


def test_fit_recovers_latency_and_bandwidth():
    link = fit({n: 20e-6 + n / 3e9 for n in (1 << 10, 1 << 16, 1 << 22)})
    assert link.gbps == pytest.approx(3.0) and link.latency_us == pytest.approx(20.0)


def test_bad_link_and_link_without_simulate_exit_2(cli):
    res = cli("bench", "--simulate", "2", "--link", "warp9")
    assert res.returncode == 2 and "--link" in res.stderr and "warp9" in res.stderr
    res = cli("bench", "--link", "nvlink")
    assert res.returncode == 2 and "--simulate" in res.stderr and "--link" in res.stderr


def test_simulate_with_link_writes_predicted_rows_that_report_shows(tmp_path, capsys):
    out = tmp_path / "pred.csv"
    settings = Settings(softmax=("learnable",), mask=("causal",), dtype=("fp32",), seq_len=64, window=(3, 0),
                        kv_schedule=("ring", "direct"))
    link = Link("test", 1.0, 2.0)
    simulate([settings], BenchOptions(warmup=0, iters=2, phase="fwdbwd", csv=str(out), simulate=(4,), link=link),
             torch.device("cpu"))
    df = pd.read_csv(out)
    assert list(df.columns) == COLUMNS
    comm = df[df["kind"].isin(["kv", "dkv"])]
    assert comm["predicted"].all() and comm["bytes"].notna().all() and (comm["bytes"] > 0).any() and (df["link"] == "test 1 GB/s 2 us").all()
    assert not df[df["kind"] == "compute"]["predicted"].any() and df[df["kind"] == "iteration"]["predicted"].all()
    # every row's bytes and time are the plan's, per rank, phase, step and kind
    for sched, part in comm.groupby("kv_schedule"):
        plan = comm_bytes(s=64, b=2, h=4, g=2, d=16, dtype=torch.float32, cp=4, mask="causal", window=(3, 0),
                          kv_schedule=sched)
        for rank in range(4):
            times = exchange_times([t for t in plan if t.rank == rank], link)
            mine = part[(part["rank"] == rank) & (part["iteration"] == 0)]
            got = {(r.phase, r.step, r.kind): (r.dur_ms, r.bytes) for r in mine.itertuples()}
            assert got.keys() == times.keys()
            for key, (ms, nbytes) in times.items():
                assert got[key] == (pytest.approx(ms), nbytes)
    # compute + exposed communication = the predicted iteration, per rank and iteration
    for _, part in df.groupby(["kv_schedule", "rank", "iteration"]):
        wall = part[part["kind"] == "iteration"]["dur_ms"].iloc[0]
        sim_gaps = wall - part[part["kind"] == "compute"]["dur_ms"].sum() - part["exposed_ms"].sum()
        assert sim_gaps >= -1e-9
    steps = step_table(load([out]))
    assert steps["predicted"].any() and (steps["comm_ms"] > 0).any()
    capsys.readouterr()
    report([str(out)])
    assert "PREDICTION" in capsys.readouterr().out


@pytest.mark.slow
def test_the_loopback_link_is_measured_as_a_fitted_bandwidth_and_latency():
    """The measurement the validation script uses (scripts/validate_link_model.py compares the
    model with real runs; timings stay in that benchmark, out of the tests)."""
    from sinkprof.tool.linkmodel import measure_gloo_loopback
    link, seconds = measure_gloo_loopback(sizes=(1 << 12, 1 << 18, 1 << 21), reps=5)
    assert link.gbps > 0 and math.isfinite(link.latency_us) and link.latency_us >= 0
    assert len(seconds) == 3 and all(t > 0 for t in seconds)




def test_a_joined_run_s_messages_are_posted_together_and_hide_behind_the_step_before_it():
    # step 0 computes 2 ms, then steps 1..2 are one run computed at step 2 (step 1 computes
    # nothing): their K/V (labels 0 and 1, 0.8 ms each) are posted together at step 0 and share
    # the link: 1.6 ms, hidden by step 0's 2 ms. Posted one step ahead, the second would be exposed.
    link = Link("x", 1.0, 0.0)
    rows = _rows([("fwd", 0, 0.0, 2.0), ("fwd", 1, 2.0, 2.0), ("fwd", 2, 2.0, 5.0)], 5.0)
    kv = [_t(sent=800_000, received=800_000, step=i) for i in (0, 1)]
    out = predict(rows, kv, link, posted_at={1: 0, 2: 0})
    comm = _by(out, "kv")
    assert list(comm) == [("fwd", 0)]
    assert comm[("fwd", 0)]["bytes"] == 1_600_000 and comm[("fwd", 0)]["dur_ms"] == pytest.approx(1.6)
    assert comm[("fwd", 0)]["exposed_ms"] == 0.0
    assert [r for r in out if r["kind"] == "iteration"][0]["dur_ms"] == pytest.approx(5.0)
    apart = _by(predict(rows, kv, link), "kv")
    assert apart[("fwd", 1)]["exposed_ms"] == pytest.approx(0.8)


def test_a_joined_runs_messages_to_several_peers_pay_the_latency_once_as_one_batch():
    """Under direct a joined run's K/V come from a peer a step, all posted at once: one batch, peers
    in parallel sharing the bandwidth (10 us + 12288 B / 1 GB/s = 22.288 us). Before, the steps'
    exchanges were summed: 3 x (10 us + 4096 B / 1 GB/s) = 42.288 us."""
    link = Link("x", 1.0, 10.0)
    kv = [_t(peer=p, sent=2048, received=4096, step=p - 1) for p in (1, 2, 3)]
    times = exchange_times(kv, link, posted_at={1: 0, 2: 0, 3: 0})
    assert list(times) == [("fwd", 0, "kv")]
    assert times[("fwd", 0, "kv")] == (pytest.approx(0.010 + 12288 / 1e6), 6144)
    same_peer = [_t(peer=1, sent=2048, received=4096, step=s) for s in (0, 1, 2)]   # one after another
    assert exchange_times(same_peer, link, posted_at={1: 0, 2: 0, 3: 0})[("fwd", 0, "kv")][0] == \
        pytest.approx(3 * 0.010 + 12288 / 1e6)


def test_an_exchange_under_compute_is_exposed_by_nothing_not_by_rounding():
    """Before: 1e-16 ms "exposed" for spans the compute covers, which a filter exposed_ms > 0 counted."""
    from sinkprof.profiling import overlap_rows
    start, dur = 0.283, 0.264   # a predicted exchange: its end is start + dur, and end - start < dur
    rows = [dict(kind="compute", phase="fwd", start_ms=0.0, end_ms=2.0),
            dict(kind="kv", phase="fwd", start_ms=start, end_ms=start + dur, dur_ms=dur)]
    assert dur - ((start + dur) - start) > 0
    (kv,) = [r for r in overlap_rows(rows) if r["kind"] == "kv"]
    assert kv["exposed_ms"] == 0.0 and kv["overlap_ms"] == pytest.approx(dur)


def test_a_prediction_is_named_with_its_link_in_every_title_the_report_gives(tmp_path, monkeypatch):
    """Before: two predictions over different links read alike everywhere; the timelines' titles and
    the trace's case slice lacked PREDICTION (they took the case's first row, a measured compute row)."""
    import json

    from matplotlib.axes import Axes

    from sinkprof.tool import figures
    from sinkprof.tool.chrome_trace import trace
    from sinkprof.tool.report import label, load
    settings = Settings(softmax=("learnable",), mask=("causal",), dtype=("fp32",), seq_len=64)
    csvs = []
    for name in ("ib", "nvlink"):
        csvs.append(tmp_path / f"{name}.csv")
        simulate([settings], BenchOptions(warmup=0, iters=1, phase="fwd", csv=str(csvs[-1]), simulate=(2,),
                                          link=PRESETS[name]), torch.device("cpu"))
    df = load(csvs)
    titles = []
    monkeypatch.setattr(Axes, "set_title", lambda self, text, *a, **kw: titles.append(text))
    for _, rows in df.groupby("run_id"):
        figures.timeline(rows, "fwd")
    assert len(titles) == 2 and all(t.startswith("PREDICTION ") for t in titles)
    assert any("over ib 50 GB/s 10 us" in t for t in titles) and any("over nvlink 450 GB/s 5 us" in t for t in titles)
    cases = [e for e in trace(df)["traceEvents"] if e.get("cat") == "case"]
    assert cases and all(e["name"].startswith("PREDICTION ") and e["args"]["predicted"] for e in cases)
    assert {e["args"]["link"] for e in cases} == {"ib 50 GB/s 10 us", "nvlink 450 GB/s 5 us"}
    assert label(df.iloc[0]).endswith(f"over {df.iloc[0]['link']}")
    assert json.loads(json.dumps(trace(df)))   # strict JSON still
