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
        return Arrival(ring, [(t, (peer, self.rank, phase, kind, step)) for t, peer in recvs])


class Arrival:
    def __init__(self, ring: ThreadRing, recvs: list):
        self.ring, self.recvs = ring, recvs

    def wait(self) -> None:
        with self.ring.cv:
            for t, key in self.recvs:
                if not self.ring.cv.wait_for(lambda: self.ring.box[key], timeout=TIMEOUT_S):
                    raise TimeoutError(f"no message {key}")
                t.copy_(self.ring.box[key].popleft())


class _Ctx:
    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def _run_threads(inputs, spec, cp: int, strategy: SinkStrategy, kv_schedule: KVSchedule):
    """Every rank's ``P2PAttention`` forward then backward, one thread each; the results unsharded."""
    sd = spec.qkv_format.seq_dim
    opts = CPOptions(spec, inputs.q.shape[3] ** -0.5, TorchTiles(), strategy, kv_schedule=kv_schedule)
    ring = ThreadRing(cp)
    results, errors = [None] * cp, []

    def rank(r: int) -> None:
        try:
            q, k, v, do = (shard(x, cp, r, sd) for x in (inputs.q, inputs.k, inputs.v, inputs.grad_out))
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
    return got, [results[r][4] for r in range(cp)]


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
    got, d_sinks = _run_threads(inputs, spec, cp, SinkStrategy.STEP0, KVSchedule.DIRECT)
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
