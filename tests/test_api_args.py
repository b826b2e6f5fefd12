"""A user's mistakes at the public entry points (``shard``, ``unshard``, ``pad_pack``,
``comm_bytes``) are refused there, with an error that names the argument, its value and the fix,
never a torch error from deep inside nor a silently wrong answer."""
import re

import numpy as np
import pytest
import torch

import sinkprof
from sinkprof.options import A2AError


def raises(kind, *parts):
    """``pytest.raises`` of ``kind`` whose message holds every one of ``parts``, in order."""
    return pytest.raises(kind, match=".*".join(map(re.escape, parts)))


X = torch.arange(16.).reshape(1, 16, 1, 1)


# shard

@pytest.mark.parametrize("call, kind, parts", [
    (lambda: sinkprof.shard(X, 2, 0, 7), ValueError, ("seq_dim=7", "out of range", "(1, 16, 1, 1)", "from -4 to 3")),
    (lambda: sinkprof.shard(X, 2, 0, "1"), TypeError, ("seq_dim='1'", "must be an int", "not str")),
    (lambda: sinkprof.shard(torch.tensor(1.), 2, 0, 0), ValueError, ("seq_dim=0", "0-d", "no sequence dim")),
    (lambda: sinkprof.shard(X, 2.0, 0, 1), TypeError, ("cp_size=2.0", "must be an int", "ranks", "not float")),
    (lambda: sinkprof.shard(X, 0, 0, 1), ValueError, ("cp_size=0", "must be >= 1")),
    (lambda: sinkprof.shard(X, 2, 1.0, 1), TypeError, ("rank=1.0", "must be an int", "not float")),
    (lambda: sinkprof.shard(X, 2, 7, 1), ValueError, ("rank=7", "must be in [0, cp_size=2)")),
    (lambda: sinkprof.shard(X, 2, 0, 1.0), TypeError, ("seq_dim=1.0", "must be an int", "not float")),
    (lambda: sinkprof.shard(X.numpy(), 2, 0, 1), TypeError, ("x must be a torch.Tensor", "numpy.ndarray",
                                                             "torch.as_tensor")),
], ids=["seq_dim-out-of-range", "seq_dim-str", "0-d", "cp-float", "cp-0", "rank-float", "rank-out-of-range",
        "seq_dim-float", "numpy"])
def test_shard_names_the_argument_it_refuses(call, kind, parts):
    with raises(kind, *parts):
        call()


def test_shard_takes_what_torch_takes_as_a_dim_and_an_int():
    assert torch.equal(sinkprof.shard(X, 2, 1, -3), sinkprof.shard(X, 2, 1, 1))
    assert torch.equal(sinkprof.shard(X, np.int64(2), torch.tensor(1), 1), sinkprof.shard(X, 2, 1, 1))


# unshard

def test_unshard_refuses_shards_of_different_lengths():
    """Before: 20 rows, 12..15 twice. The cu_seqlens path refuses them too (before: its own message)."""
    a, b = sinkprof.shard(torch.arange(16.), 2, 0, 0), sinkprof.shard(torch.arange(24.), 2, 1, 0)
    with raises(ValueError, "shard of rank 1 has 12 rows along dim 0 but rank 0's has 8", "every rank holds as many"):
        sinkprof.unshard([a, b], 0)
    with raises(ValueError, "shard of rank 1 has 12 rows along dim 0 but rank 0's has 8"):
        sinkprof.unshard([a, b], 0, [0, 8, 20])


def test_unshard_refuses_shards_that_differ_in_another_dim():
    s0 = sinkprof.shard(X, 2, 0, 1)
    with raises(ValueError, "shard of rank 1 has size 2 along dim 2 but rank 0's has 1", "seq_dim=1"):
        sinkprof.unshard([s0, torch.zeros(1, 8, 2, 1)], 1)
    with raises(ValueError, "shard of rank 1 has 3 dims", "rank 0's has 4"):
        sinkprof.unshard([s0, torch.zeros(1, 8, 1)], 1)


def test_unshard_refuses_mixed_dtypes():
    """Before: torch.cat promoted the float32 shard to float64."""
    s0, s1 = (sinkprof.shard(X, 2, r, 1) for r in range(2))
    with raises(ValueError, "shard of rank 1 is torch.float64 but rank 0's is torch.float32", ".to(dtype)"):
        sinkprof.unshard([s0, s1.double()], 1)


def test_unshard_refuses_one_tensor_for_the_list_of_shards():
    """Before: a [2, 8, 2, 4] tensor was taken as two ranks' [8, 2, 4] shards along its batch dim."""
    stacked = torch.stack([sinkprof.shard(X, 2, r, 1) for r in range(2)])
    with raises(TypeError, "shards must be a list of one tensor per rank", "got torch.Tensor;", "list(x.unbind(0))"):
        sinkprof.unshard(stacked[0], 1)
    with raises(TypeError, "shards must be a list", "got int;"):
        sinkprof.unshard(3, 1)
    assert torch.equal(sinkprof.unshard(iter(stacked.unbind(0)), 1), X)


def test_unshard_names_the_seq_dim_and_a_shard_that_is_not_a_tensor():
    s0, s1 = (sinkprof.shard(X, 2, r, 1) for r in range(2))
    with raises(ValueError, "seq_dim=5", "out of range", "from -4 to 3"):
        sinkprof.unshard([s0, s1], 5)
    with raises(TypeError, "shards[1]", "must be a torch.Tensor", "numpy.ndarray"):
        sinkprof.unshard([s0, s1.numpy()], 1)
    assert torch.equal(sinkprof.unshard([s0, s1], -3), X)


def test_balanced_shards_unsharded_in_the_zigzag_layout_are_told_the_pack_layout():
    """Before: 'pad every document ... with sinkprof.pad_pack', the fix for a pack not yet sharded."""
    x, cu = torch.arange(16.), [0, 6, 16]
    shards = [sinkprof.shard(x, 2, r, 0, cu, pack_layout="balanced") for r in range(2)]
    with pytest.raises(ValueError) as err:
        sinkprof.unshard(shards, 0, cu)
    assert "pack_layout='zigzag' cannot lay out the pack cu_seqlens=[0, 6, 16] over 2 ranks" in str(err.value)
    assert "pass the pack_layout used to shard them: pack_layout='balanced'" in str(err.value)
    assert "pad_pack" not in str(err.value)
    assert torch.equal(sinkprof.unshard(shards, 0, cu, pack_layout="balanced"), x)


def test_unshard_with_cu_seqlens_no_layout_holds_names_the_cu_seqlens():
    """Odd documents: neither layout holds them, so the shards were cut from another pack."""
    shards = [torch.arange(8.), torch.arange(8., 16.)]
    with pytest.raises(ValueError) as err:
        sinkprof.unshard(shards, 0, [0, 5, 16])
    assert "no pack_layout lays out the pack cu_seqlens=[0, 5, 16] over 2 ranks" in str(err.value)
    assert "pass the cu_seqlens and pack_layout used to shard them" in str(err.value)
    assert "pad_pack" not in str(err.value)


def test_unshard_names_cu_seqlens_of_another_pack():
    shards = [sinkprof.shard(torch.arange(16.), 2, r, 0, [0, 8, 16]) for r in range(2)]
    with raises(ValueError, "cu_seqlens ends at 20 but the 2 shards hold 2 x 8 = 16 rows along dim 0",
                "pass the cu_seqlens used to shard them"):
        sinkprof.unshard(shards, 0, [0, 8, 20])


# pad_pack

T = torch.arange(10.).reshape(10, 1, 1)


@pytest.mark.parametrize("call, kind, parts", [
    (lambda: sinkprof.pad_pack(T, [0, 3, 10], 4.0), TypeError, ("multiple=4.0", "must be an int", "not float")),
    (lambda: sinkprof.pad_pack(T, [0, 3, 10], 0), ValueError, ("multiple=0", "must be >= 1")),
    (lambda: sinkprof.pad_pack(T, [0, 3, 10], 4, seq_dim=3), ValueError, ("seq_dim=3", "out of range",
                                                                          "from -3 to 2")),
    (lambda: sinkprof.pad_pack(T.numpy(), [0, 3, 10], 4), TypeError, ("x must be a torch.Tensor", "numpy.ndarray")),
    (lambda: sinkprof.pad_pack(T.long(), [0, 3, 10], 4, value=float("nan")), ValueError,
     ("value=nan", "not representable in x's dtype torch.int64", "a whole number from")),
    (lambda: sinkprof.pad_pack(T.long(), [0, 3, 10], 4, value=0.5), ValueError,
     ("value=0.5", "torch.int64", "a whole number")),
    (lambda: sinkprof.pad_pack(T.to(torch.int8), [0, 3, 10], 4, value=300), ValueError,
     ("value=300", "torch.int8", "from -128 to 127")),
    (lambda: sinkprof.pad_pack(T.bool(), [0, 3, 10], 4, value=2), ValueError, ("value=2", "torch.bool", "0 or 1")),
    (lambda: sinkprof.pad_pack(T.half(), [0, 3, 10], 4, value=1e5), ValueError, ("value=100000.0", "torch.float16")),
    (lambda: sinkprof.pad_pack(T, [0, 3, 10], 4, value="0"), TypeError, ("value='0'", "must be a number")),
], ids=["multiple-float", "multiple-0", "seq_dim", "numpy", "nan-in-int", "half-in-int", "int8-overflow", "bool",
        "fp16-overflow", "str"])
def test_pad_pack_names_the_argument_it_refuses(call, kind, parts):
    with raises(kind, *parts):
        call()


def test_pad_pack_takes_values_the_dtype_holds():
    padded, ends, real = sinkprof.pad_pack(T.long(), [0, 3, 10], 4, value=-1.0)
    assert padded.flatten().tolist() == [0, 1, 2, -1, 3, 4, 5, 6, 7, 8, 9, -1] and ends.tolist() == [0, 4, 12]
    assert sinkprof.pad_pack(T, [0, 3, 10], 4, value=float("-inf"))[0][3].item() == float("-inf")
    assert sinkprof.pad_pack(T.bool(), [0, 3, 10], 4, value=True)[0][3].item() is True
    assert sinkprof.pad_pack(T, [0, 3, 10], 4, value=torch.tensor(2.0))[0][3].item() == 2.0


# comm_bytes

CASE = dict(s=64, b=1, h=4, g=2, d=16, dtype=torch.bfloat16, cp=2)


COMM_CASES = [
    (dict(b=-1), ValueError, ("b=-1", "must be >= 1", "sequences")),       # before: negative bytes
    (dict(d=-1), ValueError, ("d=-1", "must be >= 1", "head dim")),
    (dict(b=0), ValueError, ("b=0", "must be >= 1")),
    (dict(g=0), ValueError, ("g=0", "must be >= 1", "K/V heads")),
    (dict(h=0), ValueError, ("h=0", "must be >= 1", "query heads")),
    (dict(s=0), ValueError, ("s=0", "must be >= 1")),                       # before: an AssertionError in plan.py
    (dict(cp=0), ValueError, ("cp=0", "must be >= 1")),                     # before: named cp_size
    (dict(b=1.5), TypeError, ("b=1.5", "must be an int", "not float")),     # before: float byte counts
    (dict(s=64.0), TypeError, ("s=64.0", "must be an int")),
    (dict(h=3), ValueError, ("q has 3 heads and k, v have 2", "h must be a multiple of g")),
    (dict(dtype=torch.int32), ValueError, ("dtype=torch.int32 is not supported", "fp64, fp32, bf16, fp16")),
    (dict(dtype=torch.bool), ValueError, ("dtype=torch.bool is not supported",)),
    (dict(dtype="bfloat16"), ValueError, ("dtype='bfloat16' is not supported", "bf16")),
    (dict(dtype=2), TypeError, ("dtype=2", "must be a torch.dtype")),
    (dict(a2a_size=2), ValueError, ("a2a_size=2 only applies to comm='a2a+p2p'",)),   # before: ignored
    (dict(comm="a2a", a2a_size=1), ValueError, ("a2a_size=1: comm='a2a' uses the whole group",
                                                "use comm='a2a+p2p'")),
    (dict(comm="a2a+p2p", a2a_size=2.0), TypeError, ("a2a_size=2.0", "must be an int")),
    (dict(b=2, cu_seqlens=[0, 32, 64]), ValueError, ("b=2 with cu_seqlens", "b = 1", "pass b=1")),
    (dict(cu_seqlens=[0, 32, 64], pack_layout="balanced", kv_schedule="ring"), ValueError,
     ("comm='p2p', kv_schedule='ring'", "allgather")),
]


@pytest.mark.parametrize("change, kind, parts", COMM_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in change.items()) for change, _, _ in COMM_CASES])
def test_comm_bytes_refuses_what_cp_attention_refuses(change, kind, parts):
    with raises(kind, *parts):
        sinkprof.comm_bytes(**{**CASE, **change})


def test_comm_bytes_a2a_rules_are_the_library_checks():
    with pytest.raises(A2AError, match=re.escape("a2a_size=3 must divide the CP group size 2")):
        sinkprof.comm_bytes(**{**CASE, "comm": "a2a+p2p", "a2a_size": 3})
    with pytest.raises(ValueError, match=re.escape("comm='a2a+p2p' needs a2a_size")):
        sinkprof.comm_bytes(**{**CASE, "comm": "a2a+p2p"})


@pytest.mark.parametrize("change, parts", [
    (dict(comm="a2a+p2p", a2a_size=4, h=6, g=6), ("must both be divisible by 4", "divides both and the CP group "
                                                  "size 4: 1 or 2")),
    (dict(comm="a2a", h=6, g=3), ("comm='a2a' splits the heads over the 4 ranks", "use comm='p2p'")),
    (dict(comm="a2a+p2p", a2a_size=3, h=6, g=6), ("a2a_size=3 must divide the CP group size 4",
                                                  "splits the h=6 query and g=6 K/V heads: 1 or 2")),
])
def test_comm_bytes_offers_the_a2a_sizes_cp_attention_offers(change, parts):
    """Before: sizes that split the heads but not the group (3, 6 at cp 4), an a2a size for comm='a2a'
    (which takes none), or a size that splits the group but not the heads (4 for 6 heads)."""
    with raises(A2AError, *parts):
        sinkprof.comm_bytes(**{**CASE, "cp": 4, **change})


def test_comm_bytes_takes_a_dtype_by_name_and_the_sizes_cp_attention_takes():
    assert sinkprof.comm_bytes(**{**CASE, "dtype": "bf16"}) == sinkprof.comm_bytes(**CASE)
    assert sinkprof.comm_bytes(**{**CASE, "a2a_size": 1}) == sinkprof.comm_bytes(**CASE)
    assert sinkprof.comm_bytes(**{**CASE, "comm": "a2a", "a2a_size": 2}) == sinkprof.comm_bytes(**CASE, comm="a2a")
    assert sinkprof.comm_bytes(**{**CASE, "s": np.int64(64)}) == sinkprof.comm_bytes(**CASE)
    assert all(isinstance(t.sent, int) and t.sent > 0 for t in sinkprof.comm_bytes(**CASE))
