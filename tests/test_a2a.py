"""a2a (Ulysses) and hierarchical a2a+p2p: the re-layout as data, the fp64 replay, real ranks."""
import json

import pytest
import torch

from sinkprof.a2a import join_outer, split_outer
from sinkprof.emulate import emulate_hierarchical
from sinkprof.options import A2AError, A2AProblem, SinkStrategy, check_a2a_size, check_heads, make_spec
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
    with pytest.raises(ValueError, match="h=6 heads and k, v have g=2") as err:
        check_heads(6, 2, 4)
    assert str(err.value).endswith("use an a2a size that divides both: 1 or 2")
    assert (err.value.problem, err.value.members, err.value.h, err.value.g) == (A2AProblem.HEADS, 4, 6, 2)
    assert err.value.sizes == (1, 2)


def test_the_a2a_checks_say_which_quantity_is_wrong_and_which_sizes_fit():
    """The library decides (and words) the a2a rules; the error carries the verdict for the tool."""
    with pytest.raises(A2AError, match="a2a_size=4 must divide the CP group size 6; use one that divides it: "
                                       "1, 2, 3 or 6") as err:
        check_a2a_size(4, 6)
    assert (err.value.problem, err.value.members, err.value.world, err.value.sizes) == (A2AProblem.GROUP, 4, 6,
                                                                                          (1, 2, 3, 6))
    with pytest.raises(A2AError, match="divides it and splits the h=4 query and g=2 K/V heads: 1 or 2") as err:
        check_a2a_size(4, 6, h=4, g=2)
    assert err.value.sizes == (1, 2)
    with pytest.raises(A2AError, match="divides both and the CP group size 8: 1$") as err:
        check_heads(6, 3, 4, world=8)
    assert err.value.sizes == (1,) and isinstance(err.value, ValueError)
    check_a2a_size(2, 4, h=4, g=2)
    check_heads(4, 2, 2, world=4)


def test_an_a2a_error_keeps_its_verdict_through_pickling():
    import pickle
    with pytest.raises(A2AError) as err:
        check_heads(6, 2, 4, world=8)
    back = pickle.loads(pickle.dumps(err.value))
    assert str(back) == str(err.value) and back.problem is A2AProblem.HEADS
    assert (back.members, back.world, back.h, back.g, back.sizes) == (4, 8, 6, 2, (1, 2))


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


@pytest.mark.parametrize("settings,words", [
    (dict(comm=("a2a",), ranks=4, heads=4, kv_heads=2),
     "or --comm a2a+p2p with an --a2a-size that divides both and --ranks 4: --a2a-size 2"),
    (dict(comm=("a2a",), ranks=4, heads=6, kv_heads=3),
     "or --comm p2p (no --a2a-size above 1 divides both and --ranks 4)"),
    (dict(comm=("a2a+p2p",), ranks=8, a2a_size=4, heads=4, kv_heads=2),
     "--comm a2a+p2p over 4 ranks splits the heads: --heads 4 and --kv-heads 2 must both be divisible by 4; "
     "use an --a2a-size that divides both and --ranks 8: --a2a-size 2"),
    (dict(comm=("a2a+p2p",), ranks=8, a2a_size=4, heads=6, kv_heads=3),
     "use --comm p2p (no --a2a-size above 1 divides both and --ranks 8)"),
    # the fix offered for a size that does not divide --ranks splits the heads too (3 would not)
    (dict(comm=("a2a+p2p",), ranks=6, a2a_size=4, heads=4, kv_heads=2, seq_len=72),
     "--a2a-size 4 must divide --ranks 6 (a2a+p2p runs a ring of a2a groups of that size); use --a2a-size 2 "
     "(the a2a sizes that divide --ranks 6 and split --heads 4 and --kv-heads 2: 1, 2)"),
])
def test_the_tool_words_the_librarys_a2a_verdict_with_its_options_and_a_fix_that_fits(settings, words):
    from sinkprof.tool.cases import Settings
    with pytest.raises(ValueError) as err:
        Settings(**settings).validate()
    assert words in str(err.value) and not isinstance(err.value, A2AError)
    fixed = dict(settings, comm=("p2p",)) if "--comm p2p" in words else dict(
        settings, comm=("a2a+p2p",), a2a_size=int(str(err.value).rsplit("--a2a-size ", 1)[1].split()[0]))
    Settings(**fixed).validate()   # the fix named runs
