"""The link model of ``sinkprof bench --simulate N --link LINK``: each ring step's communication
predicted from the plan's exact bytes and a link's bandwidth and latency, and the exposed part of
it from the compute measured on this device (README, "Predicting communication").

**One exchange.** A rank's messages of one (phase, step, kind) go out as one batch
(``dist.Communicator.post``). Full duplex: what it sends and what it receives travel at once, in
opposite directions. Peers in parallel, messages to one peer one after another, and all of them
sharing the GPU's injection bandwidth ``B`` (bytes/s, one direction); each message pays the
latency ``L`` once::

    T = max(L * max_peer(messages sent to the peer) + bytes sent / B,
            L * max_peer(messages received from it) + bytes received / B)

With one message each way (every K/V and dK/dV exchange of the ring and direct schedules), ``T = L + max(sent,
received) / B``. No contention: the K/V and the dK/dV exchanges in flight in one backward step are
timed apart, and nothing else shares the link. NCCL's use of a few SMs is ignored (the compute
measured here ran alone on the device).

**Overlap, as the ring runs it** (``ring.RingKV``/``DirectKV``, ``RingDKV``/``DirectDKV``): the
K/V message labelled step i is posted as step i starts and waited before step i+1 computes; the
dK/dV message of step i is posted after step i computed (and after dK/dV of step i-1 arrived) and
waited after step i+1 computed; the last one is waited after the last step. The ring and direct
schedules time dK/dV so (the ring forwards them one hop, direct sends them straight to the owner: other peers and
bytes, the same timing). Per rank, with the measured compute of step i at ``[a_i, b_i]`` and every
later moment shifted by the stalls so far::

    forward:  exposed(kv_i)  = max(0, s_i + T(kv_i) - e_i)
    backward: exposed(dkv_{i-1}) = max(0, p_{i-1} + T(dkv_{i-1}) - e_i),  p_i = max(e_i, p_{i-1} + T(dkv_{i-1}))
              exposed(kv_i)  = max(0, s_i + T(kv_i) - p_i),                 exposed(dkv_last) = T(dkv_last)

where ``s_i, e_i`` are step i's predicted start and end and ``p_i`` the moment its dK/dV is
posted. Under ``allgather`` (``ring.GatherKV``/``GatherDKV``, ``blocking_kv``) the K/V of the one
step arrive before it computes, so they are exposed whole (``exposed(kv_0) = T(kv_0)``, the step
starting after them), and its dK/dV, waited at once, too. A step's predicted time is its measured compute plus what it exposes; the predicted
iteration is the measured one plus every exposed millisecond of the rank. Each rank is modelled
with its own compute (its peers are taken to post when it does: an imbalance between ranks does
not travel around the ring), and every message crosses the same link.

**Presets** (sources in README): NVLink 4 of H100/H200 SXM (900 GB/s per GPU both directions
together, 450 GB/s each way: the spec figure, an upper bound for NCCL send/recv), and 400 Gb/s
InfiniBand NDR (one ConnectX-7 per GPU: 50 GB/s each way). Latencies per message are assumptions
(NCCL's per-message software cost dominates both wires): 5 us on NVLink, 10 us on InfiniBand.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..profiling import overlap_rows
from ..schedule import Transfer


@dataclass(frozen=True)
class Link:
    """A link: ``gbps`` GB/s (1e9 bytes/s) per direction per GPU, ``latency_us`` per message."""

    name: str
    gbps: float
    latency_us: float

    def exchange_ms(self, transfers: Iterable[Transfer]) -> float:
        """Time of one rank's batch of messages of one (phase, step, kind), ``transfers`` its
        peers (the formula of the module docstring); 0 when nothing moves."""
        transfers = list(transfers)
        if not any(t.messages_sent or t.messages_received for t in transfers):
            return 0.0
        per_byte_ms = 1e3 / (self.gbps * 1e9)
        lat_ms = self.latency_us * 1e-3
        send = max(t.messages_sent for t in transfers) * lat_ms + sum(t.sent for t in transfers) * per_byte_ms
        recv = max(t.messages_received for t in transfers) * lat_ms + sum(t.received for t in transfers) * per_byte_ms
        return max(send, recv)

    def describe(self) -> str:
        return f"{self.name} {self.gbps:g} GB/s {self.latency_us:g} us"


_NVLINK4 = dict(gbps=450.0, latency_us=5.0)
_IB_NDR = dict(gbps=50.0, latency_us=10.0)
PRESETS = {
    "nvlink": Link("nvlink", **_NVLINK4),
    "h100-nvlink": Link("h100-nvlink", **_NVLINK4),
    "h200-nvlink": Link("h200-nvlink", **_NVLINK4),
    "ib": Link("ib", **_IB_NDR),
    "ib-ndr": Link("ib-ndr", **_IB_NDR),
}


# What a link can be (a megabyte a second to a petabyte; up to a second a message): outside it the
# predicted times overflow or print as hundreds of digits.
GBPS_RANGE = (1e-3, 1e6)
LAT_US_MAX = 1e6


def parse_link(text: str, option: str = "--link") -> Link:
    """A preset name, or ``GBPS[,LAT_US]`` (GB/s per direction; latency per message in
    microseconds, 0 when left out)."""
    value = str(text).strip().lower()
    if value in PRESETS:
        return PRESETS[value]
    parts = [p.strip() for p in value.split(",")]
    usage = f"use one of {', '.join(PRESETS)} or GBPS[,LAT_US] (e.g. 400,5)"
    if len(parts) > 2 or not parts[0]:
        raise ValueError(f"{option} {text!r}: {usage}")
    try:
        gbps = float(parts[0])
        lat = float(parts[1]) if len(parts) == 2 else 0.0
    except ValueError:
        raise ValueError(f"{option} {text!r}: {usage}") from None
    if not GBPS_RANGE[0] <= gbps <= GBPS_RANGE[1]:
        raise ValueError(f"{option} {text!r}: the bandwidth must be {GBPS_RANGE[0]:g} to {GBPS_RANGE[1]:g} GB/s")
    if not 0 <= lat <= LAT_US_MAX:
        raise ValueError(f"{option} {text!r}: the latency must be 0 to {LAT_US_MAX:g} microseconds")
    return Link("custom", gbps, lat)


def exchange_times(transfers: Iterable[Transfer], link: Link, posted_at: Optional[dict] = None,
                   computed_at: Optional[dict] = None) -> dict:
    """(phase, step, kind) -> (predicted ms, bytes sent) of one rank's exchanges, each one batch
    (``Link.exchange_ms``). Given ``posted_at`` or ``computed_at``, the messages posted together
    are one batch, keyed by the step they are posted at: K/V (the message for step j is labelled
    j - 1) at ``posted_at``, the backward's dK/dV (labelled j) once the call that computes step j
    is done (``computed_at``); within a batch, a peer's messages go one after another."""
    joined = posted_at is not None or computed_at is not None
    posted_at, computed_at = posted_at or {}, computed_at or {}
    batches: dict = {}   # (phase, step, kind) -> peer -> its transfers
    for t in transfers:
        at = t.step if not joined else posted_at.get(t.step + 1, t.step) if t.kind == "kv" else \
            computed_at.get(t.step, t.step)
        batches.setdefault((t.phase, at, t.kind), {}).setdefault(t.peer, []).append(t)
    return {key: (link.exchange_ms([_one_peer(ts) for ts in peers.values()]),
                  sum(t.sent for ts in peers.values() for t in ts)) for key, peers in batches.items()}


def _one_peer(transfers: list) -> Transfer:
    """A batch's messages to and from one peer as one ``Transfer``: their counts and bytes summed."""
    return dataclasses.replace(transfers[0], sent=sum(t.sent for t in transfers),
                               received=sum(t.received for t in transfers),
                               messages_sent=sum(t.messages_sent for t in transfers),
                               messages_received=sum(t.messages_received for t in transfers))


def _comm_row(phase, step, kind, start, dur, nbytes) -> dict:
    """A predicted exchange on the timeline; its ``overlap_ms``/``exposed_ms`` are measured against
    the placed compute rows afterwards (``profiling.overlap_rows``), as a real run's are."""
    return dict(phase=phase, step=step, kind=kind, start_ms=start, end_ms=start + dur, dur_ms=dur, bytes=nbytes,
                predicted=True)


def _phase(phase: str, compute: dict, comm: dict, delay: float, blocking_kv: bool = False):
    """One phase of one iteration: ``compute`` step -> measured row; ``comm`` (step, kind) ->
    (ms, bytes); ``blocking_kv``: a step's K/V arrive before it computes (allgather). Returns the
    compute rows moved onto the predicted timeline, the predicted communication rows and the delay
    (ms of stalls) after the phase."""
    placed, rows, pending = [], [], None   # pending: dK/dV in flight (posted, ms, step, bytes)
    for i in sorted(compute):
        c = compute[i]
        if blocking_kv and (i, "kv") in comm:
            ms, nbytes = comm[(i, "kv")]
            rows.append(_comm_row(phase, i, "kv", c["start_ms"] + delay, ms, nbytes))
            delay += ms
        s, e = c["start_ms"] + delay, c["end_ms"] + delay
        placed.append(dict(c, start_ms=s, end_ms=e))
        ready = e
        if phase == "bwd":
            if pending is not None:
                posted, ms, step, nbytes = pending
                rows.append(_comm_row(phase, step, "dkv", posted, ms, nbytes))
                ready = max(e, posted + ms)
                pending = None
            if (i, "dkv") in comm:
                ms, nbytes = comm[(i, "dkv")]
                pending = (ready, ms, i, nbytes)
        if (i, "kv") in comm and not blocking_kv:
            ms, nbytes = comm[(i, "kv")]
            rows.append(_comm_row(phase, i, "kv", s, ms, nbytes))
            ready = max(ready, s + ms)
        delay += ready - e
    if pending is not None:
        posted, ms, step, nbytes = pending
        rows.append(_comm_row(phase, step, "dkv", posted, ms, nbytes))
        delay += ms
    return placed, rows, delay


def predict(rows: list[dict], transfers: Iterable[Transfer], link: Link, blocking_kv: bool = False,
            posted_at: Optional[dict] = None, computed_at: Optional[dict] = None) -> list[dict]:
    """One simulated rank's measured rows (compute and iteration rows of every iteration) -> the
    prediction: compute rows with their measured durations on the predicted timeline, one
    communication row per exchange (``predicted`` true, ``bytes`` sent, ``dur_ms`` the
    predicted time, ``overlap_ms``/``exposed_ms``), iteration rows lengthened by the exposed
    time (``predicted`` true). ``blocking_kv``: the schedule waits for a step's K/V before it
    computes (allgather). ``posted_at``: the step each step's K/V messages are posted at
    (``RankPlan.posted_at``), ``computed_at`` the step whose call computes it (``RankPlan.computed_at``,
    whose end sends its dK/dV): a ring that joins runs of steps posts a whole run's at once, which
    then share the link and are one row, labelled with that step."""
    times = exchange_times(transfers, link, posted_at, computed_at)
    out = []
    for it in sorted({r["iteration"] for r in rows}):
        mine = [r for r in rows if r["iteration"] == it]
        base = {k: mine[0][k] for k in ("rank", "iteration") if k in mine[0]}
        delay, steps = 0.0, []
        for phase in ("fwd", "bwd"):
            compute = {r["step"]: r for r in mine if r["kind"] == "compute" and r["phase"] == phase}
            if not compute:
                continue
            comm = {(step, kind): v for (p, step, kind), v in times.items() if p == phase}
            placed, comm_rows, delay = _phase(phase, compute, comm, delay, blocking_kv)
            steps += placed + [dict(base, **r) for r in comm_rows]
        # what lies under no compute is exposed, as in a measured run: a dK/dV part the model
        # lets run in the host's gap before the next step stalls nothing, yet nothing hides it
        out += overlap_rows(steps)
        for r in mine:
            if r["kind"] == "iteration":
                out.append(dict(r, end_ms=r["end_ms"] + delay, dur_ms=r["dur_ms"] + delay, predicted=True))
            elif r["kind"] != "compute":
                out.append(r)
    return out


# Measuring a link: gloo over loopback, the link the CPU validation runs on -----------------------

MEASURE_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)


def _exchange_job(info, sizes, reps: int, out_path: str) -> int:
    """Both ranks send to and receive from each other at once (the ring's exchange), ``reps``
    times per size; rank 0 writes the median seconds per size as JSON."""
    import torch.distributed as dist
    peer = 1 - info.rank
    result = {}
    for n in sizes:
        send, recv = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        times = []
        for rep in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]):
                w.wait()
            if rep >= 2:
                times.append(time.perf_counter() - t0)
        result[n] = sorted(times)[len(times) // 2]
    if info.rank == 0:
        Path(out_path).write_text(json.dumps({str(k): v for k, v in result.items()}))
    return 0


def fit(seconds: dict) -> Link:
    """``t = L + n / B`` fitted to message size n (bytes) -> seconds, least squares of the
    relative error (each size counts alike, the smallest fix L, the largest B)."""
    rows = [(1.0 / t, float(n) / t) for n, t in seconds.items()]   # 1 = L/t + (1/B) n/t, per size
    s11 = sum(a * a for a, _ in rows)
    s12 = sum(a * b for a, b in rows)
    s22 = sum(b * b for _, b in rows)
    r1, r2 = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = s11 * s22 - s12 * s12
    lat, inv_bw = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if lat < 0:   # the data say no latency: bandwidth alone
        lat, inv_bw = 0.0, r2 / s22
    return Link("gloo-loopback", 1.0 / inv_bw / 1e9, lat * 1e6)


def measure_gloo_loopback(sizes=MEASURE_SIZES, reps: int = 20, out_path: Optional[str] = None) -> tuple[Link, dict]:
    """Two local gloo ranks exchange messages of ``sizes`` bytes; the fitted link and the
    measured median seconds per size."""
    import tempfile
    from .launcher import launch
    with tempfile.TemporaryDirectory(prefix="sinkprof-link-") as folder:
        path = out_path or str(Path(folder) / "link.json")
        code = launch(_exchange_job, (tuple(sizes), reps, path), nproc=2, device="cpu", backend="gloo")
        if code != 0:
            raise RuntimeError(f"measuring the gloo loopback link failed (exit {code})")
        seconds = {int(k): v for k, v in json.loads(Path(path).read_text()).items()}
    return fit(seconds), seconds
