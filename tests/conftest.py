import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

torch.set_num_threads(1)


def run_cli(*args, timeout=240, env=None):
    """Run ``python -m sinkprof ...`` in a real subprocess; returns CompletedProcess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "sinkprof", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def assert_pack_plan_exact(cp: int, layout, band, kind) -> None:
    """Every rank's plan of a pack (``layout``: a ``plan.Layout``) under ``kind`` computes every pair
    of rows of one document that ``band`` lets see each other exactly once, no pair across
    documents, and every row's sink in exactly one tile."""
    from sinkprof.plan import ring_plan
    t = sum(layout.docs)
    doc = torch.repeat_interleave(torch.arange(len(layout.docs)), torch.tensor(layout.docs))
    truth = band.mask(t, t)
    truth = torch.ones(t, t, dtype=torch.bool) if truth is None else truth
    truth &= doc[:, None] == doc[None, :]
    for rank in range(cp):
        q_pos = layout.rows(rank)
        covered = torch.zeros(len(q_pos), t, dtype=torch.int64)
        sink_rows = torch.zeros(len(q_pos), dtype=torch.int64)
        for step in ring_plan(cp, rank, layout, band, kind).steps:
            for tile in step.tiles:
                nq, nk = tile.q_rows.stop - tile.q_rows.start, tile.kv_rows.stop - tile.kv_rows.start
                vis = tile.band.mask(nq, nk)
                vis = torch.ones(nq, nk, dtype=torch.bool) if vis is None else vis
                rows = torch.arange(tile.q_rows.start, tile.q_rows.stop)
                src = step.source_rows(tile.kv_rows)   # sequence rows of a gathered step's buffer, else the owner's
                cols = torch.arange(src.start, src.stop) if step.gathered else layout.rows(step.kv_rank)[src]
                assert doc[q_pos[rows]].unique().numel() == 1 and doc[cols].unique().numel() == 1
                covered[rows[:, None], cols[None, :]] += vis.long()
                sink_rows[rows] += int(tile.sink)
        assert torch.equal(covered, truth[q_pos].long()), f"rank {rank}"
        assert torch.equal(sink_rows, torch.ones_like(sink_rows))


@pytest.fixture
def cli():
    return run_cli


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A one-rank gloo process group for the module's tests."""
    path = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def fault_error(fault, settings, cp: int, comm: str):
    """(the case of ``settings``, the largest error against the reference of the fp64 emulator run
    of that case under ``fault``): what the preflight's ``applies`` is checked against."""
    from sinkprof import faults
    from sinkprof.emulate import emulate_hierarchical, emulate_ring
    from sinkprof.options import SinkStrategy
    from sinkprof.testing import make_inputs, reference
    from sinkprof.tool.cases import expand
    settings.validate()
    (case,) = expand(settings)
    spec = case.spec()
    x = make_inputs(case.shape, spec, 0)
    with faults.injected(fault):
        kv = case.kv_schedule
        run = (emulate_ring(x, spec, cp, SinkStrategy.STEP0, kv_schedule=kv) if comm == "p2p" else
               emulate_hierarchical(x, spec, cp, cp if comm == "a2a" else 2, SinkStrategy.STEP0, kv_schedule=kv))
    ref = reference(x, spec)
    return case, max((run.result.named()[k] - v).abs().max().item() for k, v in ref.named().items())
