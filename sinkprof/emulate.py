"""The emulator: the exact ring schedule of every rank, replayed in one process (fp64 for the checks).

K/V "communication" is indexing into the other ranks' shards that exposes only the rows the
communication schedule sends (a tile reading any other row raises ``ring.MissingRows``), and
dK/dV are added into their owner's accumulators; the loops themselves are the distributed ring's
(``ring.run_*``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .a2a import join_outer
from .kernels import TorchTiles
from .options import AttnSpec, CPOptions, KVSchedule, QKVFormat, SinkStrategy, accum_dtype, check_a2a_size, check_heads, check_scale
from .plan import shard, spec_layout, unshard
from .ring import (BackwardState, BiasTiles, ForwardState, LocalDKV, LocalKV, joined_plan, run_backward,
                   run_forward)
from .schedule import comm_schedule, row_bytes
from .sink import sink_logits
from .testing import Inputs, Result


@dataclass
class EmulatedRing:
    result: Result                   # unsharded outputs and gradients; d_offset is the CP sum
    d_sink_parts: list               # each rank's own rows' sink gradient (None without a sink)
    kv_schedule: KVSchedule = KVSchedule.RING   # the K/V schedule replayed ('auto' resolved)


def emulate_ring(inputs: Inputs, spec: AttnSpec, cp: int, strategy: SinkStrategy,
                 scale=None, kernel=None, kv_schedule="auto") -> EmulatedRing:
    """Run every rank's forward then backward tile schedule from the ring plan with the given tile
    kernel (default: the torch tiles), on the inputs' device, under the K/V schedule asked for."""
    if spec.qkv_format is QKVFormat.THD:
        run = emulate_ring(inputs.batched(), spec.batched(), cp, strategy, scale, kernel, kv_schedule)
        return dataclasses.replace(run, result=run.result.unbatched())
    fmt, sd = spec.qkv_format, spec.qkv_format.seq_dim
    s = inputs.q.shape[sd]
    layout, cu = spec_layout(spec, s, cp), spec.cu_seqlens
    h, dim = inputs.q.shape[2], inputs.q.shape[3]
    opts = CPOptions(spec, check_scale(scale, dim), kernel or TorchTiles(), strategy)
    dev = inputs.q.device
    acc = accum_dtype(inputs.q.dtype)
    sink = sink_logits(spec.softmax_type, inputs.offset, h, inputs.q.device)
    ranks = range(cp)

    def shards(x):
        return [shard(x, cp, r, sd, cu, spec.pack_layout) for r in ranks]

    def bhsd(xs):
        return [fmt.to_bhsd(x) for x in xs]

    qs, ks, vs, dos = (shards(x) for x in (inputs.q, inputs.k, inputs.v, inputs.grad_out))
    g, b = inputs.k.shape[2], inputs.q.shape[1 - sd]
    schedule = comm_schedule(kv_schedule, cp, layout, spec.band, *row_bytes(b, g, dim, inputs.q.dtype))
    # every rank's steps, its runs joined as the ring joins them (forward and backward)
    plans = [joined_plan(schedule, r, ks[r], fmt, inputs.bias is not None) for r in ranks]
    positions = [layout.rows(r, dev) for r in ranks]
    biases = [BiasTiles(inputs.bias, plans[r], positions[r], positions, acc) if inputs.bias is not None else None
              for r in ranks]

    outs, lses = [], []
    for r in ranks:
        # NaN-filled: a row the plan forgets to write (or reads before writing) shows in the result
        lse = torch.full((qs[r].shape[1 - sd], h, qs[r].shape[sd]), float("nan"), dtype=acc, device=dev)
        out = torch.full_like(qs[r], float("nan"))
        plan = plans[r]
        run_forward(plan, LocalKV(bhsd(ks), bhsd(vs), schedule, r, "fwd"),
                    state=ForwardState.make(plan, fmt.to_bhsd(qs[r]), fmt.to_bhsd(out), lse, fill=float("nan")),
                    sink=sink, bias=biases[r], opts=opts)
        outs.append(out)
        lses.append(lse)

    # NaN-filled in the accumulator dtype, which the rows backward then accumulates in: a row no tile writes stays NaN
    dqs = [torch.full(x.shape, float("nan"), dtype=acc, device=dev) for x in qs]
    dks = [torch.zeros(x.shape, dtype=acc, device=dev) for x in ks]
    dvs = [torch.zeros(x.shape, dtype=acc, device=dev) for x in vs]
    parts = []
    for r in ranks:
        dkv = LocalDKV(bhsd(dks), bhsd(dvs), schedule, reader=r, kv_dtype=ks[0].dtype)
        state = BackwardState(fmt.to_bhsd(qs[r]), fmt.to_bhsd(outs[r]), fmt.to_bhsd(dos[r]), lses[r],
                              fmt.to_bhsd(dqs[r]))
        parts.append(run_backward(plans[r], LocalKV(bhsd(ks), bhsd(vs), schedule, r, "bwd"), dkv, state=state, sink=sink,
                                  bias=biases[r], opts=opts))
    d_offset = torch.stack(parts).sum(0) if inputs.offset is not None else None
    d_bias = torch.stack([b.grad for b in biases]).sum(0) if inputs.bias is not None else None
    pl = spec.pack_layout
    result = Result(unshard(outs, sd, cu, pl), unshard(dqs, sd, cu, pl), unshard(dks, sd, cu, pl),
                    unshard(dvs, sd, cu, pl), d_offset, d_bias, unshard(lses, 2, cu, pl))
    return EmulatedRing(result, parts, schedule.kind)


def emulate_hierarchical(inputs: Inputs, spec: AttnSpec, world: int, a2a_size: int, strategy: SinkStrategy,
                         scale=None, kv_schedule="auto") -> EmulatedRing:
    """a2a+p2p in one process: the a2a re-layout is indexing (``join_outer`` of the inner group's
    shards, the same function the distributed a2a uses), then one ring over the outer groups per
    inner head group. ``world`` ranks, inner groups of ``a2a_size``."""
    if spec.qkv_format is QKVFormat.THD:
        run = emulate_hierarchical(inputs.batched(), spec.batched(), world, a2a_size, strategy, scale, kv_schedule)
        return dataclasses.replace(run, result=run.result.unbatched())
    check_a2a_size(a2a_size, world)
    outer = world // a2a_size
    h, g = inputs.q.shape[2], inputs.k.shape[2]
    check_heads(h, g, a2a_size)
    sd, cu = spec.qkv_format.seq_dim, spec.cu_seqlens
    chunks = spec.chunks(inputs.q.shape[sd], world)
    for x in (inputs.q, inputs.k):  # the re-layout lands every group on its outer load-balanced shard
        for o in range(outer):
            joined = join_outer([shard(x, world, o * a2a_size + m, sd, cu)
                                 for m in range(a2a_size)], sd, chunks)
            if not torch.equal(joined, shard(x, outer, o, sd, cu)):
                raise AssertionError(f"a2a re-layout of group {o} is not its outer shard")
    runs = []
    for i in range(a2a_size):
        qh, kh = slice(i * h // a2a_size, (i + 1) * h // a2a_size), slice(i * g // a2a_size, (i + 1) * g // a2a_size)
        bias = inputs.bias
        if bias is not None and bias.shape[1] != 1:
            bias = bias[:, qh]
        part = Inputs(inputs.q[:, :, qh], inputs.k[:, :, kh], inputs.v[:, :, kh],
                      inputs.offset[:, qh] if inputs.offset is not None else None, bias, inputs.grad_out[:, :, qh])
        runs.append(emulate_ring(part, spec, outer, strategy, scale, kv_schedule=kv_schedule))
    res = [r.result for r in runs]
    d_bias = None
    if inputs.bias is not None:
        d_bias = torch.cat([r.d_bias for r in res], 1) if inputs.bias.shape[1] != 1 else sum(r.d_bias for r in res)
    result = Result(torch.cat([r.out for r in res], 2), torch.cat([r.dq for r in res], 2),
                    torch.cat([r.dk for r in res], 2), torch.cat([r.dv for r in res], 2),
                    torch.cat([r.d_offset for r in res], 1) if inputs.offset is not None else None, d_bias,
                    torch.cat([r.lse for r in res], 1))
    return EmulatedRing(result, [p for r in runs for p in r.d_sink_parts], runs[0].kv_schedule)
