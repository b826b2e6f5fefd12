"""cp_attention meets a user's mistakes on real ranks: gloo processes, each a subprocess of this
file with a deadline, that run a batch of cases in order and print what each returned or raised.

A mistake must fail on every rank, in words that name the argument, and never hang, abort a
process or return wrong numbers: ranks that pass different arguments, a double backward, a2a+p2p
groups that do not split the CP group as ``a2a_size`` does, a group the rank is not in, an offset
edited between forward and backward, a peer that never arrives.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
DEADLINE_S = 300   # a whole batch, every rank; a hang fails the test instead of the run
T = 20             # cp_attention's timeout in the cases: a hang turns into a CommError well before the deadline


# -- the launcher (the test process) ---------------------------------------------------------------

def launch(batch: str, world: int) -> dict:
    """Run ``batch`` on ``world`` gloo ranks; {case: [rank 0's result, rank 1's, ...]}, each
    ``{"value": ...}`` or ``{"error": type name, "message": ...}``. Fails if a rank hangs past the
    deadline or does not exit cleanly."""
    store = Path(tempfile.mkdtemp(prefix="sinkprof-misuse-")) / "store"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(HERE), batch, str(r), str(world), str(store)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    end = time.monotonic() + DEADLINE_S
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, end - time.monotonic())))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        report = [p.communicate() for p in procs]
        pytest.fail(f"batch {batch!r} hung past {DEADLINE_S}s:\n" + "\n".join(f"rank {r}:\n{o}\n{e[-3000:]}"
                                                                                for r, (o, e) in enumerate(report)))
    results: dict = {}
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} of batch {batch!r} exited with {p.returncode}:\n{out}\n{err[-3000:]}"
        for line in out.splitlines():
            if line.startswith("RESULT "):
                row = json.loads(line[len("RESULT "):])
                results.setdefault(row.pop("case"), [None] * world)[rank] = row
    return results


@pytest.fixture(scope="module")
def two():
    return launch("two", 2)


@pytest.fixture(scope="module")
def four():
    return launch("four", 4)


def _errors(results: list, kind: str, *parts: str) -> None:
    """Every rank raised ``kind`` with each of ``parts`` in its message."""
    for rank, r in enumerate(results):
        assert r is not None and r.get("error") == kind, (rank, r)
        for part in parts:
            assert part in r["message"], (rank, part, r["message"])


# -- the cases (the rank processes) --------------------------------------------------------------

def _data(b=2, s=16, h=4, g=2, d=8, dtype=torch.float64, seed=0):
    """Full-sequence q, k, v, an offset (randn * 5: the sink matters) and a gradient of the output."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64)
    q, k, v, do = randn(b, s, h, d), randn(b, s, g, d), randn(b, s, g, d), randn(b, s, h, d)
    a = randn(1, h, 1, 1) * 5
    return tuple(x.to(dtype) for x in (q, k, v, a, do))


def _shards(rank, world, *xs, dim=1):
    import sinkprof
    return [sinkprof.shard(x, world, rank, dim).clone() for x in xs]


def _against_reference(rank, world, *, shard_index=None, h=4, g=2, **kw):
    """Largest error of the output and of every gradient (q, k, v, offset) against the reference."""
    import sinkprof
    q, k, v, a, do = _data(h=h, g=g)
    ref = [x.clone().requires_grad_() for x in (q, k, v, a)]
    expected = sinkprof.attention(*ref, softmax_type="learnable", mask="causal")
    expected.backward(do)
    n = rank if shard_index is None else shard_index
    mine = [x.requires_grad_() for x in _shards(n, world, q, k, v)] + [a.clone().requires_grad_()]
    out = sinkprof.cp_attention(*mine, softmax_type="learnable", mask="causal", timeout=T, **kw)
    out.backward(sinkprof.shard(do, world, n, 1))
    errs = [(out - sinkprof.shard(expected, world, n, 1)).abs().max()]
    errs += [(m.grad - sinkprof.shard(r.grad, world, n, 1)).abs().max() for m, r in zip(mine[:3], ref[:3])]
    errs.append((mine[3].grad - ref[3].grad).abs().max())
    return max(float(e) for e in errs)


def _call(rank, world, *, b=2, s=16, h=4, g=2, dtype=torch.float64, learnable=False, grad=False, **kw):
    import sinkprof
    q, k, v, a, _ = _data(b=b, s=s, h=h, g=g, dtype=dtype)
    q, k, v = _shards(rank, world, q, k, v)
    if grad:
        q.requires_grad_()
    extra = dict(softmax_offset=a, softmax_type="learnable") if learnable else {}
    return sinkprof.cp_attention(q, k, v, **extra, **{"timeout": T, **kw})


def _differ(rank, world, **per_rank):
    """One call in which each argument of ``per_rank`` takes its rank's value."""
    return _call(rank, world, **{name: values[rank] for name, values in per_rank.items()}).shape


def _double_backward(rank, world, **kw):
    """A gradient with create_graph=True (it must equal the plain one), then its gradient."""
    import sinkprof
    q, k, v, a, do = _data()
    q, k, v, do = _shards(rank, world, q, k, v, do)
    q, k, v, a = (x.requires_grad_() for x in (q, k, v, a))
    call = dict(softmax_type="learnable", mask="causal", timeout=T, **kw)
    gq, ga = torch.autograd.grad((sinkprof.cp_attention(q, k, v, a, **call) * do).sum(), (q, a), create_graph=True)
    pq, pa = torch.autograd.grad((sinkprof.cp_attention(q, k, v, a, **call) * do).sum(), (q, a))
    seen = {"first_order": max(float((gq - pq).abs().max()), float((ga - pa).abs().max())),
            "requires_grad": [gq.requires_grad, ga.requires_grad]}
    for name, grad, wrt in (("q", gq, q), ("offset", ga, a)):
        try:
            second = torch.autograd.grad(grad.pow(2).sum(), wrt)[0]
            seen[name] = f"returned {float(second.abs().max()):.3g}"
        except Exception as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
    return seen


def _counting_gathers(fn):
    """(fn's result, how many all-gathers it ran)."""
    import torch.distributed as dist
    real, calls = dist.all_gather, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    dist.all_gather = counted
    try:
        return fn(), len(calls)
    finally:
        dist.all_gather = real


def _agreed_once(rank, world):
    """A configuration costs one all-gather on its first call and none after, even with other
    offset values (compared on the first call only, as documented)."""
    import sinkprof
    q, k, v, a, _ = _data(s=32)
    q, k, v = _shards(rank, world, q, k, v)
    counts = []
    for offset in (a, a + 1.0, a):
        counts.append(_counting_gathers(lambda: sinkprof.cp_attention(q, k, v, offset, softmax_type="learnable",
                                                                      window=(3, 0), timeout=T))[1])
    return counts


def _capture_refused(rank, world):
    """A configuration's first call inside a CUDA graph capture raises before anything is sent."""
    real = torch.cuda.is_available, torch.cuda.is_current_stream_capturing
    torch.cuda.is_available = torch.cuda.is_current_stream_capturing = lambda: True
    try:
        _, gathers = _counting_gathers(lambda: _call(rank, world, s=48))
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    finally:
        torch.cuda.is_available, torch.cuda.is_current_stream_capturing = real
    return f"ran, {gathers} all-gathers"


def _offset_edited_in_place(rank, world):
    import sinkprof
    q, k, v, a, do = _data()
    q, k, v, do = _shards(rank, world, q, k, v, do)
    a = a.requires_grad_()
    out = sinkprof.cp_attention(q.requires_grad_(), k, v, a, softmax_type="learnable", mask="causal", timeout=T)
    with torch.no_grad():
        a.add_(1.0)
    out.backward(do)


def _not_a_member(rank, world):
    import torch.distributed as dist
    import sinkprof
    first = dist.new_group([0])   # GroupMember.NON_GROUP_MEMBER on the other ranks
    q, k, v, *_ = _data()
    return tuple(sinkprof.cp_attention(q, k, v, group=first, timeout=T).shape)


def _cp_error_peers(rank, world):
    """Rank 1 agrees to the call, then leaves before the ring: rank 0's exchange fails, and its
    CommError names each peer once (K and V are two tensors of one message under direct)."""
    import sinkprof.context_parallel as cp
    if rank == 1:
        def leave(*args, **kwargs):
            time.sleep(4)
            raise RuntimeError("rank 1 left")
        cp.hierarchical_attention = leave
    return tuple(_call(rank, world, mask="causal", kv_schedule="direct", timeout=2).shape)


def _missing_peer(rank, world):
    """Rank 1 never calls: rank 0's argument check times out with a CommError naming the group."""
    if rank == 1:
        time.sleep(5)
        return "did not call"
    return tuple(_call(rank, world, timeout=2).shape)


def _grid(rank, kind: str):
    """The (a2a group, p2p group) of ``rank`` among 4: ``right`` as a2a_size=2 splits them, ``transposed``
    (a2a groups [0, 2] and [1, 3]) or ``world`` (the world twice)."""
    import torch.distributed as dist
    rows, cols = _GROUPS
    if kind == "right":
        return rows[rank // 2], cols[rank % 2]
    if kind == "transposed":
        return cols[rank % 2], rows[rank // 2]
    return dist.group.WORLD, dist.group.WORLD


_GROUPS: tuple = ()


def _make_groups(rank, world):
    import torch.distributed as dist
    global _GROUPS
    made = [dist.new_group(m) for m in ([0, 1], [2, 3], [0, 2], [1, 3])]   # every rank makes every group
    _GROUPS = (made[:2], made[2:])
    return "made"


def _thd(rank, world, cu):
    """A pack of 16 tokens in the documents of ``cu``."""
    import sinkprof
    q, k, v, *_ = (x[0] for x in _data(b=1, s=16))
    return tuple(sinkprof.cp_attention(*(sinkprof.shard(x, world, rank, 0, cu) for x in (q, k, v)),
                                       mask="causal", qkv_format="thd", cu_seqlens=cu, timeout=T).shape)


def _two_cases():
    return [
        ("correct_first", lambda r, w: _against_reference(r, w)),
        ("agreed_once", _agreed_once),
        ("differ_cu_seqlens", lambda r, w: _thd(r, w, [[0, 4, 12, 16], [0, 8, 16]][r])),
        ("differ_length", lambda r, w: tuple(_call(r, w, s=[16, 24][r], mask="causal").shape)),
        ("differ_batch", lambda r, w: _differ(r, w, b=[2, 1])),
        ("differ_mask", lambda r, w: _differ(r, w, mask=["causal", "no_mask"])),
        ("differ_window", lambda r, w: _differ(r, w, mask=["causal"] * 2, window=[(2, 0), (5, 0)])),
        ("differ_dtype", lambda r, w: _differ(r, w, dtype=[torch.float64, torch.float32])),
        ("differ_kv_heads", lambda r, w: _differ(r, w, g=[2, 1])),
        ("differ_kv_schedule", lambda r, w: _differ(r, w, kv_schedule=["ring", "allgather"])),
        ("differ_scale", lambda r, w: _differ(r, w, scale=[0.5, 0.3])),
        ("differ_comm", lambda r, w: _differ(r, w, comm=["p2p", "a2a"])),
        ("differ_sink_grad", lambda r, w: _differ(r, w, learnable=[True] * 2, sink_grad=["full", "partial"])),
        ("differ_requires_grad", lambda r, w: _differ(r, w, grad=[True, False])),
        ("differ_offset_values", lambda r, w: _differ_offset(r, w)),
        ("double_backward_p2p", lambda r, w: _double_backward(r, w)),
        ("double_backward_a2a", lambda r, w: _double_backward(r, w, comm="a2a")),
        ("offset_edited_in_place", _offset_edited_in_place),
        ("capture_refused", _capture_refused),
        ("group_tuple_with_p2p", lambda r, w: _call(r, w, group=(None, None))),
        ("group_string", lambda r, w: _call(r, w, group="world")),
        ("not_a_member", _not_a_member),
        ("a2a_heads", lambda r, w: _call(r, w, h=3, g=1, comm="a2a")),
        ("correct_after", lambda r, w: _against_reference(r, w, kv_schedule="ring")),
    ]


def _differ_offset(rank, world):
    import sinkprof
    q, k, v, a, _ = _data()
    q, k, v = _shards(rank, world, q, k, v)
    return tuple(sinkprof.cp_attention(q, k, v, a + rank, softmax_type="learnable", timeout=T).shape)


def _four_cases():
    return [
        ("make_groups", _make_groups),
        ("grid_right", lambda r, w: _against_reference(r, w, comm="a2a+p2p", group=_grid(r, "right"))),
        ("split_right", lambda r, w: _against_reference(r, w, comm="a2a+p2p", a2a_size=2)),
        ("grid_transposed", lambda r, w: _call(r, w, comm="a2a+p2p", group=_grid(r, "transposed"))),
        ("grid_world_twice", lambda r, w: _call(r, w, h=8, g=4, comm="a2a+p2p", group=_grid(r, "world"))),
        ("grid_differ_window", lambda r, w: _call(r, w, mask="causal", window=(5 if r == 3 else 2, 0), comm="a2a+p2p",
                                                  group=_grid(r, "right"))),
        ("differ_a2a_size", lambda r, w: _call(r, w, g=4, comm="a2a+p2p", a2a_size=2 if r < 2 else 4)),
        ("a2a_heads", lambda r, w: _call(r, w, s=32, h=6, g=2, comm="a2a")),
        ("grid_double_backward", lambda r, w: _double_backward(r, w, comm="a2a+p2p", group=_grid(r, "right"))),
        ("grid_after", lambda r, w: _against_reference(r, w, comm="a2a+p2p", group=_grid(r, "right"))),
    ]


BATCHES = {
    "two": _two_cases,
    "four": _four_cases,
    "cp_error_peers": lambda: [("cp_error_peers", _cp_error_peers)],
    "missing_peer": lambda: [("missing_peer", _missing_peer)],
}


def _worker(batch: str, rank: int, world: int, store: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for name, case in BATCHES[batch]():
        try:
            row = {"value": case(rank, world)}
        except Exception as exc:
            row = {"error": type(exc).__name__, "message": str(exc)}
        print("RESULT " + json.dumps({"case": name, **row}, default=str), flush=True)
    sys.stdout.flush()
    os._exit(0)   # (a batch that ends in a CommError leaves gloo work that a clean shutdown would wait for)


# -- the tests -----------------------------------------------------------------------------------

def test_the_arguments_checked_agree_and_the_results_equal_the_reference(two):
    for r in two["correct_first"] + two["correct_after"]:
        assert r.get("value", 1) < 1e-12, r


def test_a_configuration_costs_one_all_gather_on_its_first_call_and_none_after(two):
    for r in two["agreed_once"]:
        assert r == {"value": [1, 0, 0]}


@pytest.mark.parametrize("case,field,values", [
    ("differ_cu_seqlens", "cu_seqlens", ["(0, 4, 12, 16)", "(0, 8, 16)"]),
    ("differ_length", "q.shape", ["(2, 8, 4, 8)", "(2, 12, 4, 8)"]),
    ("differ_batch", "q.shape", ["(2, 8, 4, 8)", "(1, 8, 4, 8)"]),
    ("differ_mask", "mask", ["'causal'", "'no_mask'"]),
    ("differ_window", "window", ["(2, 0)", "(5, 0)"]),
    ("differ_dtype", "q.dtype", ["'torch.float64'", "'torch.float32'"]),
    ("differ_kv_heads", "k.shape", ["(2, 8, 2, 8)", "(2, 8, 1, 8)"]),
    ("differ_kv_schedule", "kv_schedule", ["'ring'", "'allgather'"]),
    ("differ_scale", "scale", ["0.5", "0.3"]),
    ("differ_comm", "comm", ["'p2p'", "'a2a'"]),
    ("differ_sink_grad", "sink_grad", ["'full'", "'partial'"]),
    ("differ_requires_grad", "requires_grad (q, k, v, softmax_offset, bias)",
     ["(True, False, False, False, False)", "(False, False, False, False, False)"]),
    ("differ_offset_values", "softmax_offset values", ["(", "("]),
])
def test_ranks_that_pass_different_arguments_all_raise_naming_the_first_that_differs(two, case, field, values):
    """Before: wrong numbers (cu_seqlens, offsets, scale), or gloo aborting one process while the
    other returned (lengths, batch, mask, window, dtype, heads, schedule)."""
    _errors(two[case], "ValueError", f"passed different {field}: rank 0 vs rank 1",
            "every rank of the group must pass the same arguments")
    for rank, r in enumerate(two[case]):
        assert f"(this rank, {rank}, passed {values[rank]}" in r["message"]


@pytest.mark.parametrize("case", ["double_backward_p2p", "double_backward_a2a"])
def test_a_double_backward_raises_on_every_rank_and_the_first_order_is_exact(two, case):
    for r in two[case]:
        seen = r["value"]
        assert seen["first_order"] == 0.0 and seen["requires_grad"] == [True, True]
        for wrt in ("q", "offset"):
            assert seen[wrt].startswith("NotImplementedError: cp_attention has no double backward"), seen


def test_an_offset_edited_in_place_before_the_backward_is_named(two):
    _errors(two["offset_edited_in_place"], "RuntimeError",
            "softmax_offset was modified in place after cp_attention's forward", "softmax_offset.clone()")


def test_a_first_call_under_cuda_graph_capture_raises_before_sending(two):
    for r in two["capture_refused"]:
        assert r["value"].startswith("RuntimeError: cp_attention's first call with these arguments"), r
        assert "before capturing" in r["value"]


def test_a_group_that_is_not_one_is_refused_naming_group(two):
    _errors(two["group_tuple_with_p2p"], "ValueError", "group=(a2a_group, p2p_group) is the form of comm='a2a+p2p'")
    _errors(two["group_string"], "ValueError", "group='world' must be a torch.distributed ProcessGroup")


def test_a_rank_outside_the_group_is_told_so(two):
    """The member runs a group of one (what it was given: it cannot know the other meant to join)."""
    member, outsider = two["not_a_member"]
    assert member == {"value": [2, 16, 4, 8]}
    _errors([outsider], "ValueError", "rank 1 is not a member of group")


def test_plain_a2a_that_cannot_split_the_heads_advises_p2p(two, four):
    _errors(two["a2a_heads"], "A2AError", "comm='a2a' splits the heads over the 2 ranks of the group",
            "h=3 and g=1 must both be divisible by 2; use comm='p2p'")
    assert all(r["message"].endswith("use comm='p2p'") for r in two["a2a_heads"])
    _errors(four["a2a_heads"], "A2AError", "use comm='p2p', or comm='a2a+p2p' with a2a_size=2")


def test_a2a_p2p_groups_that_split_the_cp_group_as_a2a_size_does_equal_the_reference(four):
    assert all(r == {"value": "made"} for r in four["make_groups"])
    for case in ("grid_right", "split_right", "grid_after"):
        for r in four[case]:
            assert r.get("value", 1) < 1e-12, (case, r)


def test_transposed_a2a_p2p_groups_are_refused_naming_the_shard_each_rank_would_need(four):
    """Before: wrong numbers (each rank's shard is read as shard o * A + i)."""
    _errors(four["grid_transposed"], "ValueError", "group=(a2a_group, p2p_group)", "must split the CP group as "
            "a2a_size=2 does")
    for rank, (o, i) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        assert f"shard as shard {o} * 2 + {i} = {2 * o + i} of the sequence" in four["grid_transposed"][rank]["message"]
    _errors(four["grid_world_twice"], "ValueError", "the two groups share ranks [0, 1, 2, 3]")


def test_a_difference_on_one_rank_of_an_a2a_p2p_grid_raises_on_every_rank(four):
    _errors(four["grid_differ_window"], "ValueError", "passed different window")
    _errors(four["differ_a2a_size"], "ValueError", "passed different a2a_size: ranks 0, 1 vs ranks 2, 3")


def test_a_double_backward_of_a2a_p2p_raises_on_every_rank(four):
    for r in four["grid_double_backward"]:
        assert r["value"]["first_order"] == 0.0
        assert r["value"]["q"].startswith("NotImplementedError: cp_attention has no double backward")


def test_a_comm_error_names_each_peer_once():
    rank0, rank1 = launch("cp_error_peers", 2)["cp_error_peers"]
    assert rank0["error"] == "CommError" and "(send to rank 1, receive from rank 1)" in rank0["message"], rank0
    assert rank1 == {"error": "RuntimeError", "message": "rank 1 left"}


def test_a_peer_that_never_arrives_is_a_comm_error_naming_the_group():
    rank0, rank1 = launch("missing_peer", 2)["missing_peer"]
    assert rank0["error"] == "CommError", rank0
    assert "the check that every rank passed the same arguments (an all-gather over the group of ranks [0, 1])" \
        in rank0["message"] and "timeout 2s" in rank0["message"]
    assert rank1 == {"value": "did not call"}


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
