"""Torch tile kernels: one tile against the reference, and tiles driven with merged stats."""
import os
import subprocess
import sys

import pytest
import torch

import sinkprof
from sinkprof.kernels import BackendUnavailable, TorchTiles, get_kernel
from sinkprof.options import Band
from sinkprof.sink import merge_parts_


def _data(seed=0, b=2, s=10, h=4, g=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, s, g, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, s, g, d, generator=gen, dtype=torch.float64)
    a = torch.randn(1, h, 1, 1, generator=gen, dtype=torch.float64) * 5
    bias = torch.randn(1, h, s, s, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64)
    return q, k, v, a, bias, dout


def bhsd(x):
    return x.permute(0, 2, 1, 3)


@pytest.mark.parametrize("band,window", [(Band(), None), (Band(None, 0), (-1, 0)), (Band(-3, 2), (3, 2))])
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_tile_forward_and_backward_match_the_reference(band, window, with_sink, with_bias):
    q, k, v, a, bias, dout = _data()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, a, bias)]
    ref = sinkprof.attention(*leaves[:3], leaves[3] if with_sink else None,
                             softmax_type="learnable" if with_sink else "vanilla",
                             mask="no_mask", window=window, bias=leaves[4] if with_bias else None)
    ref.backward(dout)
    kern = TorchTiles()
    sink = a if with_sink else None
    tb = bias if with_bias else None
    o, lse = kern.forward(bhsd(q), bhsd(k), bhsd(v), band, sink, tb, 8 ** -0.5)
    assert torch.allclose(o, bhsd(ref.detach()), atol=1e-13)
    grads = kern.backward(bhsd(q), bhsd(k), bhsd(v), o, bhsd(dout), lse, band, sink, tb, 8 ** -0.5)
    for got, leaf in ((grads.dq, leaves[0]), (grads.dk, leaves[1]), (grads.dv, leaves[2])):
        assert torch.allclose(got, bhsd(leaf.grad), atol=1e-12)
    if with_sink:
        assert torch.allclose(grads.d_sink, leaves[3].grad, atol=1e-12)
    else:
        assert grads.d_sink is None
    if with_bias:
        assert torch.allclose(grads.d_bias, leaves[4].grad, atol=1e-12)


def test_tiles_driven_with_merged_stats_reproduce_the_whole_attention():
    q, k, v, a, _, dout = _data(seed=3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, a)]
    ref = sinkprof.attention(*leaves, softmax_type="learnable", mask="causal")
    ref.backward(dout)
    kern = TorchTiles()
    qh, kh, vh, dh = (bhsd(x) for x in (q, k, v, dout))
    # two key tiles: keys 0..3 (causal diagonal offset) and 4..9, the sink only on the first
    tiles = [(slice(0, 4), Band(None, 0), a), (slice(4, 10), Band(None, -4), None)]
    o_acc = torch.zeros(2, 4, 10, 8, dtype=torch.float64)
    lse_acc = torch.full((2, 4, 10), float("-inf"), dtype=torch.float64)
    for cols, band, sink in tiles:
        o, lse = kern.forward(qh, kh[:, :, cols], vh[:, :, cols], band, sink, None, 8 ** -0.5)
        merge_parts_(o_acc, lse_acc, o.unsqueeze(0), lse.unsqueeze(0))
    assert torch.allclose(o_acc, bhsd(ref.detach()), atol=1e-13)
    dq = torch.zeros_like(qh)
    dk, dv = torch.zeros_like(kh), torch.zeros_like(vh)
    d_sink = None
    for cols, band, sink in tiles:
        g = kern.backward(qh, kh[:, :, cols], vh[:, :, cols], o_acc, dh, lse_acc, band, sink, None, 8 ** -0.5)
        dq += g.dq
        dk[:, :, cols] += g.dk
        dv[:, :, cols] += g.dv
        d_sink = g.d_sink if g.d_sink is not None else d_sink
    assert torch.allclose(dq, bhsd(leaves[0].grad), atol=1e-12)
    assert torch.allclose(dk, bhsd(leaves[1].grad), atol=1e-12)
    assert torch.allclose(dv, bhsd(leaves[2].grad), atol=1e-12)
    assert torch.allclose(d_sink, leaves[3].grad, atol=1e-12)


def test_bf16_tile_returns_bf16_output_and_fp32_stats():
    q, k, v, a, _, _ = _data()
    o, lse = TorchTiles().forward(*(bhsd(x).bfloat16() for x in (q, k, v)), Band(None, 0), a.float(), None, 0.35)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_backend_selection():
    assert get_kernel("torch", "cpu").name == "torch"
    assert get_kernel("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="backend='tpu'"):
        get_kernel("tpu", "cpu")


@pytest.mark.parametrize("backend", ["cudnn", "fa4"])
def test_gpu_backends_on_cpu_are_refused_with_a_reason(backend):
    with pytest.raises(BackendUnavailable, match=f"backend='{backend}' cannot run: .*CUDA device"):
        get_kernel(backend, "cpu")


@pytest.mark.parametrize("band", [Band(None, 0), Band(None, 5), Band(-7, 0), Band(-3, 2), Band(-5, None), Band()],
                         ids=str)
@pytest.mark.parametrize("n_q,n_kv", [(8, 8), (8, 4), (4, 8)])
def test_fa4_window_sees_exactly_the_trimmed_band(band, n_q, n_kv):
    """FA4's bottom-right-aligned (causal, left, right) reproduces the trimmed band's mask."""
    from sinkprof.kernels.base import trim_band
    from sinkprof.kernels.fa4 import fa4_window
    trimmed = trim_band(band, n_q, n_kv)
    if trimmed is None:
        return
    rows, cols, sub = trimmed
    nq, nk = rows.stop - rows.start, cols.stop - cols.start
    causal, left, right = fa4_window(sub, nq, nk)
    offset = nk - nq
    j_minus_i = torch.arange(nk)[None, :] - torch.arange(nq)[:, None]
    fa4 = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        assert left is None and right is None
        fa4 &= j_minus_i <= offset
    if left is not None:
        assert left >= 0
        fa4 &= j_minus_i >= offset - left
    if right is not None:
        assert right >= 0
        fa4 &= j_minus_i <= offset + right
    want = sub.mask(nq, nk)
    assert torch.equal(fa4, torch.ones_like(fa4) if want is None else want)


@pytest.mark.parametrize("band", [Band(None, -2), Band(3, None), Band(-3, 2), Band(None, 0), Band(-40, -30),
                                  Band(30, 40), Band(-2, -1), Band(1, 3), Band(-9, None), Band(None, 9), Band()],
                         ids=str)
@pytest.mark.parametrize("n_q,n_kv", [(8, 8), (8, 4), (4, 8)])
def test_cudnn_trim_keeps_exactly_the_visible_part_of_a_tile(band, n_q, n_kv):
    from sinkprof.kernels.base import trim_band as _trim
    full = band.mask(n_q, n_kv)
    full = torch.ones(n_q, n_kv, dtype=torch.bool) if full is None else full
    trimmed = _trim(band, n_q, n_kv)
    if trimmed is None:
        assert not full.any()
        return
    rows, cols, sub = trimmed
    assert (sub.lo is None or sub.lo <= 0) and (sub.hi is None or sub.hi >= 0)
    part = sub.mask(rows.stop - rows.start, cols.stop - cols.start)
    rebuilt = torch.zeros_like(full)
    rebuilt[rows, cols] = True if part is None else part
    assert torch.equal(rebuilt, full)
    assert full[rows].any(dim=1).all()  # every kept row sees at least one key


def test_fa4_calls_show_the_cute_dsl_only_the_program_name(monkeypatch):
    """The CuTe DSL parses sys.argv at every compile, and argparse takes ``--h 8`` for ``--help``."""
    import argparse
    import sys
    from sinkprof.kernels.fa4 import _program_name_only
    monkeypatch.setattr(sys, "argv", ["sinkprof", "check", "--h", "8"])
    parser = argparse.ArgumentParser()
    parser.add_argument("-diagnostic", nargs="?")
    with _program_name_only():
        assert sys.argv == ["sinkprof"]
        parser.parse_known_args()                       # would print the help and exit on the full argv
    assert sys.argv == ["sinkprof", "check", "--h", "8"]
    with pytest.raises(SystemExit):
        parser.parse_known_args()


def test_the_fa4_rows_backward_takes_whole_tiles_that_end_on_a_block_or_the_last_row():
    """A tile's rows may start off FA4's blocks (the rows before them in the block then see
    nothing), not end off them short of the last row (the block's other rows would add to dq)."""
    from sinkprof.kernels import fa4_rows
    from sinkprof.plan import Tile, ring_plan
    causal, window = Band(None, 0), Band(-128, 0)
    tiles = lambda chunk, band: [t for st in ring_plan(4, 0, chunk, band).backward_steps for t in st.tiles]
    assert {t.q_rows.start for t in tiles(320, causal)} == {0, 320}   # rank 0: later tiles take its second chunk
    assert fa4_rows.unqualified(tiles(256, causal), 512, 128) is None
    assert fa4_rows.unqualified(tiles(320, causal), 640, 64) is None
    assert fa4_rows.unqualified(tiles(320, causal), 640, 128) is None   # rows from 320: from 256, 64 seeing nothing
    first_chunk = Tile(slice(0, 320), slice(0, 320), causal, True)
    assert "end on a 128-row block" in fa4_rows.unqualified([first_chunk], 640, 128)
    assert fa4_rows.unqualified([first_chunk], 640, 64) is None
    assert "part of its rows or keys" in fa4_rows.unqualified(tiles(256, window), 512, 128)
    no_mask = tiles(320, Band())
    assert fa4_rows.unqualified(no_mask, 640, 80) is None     # every tile is all the rows
    assert {(t.q_rows.start, t.q_rows.stop) for t in no_mask} == {(0, 640)}


def test_the_fa4_rows_backward_runs_the_unmasked_configuration_where_its_tiles_allow():
    """FA4's configuration for unmasked tiles (80-row blocks at d128) for causal and full ranks,
    FA4's own for masked ones where a tile has a window's left bound or would end off its blocks
    (a pack's document) and on the masked one's."""
    from types import SimpleNamespace
    from sinkprof.kernels import fa4_rows
    from sinkprof.plan import Tile, ring_plan
    fa4 = SimpleNamespace(_tile_size_bwd_sm90=lambda d, d_v, masked, local: SimpleNamespace(
        m_block_size=64 if masked else 80, masked=masked))
    causal = [t for st in ring_plan(2, 0, 4096, Band(None, 0)).backward_steps for t in st.tiles]
    assert {t.q_rows.start for t in causal} == {0, 4096}            # the later tile starts off the 80-row blocks
    cfg, why = fa4_rows.choose_configuration(fa4, causal, 8192, 128, 128, unmasked=True)
    assert why is None and cfg.m_block_size == 80
    cfg, why = fa4_rows.choose_configuration(fa4, causal, 8192, 128, 128, unmasked=False)
    assert why is None and cfg.m_block_size == 64
    window = [t for st in ring_plan(2, 0, 4096, Band(-1024, 0)).backward_steps for t in st.tiles]
    assert fa4_rows.configuration(fa4, window, 128, 128, unmasked=True).m_block_size == 64
    assert fa4_rows.configuration(fa4, [Tile(slice(0, 8), slice(0, 8), Band(), True)], 128, 128).m_block_size == 80
    doc = [Tile(slice(0, 192), slice(0, 192), Band(None, 0), True), Tile(slice(192, 512), slice(0, 320), Band(), False)]
    cfg, why = fa4_rows.choose_configuration(fa4, doc, 512, 128, 128, unmasked=True)   # 192: on 64, not on 80
    assert why is None and cfg.m_block_size == 64
    odd = [Tile(slice(0, 100), slice(0, 100), Band(None, 0), True)]
    cfg, why = fa4_rows.choose_configuration(fa4, odd, 512, 128, 128, unmasked=True)
    assert cfg is None and "end on a 64-row block" in why


def test_side_streams_are_made_once_and_never_a_stream_in_use(monkeypatch):
    """torch hands streams out of a pool in turn (here one of 12): the streams run beside a stream
    are made once per stream and purpose, and are neither that stream nor one handed out for
    anything else, even when the pool comes round to them; a stream handed out that later asks
    for streams of its own (a capture's) gets others."""
    from sinkprof.kernels import base
    made = []

    class PoolStream:   # torch.cuda.Stream as torch makes it: the next of the pool's streams
        def __init__(self, device, priority=0):
            self.device, self.priority = device, priority
            self.cuda_stream = 100 + len(made) % 12
            made.append(self)
    monkeypatch.setattr(torch.cuda, "Stream", PoolStream)
    monkeypatch.setattr(base, "_SIDE_STREAMS", {})
    monkeypatch.setattr(base, "_HANDED", set())
    handles = lambda streams: [x.cuda_stream for x in streams]
    main = PoolStream("cuda:0")   # the ring's stream: pool stream 100
    side = base.side_streams(main, 1, "beside")
    pieces = base.side_streams(main, 2, "pieces")
    assert handles(side + pieces) == [101, 102, 103] and len(made) == 4
    assert base.side_streams(main, 2, "pieces") == pieces and len(made) == 4   # made once
    assert base.side_streams(main, 1, "pieces") == pieces[:1]
    assert handles(base.side_streams(side[0], 2, "pieces")) == [104, 105]   # Beside's stream cutting step 0
    assert handles(base.side_streams(pieces[0], 1, "beside")) == [106]      # a stream handed out, now a caller
    other = [PoolStream("cuda:0") for _ in range(5)]   # 107-111: another ring's stream and others
    assert handles(base.side_streams(other[0], 1, "beside")) == [108]   # the pool came round: 100-107 drawn past
    assert len(made) == 12 + 9


def test_the_dispatch_model_of_a_causal_backward_and_the_cuts_it_picks():
    """``fa4_rows.predicted_time`` lists FA4's programs head after head on the SMs; a tile whose
    last head's longest programs start late is cut, one that fits the SMs at once or has the heads
    to even out is not."""
    from sinkprof.kernels import fa4_rows
    cost = fa4_rows.PROGRAM_COST
    # 2 key blocks of 128, rows in blocks of 64: the first program loops over 4 row blocks, the second over 2
    assert fa4_rows.predicted_time(256, (), 1, 128, 64, 4) == 4 + cost
    assert fa4_rows.predicted_time(256, (), 3, 128, 64, 1) == 3 * (4 + 2 + 2 * cost)   # one SM: the sum
    assert fa4_rows.predicted_time(256, (128,), 1, 128, 64, 4) == 4 + cost   # the pieces' programs are the tile's
    # 16 heads of 64 key blocks on 132 SMs: head 15's longest programs start after 15/16 of the work
    one = fa4_rows.predicted_time(8192, (), 16, 128, 64, 132)
    work = 16 * sum(128 - 2 * j + cost for j in range(64))
    assert work / 132 < one < 1.2 * work / 132
    cut = fa4_rows.causal_cuts(8192, 16, 128, 64, 132)
    assert cut == (4096, 6144)
    assert fa4_rows.predicted_time(8192, cut, 16, 128, 64, 132) < 0.95 * one
    assert fa4_rows.causal_cuts(1024, 8, 128, 64, 132) == ()    # 64 programs: all on the SMs at once
    assert fa4_rows.causal_cuts(16384, 16, 128, 64, 132) == ()  # 128 blocks a head: the heads even out
    assert fa4_rows.causal_cuts(8192, 64, 128, 128, 132) == (4096, 6144)   # gpt-oss: 64 heads, 1.8% less
    assert fa4_rows.causal_cuts(16384, 64, 128, 128, 132) == ()
    assert all(c % 384 == 0 for c in fa4_rows.causal_cuts(6144, 16, 128, 96, 132))   # on blocks of both sizes


def test_fa4_varlen_index_tensors_are_made_once_per_group_and_only_the_latest_kept(monkeypatch):
    """A group's cu_seqlens and seqused are made once (a warm ring is graph-capturable), hold where
    each tile starts and how many rows it has, and packs that change every batch do not grow the
    cache without bound."""
    from sinkprof.kernels import fa4
    monkeypatch.setattr(fa4, "INDEX_CACHE", 3)
    kernel = fa4.FA4Tiles(0)            # no GPU needed to build the arguments (on q's device)
    q = torch.zeros(1, 2, 40, 8, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 30, 8, dtype=torch.bfloat16)
    rows, cols = (slice(0, 10), slice(16, 40)), (slice(0, 10), slice(12, 30))
    args = kernel._varlen_args(q, k, rows, cols, (Band(), Band()))
    assert args["cu_seqlens_q"].tolist() == [0, 16, 40] and args["seqused_q"].tolist() == [10, 24]
    assert args["cu_seqlens_k"].tolist() == [0, 12, 30] and args["seqused_k"].tolist() == [10, 18]
    assert (args["max_seqlen_q"], args["max_seqlen_k"], args["causal"]) == (24, 18, False)
    again = kernel._varlen_args(q, k, rows, cols, (Band(), Band()))
    assert again["cu_seqlens_q"] is args["cu_seqlens_q"]   # made once
    for n in range(1, 4):                                   # three other groups: the first one is dropped
        kernel._varlen_args(q, k, (slice(0, n), slice(16, 40)), (slice(0, n), slice(12, 30)), (Band(), Band()))
    assert len(kernel._varlen) == 3
    assert kernel._varlen_args(q, k, rows, cols, (Band(), Band()))["cu_seqlens_q"] is not args["cu_seqlens_q"]


PEAK_SCRIPT = """
import sys, torch
from sinkprof.kernels import TorchTiles
from sinkprof.options import Band
b, h, g, n, d = 1, 2, 1, 2048, 32
q, do = torch.randn(b, h, n, d, dtype=torch.float64), torch.randn(b, h, n, d, dtype=torch.float64)
k, v = torch.randn(b, g, n, d, dtype=torch.float64), torch.randn(b, g, n, d, dtype=torch.float64)
sink, bias = torch.randn(h, dtype=torch.float64) * 5, torch.randn(1, h, n, n, dtype=torch.float64)
tile = b * h * n * n * 8

def peak(fn):  # VmHWM over VmRSS: the resident high-water mark of fn, reset first
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    status = lambda key: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
    base = status("VmRSS")
    kept = fn()
    return (status("VmHWM") - base) / tile, kept

kern = TorchTiles()
for band in (Band(None, 0), Band()):
    fwd, (o, lse) = peak(lambda: kern.forward(q, k, v, band, sink, None, 0.125))
    bwd, _ = peak(lambda: kern.backward(q, k, v, o, do, lse, band, sink, None, 0.125))
    print(f"{fwd:.3f} {bwd:.3f}")
bwd, _ = peak(lambda: kern.backward(q, k, v, o, do, lse, Band(), sink, bias, 0.125))   # dBias is a tile it returns
print(f"0 {bwd:.3f}")
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_the_torch_tiles_hold_at_most_three_score_sized_tensors():
    """The memory check (``tool.preflight.case_need``) counts three tile-sized tensors in the
    accumulator dtype: the scores become the probabilities, and dP becomes dS, in place (they were
    five: the backward's peak was 5.2 tiles, the forward's 3.1)."""
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for line in out.stdout.split("\n")[:-1]:
        fwd, bwd = map(float, line.split())
        assert fwd < 2.5 and bwd < 3.5, out.stdout


def test_a_bias_wider_than_the_accumulator_is_rounded_to_it_first_as_the_reference_does():
    """The in-place scores added an fp64 bias in fp64 and rounded once; the reference (and the
    tiles before) round the bias to the accumulator dtype first."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    bias = torch.randn(1, 2, 16, 16, generator=g, dtype=torch.float64) * 5
    sink = torch.randn(2, generator=g) * 5
    kern = TorchTiles()
    o64, lse64 = kern.forward(q, k, v, Band(None, 0), sink, bias, 0.3)
    o32, lse32 = kern.forward(q, k, v, Band(None, 0), sink, bias.float(), 0.3)
    assert torch.equal(lse64, lse32) and torch.equal(o64, o32)
    d64 = kern.backward(q, k, v, o64, q, lse64, Band(None, 0), sink, bias, 0.3)
    d32 = kern.backward(q, k, v, o32, q, lse32, Band(None, 0), sink, bias.float(), 0.3)
    assert all(torch.equal(a, b) for a, b in zip((d64.dq, d64.dk, d64.dv, d64.d_bias), (d32.dq, d32.dk, d32.dv,
                                                                                         d32.d_bias)))
