"""The communication schedule of the ring and its byte contract (docs/design.md, section 5).

Built from every rank's plan (``plan.ring_plan``), as data: which rows of whose K/V shard each
rank receives for each step, and so which bytes move, per (phase, step, kind, peer).

- ``ring``: every step forwards the whole K/V shard held to the next rank (steps 0 .. cp-2 of
  the forward and the backward), and dK/dV travel one hop behind, a whole shard after every
  backward step (the last one carries each shard's gradient home).
- ``direct``: the owner of a shard sends each reader exactly the rows its tiles read at that step
  (``Step.held``), and the reader returns those rows' dK/dV partial to the owner after computing
  it; a step that reads nothing moves nothing. A partial that one tile per row wrote
  (``Step.kv_cover``) travels in K/V's dtype, which the GPU kernels round a tile's dK/dV to, and
  is summed at home in the accumulator dtype (``partial_in_kv_dtype``); any other partial
  travels in the accumulator dtype.
- ``allgather``: before the one step (``plan.gather_plan``) every rank sends each other rank the
  rows of its shard that rank's tiles read (``Step.held``, sequence rows), in the forward and
  again in the backward, and returns each owner the dK/dV it computed of those rows (a
  reduce-scatter). Nothing computes while the K/V travel (at most the bytes of ``ring``, less one
  dK/dV shard: fewer where a rank's tiles read only part of the sequence, as under a causal mask
  or in a pack's balanced layout); in exchange every chunk meets all its keys in one tile (long
  kernel loops, nothing to merge). Labelled step 0.

A message is labelled with the step during which it is in flight: the K/V a rank computes with at
step i+1 is posted as step i starts (label i), so it overlaps step i's compute; a dK/dV message
is labelled with the step whose tiles produced it. ``auto`` takes whichever of ``ring`` and
``direct`` moves fewer bytes in all (ties go to the ring). Nothing here needs a process group:
``comm_bytes`` gives the bytes of any shape on any cp, for models of links as much as for
``sinkprof check``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .options import (CommType, KVSchedule, PackLayout, a2a_members, accum_dtype, check_a2a_heads, check_a2a_size,
                      check_dtype, check_gqa, check_int, check_runs, make_spec)
from .plan import RankPlan, as_layout, join_runs, ring_plan, rows_in, spec_layout

PHASE_KINDS = (("fwd", "kv"), ("fwd", "a2a"), ("bwd", "kv"), ("bwd", "dkv"), ("bwd", "a2a"))


@dataclass(frozen=True)
class Transfer:
    """What one rank sends to and receives from one peer in one (phase, step, kind): messages and
    bytes. ``rank`` and ``peer`` are ranks of the group the messages travel in (CP-group ranks
    from ``comm_bytes``); a2a re-layouts have step -1."""

    rank: int
    phase: str        # "fwd" or "bwd"
    step: int
    kind: str         # "kv", "dkv" or "a2a"
    peer: int
    sent: int         # bytes
    received: int     # bytes
    messages_sent: int
    messages_received: int

    @property
    def key(self) -> tuple:
        return self.phase, self.step, self.kind, self.peer

    @property
    def counts(self) -> tuple[int, int, int, int]:
        return self.messages_sent, self.sent, self.messages_received, self.received


class CommSchedule:
    """Every rank's plan under one K/V schedule, and what moves between them."""

    def __init__(self, kind: KVSchedule, cp: int, chunk, band):
        """``chunk``: rows per chunk, or a tuple of them, one per document of a thd pack, or a ``Layout``."""
        if kind is KVSchedule.AUTO:
            raise ValueError("CommSchedule needs 'ring', 'direct' or 'allgather'; comm_schedule resolves 'auto'")
        self.kind, self.cp, self.layout, self.band = kind, cp, as_layout(cp, chunk), band
        self.plans: tuple[RankPlan, ...] = tuple(ring_plan(cp, r, self.layout, band, kind) for r in range(cp))
        self._index: dict = {}   # index tensors made once per device (gather_index, partial_table)

    def gathered_rows(self, reader: int, owner: int) -> list[tuple[int, int, int]]:
        """The rows of ``owner``'s shard that ``reader``'s tiles read (``allgather``: what the owner
        sends it), as runs ``(owner's local row, row of the reader's buffer, rows)`` in local order."""
        held, out, starts = self.plans[reader].steps[0].held, [], []
        for part in held:
            starts.append(sum(p.stop - p.start for p in held[:len(starts)]))
        for at, piece in self.layout.local_pieces(owner):
            for part, buffer_at in zip(held, starts):
                lo, hi = max(piece.start, part.start), min(piece.stop, part.stop)
                if lo < hi:
                    out.append((at + lo - piece.start, buffer_at + lo - part.start, hi - lo))
        return out

    def gather_index(self, reader: int, owner: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``gathered_rows`` as index tensors (the owner's local rows, the reader's buffer rows) and
        their count, made once per device: a warm call does no host work, and a graph can capture it."""
        key = (reader, owner, str(torch.device(device)))
        if key not in self._index:
            runs = self.gathered_rows(reader, owner)
            mine = [torch.arange(src, src + n) for src, _, n in runs]
            at = [torch.arange(dst, dst + n) for _, dst, n in runs]
            empty = torch.zeros(0, dtype=torch.int64)
            self._index[key] = (torch.cat(mine or [empty]).to(device), torch.cat(at or [empty]).to(device),
                                       sum(n for _, _, n in runs))
        return self._index[key]

    def kv_rows(self, reader: int, step: int) -> tuple[slice, ...]:
        """Rows of rank ``(reader - step) % cp``'s shard that ``reader`` holds at ``step`` (the
        message its owner sends it under ``direct``; the whole shard under ``ring``); under
        ``allgather`` the sequence rows of its one step's buffer."""
        return self.plans[reader].steps[step].held

    def largest(self) -> int:
        """The most rows any rank receives (or sends) for one step after step 0."""
        return max((s.held_rows for p in self.plans for s in p.steps[1:]), default=0)

    @functools.cached_property
    def joined_plans(self) -> tuple[RankPlan, ...]:
        """Every rank's steps with its runs joined (``plan.join_runs``), forward and backward, under
        ``direct``, where every message is one range of its owner's rows (sent from the owner's
        memory, never packed: a run's messages are in flight at once, and a run's dK/dV go back to
        each step's owner from the rows of one call's output); else ``plans``. Messages, rows and
        bytes are the same as ``plans``' (``kv_rows``, ``transfers``)."""
        if self.kind is not KVSchedule.DIRECT or any(len(s.held) > 1 for p in self.plans for s in p.steps[1:]):
            return self.plans
        return tuple(join_runs(p) for p in self.plans)

    def transfers(self, rank: int, kv_row_bytes: int, dkv_row_bytes: int) -> list[Transfer]:
        """Every (phase, step, kind, peer) of ``rank``'s K/V and dK/dV messages; ``kv_row_bytes``
        is one row of K and V together, ``dkv_row_bytes`` one row of dK and dV in the accumulator
        dtype (a ``direct`` step's partial written once per row travels in K/V's dtype:
        ``kv_row_bytes``)."""
        cp, out = self.cp, {}

        def add(phase, step, kind, peer, sent_rows, received_rows, row_bytes):
            key = (phase, step, kind, peer)
            m_s, b_s, m_r, b_r = out.get(key, (0, 0, 0, 0))
            if sent_rows:
                m_s, b_s = m_s + 1, b_s + sent_rows * row_bytes
            if received_rows:
                m_r, b_r = m_r + 1, b_r + received_rows * row_bytes
            if m_s or m_r:
                out[key] = (m_s, b_s, m_r, b_r)

        shard = self.layout.shard_rows
        if cp > 1 and self.kind is KVSchedule.ALLGATHER:
            for peer in range(cp):   # the rows of each shard the reader reads; dK/dV of them go back
                if peer != rank:
                    mine = sum(n for _, _, n in self.gathered_rows(peer, rank))
                    theirs = sum(n for _, _, n in self.gathered_rows(rank, peer))
                    add("fwd", 0, "kv", peer, mine, theirs, kv_row_bytes)
                    add("bwd", 0, "kv", peer, mine, theirs, kv_row_bytes)
                    add("bwd", 0, "dkv", peer, theirs, mine, dkv_row_bytes)
        elif cp > 1 and self.kind is KVSchedule.RING:
            nxt, prev = (rank + 1) % cp, (rank - 1) % cp
            for phase in ("fwd", "bwd"):
                for i in range(cp - 1):
                    add(phase, i, "kv", nxt, shard, 0, kv_row_bytes)
                    add(phase, i, "kv", prev, 0, shard, kv_row_bytes)
            for i in range(cp):
                add("bwd", i, "dkv", nxt, shard, 0, dkv_row_bytes)
                add("bwd", i, "dkv", prev, 0, shard, dkv_row_bytes)
        elif cp > 1:
            for i in range(1, cp):
                owner, reader = (rank - i) % cp, (rank + i) % cp
                mine, theirs = rows_in(self.kv_rows(rank, i)), rows_in(self.kv_rows(reader, i))
                for phase in ("fwd", "bwd"):  # posted as step i-1 starts
                    add(phase, i - 1, "kv", reader, theirs, 0, kv_row_bytes)
                    add(phase, i - 1, "kv", owner, 0, mine, kv_row_bytes)
                for peer, reading, sent, received in ((owner, rank, mine, 0), (reader, reader, 0, theirs)):
                    row = kv_row_bytes if self.partial_in_kv_dtype(reading, i) else dkv_row_bytes
                    add("bwd", i, "dkv", peer, sent, received, row)
        return [Transfer(rank, *key, b_s, b_r, m_s, m_r) for key, (m_s, b_s, m_r, b_r) in sorted(out.items())]

    def partial_in_kv_dtype(self, reader: int, step: int) -> bool:
        """Whether the dK/dV partial of ``reader``'s ``step`` (after step 0, under ``direct``) is
        kept and sent in K/V's dtype rather than the accumulator's: when one tile per row wrote it
        (``Step.kv_cover``). The GPU kernels round a tile's dK/dV to that dtype themselves, so
        nothing is lost; the torch tiles' fp32 partials are rounded once more (half precision only:
        for fp32 and fp64 K/V the two dtypes are one)."""
        return self.kind is KVSchedule.DIRECT and step > 0 and self.plans[reader].steps[step].kv_cover

    def kept_partials(self, owner: int) -> list[tuple[int, tuple[slice, ...]]]:
        """``(step, rows of owner's shard)`` of every dK/dV partial that returns to ``owner`` in K/V's
        dtype (``partial_in_kv_dtype``), in step order: ``DirectDKV`` keeps them apart and sums them
        at the end, in one pass."""
        cp = self.cp
        return [(i, self.kv_rows((owner + i) % cp, i)) for i in range(1, cp)
                if self.partial_in_kv_dtype((owner + i) % cp, i) and self.kv_rows((owner + i) % cp, i)]

    def home_in_kv_dtype(self, owner: int) -> bool:
        """Whether ``owner``'s own dK/dV can be held in K/V's dtype from the start under ``direct``:
        its step 0 writes every row once (``Step.kv_cover``) and every partial that returns to it
        is kept in K/V's dtype (``kept_partials``), so nothing is ever added into it before the
        one sum at the end. Step 0's tiles then write it without a conversion pass (FA4 rounds a
        tile's dK/dV to K/V's dtype itself), and the sum of the kept partials goes into it in
        place."""
        if self.kind is not KVSchedule.DIRECT or not self.plans[owner].steps[0].kv_cover:
            return False
        cp = self.cp
        return all(self.partial_in_kv_dtype((owner + i) % cp, i) for i in range(1, cp)
                   if self.kv_rows((owner + i) % cp, i))

    def partial_table(self, owner: int, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``kept_partials`` as index tensors, made once per device: int32 ``[rows, J]``, each row of
        the shard's place in partial j (-1 where it is not in it), and int64 ``[J]``, the rows of
        each partial."""
        key = ("partials", owner, rows, str(torch.device(device)))
        if key not in self._index:
            kept = self.kept_partials(owner)
            table = torch.full((rows, len(kept)), -1, dtype=torch.int32)
            for j, (_, parts) in enumerate(kept):
                at = 0
                for p in parts:
                    table[p.start:p.stop, j] = torch.arange(at, at + p.stop - p.start, dtype=torch.int32)
                    at += p.stop - p.start
            sizes = torch.tensor([rows_in(parts) for _, parts in kept], dtype=torch.int64)
            self._index[key] = (table.to(device), sizes.to(device))
        return self._index[key]

    def total_bytes(self, kv_row_bytes: int, dkv_row_bytes: int) -> int:
        """Bytes sent by all ranks together, forward and backward."""
        return sum(t.sent for r in range(self.cp) for t in self.transfers(r, kv_row_bytes, dkv_row_bytes))


def row_bytes(b: int, g: int, d: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of one K and V row, bytes of one dK and dV row) of ``b`` sequences, ``g`` K/V heads."""
    elems = 2 * b * g * d
    return (elems * torch.empty((), dtype=dtype).element_size(),
            elems * torch.empty((), dtype=accum_dtype(dtype)).element_size())


def planless_kv_schedule(kv_schedule, layout: PackLayout) -> KVSchedule:
    """The K/V schedule known without a plan: the one asked for, or under ``auto`` allgather for a
    pack in the balanced layout (which runs under it alone); ``AUTO`` where the plan's bytes choose."""
    kind = KVSchedule.parse(kv_schedule, "kv_schedule")
    return KVSchedule.ALLGATHER if kind is KVSchedule.AUTO and layout is PackLayout.BALANCED else kind


@functools.lru_cache(maxsize=256)
def comm_schedule(kv_schedule, cp: int, chunk, band, kv_row_bytes: int, dkv_row_bytes: int) -> CommSchedule:
    """The schedule asked for; ``auto`` is the one of ``ring`` and ``direct`` moving fewer bytes in
    all (ring on a tie; ``allgather`` only when asked for, or for a pack in the balanced layout,
    which runs under it alone). Every rank computes the same answer from the same plan. ``chunk``:
    as ``CommSchedule`` takes it."""
    kind = planless_kv_schedule(kv_schedule, as_layout(cp, chunk).kind)
    if kind is not KVSchedule.AUTO:
        return CommSchedule(kind, cp, chunk, band)
    ring = CommSchedule(KVSchedule.RING, cp, chunk, band)
    direct = CommSchedule(KVSchedule.DIRECT, cp, chunk, band)
    if direct.total_bytes(kv_row_bytes, dkv_row_bytes) < ring.total_bytes(kv_row_bytes, dkv_row_bytes):
        return direct
    return ring


def a2a_transfers(members: int, rank: int, q_piece: int, kv_piece: int) -> list[Transfer]:
    """The a2a re-layout of one member of an inner group: per phase three all-to-alls (q, stacked
    K/V and the output; in the backward their gradients), ``q_piece`` bytes (the output's piece is
    the same size) and ``kv_piece`` bytes to and from every other member."""
    per = 2 * q_piece + kv_piece
    return [Transfer(rank, phase, -1, "a2a", peer, per, per, 3, 3)
            for phase in ("fwd", "bwd") for peer in range(members) if peer != rank]


@dataclass(frozen=True)
class CaseComm:
    """Where a case's messages travel: the outer ring's schedule, and the inner a2a group."""

    schedule: Optional[CommSchedule]    # None when the ring has one rank (plain a2a)
    ring_size: int
    a2a_size: int
    kv_row_bytes: int
    dkv_row_bytes: int
    q_piece: int
    kv_piece: int

    def ring_transfers(self, ring_rank: int) -> list[Transfer]:
        if self.schedule is None:
            return []
        return self.schedule.transfers(ring_rank, self.kv_row_bytes, self.dkv_row_bytes)

    def a2a_transfers(self, inner_rank: int) -> list[Transfer]:
        return a2a_transfers(self.a2a_size, inner_rank, self.q_piece, self.kv_piece) if self.a2a_size > 1 else []


def case_comm(*, s: int, b: int, h: int, g: int, d: int, dtype: torch.dtype, cp: int, mask="no_mask", window=None,
              comm="p2p", a2a_size: Optional[int] = None, kv_schedule="auto", cu_seqlens=None,
              pack_layout="zigzag") -> CaseComm:
    """The schedule and message sizes of one case (the arguments of ``comm_bytes``, which checks
    them; ``a2a_size`` counts under ``a2a+p2p`` only)."""
    spec = make_spec("vanilla", mask, window, "bshd" if cu_seqlens is None else "thd", cu_seqlens, pack_layout)
    comm_type = CommType.parse(comm, "comm")
    members = a2a_members(comm_type, cp, a2a_size if comm_type is CommType.A2A_P2P else None)
    check_a2a_size(members, cp, h, g)        # as cp_attention checks its own: the sizes offered fit both
    check_a2a_heads(h, g, members, cp, comm_type)
    ring_size = cp // members
    if spec.docs and sum(spec.docs) != s:
        raise ValueError(f"cu_seqlens ends at {sum(spec.docs)} but s={s}")
    check_runs(spec.pack_layout, comm_type, KVSchedule.parse(kv_schedule, "kv_schedule"))
    spec_layout(spec, s, cp)   # the layout exists (a zigzag one: every document splits into 2 * cp chunks)
    kv_row, dkv_row = row_bytes(b, g // members, d, dtype)
    schedule = comm_schedule(kv_schedule, ring_size, spec_layout(spec, s, ring_size), spec.band, kv_row, dkv_row) \
        if ring_size > 1 else None
    size = torch.empty((), dtype=dtype).element_size()
    local = s // cp
    return CaseComm(schedule, ring_size, members, kv_row, dkv_row, b * local * (h // members) * d * size,
                    2 * b * local * (g // members) * d * size)


def comm_bytes(*, s: int, b: int, h: int, g: int, d: int, dtype: torch.dtype, cp: int, mask="no_mask",
               window=None, comm="p2p", a2a_size: Optional[int] = None, kv_schedule="auto",
               cu_seqlens=None, pack_layout="zigzag") -> list[Transfer]:
    """Every message of one CP attention's forward and backward, from the plan alone (no process
    group): one ``Transfer`` per (rank, phase, step, kind, peer), ranks and peers numbered in
    the CP group. The arguments are ``cp_attention``'s words: ``s`` the full sequence, ``h`` query
    heads, ``g`` K/V heads, ``dtype`` of q, k, v (dK/dV travel in its accumulator dtype: fp32,
    fp64 for fp64). Under ``a2a+p2p`` the inner group of CP rank ``o * a2a_size + i`` is
    ``o * a2a_size ..``, its ring links the ranks ``j * a2a_size + i``.
    ``sum(t.sent for t in comm_bytes(...) if t.rank == r)`` is what rank r sends in all. A thd
    pack of ``s`` tokens gives its document boundaries as ``cu_seqlens`` (and ``b = 1``) and its
    ``pack_layout``.

    The arguments are checked as ``cp_attention`` checks its own: sizes are positive ints, ``h`` a
    multiple of ``g``, ``dtype`` one attention runs in (a ``torch.dtype`` or its name, ``"bf16"``),
    ``a2a_size`` only with ``comm="a2a+p2p"`` (or the whole group under ``a2a``), and a pack
    (``cu_seqlens``) is one sequence, ``b = 1``."""
    args = _checked_case(s=s, b=b, h=h, g=g, d=d, dtype=dtype, cp=cp, comm=comm, a2a_size=a2a_size,
                         cu_seqlens=cu_seqlens)
    case = case_comm(**args, mask=mask, window=window, kv_schedule=kv_schedule, pack_layout=pack_layout)
    cp, a = args["cp"], case.a2a_size
    out = []
    for rank in range(cp):
        outer, inner = divmod(rank, a)
        for t in case.ring_transfers(outer):
            out.append(Transfer(rank, t.phase, t.step, t.kind, t.peer * a + inner, t.sent, t.received,
                                t.messages_sent, t.messages_received))
        for t in case.a2a_transfers(inner):
            out.append(Transfer(rank, t.phase, t.step, t.kind, outer * a + t.peer, t.sent, t.received,
                                t.messages_sent, t.messages_received))
    return out


_SIZES = {"s": " (tokens of the whole sequence)", "b": " (sequences in the batch)", "h": " (query heads)",
          "g": " (K/V heads)", "d": " (the head dim)", "cp": " (ranks in the CP group)"}


def _checked_case(*, dtype, comm, a2a_size, cu_seqlens, **sizes) -> dict:
    """``comm_bytes``'s arguments checked by the library's own checks (``cp_attention``'s rules),
    as ``case_comm`` takes them: the sizes as ints, the dtype as a ``torch.dtype``."""
    args = {name: check_int(sizes[name], name, 1, what) for name, what in _SIZES.items()}
    check_gqa(args["h"], args["g"])
    if a2a_size is not None:
        a2a_size = check_int(a2a_size, "a2a_size", None, " (ranks per inner a2a group)")
    a2a_members(CommType.parse(comm, "comm"), args["cp"], a2a_size)
    if cu_seqlens is not None and args["b"] != 1:
        raise ValueError(f"b={args['b']} with cu_seqlens: a thd pack is one sequence of documents ([t, h, d], "
                         f"b = 1); pass b=1 and every sequence's documents in the pack's cu_seqlens")
    return dict(args, dtype=check_dtype(dtype), comm=comm, a2a_size=a2a_size, cu_seqlens=cu_seqlens)


def resolved_kv_schedule(**case) -> Optional[KVSchedule]:
    """The schedule ``auto`` (or the given one) comes to for a case given as ``comm_bytes``'s
    arguments; None when no ring runs (plain a2a, or cp 1)."""
    schedule = case_comm(**case).schedule
    return None if schedule is None else schedule.kind
