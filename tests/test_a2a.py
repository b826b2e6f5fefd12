"""a2a (Ulysses) and hierarchical a2a+p2p: the re-layout as data, the fp64 replay, real ranks."""
import json

import pytest
import torch

from sinkprof.a2a import join_outer, split_outer
from sinkprof.emulate import emulate_hierarchical
from sinkprof.options import check_heads
from sinkprof.options import SinkStrategy, make_spec
from sinkprof.plan import shard
from sinkprof.testing import Shape, make_inputs, reference


@pytest.mark.parametrize("world,members", [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4), (6, 3)])
@pytest.mark.parametrize("seq_dim", [0, 1])
def test_the_a2a_relayout_lands_each_group_on_its_outer_shard(world, members, seq_dim):
    s = 2 * world * 3
    x = torch.arange(s).view(-1, 1) if seq_dim == 0 else torch.arange(s).view(1, -1)
    outer = world // members
    for o in range(outer):
        pieces = [shard(x, world, o * members + m, seq_dim) for m in range(members)]
        joined = join_outer(pieces, seq_dim, (3,))
        assert torch.equal(joined, shard(x, outer, o, seq_dim))
        assert all(torch.equal(a, b) for a, b in zip(split_outer(joined, members, seq_dim, (3,)), pieces))


@pytest.mark.parametrize("world,members", [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)])
@pytest.mark.parametrize("mask,window", [("causal", None), ("no_mask", None), ("causal", (5, 0))])
def test_hierarchical_replay_matches_the_reference(world, members, mask, window):
    spec = make_spec("learnable", mask, window, "bshd")
    shape = Shape(b=2, s=2 * world * 4, h=8, g=4, d=8)
    inputs = make_inputs(shape, spec, seed=world + members, with_bias=True)
    ref = reference(inputs, spec)
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        got = emulate_hierarchical(inputs, spec, world, members, strategy).result
        for name, value in ref.named().items():
            assert (got.named()[name] - value).abs().max() <= 1e-12, name


def test_head_counts_that_do_not_split_are_refused_naming_both():
    with pytest.raises(ValueError, match="h=6 heads and k, v have g=2"):
        check_heads(6, 2, 4)


def _check(cli, *args):
    res = cli("check", "--format", "json", *args)
    assert "Traceback" not in res.stderr, res.stderr
    return res.returncode, json.loads(res.stdout)


@pytest.mark.slow
def test_a2a_cp2_every_softmax_type_mask_contract_window_and_gqa(cli):
    code, doc = _check(cli, "--comm", "a2a", "--ranks", "2", "--heads", "4", "--kv-heads", "2", "--softmax", "all",
                       "--mask", "all", "--sink-grad", "all", "--dtype", "fp64,fp32", "--window", "6,0", "--bias")
    assert code == 0, doc
    assert len(doc["cases"]) == 2 * 2 * 3 * 2  # masks x dtypes x softmax types x contracts (bias has one too)


@pytest.mark.slow
def test_a2a_cp4_and_a2a_p2p_2x2(cli):
    code, doc = _check(cli, "--comm", "a2a,a2a+p2p", "--ranks", "4", "--a2a-size", "2", "--heads", "8", "--kv-heads", "4",
                       "--softmax", "all", "--mask", "all", "--sink-grad", "all", "--sink-strategy", "all",
                       "--dtype", "fp64")
    assert code == 0, doc
    assert {c["comm"] for c in doc["cases"]} == {"a2a", "a2a+p2p"}
    assert all(c["passed"] for c in doc["cases"])


@pytest.mark.slow
def test_a2a_p2p_8_ranks_in_4x2_with_a_window_and_sbhd(cli):
    code, doc = _check(cli, "--comm", "a2a+p2p", "--ranks", "8", "--a2a-size", "4", "--seq-len", "64", "--heads", "8",
                       "--kv-heads", "4", "--softmax", "learnable", "--mask", "causal", "--window", "5,0", "--qkv-format",
                       "sbhd", "--sink-grad", "all", "--dtype", "fp64")
    assert code == 0, doc
    assert doc["cp"] == 8 and len(doc["cases"]) == 2


@pytest.mark.slow
def test_skipping_the_sink_head_slice_is_caught(cli):
    code, doc = _check(cli, "--comm", "a2a,a2a+p2p", "--ranks", "4", "--heads", "8", "--kv-heads", "4", "--softmax",
                       "learnable", "--mask", "causal", "--dtype", "fp64", "--inject", "skip-sink-slice")
    assert code == 1
    assert all(not c["passed"] and not c["errors"]["out"]["passed"] for c in doc["cases"])


def test_a2a_with_heads_that_do_not_split_is_a_usage_error(cli):
    res = cli("check", "--comm", "a2a", "--ranks", "4", "--heads", "4", "--kv-heads", "2")
    assert res.returncode == 2
    message = " ".join(res.stderr.split())
    assert "--comm a2a over 4 ranks splits the heads: --heads 4 and --kv-heads 2 must both be divisible by 4" in message
    assert "or --comm a2a+p2p with an --a2a-size" in message and "Traceback" not in res.stderr
    res = cli("check", "--comm", "a2a+p2p", "--a2a-size", "3", "--ranks", "2")
    assert res.returncode == 2
    assert "--a2a-size 3 must divide --ranks 2" in res.stderr and "use --a2a-size 2" in res.stderr
