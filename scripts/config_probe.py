"""How fast FA4's sm90 backward runs a ring's full (unmasked) tiles under FA4's configuration for
masked tiles (64-row blocks at head dim 128) and its own for unmasked tiles (80-row blocks at head
dim 128), and a causal tile (step 0, whole) under both.

``fa4_rows`` keeps one fp32 dq accumulator per rank, whose layout depends on the configuration, so
every tile of a rank runs one: a causal rank's ran the masked one until its tiles could start off
the blocks (``FA4Tiles.unmasked_config``; docs/design.md, section 7). Each tile runs through the
rows backward (``FA4RowsBackward.tile``, the main kernel alone: the preprocess and postprocess are
once per rank) under both configurations, as interleaved CUDA-graph replays (b1, bf16).

    python3 scripts/config_probe.py [--tiles 4096x8192,8192x4096] [--causal 8192] [--heads 16] [--head-dim 128]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import fa4_interface_or_exit, interleaved_ms  # noqa: E402

TILES = "4096x8192,8192x4096,8192x8192,8192x12288,4096x16384"


def parse_tiles(text: str) -> list:
    """``"4096x8192,..."`` -> ``[(4096, 8192), ...]`` (rows x keys, multiples of 128), or [] if not."""
    try:
        tiles = [tuple(int(x) for x in item.split("x")) for item in text.split(",")]
    except ValueError:
        return []
    if not tiles or any(len(t) != 2 or min(t) < 128 or t[0] % 128 or t[1] % 128 for t in tiles):
        return []
    return tiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", default=TILES, help="rows x keys of each full tile, comma-separated")
    ap.add_argument("--causal", default="8192", help="rows (= keys) of each causal tile, comma-separated")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    tiles = parse_tiles(args.tiles)
    causal = parse_tiles(",".join(f"{n}x{n}" for n in args.causal.split(","))) if args.causal else []
    if not tiles or (args.causal and not causal):
        ap.error(f"--tiles {args.tiles}: give rows x keys in multiples of 128, e.g. {TILES}"
                 if not tiles else f"--causal {args.causal}: give multiples of 128, comma-separated")
    if args.heads < 1 or args.head_dim not in (64, 96, 128):
        ap.error("--heads: at least 1; --head-dim: 64, 96 or 128")
    fa4 = fa4_interface_or_exit(ap)
    from sinkprof.kernels import fa4 as fa4_tiles
    from sinkprof.kernels import fa4_rows
    from sinkprof.kernels.base import BackwardState
    from sinkprof.options import Band
    from sinkprof.plan import Tile
    dev = torch.device("cuda")
    h, d = args.heads, args.head_dim
    configs = {masked: fa4._tile_size_bwd_sm90(d, d, masked, False) for masked in (True, False)}
    print(f"{torch.cuda.get_device_name(dev)}; h{h} d{d}; masked: {configs[True]}; unmasked: {configs[False]}")
    for (n_q, n_kv), masked_tile in [*((t, False) for t in tiles), *((t, True) for t in causal)]:
        def rand(n):
            return torch.randn(1, h, n, d, device=dev).to(torch.bfloat16)
        q, out, do, k, v = rand(n_q), rand(n_q), rand(n_q), rand(n_kv), rand(n_kv)
        lse = torch.randn(1, h, n_q, device=dev) + 8
        band = Band(None, 0) if masked_tile else Band(None, None)
        fns = {}
        for masked, cfg in configs.items():
            rows_bwd = fa4_rows.FA4RowsBackward(fa4, BackwardState(q, out, do, lse, torch.empty_like(q)), d ** -0.5,
                                                cfg, tiles=[Tile(slice(0, n_q), slice(0, n_kv), band, False)],
                                                window=fa4_tiles.fa4_window, quiet=fa4_tiles._program_name_only,
                                                causal_pieces=False)

            def run(rows_bwd=rows_bwd):
                rows_bwd.tile(slice(0, n_q), k, v, band, None, None, first=True)
            run()
            fns[f"{cfg.m_block_size}-row blocks ({'masked' if masked else 'unmasked'})"] = run
        torch.cuda.synchronize()
        t = interleaved_ms(fns, calls=4, rounds=21)
        flops = 2.5 * 4 * h * d * (n_q * (n_q + 1) / 2 if masked_tile else n_q * n_kv)
        (a, ta), (b, tb) = t.items()
        print(f"{n_q}x{n_kv} {'causal' if masked_tile else 'full'}: {a} {ta['ms']:.3f} ms "
              f"({flops / ta['ms'] / 1e9:.0f} TFLOP/s); {b} {tb['ms']:.3f} ms ({flops / tb['ms'] / 1e9:.0f} TFLOP/s); "
              f"unmasked / masked time {tb['ms'] / ta['ms']:.3f}; "
              f"spreads {ta['spread_ms']:.3f}, {tb['spread_ms']:.3f}", flush=True)


if __name__ == "__main__":
    main()
