"""The ring's own code (``P2PAttention``: its K/V and dK/dV movers, its buffers in K/V's dtype)
run by one thread per rank over an in-memory communicator, against the emulator's replay of the
same schedule with the same tile kernel: equal bit for bit, in bf16, where the home dK/dV is held
in K/V's dtype and the returning partials are kept and summed at the end."""
import collections
import threading

import pytest
import torch

from sinkprof import ring as ring_module
from sinkprof.emulate import emulate_ring
from sinkprof.kernels import TorchTiles
from sinkprof.options import CPOptions, KVSchedule, SinkStrategy, make_spec
from sinkprof.plan import shard, unshard
from sinkprof.ring import P2PAttention
from sinkprof.testing import Shape, make_inputs

TIMEOUT_S = 60


class ThreadRing:
    """Messages between threads: a send is a copy queued under (sender, receiver, phase, kind,
    step), which the receiver's ``wait`` copies into its buffer."""

    def __init__(self, size: int):
        self.size = size
        self.box = collections.defaultdict(collections.deque)
        self.cv = threading.Condition()
        self.events = collections.defaultdict(list)   # rank -> ("post" | "wait", phase, kind, label)

    def member(self, rank: int) -> "Member":
        return Member(self, rank)


class Member:
    def __init__(self, ring: ThreadRing, rank: int):
        self.ring, self.rank, self.size = ring, rank, ring.size

    def exchange(self, send, recv, kind: str, phase: str, step: int):
        return self.post([(send, (self.rank + 1) % self.size)], [(recv, (self.rank - 1) % self.size)],
                         kind, phase, step)

    def post(self, sends: list, recvs: list, kind: str, phase: str, step: int):
        ring = self.ring
        with ring.cv:
            for t, peer in sends:
                ring.box[(self.rank, peer, phase, kind, step)].append(t.clone())
            ring.cv.notify_all()
        ring.events[self.rank].append(("post", phase, kind, step, bool(sends), bool(recvs), len(sends), len(recvs)))
        return Arrival(ring, [(t, (peer, self.rank, phase, kind, step)) for t, peer in recvs],
                       (self.rank, ("wait", phase, kind, step, bool(sends), bool(recvs), len(sends), len(recvs))))


class Arrival:
    def __init__(self, ring: ThreadRing, recvs: list, event):
        self.ring, self.recvs, self.event = ring, recvs, event

    def wait(self) -> None:
        self.ring.events[self.event[0]].append(self.event[1])
        with self.ring.cv:
            for t, key in self.recvs:
                if not self.ring.cv.wait_for(lambda: self.ring.box[key], timeout=TIMEOUT_S):
                    raise TimeoutError(f"no message {key}")
                t.copy_(self.ring.box[key].popleft())


class _Ctx:
    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def _run_threads(inputs, spec, cp: int, strategy: SinkStrategy, kv_schedule: KVSchedule, fused: bool = False):
    """Every rank's ``P2PAttention`` forward then backward, one thread each; the results unsharded.
    ``fused``: each rank's k and v are the halves of one buffer (a fused K/V projection's output)."""
    sd = spec.qkv_format.seq_dim
    opts = CPOptions(spec, inputs.q.shape[3] ** -0.5, TorchTiles(), strategy, kv_schedule=kv_schedule)
    ring = ThreadRing(cp)
    results, errors = [None] * cp, []

    def rank(r: int) -> None:
        try:
            q, k, v, do = (shard(x, cp, r, sd) for x in (inputs.q, inputs.k, inputs.v, inputs.grad_out))
            if fused:
                k, v = torch.stack([k, v], dim=sd + 1).unbind(sd + 1)
            ctx = _Ctx()
            out = P2PAttention.forward(ctx, q, k, v, inputs.offset, None, opts, ring.member(r))
            results[r] = (out, *P2PAttention.backward(ctx, do)[:4])
        except Exception as exc:   # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads), "a rank hung"
    names = ("out", "dq", "dk", "dv")
    got = {name: unshard([results[r][i] for r in range(cp)], sd) for i, name in enumerate(names)}
    return got, [results[r][4] for r in range(cp)], ring.events


@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_the_threaded_ring_equals_the_emulator_bit_for_bit_in_bf16_under_direct(mask, softmax_type, monkeypatch):
    cp = 4
    spec = make_spec(softmax_type, mask, None, "bshd")
    inputs = make_inputs(Shape(b=1, s=64, h=4, g=2, d=8), spec, seed=11).to("cpu", torch.bfloat16)
    homes = []
    real = ring_module.DirectDKV.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        homes.append(self.acc.dtype)
    monkeypatch.setattr(ring_module.DirectDKV, "__init__", spy)
    got, d_sinks, _ = _run_threads(inputs, spec, cp, SinkStrategy.STEP0, KVSchedule.DIRECT)
    # every home dK/dV of this schedule is held in bf16 (nothing is ever added into it before the end)
    assert homes == [torch.bfloat16] * cp
    emu = emulate_ring(inputs, spec, cp, SinkStrategy.STEP0, kv_schedule="direct")
    assert emu.kv_schedule is KVSchedule.DIRECT
    expected = emu.result
    for name, want in (("out", expected.out), ("dq", expected.dq), ("dk", expected.dk), ("dv", expected.dv)):
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], want.to(torch.bfloat16)), name
    if softmax_type == "learnable":
        for mine, part in zip(d_sinks, emu.d_sink_parts):
            assert torch.equal(mine.reshape(part.shape), part)
    else:
        assert d_sinks == [None] * cp


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fmt,b", [("bshd", 1), ("sbhd", 2), ("bshd", 2)])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_a_forward_of_joined_runs_posts_a_whole_run_at_once_and_equals_the_reference(fmt, b, mask, fused):
    """At cp 4 under direct a rank's forward joins its runs of steps (their rows side by side in
    one buffer, in place): as a step that computes starts, the messages of every step of the next
    run are posted, before any is waited for (rank 0 posts steps 1..3 at step 0), and the result
    (fp64) is the reference's. Where the rows are not outermost (bshd with b > 1) the steps are
    not joined: one message ahead. K and V travel apart (two tensors a message), or ``fused`` as
    the one buffer they are the halves of."""
    from sinkprof.schedule import CommSchedule
    from sinkprof.testing import reference
    cp = 4
    spec = make_spec("learnable", mask, None, fmt)
    inputs = make_inputs(Shape(b=b, s=64, h=4, g=2, d=8), spec, seed=5)
    got, d_sinks, events = _run_threads(inputs, spec, cp, SinkStrategy.STEP0, KVSchedule.DIRECT, fused)
    schedule = CommSchedule(KVSchedule.DIRECT, cp, 8, spec.band)
    joined = fmt == "sbhd" or b == 1
    for rank in range(cp):
        plan = (schedule.joined_plans if joined else schedule.plans)[rank]
        expected = []
        for i in [0] + [s_.index for s_ in plan.steps[1:] if plan.landing[s_.index][0] == s_.index]:
            if i:
                expected += [("wait", "fwd", "kv", j - 1) for j in sorted(plan.landing) if plan.landing[j][0] == i]
            expected += [("post", "fwd", "kv", j - 1) for j in sorted(plan.posted_at) if plan.posted_at[j] == i]
        received = [e[:4] for e in events[rank] if e[1:3] == ("fwd", "kv") and e[5]]
        assert received == expected, rank
    first = [e[0] for e in events[0] if e[1:3] == ("fwd", "kv") and e[5]]
    assert first == (["post"] * 3 + ["wait"] * 3 if joined else ["post", "wait"] * 3)
    # every rank sends each message (labelled with its step less one) once, received once
    sent = sorted((e[3], r) for r in range(cp) for e in events[r] if e[:3] == ("post", "fwd", "kv") and e[4])
    assert sent == sorted((j - 1, r) for r in range(cp) for j in range(1, cp))
    # a message is one tensor a piece: K and V stacked (fused) or apart
    pieces = 1 if fused else 2
    assert {e[6] for r in range(cp) for e in events[r] if e[:3] == ("post", "fwd", "kv") and e[4]} == {pieces}
    assert {e[7] for r in range(cp) for e in events[r] if e[:3] == ("post", "fwd", "kv") and e[5]} == {pieces}
    ref = reference(inputs, spec)
    for name, want in (("out", ref.out), ("dq", ref.dq), ("dk", ref.dk), ("dv", ref.dv)):
        assert torch.allclose(got[name], want, atol=1e-12, rtol=0), name
    assert torch.allclose(sum(x.reshape(-1) for x in d_sinks), ref.d_offset.reshape(-1), atol=1e-12, rtol=0)


class _Comm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("cp", [3, 4, 8])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_an_owner_posts_each_message_at_the_step_its_reader_posts_the_receive(cp, mask):
    """Under a causal mask the ranks' runs differ (rank 5 at cp 8 needs step 5's K/V right after
    its step 0; rank 0 computes steps 1..4 first): each message is posted by its owner and its
    reader at the same step index, the reader's step before the run that reads it, so it is in
    flight while that step computes on the reader whatever the owner's runs."""
    from sinkprof.ring import DirectKV
    from sinkprof.schedule import CommSchedule
    spec = make_spec("vanilla", mask, None, "bshd")
    c = 2048
    schedule = CommSchedule(KVSchedule.DIRECT, cp, c, spec.band)
    plans = schedule.joined_plans
    kv = (torch.zeros(1, 2 * c, 1, 1), torch.zeros(1, 2 * c, 1, 1))
    movers = [DirectKV(_Comm(r, cp), kv, spec.qkv_format, "fwd", schedule, plans) for r in range(cp)]
    for owner in range(cp):
        for j in range(1, cp):
            reader = (owner + j) % cp
            at = plans[reader].posted_at[j]
            assert (j, True, False) in movers[owner].posts[at] or (j, True, True) in movers[owner].posts[at]
            assert any(p[0] == j and p[2] for p in movers[reader].posts[at])
            assert at < plans[reader].landing[j][0]
    if mask == "causal" and cp == 8:
        assert plans[5].posted_at[5] == 0 and plans[0].posted_at[5] == 4
        assert (5, True, False) in movers[0].posts[0]        # rank 0 sends rank 5's step 5 at its step 0
        assert (5, False, True) in movers[0].posts[4]        # and receives its own at its step 4


@pytest.mark.parametrize("cp", [4, 8])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_a_backward_of_joined_runs_returns_each_steps_dkv_at_the_end_of_its_run_in_one_order(cp, mask):
    """Under direct the backward joins the forward's runs (``joined_plans``): a run's K/V messages
    are posted together and each of its steps' dK/dV leaves, dK and dV apart (two tensors), once
    the run's call is done (``RankPlan.computed_at``). Its owner posts the receive at its own step
    of that index, in the same post as the dK/dV it sends for the same step j if it sends then:
    every rank's posts go in the order (index, j), so batches of NCCL p2p calls, which run in
    order on one stream, meet their peers' in one order. The result (fp64) is the reference's."""
    from sinkprof.schedule import CommSchedule
    from sinkprof.testing import reference
    spec = make_spec("learnable", mask, None, "sbhd")
    s = 64 if cp == 4 else 128
    inputs = make_inputs(Shape(b=2, s=s, h=4, g=2, d=8), spec, seed=9)
    got, d_sinks, events = _run_threads(inputs, spec, cp, SinkStrategy.STEP0, KVSchedule.DIRECT)
    plans = CommSchedule(KVSchedule.DIRECT, cp, s // (2 * cp), spec.band).joined_plans
    assert any(st.joins for p in plans for st in p.steps)
    sent = []
    for rank in range(cp):
        plan = plans[rank]
        # the backward's K/V: as the forward's, a run's messages posted together
        expected = []
        for i in [0] + [st.index for st in plan.steps[1:] if plan.computed_at[st.index] == st.index]:
            if i:
                expected += [("wait", "bwd", "kv", j - 1) for j in sorted(plan.computed_at) if plan.computed_at[j] == i]
            expected += [("post", "bwd", "kv", j - 1) for j in sorted(plan.posted_at) if plan.posted_at[j] == i]
        assert [e[:4] for e in events[rank] if e[1:3] == ("bwd", "kv") and e[5]] == expected, rank
        keys = []
        for e in events[rank]:
            if e[:3] != ("post", "bwd", "dkv"):
                continue
            j, sends, recvs, n_sends, n_recvs = e[3:]
            at = {plan.computed_at[j]} if sends else set()
            at |= {plans[(rank + j) % cp].computed_at[j]} if recvs else set()
            assert len(at) == 1, (rank, j, at)   # a send and a receive in one post: one index
            keys.append((at.pop(), j))
            assert n_sends in (0, 2) and n_recvs in (0, 2)   # dK and dV apart
            if sends:
                sent.append((rank, j))
        assert keys == sorted(keys), rank
    assert sorted(sent) == [(r, j) for r in range(cp) for j in range(1, cp)
                            if plans[r].steps[j].held_rows]
    ref = reference(inputs, spec)
    for name, want in (("out", ref.out), ("dq", ref.dq), ("dk", ref.dk), ("dv", ref.dv)):
        assert torch.allclose(got[name], want, atol=1e-12, rtol=0), name
    assert torch.allclose(sum(x.reshape(-1) for x in d_sinks), ref.d_offset.reshape(-1), atol=1e-12, rtol=0)
