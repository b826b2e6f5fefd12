"""The fused Triton kernels (``sinkprof/fused.py``) on the CPU, through Triton's interpreter
(``TRITON_INTERPRET=1``), against the torch formulas of ``sink.py``: the kernels' indexing,
masking and arithmetic are checked without a GPU. Skipped where Triton is not installed (the GPU
tests run the same kernels compiled)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import torch
    from sinkprof import fused, sink

    def bshd(*shape, dtype, fill=None):   # [n.., b, s, h, d] storage seen as [n.., b, h, s, d]
        *lead, b, h, s, d = shape
        x = torch.randn(*lead, b, s, h, d, dtype=torch.float64).to(dtype)
        return x.transpose(-2, -3)

    torch.manual_seed(0)
    b, h, s, d = 2, 3, 37, 20
    for n in (0, 1, 3):
        for base_dtype, into_dtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                       (torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
            for with_sink in (False, True):
                o = bshd(b, h, s, d, dtype=base_dtype)
                lse = torch.randn(b, h, s) * 3
                lse[:, :, :2] = float("-inf")            # rows nothing covered so far
                o[:, :, :2] = 0
                parts_o = bshd(n, b, h, s, d, dtype=torch.bfloat16)
                parts_lse = torch.randn(n, b, h, s) * 3
                for i in range(n):                      # each part covers a different span of rows
                    lo, hi = 5 * i, 5 * i + 20
                    parts_lse[i, :, :, :lo] = float("-inf")
                    parts_lse[i, :, :, hi:] = float("-inf")
                    parts_o[i, :, :, :lo] = float("nan")  # never to be read
                    parts_o[i, :, :, hi:] = float("nan")
                a = torch.randn(1, h, 1, 1) * 5 if with_sink else None
                into = torch.empty(b, h, s, d, dtype=into_dtype)
                want, want_lse = into.clone().double(), lse.clone().double()
                sink.merge_parts_(o.double(), want_lse, parts_o.double(), parts_lse.double(), into=want,
                                  sink=None if a is None else a.double())
                got_lse = lse.clone()
                fused.merge_parts_(o, got_lse, parts_o, parts_lse, into=into, sink=a)
                tol = 1e-2 if into_dtype == torch.bfloat16 else 1e-5
                assert not into.isnan().any(), (n, base_dtype, into_dtype, with_sink)
                torch.testing.assert_close(into.double(), want, atol=tol, rtol=tol)
                torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-5, rtol=1e-5)
                if n == 0 and not with_sink and into_dtype.itemsize >= base_dtype.itemsize:
                    assert torch.equal(into, o.to(into_dtype))   # nothing to merge: a copy, exact
                    # (narrowing rounds differently in the interpreter than on a GPU: the tolerance covers it)
    # in place: the result so far is also where the merged result goes
    acc, lse = bshd(b, h, s, d, dtype=torch.float32), torch.randn(b, h, s)
    parts_o, parts_lse = bshd(2, b, h, s, d, dtype=torch.bfloat16), torch.randn(2, b, h, s)
    want, want_lse = acc.double(), lse.double()
    sink.merge_parts_(want, want_lse, parts_o.double(), parts_lse.double())
    fused.merge_parts_(acc, lse, parts_o, parts_lse)
    torch.testing.assert_close(acc.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)

    # in place on a span of rows (``run_forward``: the rows later tiles wrote), bf16 output: the rows
    # outside the span are not touched
    out, lse = bshd(b, h, s, d, dtype=torch.bfloat16), torch.randn(b, h, s)
    parts_o, parts_lse = bshd(2, b, h, s, d, dtype=torch.bfloat16), torch.randn(2, b, h, s)
    rows = slice(11, 30)
    want, want_lse = out.double(), lse.double()
    sink.merge_parts_(want[:, :, rows], want_lse[:, :, rows], parts_o[:, :, :, rows].double(),
                      parts_lse[:, :, :, rows].double())
    before, before_lse = out.clone(), lse.clone()
    fused.merge_parts_(out[:, :, rows], lse[:, :, rows], parts_o[:, :, :, rows], parts_lse[:, :, :, rows],
                       into=out[:, :, rows])
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    for keep in (slice(0, 11), slice(30, s)):
        assert torch.equal(out[:, :, keep], before[:, :, keep]) and torch.equal(lse[:, :, keep], before_lse[:, :, keep])
    assert not torch.equal(out[:, :, rows], before[:, :, rows])

    # a group's rows added (or written) in one pass: only the indexed rows change
    for write in (False, True):
        dst, src = bshd(b, h, s, d, dtype=torch.float32), bshd(b, h, s, d, dtype=torch.bfloat16)
        index = torch.tensor([3, 4, 5, 20, 21, 36], dtype=torch.int32)
        want = dst.clone()
        want[:, :, index.long()] = src[:, :, index.long()].float() + (0 if write else want[:, :, index.long()])
        fused.add_rows_(dst, src, index, write=write)
        assert torch.equal(dst, want), write

    # the sink gradient's row terms
    o, d_o = bshd(b, h, s, d, dtype=torch.bfloat16), bshd(b, h, s, d, dtype=torch.bfloat16)
    lse, a = torch.randn(b, h, s) * 3, torch.randn(1, h, 1, 1) * 5
    got = fused.sink_grad_rows(o, d_o, lse, a).sum(dim=(0, 2))
    want = sink.sink_grad(o.double(), d_o.double(), lse.double(), a.double()).flatten()
    torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=1e-4)

    # a head whose sink is -inf (switched off) and rows that saw no key: finite, as the torch form
    a = torch.randn(1, h, 1, 1) * 5
    a[0, 1] = float("-inf")
    o, lse = bshd(b, h, s, d, dtype=torch.float32), torch.randn(b, h, s) * 3
    o[:, :, :4], lse[:, :, :4] = 0, float("-inf")
    want, want_lse = torch.empty(b, h, s, d, dtype=torch.float64), lse.double()
    sink.merge_parts_(o.double(), want_lse, *(x[:0] for x in (o.double().unsqueeze(0), lse.double().unsqueeze(0))),
                      into=want, sink=a.double())
    into, got_lse = torch.empty(b, h, s, d), lse.clone()
    fused.merge_parts_(o, got_lse, o.unsqueeze(0)[:0], lse.unsqueeze(0)[:0], into=into, sink=a)
    assert not into.isnan().any() and not got_lse.isnan().any()
    torch.testing.assert_close(into.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    rows = fused.sink_grad_rows(into, into, got_lse, a)
    assert torch.isfinite(rows).all()
    torch.testing.assert_close(rows.sum(dim=(0, 2)).double(),
                               sink.sink_grad(want, want, want_lse, a.double()).flatten(), atol=1e-3, rtol=1e-4)
    print("ok")
''')


def test_fused_kernels_match_the_torch_formulas():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


LONG = textwrap.dedent('''
    import torch
    from sinkprof import fused
    h, s, d, n = 2, 8, 16, 3
    P = 1_100_000_000          # elements per buffer: buffer 2 starts 2.2e9 elements in, past 2^31
    try:
        store = torch.empty(n * P, dtype=torch.bfloat16)     # virtual: only the rows written are touched
    except RuntimeError:
        print("skip: cannot map the buffers")
        raise SystemExit
    parts_o = store.as_strided((n, 1, h, s, d), (P, s * h * d, d, h * d, 1))
    for i in range(n):
        parts_o[i].fill_(float(i + 1))
    parts_lse = torch.full((n, 1, h, s), float("-inf"))
    parts_lse[n - 1] = 0.0                                   # only the last buffer covers the rows
    o, lse = torch.zeros(1, h, s, d), torch.full((1, h, s), float("-inf"))
    fused.merge_parts_(o, lse, parts_o, parts_lse)
    assert torch.equal(o, torch.full_like(o, float(n))), o.unique()
    print("ok")
''')


def test_the_fused_merge_reaches_buffers_past_two_to_the_31_elements():
    """A buffer's offset (n x its stride) passes 2^31 elements at long contexts (cp 8, gpt-oss
    shapes, ~700k tokens); computed in 32 bits it wrapped to an address gigabytes away."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", LONG], env=env, capture_output=True, text=True, timeout=600)
    if run.stdout.startswith("skip"):
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
