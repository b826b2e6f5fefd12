"""The ``sinkprof`` command line: it parses options and delegates to ``sinkprof.tool``.

Options that ``check`` and ``bench`` share are declared once (``CASE_OPTIONS``) and reach the
command as one ``CaseOptions``; every command writes through ``tool.output.Output``; errors are
turned into messages and exit codes in one place (``tool.errors``, every command's class).
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import re
from typing import Callable, Optional

import typer

from . import __version__
from .options import KVSchedule, MaskType, PackLayout, SinkStrategy, check_seed
from .tool.cases import CaseOptions
from .tool.errors import Command, stdout_open
from .tool import preflight
from .tool.output import Format, Output, check_folder, check_writable, settle

app = typer.Typer(add_completion=False, no_args_is_help=False, rich_markup_mode=None,
                  help="Correctness checks and profiles of context-parallel attention with attention sinks.",
                  context_settings={"help_option_names": ["-h", "--help"]})
command = functools.partial(app.command, cls=Command)


def _version(value: bool):
    if value:
        print(f"sinkprof {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    """sinkprof: is my context-parallel attention with a sink correct, and where does its time go."""


def main() -> None:
    """Run the command line. The installed ``sinkprof`` and ``python -m sinkprof`` enter through
    ``sinkprof.__main__.main``, which imports this module (and torch) where a Ctrl-C is handled."""
    app()


def split_list(value: str, option: str, parse: Callable = str, allowed: Optional[list] = None) -> list:
    """``"a,b"`` -> parsed items; ``all`` expands to ``allowed``; errors name the option."""
    from .tool.cases import check_once, split_values
    items = list(split_values(value))
    if not items:
        raise ValueError(f"{option} needs at least one value")
    if allowed is not None and items == ["all"]:
        items = list(allowed)
    for item in items:
        if allowed is not None and item not in allowed:
            raise ValueError(f"{option}: {item!r} is not one of {', '.join(allowed)} (or 'all')")
    values = [parse(item, option) for item in items]
    check_once(values, option)
    return values


def positive_int(item: str, option: str) -> int:
    if not re.fullmatch(r"-?[0-9]+", item):
        raise ValueError(f"{option}: {item!r} is not an integer")
    if int(item) < 1:
        raise ValueError(f"{option}: {item} must be >= 1")
    return int(item)


def _option(name: str, annotation, default, *decls: str, **kw) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *decls, **kw))


# The case options of check and bench, declared once; ``case_options`` adds them to a command.
CASE_OPTIONS = [
    _option("profile", Optional[str], None, help="Named profile (see `sinkprof profiles`) or a .toml path."),
    _option("comm", Optional[str], None, help="p2p, a2a, a2a+p2p (comma list) or all."),
    _option("a2a_size", Optional[int], None, "--a2a-size", help="Ranks per inner a2a group for a2a+p2p (default 2)."),
    _option("softmax", Optional[str], None, help="vanilla, off-by-one, learnable (comma list) or all."),
    _option("mask", Optional[str], None, help="causal, no_mask (comma list) or all."),
    _option("qkv_format", Optional[str], None, "--qkv-format",
            help="bshd, sbhd, thd (comma list) or all. thd: one pack of documents, b = 1, no bias; its documents "
                 "are --seqlens, or --docs random ones (default 3 random ones from --seed)."),
    _option("dtype", Optional[str], None, help="fp64, fp32, bf16, fp16 (comma list) or all."),
    _option("sink_strategy", Optional[str], None, "--sink-strategy", help="step0, post-merge or all."),
    _option("sink_grad", Optional[str], None, "--sink-grad", help="full, partial or all."),
    _option("kv_schedule", Optional[str], None, "--kv-schedule",
            help="How the ring moves K/V: auto (ring or direct, fewer bytes), ring, direct, allgather "
                 "(comma list) or all."),
    _option("pack_layout", Optional[str], None, "--pack-layout",
            help="thd: which rows of the pack each rank holds: zigzag (every document in 2 * cp chunks, rank r "
                 "holding chunks r and 2cp-1-r) or balanced (each document in a few long pieces on a few ranks, "
                 "equal tokens and causal work per rank; --comm p2p, --kv-schedule allgather or auto)."),
    _option("window", Optional[str], None, help="Sliding window LEFT,RIGHT (-1 = unbounded)."),
    _option("bias", Optional[bool], None, "--bias/--no-bias", help="Add a learnable [1, h, S, S] bias."),
    _option("batch", Optional[int], None, "--batch", help="Batch of the bshd and sbhd cases (thd: b = 1)."),
    _option("seq_len", Optional[int], None, "--seq-len", help="Full sequence length (divisible by 2 * cp); "
                                                               "thd: the pack's length."),
    _option("seqlens", Optional[str], None, "--seqlens",
            help="thd: the documents' lengths, e.g. 96,160,256, each a multiple of 2 * cp (even, under "
                 "--pack-layout balanced); their sum is the pack (it sets --seq-len)."),
    _option("docs", Optional[int], None, "--docs",
            help="thd: this many documents of random lengths from --seed (each a multiple of 2 * cp), summing "
                 "to --seq-len."),
    _option("heads", Optional[int], None, "--heads", help="Query heads."),
    _option("kv_heads", Optional[int], None, "--kv-heads", help="K/V heads (heads % kv-heads == 0)."),
    _option("head_dim", Optional[int], None, "--head-dim", help="Head dim."),
    _option("ranks", Optional[int], None, "--ranks",
            help="Ranks to self-launch (the cp size); under torchrun the world size is it."),
    _option("device", Optional[str], None, help="cpu or cuda."),
    _option("backend", Optional[str], None,
            help="Tile kernels: auto (fa4, else cudnn, else torch), torch, cudnn or fa4."),
    _option("dist_backend", str, "auto", "--dist-backend",
            help="auto (nccl with a GPU per rank, else gloo), gloo or nccl."),
    _option("seed", Optional[int], None, help="Seed of the CPU generator for all inputs."),
    _option("timeout", float, 120.0, help="Seconds any one exchange or collective may take (1 to 365 days)."),
    _option("run_timeout", float, 900.0, "--run-timeout", help="Seconds the whole run may take (1 to 365 days)."),
]


def case_options(fn):
    """Give ``fn`` the shared case options; it receives them as ``case: CaseOptions``."""
    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "case"]

    @functools.wraps(fn)
    def wrapper(**kwargs):
        shared = {p.name: kwargs.pop(p.name) for p in CASE_OPTIONS}
        return fn(case=CaseOptions(**shared), **kwargs)

    wrapper.__signature__ = inspect.Signature(CASE_OPTIONS + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                                                              for p in own])
    del wrapper.__wrapped__  # Typer reads the signature above, not fn's
    wrapper.__annotations__ = {}
    return wrapper


def _config(command: str, groups: list, case: CaseOptions, **extra) -> dict:
    """What every rank of a run must agree on: each setting of each group under its option's name,
    and the run's own options (output paths are rank 0's business and left out)."""
    from dataclasses import asdict
    from .tool.cases import option
    out = {"command": command, "--dist-backend": case.dist_backend, "--timeout": case.timeout,
           "--run-timeout": case.run_timeout, **extra}
    for i, settings in enumerate(groups):
        group = f" ([[cases]] #{i + 1})" if len(groups) > 1 else ""
        out.update({option(k) + group: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()})
    return out


FORMAT = typer.Option("table", "--format", help="table or json.")


@command()
@case_options
def check(
    case: CaseOptions,
    inject: Optional[str] = typer.Option(None, help="Inject a bug to prove the check fails: sink-every-tile, "
                                                    "no-sink-reduce, aliased-reference, vanilla-fallback, "
                                                    "skip-sink-slice, drop-halo (with --kv-schedule direct), "
                                                    "doc-leak (thd, two documents or more), stall, crash."),
    fmt: str = FORMAT,
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the report here (whole file)."),
):
    """Check CP attention (out, dq, dk, dv, sink and bias gradients) against the fp64 reference.

    Exit 0 when every case passes, 1 when any fails or hangs, 2 for usage errors.
    """
    from .faults import Fault
    from .tool.check import check_job
    from .tool.launcher import launch, torchrun_env
    from .tool.profiles import check_not_the_profile, settings_for

    ranks_name = "--ranks" if torchrun_env() is None else "WORLD_SIZE"   # a broken torchrun environment: exit 2
    preflight.check_values(case)
    output = settle(output, "--output")
    if output in (None, "-"):
        stdout_open()
    out = Output(Format.parse(fmt, Format.TABLE, Format.JSON), output, width=200)
    fault = Fault.parse(inject, "--inject") if inject is not None else None
    groups = settings_for(case)
    check_writable(output, "--output")
    check_not_the_profile(case, output, "--output")
    preflight.check_memory(groups, groups[0].ranks, groups[0].device, reference=True)   # first: quick, for any cp
    preflight.check_fault(fault, groups, ranks_name)
    config = _config("check", groups, case, **{"--inject": inject})
    raise typer.Exit(launch(check_job, (groups, fault, case.timeout, out), nproc=groups[0].ranks,
                            device=groups[0].device, backend=case.dist_backend, timeout=case.timeout,
                            run_timeout=case.run_timeout, config=config))


@command()
@case_options
def bench(
    case: CaseOptions,
    warmup: int = typer.Option(2, min=0, help="Iterations run before measuring."),
    iters: int = typer.Option(5, min=1, help="Measured iterations."),
    phase: str = typer.Option("fwdbwd", help="fwd, bwd or fwdbwd."),
    csv_path: Optional[str] = typer.Option(None, "--csv", help="Write every timed span here (tidy CSV, whole file)."),
    trace: Optional[str] = typer.Option(None, help="Write a torch.profiler Chrome trace per rank into this folder."),
    use_nvtx: bool = typer.Option(True, "--nvtx/--no-nvtx", help="Emit NVTX ranges (domain sinkprof)."),
    simulate: Optional[str] = typer.Option(None, help="CP sizes (e.g. 8,16,32) whose every rank's compute schedule "
                                                      "runs on this one device, without communication."),
    inject: Optional[str] = typer.Option(None, help="stall or crash rank 1 on the second measured iteration."),
    link: Optional[str] = typer.Option(None, help="With --simulate: predict each step's communication over this "
                                                  "link (nvlink, h100-nvlink, h200-nvlink, ib, ib-ndr, or "
                                                  "GBPS[,LAT_US]); rows marked predicted."),
):
    """Time CP attention per ring step (compute, communication, overlap) with NVTX ranges; CSV export.

    For Nsight Systems: torchrun --nproc-per-node N --no-python nsys profile -t cuda,nvtx,nccl
    --capture-range=cudaProfilerApi -o rank%q{RANK} sinkprof bench ...
    """
    from .faults import Fault
    from .tool.bench import BenchOptions, bench_job, check_simulated_sizes, check_trace_files
    from .tool.bench import simulate as run_simulation
    from .tool.launcher import launch, torchrun_env
    from .tool.linkmodel import parse_link
    from .tool.profiles import check_not_the_profile, settings_for

    ranks_name = "--ranks" if torchrun_env() is None else "WORLD_SIZE"   # a broken torchrun environment: exit 2
    preflight.check_values(case)
    stdout_open()    # the summary goes there
    csv_path = settle(csv_path, "--csv")
    sims = tuple(split_list(simulate, "--simulate", positive_int)) if simulate is not None else ()
    if sims and case.ranks is not None:
        raise ValueError(f"--ranks {case.ranks} with --simulate: a simulation replays every rank of each "
                         f"--simulate size on this process; drop --ranks (or --simulate)")
    fault = Fault.parse(inject, "--inject") if inject is not None else None
    opts = BenchOptions(warmup, iters, phase, csv_path, trace, use_nvtx, sims, fault, case.timeout,
                        parse_link(link, "--link") if link is not None else None)
    groups = settings_for(case, ranks=1, cps=sims) if sims else settings_for(case)
    check_writable(csv_path, "--csv")
    check_not_the_profile(case, csv_path, "--csv")
    check_folder(trace, "--trace")
    check_trace_files(opts, groups[0].ranks)
    check_simulated_sizes(groups, sims)
    preflight.check_memory(groups, min(sims) if sims else groups[0].ranks, groups[0].device, reference=False,
                           procs=1 if sims else None)
    preflight.check_fault(fault, groups, ranks_name)
    if sims:
        import torch
        raise typer.Exit(run_simulation(groups, opts, torch.device(groups[0].device)))
    config = _config("bench", groups, case, **{"--inject": inject, "--warmup": warmup, "--iters": iters,
                                               "--phase": phase, "--nvtx": use_nvtx})
    raise typer.Exit(launch(bench_job, (groups, opts), nproc=groups[0].ranks, device=groups[0].device,
                            backend=case.dist_backend, timeout=case.timeout, run_timeout=case.run_timeout,
                            config=config))


@command()
def emulate(
    cp: str = typer.Option("2,4,8", help="Comma-separated CP sizes (total ranks) to replay."),
    comm: str = typer.Option("p2p", help="p2p, or a2a+p2p (inner a2a groups of --a2a-size around a ring)."),
    a2a_size: Optional[int] = typer.Option(None, "--a2a-size", min=1,
                                           help="Ranks per inner a2a group for a2a+p2p (default 2)."),
    mask: str = typer.Option("all", help="causal, no_mask or all."),
    strategy: str = typer.Option("all", help="Sink strategies: step0, post-merge, every-tile (the bug) or all."),
    window: Optional[str] = typer.Option(None, help="Sliding window LEFT,RIGHT (-1 = unbounded)."),
    kv_schedule: str = typer.Option("all", "--kv-schedule", help="K/V schedules to replay: ring, direct, allgather, "
                                                                 "auto (comma list) or all (all but auto)."),
    qkv_format: str = typer.Option("bshd", "--qkv-format", help="bshd, sbhd, thd (comma list) or all. thd: one pack "
                                                                 "of documents, b = 1: --seqlens, or --docs random "
                                                                 "ones (default 3)."),
    seqlens: Optional[str] = typer.Option(None, "--seqlens", help="thd: the documents' lengths, e.g. 32,64,32, each "
                                                                  "a multiple of 2 * every cp (sets --seq-len)."),
    docs: Optional[int] = typer.Option(None, "--docs", help="thd: this many documents of random lengths from --seed, "
                                                            "summing to --seq-len."),
    pack_layout: str = typer.Option("zigzag", "--pack-layout",
                                    help="thd: zigzag (every document in 2 * cp chunks) or balanced (a few long "
                                         "pieces per document; replayed under allgather, which 'all' then means)."),
    batch: Optional[int] = typer.Option(None, "--batch", min=1, help="Batch of bshd and sbhd (default 2; thd: 1)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=2,
                                          help="Full sequence length (divisible by 2 * every cp; default 64)."),
    heads: int = typer.Option(4, "--heads", min=1, help="Query heads."),
    kv_heads: int = typer.Option(2, "--kv-heads", min=1, help="K/V heads (heads % kv-heads == 0)."),
    head_dim: int = typer.Option(16, "--head-dim", min=1, help="Head dim."),
    seed: int = typer.Option(0, help="Seed of the CPU generator for inputs and offsets (randn * 5)."),
    fmt: Format = typer.Option(Format.TABLE, "--format", help="table, json or csv."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the result here instead of stdout."),
):
    """Replay every rank's ring schedule in fp64 in one process and compare with the reference.

    Exit 0 when step0 and post-merge match to 1e-12 and the every-tile bug is detected, else 1;
    2 for usage errors, every-tile included where it cannot change a result (a one-rank ring).
    """
    from .options import QKVFormat
    from .testing import Shape
    from .tool.cases import check_seq_len, parse_seqlens
    from .tool.emulate import only_allgather, pack, run

    check_seed(seed, "--seed")
    output = settle(output, "--output")
    if output in (None, "-"):
        stdout_open()
    cps = split_list(cp, "--cp", positive_int)
    formats = split_list(qkv_format, "--qkv-format", QKVFormat.parse, allowed=[f.value for f in QKVFormat])
    layout = PackLayout.parse(pack_layout, "--pack-layout")
    seq_len, batch, lengths = pack(formats, cps, seq_len=seq_len, batch=batch, docs=docs, seed=seed,
                                   seqlens=None if seqlens is None else parse_seqlens(seqlens, "--seqlens"),
                                   pack_layout=layout)
    check_seq_len(seq_len, cps, "--cp")
    masks = split_list(mask, "--mask", lambda v, option: v, allowed=[m.value for m in MaskType])
    strategies = split_list(strategy, "--strategy", SinkStrategy.parse, allowed=[x.value for x in SinkStrategy])
    schedules = split_list(kv_schedule, "--kv-schedule", KVSchedule.parse, allowed=[x.value for x in KVSchedule])
    every = kv_schedule.strip() == "all"
    if every:   # each case under every schedule its layout runs (emulate.replayed)
        schedules = [k for k in KVSchedule if k is not KVSchedule.AUTO]
    gathered = only_allgather(schedules, layout) or (every and layout is PackLayout.BALANCED
                                                      and set(formats) == {QKVFormat.THD})
    if strategy.strip() == "all" and gathered:   # each row's keys are one tile
        strategies = [s for s in strategies if s is not SinkStrategy.EVERY_TILE]
    check_writable(output, "--output")
    raise typer.Exit(run(cps, comm, a2a_size, masks, strategies, Shape(batch, seq_len, heads, kv_heads, head_dim),
                         seed, window, Output(fmt, output), schedules, formats, lengths, layout, every))


@command()
def report(
    csv_files: list[str] = typer.Argument(..., help="CSV files written by `sinkprof bench --csv`."),
    plot: Optional[str] = typer.Option(None, help="Write the pictures into this folder: a timeline per case and "
                                                  "phase (SLUG-fwd.png, SLUG-bwd.png) and summary.png."),
    html: Optional[str] = typer.Option(None, help="Write one self-contained HTML page (tables and pictures "
                                                  "inline); - for stdout."),
    chrome_trace: Optional[str] = typer.Option(None, "--chrome-trace",
                                               help="Write one Chrome/Perfetto trace JSON of every rank; - for stdout."),
):
    """Summarise bench CSVs: per-step compute, communication, overlap, exposed time, TFLOP/s.

    Exit 2 when a file is not a bench CSV.
    """
    import sys
    from .tool.report import report as run
    stdout_open()    # the summary tables go there
    html, chrome_trace = settle(html, "--html"), settle(chrome_trace, "--chrome-trace")
    check_folder(plot, "--plot")
    check_writable(html, "--html")
    check_writable(chrome_trace, "--chrome-trace")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'sinkprof[plots]' (or drop --plot)")
    to_stdout = "-" in (html, chrome_trace)
    for path in run(csv_files, plot, Output(), html=html, chrome_trace=chrome_trace):
        print(f"wrote {path}", file=sys.stderr if to_stdout else sys.stdout)


@command()
def doctor(
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when visible)."),
    fmt: str = FORMAT,
):
    """Show the environment and which comm x softmax x backend x dtype x layout cells run here."""
    from .tool.doctor import run
    stdout_open()
    run(device, Output(Format.parse(fmt, Format.TABLE, Format.JSON)))


@command()
def profiles(name: Optional[str] = typer.Argument(None, help="Show this profile's settings.")):
    """List the named run configurations, or show one."""
    from .tool.profiles import show
    stdout_open()
    show(name, Output())
