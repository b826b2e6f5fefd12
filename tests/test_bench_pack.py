"""The pack benchmark of scripts/bench_kernels.py on the CPU: the seeded document lengths, the
command line, the pack's plans and shards (the ring it times computes the pack's attention), the
slowest-rank bookkeeping, and the FA4 varlen call's arguments against FA4's own checks (the GPU
timings themselves run only on the H200)."""
import collections
import importlib.util
import itertools
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from sinkprof.kernels import get_kernel
from sinkprof.options import make_spec
from sinkprof.testing import Inputs, reference

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_kernels.py"


@pytest.fixture(scope="module")
def bk():
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernels"] = module   # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_kernels", None)


@pytest.mark.parametrize("seed", range(20))
def test_pack_lengths_are_multiples_of_2cp_in_range_summing_to_the_pack(bk, seed):
    docs = bk.pack_lengths(65536, 2048, 16384, 16, seed)
    assert sum(docs) == 65536
    assert all(2048 <= n <= 16384 and n % 16 == 0 for n in docs)
    assert docs == bk.pack_lengths(65536, 2048, 16384, 16, seed)


def test_pack_lengths_differ_by_seed_and_refuse_impossible_packs(bk):
    assert len({tuple(bk.pack_lengths(65536, 2048, 16384, 16, s)) for s in range(10)}) > 5
    for args in ((65536, 2048, 16384, 24, 0), (65536, 2048, 3072, 16, 0), (1024, 2048, 16384, 16, 0)):
        with pytest.raises(ValueError):
            bk.pack_lengths(*args)
    assert bk.pack_lengths(4096, 2048, 16384, 16, 0) == [4096]


def test_the_gpu_session_command_line_parses_into_one_64k_pack_at_cp_8(bk):
    from sinkprof.options import KVSchedule
    args = bk.parse_args(["--skip-tiles", "--rings", "", "--packs", "gpt-oss:8", "--ring-backends", "fa4,fa4+comm",
                          "--kv-schedules", "ring,allgather", "--out", "x.json"])
    assert bk._configs(args.rings) == []
    [(name, cp, docs)] = args.pack_cases
    assert (name, cp, sum(docs)) == ("gpt-oss", 8, 65536) and min(docs) >= 2048 and max(docs) <= 16384
    assert args.kinds == [KVSchedule.RING, KVSchedule.ALLGATHER]
    assert bk.parse_args(["--packs", "gpt-oss:8"]).kinds == [KVSchedule.DIRECT]   # what auto takes for them
    from sinkprof.schedule import case_comm
    for name, mask in (("h16-d128", "causal"), ("h16-d128", "no_mask"), ("gpt-oss", "causal"), ("gpt-oss", "no_mask")):
        h, g, d = bk.CONFIGS[name]
        for cp in (2, 4, 8):
            case = case_comm(s=8192 * cp, b=1, h=h, g=g, d=d, dtype=torch.bfloat16, cp=cp, mask=mask)
            assert case.schedule.kind is KVSchedule.DIRECT, (name, mask, cp)
    for bad in (["--pack-docs", "2048"], ["--packs", "nope:8"], ["--packs", "gpt-oss:6", "--pack-len", "65532"],
                ["--kv-schedules", "auto"], ["--kv-schedules", "sideways"]):
        with pytest.raises(SystemExit):
            bk.parse_args(["--packs", "gpt-oss:8", *bad])


def test_every_rank_of_the_64k_pack_does_an_equal_share_of_the_documents_causal_work(bk):
    from sinkprof.options import Band, KVSchedule
    from sinkprof.schedule import CommSchedule
    docs = bk.pack_lengths(65536, 2048, 16384, 16, 0)
    schedule = CommSchedule(KVSchedule.RING, 8, tuple(n // 16 for n in docs), Band(None, 0))
    total = sum(4 * 64 * 64 * n * (n + 1) // 2 for n in docs)
    assert [bk.rank_flops(plan, 1, 64, 64) for plan in schedule.plans] == [total // 8] * 8


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kind,layout", [("ring", "zigzag"), ("allgather", "zigzag"), ("allgather", "balanced")])
def test_the_pack_ring_each_rank_runs_is_the_packs_attention(bk, cp, kind, layout):
    """The benchmark's inputs, shards, schedule and loops (torch tiles, fp32) against the reference."""
    from sinkprof.options import KVSchedule, PackLayout
    from sinkprof.schedule import CommSchedule
    docs = bk.pack_lengths(16 * cp * 6, 8 * cp, 32 * cp, 2 * cp, seed=cp)
    h, g, d = 4, 2, 8
    p = bk.pack_setup(cp, h, g, d, docs, "cpu", dtype=torch.float32, seed=3,
                      pack_layout=PackLayout.parse(layout, "layout"))
    assert p.schedule.layout.kind.value == layout
    p.schedule = CommSchedule(KVSchedule.parse(kind, "kind"), cp, p.schedule.layout, p.schedule.band)
    assert p.flops == sum(4 * h * d * n * (n + 1) // 2 for n in docs)
    assert sum(bk.rank_flops(plan, 1, h, d) for plan in p.schedule.plans) == p.flops
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, *itertools.accumulate(docs)]
    kernel = get_kernel("torch", "cpu")
    for softmax, strategy in bk.RUNS:
        spec = make_spec(softmax, "causal", None, "thd", p.cu_seqlens.tolist())
        ref = reference(Inputs(p.q, p.k, p.v, p.sink if softmax == "learnable" else None, None, p.do), spec)
        dk = [torch.zeros_like(x, dtype=torch.float32) for x in p.ks]
        dv = [torch.zeros_like(x, dtype=torch.float32) for x in p.vs]
        for rank in range(cp):
            qh, dol = p.shards(rank)
            ring = bk._ring_fns(kernel, p.schedule, rank, qh, dol, p.ks, p.vs, p.sink, softmax, strategy, "causal", d)
            ring.fwd()
            ring.bwd()
            for name, got, want in (("out", ring.out, ref.out), ("dq", ring.dq, ref.dq)):
                err = (got.double() - p.rank_shard(want, rank)).abs().max()
                assert err < 1e-4, (softmax, strategy, rank, name, float(err))
            for acc, part in zip(dk + dv, ring.dks + ring.dvs):
                acc += part
        for rank in range(cp):
            assert (dk[rank].double() - p.rank_shard(ref.dk, rank)).abs().max() < 1e-4
            assert (dv[rank].double() - p.rank_shard(ref.dv, rank)).abs().max() < 1e-4


def test_a_pack_the_balanced_layout_takes_is_set_up_in_it(bk):
    """Documents of even lengths, not multiples of 2 cp: the balanced layout takes them, the zigzag one does not."""
    from sinkprof.options import PackLayout
    p = bk.pack_setup(2, 2, 1, 8, [2, 4, 6, 12], "cpu", pack_layout=PackLayout.BALANCED)
    assert p.schedule.kind.value == "allgather" and [x.shape[2] for x in p.ks] == [12, 12]
    with pytest.raises(ValueError, match="pad_pack"):
        p.laid_out(PackLayout.ZIGZAG)


def test_the_slowest_rank_rows_and_their_rates_on_the_cpu(bk, monkeypatch):
    """The bookkeeping the GPU run does, with wall-clock timings standing in for CUDA graph replays."""
    def cpu_ms(fns, calls=2, rounds=15, graphed=True, ready=None):
        out = {}
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[name] = {"ms": (time.perf_counter() - t0) * 1e3, "spread_ms": 0.0, "launch_us": 0.0, "calls": 1}
        return out
    monkeypatch.setattr(bk, "interleaved_ms", cpu_ms)
    monkeypatch.setattr(bk, "host_us", lambda fn, calls=20: 1.0)
    docs = bk.pack_lengths(96, 8, 32, 8, seed=1)
    p = bk.pack_setup(4, 4, 2, 8, docs, "cpu", dtype=torch.float32)
    rows = bk.slowest_rank(["torch"], p.schedule, [0, 2, 3], p.shards, p.ks, p.vs, p.sink, "causal", 8)
    assert [r["variant"] for r in rows] == ["vanilla step0", "learnable step0", "learnable post-merge"]
    assert all(r["rank"] in (0, 2, 3) and r["flops"] == p.flops // 4 and r["timing"] == "graphs" for r in rows)
    for r in rows:   # every rank timed is listed, the slowest is the one reported
        assert set(r["ranks_ms"]) == {0, 2, 3}
        assert r["fwd_ms"] + r["bwd_ms"] == max(f + b for f, b in r["ranks_ms"].values())
    mono = {f"fa4 varlen {tag} {phase}": {"ms": 1.0} for tag in ("vanilla", "learnable") for phase in ("fwd", "bwd")}
    bk.with_rates(rows, p.flops, mono, mono="fa4 varlen")
    for r in rows:
        assert r["fwd_vs_fa4_mono"] == pytest.approx(r["fwd_tflops"] / (p.flops / 1e9))
        assert r["bwd_vs_fa4_mono"] == pytest.approx(r["bwd_tflops"] / (2.5 * p.flops / 1e9))
        assert "mono_ms" not in r and "fwd_vs_fa4_mono_separate_run" not in r


def test_the_control_variants_turn_off_their_settings_at_each_call(bk, monkeypatch):
    """``--one-stream-too``, ``--whole-causal-too`` and ``--masked-config-too`` add vanilla step0
    rows with the kernel's ``concurrent``, ``causal_pieces`` or ``unmasked_config`` off, set at each
    call (the variants of one kernel run interleaved); the other variants run with the class's
    settings."""
    monkeypatch.setattr(bk, "interleaved_ms", lambda fns, calls=2, rounds=15, graphed=True, ready=None:
                        {name: {"ms": 1.0, "spread_ms": 0.0, "launch_us": 0.0, "calls": 1} for name in fns})
    monkeypatch.setattr(bk, "host_us", lambda fn, calls=20: 1.0)

    class Kernel:
        concurrent = True
        causal_pieces = True
        unmasked_config = True
    kernel, seen = Kernel(), []
    fn = lambda: seen.append((kernel.concurrent, kernel.causal_pieces, kernel.unmasked_config))
    bk._configured(fn, kernel, bk.CONTROLS["whole-causal"])()
    bk._configured(fn, kernel, bk.CONTROLS["one-stream"])()
    bk._configured(fn, kernel, bk.CONTROLS["masked-config"])()
    bk._configured(fn, kernel)()
    assert seen == [(True, False, True), (False, True, True), (True, True, False), (True, True, True)]
    args = bk.parse_args(["--whole-causal-too", "--one-stream-too", "--masked-config-too"])
    assert bk.controls(args) == ("one-stream", "whole-causal", "masked-config")
    assert bk.controls(bk.parse_args([])) == ()
    docs = bk.pack_lengths(96, 8, 32, 8, seed=1)
    p = bk.pack_setup(4, 4, 2, 8, docs, "cpu", dtype=torch.float32)
    rows = bk.slowest_rank(["torch"], p.schedule, [0], p.shards, p.ks, p.vs, p.sink, "causal", 8,
                           controls=bk.controls(args))
    assert [r["variant"] for r in rows] == ["vanilla step0", "learnable step0", "learnable post-merge",
                                            "vanilla step0 one-stream", "vanilla step0 whole-causal",
                                            "vanilla step0 masked-config"]


def test_a_rows_ratio_comes_from_the_monolithic_calls_timed_in_its_own_run(bk, monkeypatch):
    """The monolithic calls given to ``slowest_rank`` run in every rank's interleaved run, and
    each row's ratio is against their times in the reported rank's run; the ratio against the
    monolithic calls' own run stays beside it ("timed apart")."""
    runs = []

    def fake_ms(fns, calls=2, rounds=15, graphed=True, ready=None):
        runs.append(sorted(fns))
        scale = len(runs)   # each run its own clock: the monolithic calls read differently in each
        return {name: {"ms": (2.0 if name.startswith("mono") else 1.0) * scale, "spread_ms": 0.0, "launch_us": 0.0, "calls": 1} for name in fns}
    monkeypatch.setattr(bk, "interleaved_ms", fake_ms)
    monkeypatch.setattr(bk, "host_us", lambda fn, calls=20: 1.0)
    docs = bk.pack_lengths(96, 8, 32, 8, seed=1)
    p = bk.pack_setup(4, 4, 2, 8, docs, "cpu", dtype=torch.float32)
    mono = {f"fa4 varlen {tag} {phase}": (lambda: None) for tag in ("vanilla", "learnable") for phase in ("fwd", "bwd")}
    rows = bk.slowest_rank(["torch"], p.schedule, [0, 3], p.shards, p.ks, p.vs, p.sink, "causal", 8, mono=mono)
    assert len(runs) == 2 and all({f"mono {n}" for n in mono} <= set(run) for run in runs)
    for r in rows:   # every rank's run reads 1 x its scale for the ring, 2 x for the monolithic calls
        scale = r["fwd_ms"]
        assert r["mono_ms"] == {n: {"ms": 2.0 * scale, "spread_ms": 0.0, "launch_us": 0.0, "calls": 1} for n in mono}
    apart = {n: {"ms": 10.0} for n in mono}
    bk.with_rates(rows, p.flops, apart, mono="fa4 varlen")
    for r in rows:   # the ring's FLOPs are a quarter of the pack's: (1/4) / (1 / 2) in its own run
        assert r["fwd_vs_fa4_mono"] == pytest.approx(0.5)
        assert r["bwd_vs_fa4_mono"] == pytest.approx(0.5)
        assert r["fwd_vs_fa4_mono_separate_run"] == pytest.approx(r["flops"] / r["fwd_ms"] / (p.flops / 10.0))


def test_the_timeline_counts_the_time_no_kernel_ran(bk):
    """Kernels of two streams, overlapping and with gaps: each one's gap since any ended, the
    union of their times, the part of it where a copy ran alone (eager or graphed), and the idle
    rest of the span."""
    def event(start, end, stream, name):
        return types.SimpleNamespace(time_range=types.SimpleNamespace(start=start, end=end),
                                     device_resource_id=stream, name=name)
    text = bk.timeline([event(100, 200, 7, "a"), event(150, 260, 61, "Memcpy DtoD"), event(300, 400, 7, "b"),
                        event(390, 395, 61, "c")])
    lines = text.splitlines()
    assert [line.split()[:3] for line in lines[1:5]] == [["0.0", "100.0", "0.0"], ["50.0", "110.0", "0.0"],
                                                         ["200.0", "100.0", "40.0"], ["290.0", "5.0", "0.0"]]
    assert lines[-1] == ("span 300.0 us: kernels running 260.0 us, only copies 60.0 us (20.0%), "
                         "none running 40.0 us (13.3%)")
    assert bk.timeline([]) == "(no kernels)"
    graphed = bk.timeline([event(100, 200, 7, "a"), event(150, 260, 61, "memcpy128"), event(300, 400, 7, "b")])
    assert graphed.splitlines()[-1].startswith("span 300.0 us: kernels running 260.0 us, only copies 60.0 us")


def test_the_fa4_varlen_call_passes_what_fa4s_interface_asserts(bk, monkeypatch):
    """A stand-in for flash_attn.cute.interface holding FA4 4.0.0b36's argument checks for varlen."""
    calls = []

    def fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            softmax_scale=None, causal=False, learnable_sink=None, return_lse=False):
        t, h, d = q.shape
        batch = cu_seqlens_q.shape[0] - 1
        assert k.shape == v.shape and k.dim() == 3 and k.shape[0] == t and h % k.shape[1] == 0
        for cu in (cu_seqlens_q, cu_seqlens_k):
            assert cu.dtype == torch.int32 and cu.shape == (batch + 1,) and cu.stride(0) == 1
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int) and causal and return_lse
        assert learnable_sink is None or (learnable_sink.shape == (h,) and learnable_sink.dtype == torch.float32)
        calls.append("fwd")
        return torch.empty_like(q), torch.empty(h, t), None, None, None

    def bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None, learnable_sink=None):
        t, h, _ = q.shape
        assert out.shape == dout.shape == q.shape and lse.shape == (h, t), "lse must have shape (num_head, total_q)"
        assert cu_seqlens_q is cu_seqlens_k and causal and isinstance(max_seqlen_q, int)
        calls.append("bwd")

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = fwd, bwd
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    p = bk.pack_setup(2, 8, 2, 16, [32, 64, 32], "cpu")
    for sink in (None, p.sink):
        f, b = bk.fa4_varlen(p, sink, 0.25)
        f()
        b()
    assert calls == ["fwd", "fwd", "bwd"] * 2


@pytest.mark.parametrize("cp,mask", [(2, "causal"), (4, "causal"), (4, "no_mask")])
@pytest.mark.parametrize("kind", ["ring", "direct", "allgather"])
@pytest.mark.parametrize("docs", [None, (32, 64, 32)], ids=["sequence", "pack"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loopback_ring_runs_the_rings_own_exchanges(bk, cp, mask, kind, docs, dtype):
    """``--ring-backends BACKEND+comm`` times ``P2PAttention`` over ``Loopback``: every message
    the plan of the K/V schedule sends reaches it, for a sequence and for a pack, with the bytes
    the schedule counts (in bf16, direct's dK/dV partials written once per row travel in bf16,
    the others in fp32)."""
    from sinkprof.options import KVSchedule, SinkStrategy, SoftmaxType
    from sinkprof.schedule import CommSchedule, comm_bytes
    from sinkprof.sink import sink_logits
    b, h, g, d, s = 1, 4, 2, 16, 32 * cp
    cu = None if docs is None else [0, *itertools.accumulate(n * cp // 2 for n in docs)]
    s = s if cu is None else cu[-1]
    spec = bk._spec("learnable", mask, cu)
    schedule = CommSchedule(KVSchedule.parse(kind, "kind"), cp, spec.chunks(s, cp), spec.band)
    gen = torch.Generator().manual_seed(cp)
    q, do = (torch.randn(b, s, h, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, s, g, d, generator=gen).to(dtype) for _ in range(2))
    sink = sink_logits(SoftmaxType.LEARNABLE, torch.randn(1, h, 1, 1, generator=gen) * 5, h, "cpu")
    for rank in (0, cp - 1):
        parts = [bk.shard(x, cp, rank, 1, cu) for x in (q, k, v, do)]
        ring = bk._comm_ring_fns(get_kernel("torch", "cpu"), schedule, rank, *parts, sink, "learnable",
                                 SinkStrategy.STEP0, mask, d, cu)
        ring.fwd()
        ring.bwd()
        planned, planned_bytes = collections.Counter(), collections.Counter()
        for t in comm_bytes(s=s, b=b, h=h, g=g, d=d, dtype=q.dtype, cp=cp, mask=mask, kv_schedule=kind,
                            cu_seqlens=cu):
            if t.rank == rank:
                planned[(t.phase, t.kind)] += t.messages_received
                planned_bytes[(t.phase, t.kind)] += t.received
        assert dict(ring.comm.received) == dict(planned)
        assert dict(ring.comm.received_bytes) == dict(planned_bytes)
        assert planned[("bwd", "dkv")] >= cp - 1
        if kind == "direct" and dtype is torch.bfloat16 and docs is None:   # the partials come in bf16
            shard = 2 * b * g * d * s // cp   # elements of a shard's K and V
            assert planned_bytes[("bwd", "dkv")] <= 2 * shard * (cp - 1)


def test_the_loopback_never_feeds_zeros(bk):
    """A received buffer that no sent one of its size fills comes from a kept buffer of standard
    normal values, the same at every message (made once), never zeros: FA4 runs faster on zeros,
    so a rank fed them timed faster than it is. A same-size send is copied as it is."""
    comm = bk.Loopback(0, 4, "cpu")
    send = torch.full((32, 16), 3.0, dtype=torch.bfloat16)
    recv, again, same = torch.empty(64, 16, dtype=torch.bfloat16), torch.empty(64, 16, dtype=torch.bfloat16), \
        torch.empty(32, 16, dtype=torch.bfloat16)
    comm.post([(send, 1)], [(recv, 3)], "kv", "fwd", 1).wait()
    assert 0.8 < recv.float().std().item() < 1.2 and abs(recv.float().mean().item()) < 0.2
    assert (recv == 0).float().mean().item() < 0.01
    comm.post([], [(again, 3)], "kv", "fwd", 2).wait()
    assert torch.equal(again, recv)
    comm.post([(send, 1)], [(same, 3)], "kv", "fwd", 3).wait()
    assert torch.equal(same, send)
    assert comm.received[("fwd", "kv")] == 3


def test_the_null_communicator_moves_nothing_and_fills_what_a_capture_received_into(bk, monkeypatch):
    """``BACKEND+null``: the ring's own code with no message moved. Every message is still
    counted. Issued eagerly, a buffer is filled with normal values the first time its memory is
    received into, and left as it is after; under a CUDA graph's capture it is kept, and ``fill``
    writes normal values into it once the capture is done (the graph then reads no zeros)."""
    def normal(t):
        return 0.8 < t.float().std().item() < 1.2 and (t == 0).float().mean().item() < 0.01
    comm = bk.Loopback(0, 4, "cpu", copies=False)
    send = torch.full((32, 16), 3.0, dtype=torch.bfloat16)
    recv = torch.zeros(32, 16, dtype=torch.bfloat16)
    comm.post([(send, 1)], [(recv, 3)], "kv", "fwd", 1).wait()
    assert normal(recv) and comm.unfilled == []
    recv.zero_()
    comm.post([(send, 1)], [(recv, 3)], "kv", "fwd", 2).wait()
    assert (recv == 0).all()   # filled once, not at every message
    monkeypatch.setattr(comm, "capturing", lambda: True)
    captured = torch.zeros(64, 16, dtype=torch.bfloat16)
    comm.post([(send, 1)], [(recv, 3), (captured, 3)], "kv", "fwd", 3).wait()
    assert (recv == 0).all() and (captured == 0).all() and len(comm.unfilled) == 2
    comm.fill()
    assert normal(recv) and normal(captured)
    assert comm.unfilled == [] and comm.received[("fwd", "kv")] == 3
    assert comm.received_bytes[("fwd", "kv")] == (3 * 32 + 64) * 16 * 2


def test_a_null_ring_is_timed_after_its_buffers_are_filled(bk, monkeypatch):
    """``slowest_rank`` with ``torch+null`` runs ``P2PAttention`` over a ``Loopback`` that copies
    nothing, and its timing gets the fill of those rings' buffers to call between capture and the
    rounds."""
    filled = []
    monkeypatch.setattr(bk.Loopback, "fill", lambda self: filled.append(self))

    def cpu_ms(fns, calls=2, rounds=15, graphed=True, ready=None):
        assert filled == []
        ready()
        return {name: {"ms": 1.0, "spread_ms": 0.0, "launch_us": 0.0, "calls": 1} for name in fns}
    monkeypatch.setattr(bk, "interleaved_ms", cpu_ms)
    monkeypatch.setattr(bk, "host_us", lambda fn, calls=20: 1.0)
    docs = bk.pack_lengths(96, 8, 32, 8, seed=1)
    p = bk.pack_setup(4, 4, 2, 8, docs, "cpu", dtype=torch.float32)
    rows = bk.slowest_rank(["torch+null"], p.schedule, [0], p.shards, p.ks, p.vs, p.sink, "causal", 8,
                           cu_seqlens=[0, *itertools.accumulate(docs)])
    assert [r["backend"] for r in rows] == ["torch+null"] * 3
    assert len(filled) == 3 and all(not c.copies for c in filled)


def test_the_concurrent_loopback_is_its_own_backend_in_the_same_run(bk, monkeypatch):
    """``BACKEND+comm-concurrent`` runs the ring's own code over a ``Loopback`` that issues every
    copy at once (on the GPU, each on a stream of its own), timed in the same interleaved run as
    ``+comm``; on the CPU its messages arrive as the plain loopback's do."""
    made = []
    real = bk.Loopback.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(bk.Loopback, "__init__", init)
    monkeypatch.setattr(bk, "interleaved_ms", lambda fns, calls=2, rounds=15, graphed=True, ready=None:
                        {name: {"ms": 1.0, "spread_ms": 0.0, "launch_us": 0.0, "calls": 1} for name in fns})
    monkeypatch.setattr(bk, "host_us", lambda fn, calls=20: 1.0)
    docs = bk.pack_lengths(96, 8, 32, 8, seed=1)
    p = bk.pack_setup(4, 4, 2, 8, docs, "cpu", dtype=torch.float32)
    rows = bk.slowest_rank(["torch+comm", "torch+comm-concurrent"], p.schedule, [0], p.shards, p.ks, p.vs, p.sink,
                           "causal", 8, cu_seqlens=[0, *itertools.accumulate(docs)])
    assert [r["backend"] for r in rows] == ["torch+comm"] * 3 + ["torch+comm-concurrent"] * 3
    assert [c.concurrent for c in made] == [False] * 3 + [True] * 3
    assert all(c.copies and c.streams == [] for c in made)
    assert made[0].received == made[3].received and made[0].received_bytes == made[3].received_bytes


def test_a_ranks_calls_are_its_steps_tiles_and_their_standalone_time_its_shape_cost(bk):
    """What a ring's tile shapes cost: a causal cp 8 rank's calls are its step-0 causal tile and
    one full tile a step (rank 4: four of all its rows against the first chunk, then three of its
    second chunk against whole shards), and with its runs joined (``join_runs``, at most 16k keys
    a call) one call per run; its efficiency were they all it did is its share of FA4's monolithic
    time over those calls' standalone times, per phase, given to fa4 vanilla rows only. A pack's
    varlen groups have no dense shape: no figure."""
    from sinkprof.options import Band, KVSchedule
    from sinkprof.plan import join_runs
    from sinkprof.schedule import CommSchedule
    c = 4096
    schedule = CommSchedule(KVSchedule.DIRECT, 8, c, Band(None, 0))
    calls = bk.rank_calls(schedule.plans[4])
    assert calls == [(2 * c, 2 * c, Band(None, 0))] + [(2 * c, c, Band())] * 4 + [(c, 2 * c, Band())] * 3
    assert bk.rank_calls(schedule.plans[0]) == [(2 * c, 2 * c, Band(None, 0))] + [(c, 2 * c, Band())] * 7
    assert bk.rank_calls(schedule.joined_plans[4]) == [(2 * c, 2 * c, Band(None, 0)), (2 * c, 4 * c, Band()),
                                                        (c, 4 * c, Band()), (c, 2 * c, Band())]
    assert bk.rank_calls(join_runs(schedule.plans[7])) == [(2 * c, 2 * c, Band(None, 0)), (2 * c, 4 * c, Band()),
                                                           (2 * c, 3 * c, Band())]
    assert [bk.shape_key(2 * c, c, band) for band in (Band(), Band(None, 0), Band(-127, 0), Band(3, None))] == [
        "tile 8192x4096 full", "tile 8192x4096 causal", "tile 8192x4096 band -127..0", "tile 8192x4096 band 3..inf"]
    timed = {"fa4 vanilla fwd": {"ms": 16.0}, "fa4 vanilla bwd": {"ms": 40.0}}
    for (n_q, n_kv, band), fwd in {(2 * c, 2 * c, Band(None, 0)): 0.5, (2 * c, c, Band()): 0.25,
                                   (c, 2 * c, Band()): 0.2, (2 * c, 4 * c, Band()): 0.9,
                                   (c, 4 * c, Band()): 0.38}.items():
        timed[f"{bk.shape_key(n_q, n_kv, band)} fwd"] = {"ms": fwd}
        timed[f"{bk.shape_key(n_q, n_kv, band)} bwd"] = {"ms": 2.5 * fwd}
    rows = [dict(backend=backend, kv_schedule=kv, rank=4, flops=1, variant=variant)
            for backend, kv, variant in [("fa4+comm", "direct", "vanilla step0"), ("fa4", "ring", "vanilla step0"),
                                         ("cudnn", "direct", "vanilla step0"), ("fa4", "direct", "learnable step0")]]
    per_phase = {("direct", 4, "fwd"): bk.rank_calls(schedule.joined_plans[4]), ("direct", 4, "bwd"): calls}
    out = bk.with_standalone_calls(rows, per_phase, 8, timed)
    assert out[0]["fwd_vs_fa4_mono_calls_standalone"] == pytest.approx(16.0 / 8 / (0.5 + 0.9 + 0.38 + 0.2))
    assert out[0]["bwd_vs_fa4_mono_calls_standalone"] == pytest.approx(40.0 / 8 / (2.5 * (0.5 + 4 * 0.25 + 3 * 0.2)))
    assert not any("fwd_vs_fa4_mono_calls_standalone" in row for row in out[1:])
    docs = bk.pack_lengths(16 * 2 * 6, 8 * 2, 32 * 2, 4, seed=2)
    pack = CommSchedule(KVSchedule.ALLGATHER, 2, tuple(n // 4 for n in docs), Band(None, 0))
    assert any(len(gr) > 1 for st in pack.plans[0].steps for gr in st.groups)
    assert bk.rank_calls(pack.plans[0]) is None


def test_the_full_window_experiment_covers_every_pair_and_leaves_other_bands(bk):
    """``--fa4-full-window``: a full band becomes a window that, read in FA4's bottom-right
    convention (row i sees keys i + (n_kv - n_q) - left .. i + (n_kv - n_q) + right), covers every
    key of every row; causal and windowed bands keep FA4's own reading."""
    from sinkprof.options import Band
    for n_q, n_kv in [(8, 8), (4, 16), (16, 4)]:
        causal, left, right = bk._full_as_window(Band(), n_q, n_kv)
        assert not causal
        offset = n_kv - n_q
        assert all(i + offset - left <= 0 and i + offset + right >= n_kv - 1 for i in range(n_q))
        for band in (Band(None, 0), Band(-3, 0), Band(-2, 2)):
            assert bk._full_as_window(band, n_q, n_kv) == bk.FA4_WINDOW(band, n_q, n_kv)
    args = bk.parse_args(["--fa4-full-window", "--loopback-priority", "high", "--run-rows", "65536"])
    assert args.fa4_full_window and args.loopback_priority == "high" and args.run_rows == 65536
    with pytest.raises(SystemExit):
        bk.parse_args(["--run-rows", "0"])


def test_the_full_window_experiment_changes_the_forward_alone(bk):
    """``_forward_full_as_window``: inside the wrapped forward the fa4 module reads a full band as
    the covering window; before and after the call it reads FA4's own."""
    from sinkprof.kernels import fa4 as fa4_module
    from sinkprof.options import Band
    seen = []
    wrapped = bk._forward_full_as_window(lambda n_q, n_kv: seen.append(fa4_module.fa4_window(Band(), n_q, n_kv)))
    wrapped(4, 16)
    assert seen == [(False, 16, 4)]
    assert fa4_module.fa4_window(Band(), 4, 16) == bk.FA4_WINDOW(Band(), 4, 16) == (False, None, None)


@pytest.mark.parametrize("script", ["pieces_probe.py", "overlap_probe.py"])
@pytest.mark.parametrize("argv,says", [(["--n", "100"], "--n 100"), (["--shapes", "h99"], "--shapes"),
                                       ([], "needs FlashAttention-4 on a GPU")])
def test_the_probes_usage_errors_name_the_option_and_exit_2(script, argv, says):
    """The probes refuse a bad size or shape by name, and say why FA4 cannot run (no GPU here),
    with exit 2 and no traceback."""
    import subprocess
    if torch.cuda.is_available() and not argv:
        pytest.skip("a GPU is here: the probe would run")
    done = subprocess.run([sys.executable, str(SCRIPT.parent / script), *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("script,argv,says", [
    ("layout_probe.py", ["--kv-rows", "0"], "--kv-rows 0"), ("layout_probe.py", ["--kv-rows", "x"], "--kv-rows x"),
    ("layout_probe.py", [], "needs FlashAttention-4 on a GPU"), ("copy_probe.py", ["--mib", "0"], "--mib 0"),
    ("copy_probe.py", [], "needs FlashAttention-4 on a GPU")])
def test_the_layout_and_copy_probes_usage_errors_name_the_option_and_exit_2(script, argv, says):
    import subprocess
    if torch.cuda.is_available() and not argv:
        pytest.skip("a GPU is here: the probe would run")
    done = subprocess.run([sys.executable, str(SCRIPT.parent / script), *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_graph_census_reads_as_one_line_the_most_frequent_type_first(bk):
    assert bk.census_text({"kernel": 7, "event record": 3, "empty": 3, "memcpy": 1}) == \
        "14 nodes: 7 kernel, 3 empty, 3 event record, 1 memcpy"
    assert bk.census_text({"kernel": 1}) == "1 node: 1 kernel"
    assert bk.census_text({}) == "0 nodes"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graph_census_counts_the_nodes_a_capture_made_and_the_kept_graph_replays(bk):
    x = torch.zeros(1024, device="cuda")
    y = torch.empty_like(x)

    def fn():
        for _ in range(3):
            x.add_(1)
        y.copy_(x)
    graph = bk.capture(fn, 1, keep=True)   # (its warm-up added 2 x 3 to x)
    counts = bk.graph_census(graph)
    assert counts.get("kernel", 0) + counts.get("memcpy", 0) == 4 and counts.get("kernel", 0) >= 3, counts
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert y.eq(3).all() and x.eq(3).all()


def test_a_shorter_functions_replay_holds_more_calls_so_every_round_is_as_long(bk):
    per = bk.round_calls({"mono": 70.0, "ring": 3.1, "tile": 0.05, "twin": 68.0, "zero": 0.0}, 1)
    assert per == {"mono": 1, "ring": 23, "tile": bk.ROUND_CALLS_MAX, "twin": 1, "zero": bk.ROUND_CALLS_MAX}
    # short functions alone: every round lasts ROUND_MS at least
    assert bk.round_calls({"a": 1.0, "b": 2.5}, 2) == {"a": round(bk.ROUND_MS), "b": round(bk.ROUND_MS / 2.5)}
    assert bk.round_calls({}, 2) == {}


def test_equal_rounds_recapture_a_shorter_function_with_more_calls_and_time_each_call(bk, monkeypatch):
    call_ms = {"mono": 70.0, "ring": 3.5}
    gpu = {"ms": 0.0}   # a fake GPU clock: a replay of n calls of f adds n * call_ms[f]
    captures, filled = [], []

    class Graph:
        def __init__(self, fn, n):
            self.name, self.n = fn(), n
            captures.append((self.name, n))

        def replay(self):
            gpu["ms"] += self.n * call_ms[self.name]

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = gpu["ms"]

        def synchronize(self):
            """The fake GPU has always finished."""

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(bk, "capture", Graph)
    monkeypatch.setattr(bk.torch.cuda, "Event", Event)
    fns = {name: (lambda name=name: name) for name in call_ms}
    out = bk.interleaved_ms(fns, calls=1, rounds=3, ready=lambda: filled.append(len(captures)))
    assert captures == [("mono", 1), ("ring", 1), ("ring", 20)]   # 70 ms a round for both
    assert filled == [2, 3]   # received buffers filled before the calibrating replays and after the recapture
    assert {name: (r["ms"], r["calls"]) for name, r in out.items()} == {"mono": (70.0, 1), "ring": (3.5, 20)}
    monkeypatch.setattr(bk, "FIXED_ROUNDS", True)
    captures.clear()
    out = bk.interleaved_ms(fns, calls=2, rounds=3)
    assert captures == [("mono", 2), ("ring", 2)] and out["ring"]["calls"] == 2 and out["ring"]["ms"] == 3.5
