"""``python3 -m sinkprof ...`` with the seeded inputs built once per shape, not once per case.

``sinkprof bench --simulate`` builds its inputs (``testing.make_inputs``: fp64, on the CPU, one
generator) for every (layer, cp) pair. For gpt-oss-120b at s = 128k that is 1.2 G normal draws:
50 s measured on this workplace's 2-core CPU box, some 40 s estimated on the H200 machine's (from
the timestamps of its 32k bench CSV), four times over for two layers and two cp sizes while the GPU
waits; the last attempt at the prediction was stopped at 90 s after the first of the four cases. The inputs depend only on the shape, the softmax type, the layout and
documents, the seed and the bias (not on the mask, the window or cp), so the memoized call
returns exactly the tensors the plain command builds, and the CSV is the same.

    python3 scripts/inputs_once.py bench --profile gpt-oss-120b --seq-len 131072 --simulate 8,16 ...

Until ``sinkprof bench`` builds the inputs of a simulation once itself (or draws them on the device),
this is the command line that fits the 128k prediction into one device call.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sinkprof import testing  # noqa: E402
from sinkprof.tool import bench  # noqa: E402

_built: dict = {}
calls = builds = 0


def make_inputs_once(shape, spec, seed, *, with_bias=False, offset_scale=5.0):
    """``testing.make_inputs``, remembering the last inputs built (what it reads of ``spec``)."""
    global calls, builds
    calls += 1
    key = (shape, spec.softmax_type, spec.qkv_format, spec.docs, seed, with_bias, offset_scale)
    if key not in _built:
        builds += 1
        _built.clear()
        _built[key] = testing.make_inputs(shape, spec, seed, with_bias=with_bias, offset_scale=offset_scale)
    return _built[key]


def main() -> None:
    if bench.make_inputs is not testing.make_inputs:
        raise SystemExit("inputs_once: sinkprof.tool.bench no longer calls testing.make_inputs; run python3 -m "
                         "sinkprof directly")
    bench.make_inputs = make_inputs_once
    from sinkprof.cli import main as cli
    try:
        cli()
    finally:
        print(f"inputs_once: {calls} input sets asked for, {builds} built", file=sys.stderr)


if __name__ == "__main__":
    main()
