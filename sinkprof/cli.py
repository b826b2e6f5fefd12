"""The ``sinkprof`` command line: it parses options and delegates; the work lives in the modules."""
from __future__ import annotations

import dataclasses
import io
import json
import sys
from enum import Enum
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import __version__
from .options import MaskType, SinkStrategy

app = typer.Typer(add_completion=False, no_args_is_help=False, rich_markup_mode=None,
                  help="Correctness checks and profiles of context-parallel attention with attention sinks.",
                  context_settings={"help_option_names": ["-h", "--help"]})
console = Console(width=None if sys.stdout.isatty() else 160)


class OutputFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


def _version(value: bool):
    if value:
        print(f"sinkprof {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    """sinkprof: is my context-parallel attention with a sink correct, and where does its time go."""


def split_list(value: str, option: str, parse: Callable = str, allowed: Optional[list] = None) -> list:
    """``"a,b"`` -> parsed items; ``all`` expands to ``allowed``; errors name the option."""
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    if not items:
        raise typer.BadParameter(f"{option} needs at least one value")
    if allowed is not None and items == ["all"]:
        items = list(allowed)
    out = []
    for item in items:
        try:
            out.append(parse(item))
        except (ValueError, TypeError) as exc:
            raise typer.BadParameter(f"{option}: {exc}" if str(exc) else f"{option}: bad value {item!r}")
        if allowed is not None and item not in allowed:
            raise typer.BadParameter(f"{option}: {item!r} is not one of {', '.join(allowed)} (or 'all')")
    return out


def parse_window(value: Optional[str]):
    if value is None:
        return None
    try:
        left, right = (int(v) for v in value.split(","))
    except ValueError:
        raise typer.BadParameter(f"--window {value!r} must be LEFT,RIGHT (ints, -1 = unbounded), e.g. 128,0")
    return (left, right)


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError(f"{n} must be >= 1")
    return n


def _emit(text: str, output: Optional[str]) -> None:
    if output:
        from .tool.output import atomic_write_text
        atomic_write_text(output, text)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


@app.command()
def emulate(
    cp: str = typer.Option("2,4,8", help="Comma-separated CP sizes (total ranks) to replay."),
    comm: str = typer.Option("p2p", help="p2p, or a2a+p2p (inner a2a groups of --a2a-size around a ring)."),
    a2a_size: int = typer.Option(2, "--a2a-size", min=1, help="Ranks per inner a2a group for a2a+p2p."),
    mask: str = typer.Option("all", help="causal, no_mask or all."),
    strategy: str = typer.Option("all", help="Sink strategies: step0, post-merge, every-tile (the bug) or all."),
    window: Optional[str] = typer.Option(None, help="Sliding window LEFT,RIGHT (-1 = unbounded)."),
    b: int = typer.Option(2, min=1, help="Batch."),
    s: int = typer.Option(64, min=2, help="Full sequence length (divisible by 2 * every cp)."),
    h: int = typer.Option(4, min=1, help="Query heads."),
    g: int = typer.Option(2, min=1, help="K/V heads (h % g == 0)."),
    d: int = typer.Option(16, min=1, help="Head dim."),
    seed: int = typer.Option(0, help="Seed of the CPU generator for inputs and offsets (randn * 5)."),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", help="table, json or csv."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the result here instead of stdout."),
):
    """Replay every rank's ring schedule in fp64 in one process and compare with the reference.

    Exit 0 when step0 and post-merge match to 1e-12 and the every-tile bug is detected, else 1.
    """
    from .tool.emulate import EMULATE_TOLERANCE
    from .tool.emulate import emulate as run
    from .testing import Shape

    cps = split_list(cp, "--cp", _positive_int)
    masks = split_list(mask, "--mask", allowed=[m.value for m in MaskType])
    strategies = split_list(strategy, "--strategy", lambda v: SinkStrategy.parse(v, "--strategy"),
                            allowed=[x.value for x in SinkStrategy])
    shape = Shape(b, s, h, g, d)
    try:
        for n in cps:
            shape.validate(n)
        if comm not in ("p2p", "a2a+p2p"):
            raise ValueError(f"--comm {comm!r}: emulate replays p2p or a2a+p2p")
        rows = run(cps, masks, strategies, shape, seed, parse_window(window),
                   a2a_size if comm == "a2a+p2p" else None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc))
    ok = all(r.ok for r in rows)
    if fmt is OutputFormat.json:
        text = json.dumps({"passed": ok, "tolerance": EMULATE_TOLERANCE, "shape": dataclasses.asdict(shape),
                           "window": window, "seed": seed, "results": [dataclasses.asdict(r) for r in rows]},
                          indent=2)
        _emit(text, output)
    elif fmt is OutputFormat.csv:
        import pandas as pd
        buf = io.StringIO()
        pd.DataFrame([dataclasses.asdict(r) for r in rows]).to_csv(buf, index=False)
        _emit(buf.getvalue(), output)
    else:
        table = Table(title=f"fp64 ring replay vs reference (tolerance {EMULATE_TOLERANCE:g}, b={b} s={s} "
                            f"h={h} g={g} d={d}, learnable sink randn*5)")
        for col in ("comm", "cp", "mask", "strategy", "out", "dq", "dk", "dv", "d_sink", "d_sink ratio", "verdict"):
            table.add_column(col, justify="right" if col not in ("mask", "strategy", "verdict") else "left")
        for r in rows:
            verdict = ("ok" if r.passed else "WRONG") if r.strategy != "every-tile" else \
                ("bug detected" if not r.passed else "BUG NOT DETECTED")
            style = "green" if r.ok else "red"
            table.add_row(r.comm, str(r.cp), r.mask, r.strategy, *(f"{x:.1e}" for x in (
                r.out_max_abs_err, r.dq_max_abs_err, r.dk_max_abs_err, r.dv_max_abs_err, r.dsink_max_abs_err)),
                f"{r.dsink_ratio_min:.4f}..{r.dsink_ratio_max:.4f}", f"[{style}]{verdict}[/{style}]")
        if output:
            rec = Console(file=io.StringIO(), width=160, record=True)
            rec.print(table)
            _emit(rec.export_text(), output)
        else:
            console.print(table)
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    app()


def _resolve_groups(profile, dist_backend: str, nproc, options: dict) -> list:
    """Profile + command line -> validated ``check.Settings`` groups (shared by check and bench)."""
    from .tool import launcher as rt
    from .tool.profiles import find
    if dist_backend not in ("auto", "gloo", "nccl"):
        raise typer.BadParameter(f"--dist-backend {dist_backend!r}: use auto, gloo or nccl")
    try:
        overrides = _settings_overrides(**options, nproc=nproc)
        if rt.under_torchrun():
            import os
            world = int(os.environ["WORLD_SIZE"])
            if nproc is not None and nproc != world:
                raise ValueError(f"--nproc {nproc} differs from torchrun's WORLD_SIZE={world}; drop --nproc")
            overrides["nproc"] = world
        groups = find(profile).resolve(overrides)
        for settings in groups:
            settings.validate()
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc))
    first = groups[0]
    if any(gr.nproc != first.nproc or gr.device != first.device for gr in groups):
        raise typer.BadParameter("all [[cases]] of a profile must share nproc and device")
    if first.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise typer.BadParameter("--device cuda: no CUDA device is visible here; use --device cpu")
    return groups


def _settings_overrides(**opts) -> dict:
    """Command-line values for ``check.Settings`` fields; None means "not given"."""
    out = {}
    lists = {"comm", "softmax", "mask", "qkv_format", "dtype", "sink_strategy", "sink_grad"}
    for key, value in opts.items():
        if value is None:
            continue
        if key in lists:
            value = tuple(v.strip() for v in value.split(",") if v.strip())
            if value == ("all",):
                value = _ALL[key]
        elif key == "window":
            value = parse_window(value)
        out[key] = value
    return out


_ALL = {"comm": ("p2p", "a2a", "a2a+p2p"), "softmax": ("vanilla", "off-by-one", "learnable"), "mask": ("causal", "no_mask"),
        "qkv_format": ("bshd", "sbhd"), "dtype": ("fp64", "fp32", "bf16", "fp16"),
        "sink_strategy": ("step0", "post-merge"), "sink_grad": ("full", "partial")}


# Case options shared by check and bench (Typer reads these OptionInfo defaults per command).
PROFILE = typer.Option(None, help="Named profile (see `sinkprof profiles`) or a .toml path.")
COMM = typer.Option(None, help="p2p, a2a, a2a+p2p (comma list) or all.")
A2A_SIZE = typer.Option(None, "--a2a-size", help="Ranks per inner a2a group for a2a+p2p (default 2).")
SOFTMAX = typer.Option(None, help="vanilla, off-by-one, learnable (comma list) or all.")
MASK = typer.Option(None, help="causal, no_mask (comma list) or all.")
QKV_FORMAT = typer.Option(None, "--qkv-format", help="bshd, sbhd (comma list) or all.")
DTYPE = typer.Option(None, help="fp64, fp32, bf16, fp16 (comma list) or all.")
SINK_STRATEGY = typer.Option(None, "--sink-strategy", help="step0, post-merge or all.")
SINK_GRAD = typer.Option(None, "--sink-grad", help="full, partial or all.")
WINDOW = typer.Option(None, help="Sliding window LEFT,RIGHT (-1 = unbounded).")
BIAS = typer.Option(None, "--bias/--no-bias", help="Add a learnable [1, h, S, S] bias.")
SHAPE_B = typer.Option(None, help="Batch.")
SHAPE_S = typer.Option(None, help="Full sequence length (divisible by 2 * cp).")
SHAPE_H = typer.Option(None, help="Query heads.")
SHAPE_G = typer.Option(None, help="K/V heads (h % g == 0).")
SHAPE_D = typer.Option(None, help="Head dim.")
NPROC = typer.Option(None, help="Ranks to self-launch (cp size); ignored under torchrun.")
DEVICE = typer.Option(None, help="cpu or cuda.")
BACKEND = typer.Option(None, help="Tile kernels: auto (fa4, else cudnn, else torch), torch, cudnn or fa4.")
DIST_BACKEND = typer.Option("auto", "--dist-backend", help="auto (nccl with a GPU per rank, else gloo), gloo or nccl.")
SEED = typer.Option(None, help="Seed of the CPU generator for all inputs.")
TIMEOUT = typer.Option(120.0, min=1.0, help="Seconds any one exchange or collective may take.")
RUN_TIMEOUT = typer.Option(900.0, "--run-timeout", min=1.0, help="Seconds the whole run may take.")


@app.command()
def check(
    profile: Optional[str] = PROFILE,
    comm: Optional[str] = COMM,
    a2a_size: Optional[int] = A2A_SIZE,
    softmax: Optional[str] = SOFTMAX,
    mask: Optional[str] = MASK,
    qkv_format: Optional[str] = QKV_FORMAT,
    dtype: Optional[str] = DTYPE,
    sink_strategy: Optional[str] = SINK_STRATEGY,
    sink_grad: Optional[str] = SINK_GRAD,
    window: Optional[str] = WINDOW,
    bias: Optional[bool] = BIAS,
    b: Optional[int] = SHAPE_B,
    s: Optional[int] = SHAPE_S,
    h: Optional[int] = SHAPE_H,
    g: Optional[int] = SHAPE_G,
    d: Optional[int] = SHAPE_D,
    nproc: Optional[int] = NPROC,
    device: Optional[str] = DEVICE,
    backend: Optional[str] = BACKEND,
    dist_backend: str = DIST_BACKEND,
    seed: Optional[int] = SEED,
    inject: Optional[str] = typer.Option(None, help="Inject a bug to prove the check fails: sink-every-tile, "
                                                    "no-sink-reduce, aliased-reference, vanilla-fallback, "
                                                    "skip-sink-slice, stall, crash."),
    timeout: float = TIMEOUT,
    run_timeout: float = RUN_TIMEOUT,
    fmt: str = typer.Option("table", "--format", help="table or json."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the report here (whole file)."),
):
    """Check CP attention (out, dq, dk, dv, sink and bias gradients) against the fp64 reference.

    Exit 0 when every case passes, 1 when any fails or hangs, 2 for usage errors.
    """
    from .tool import launcher as rt
    from .tool.check import ReportOptions, check_job
    from .faults import Fault

    if fmt not in ("table", "json"):
        raise typer.BadParameter(f"--format {fmt!r}: use table or json")
    try:
        fault = Fault.parse(inject, "--inject") if inject else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc))
    groups = _resolve_groups(profile, dist_backend, nproc, dict(
        comm=comm, softmax=softmax, mask=mask, qkv_format=qkv_format, dtype=dtype, sink_strategy=sink_strategy,
        sink_grad=sink_grad, window=window, bias=bias, b=b, s=s, h=h, g=g, d=d, device=device, backend=backend,
        seed=seed, a2a_size=a2a_size))
    first = groups[0]
    code = rt.launch(check_job, (groups, fault, timeout, ReportOptions(fmt, output)), nproc=first.nproc,
                     device=first.device, backend=dist_backend, timeout=timeout, run_timeout=run_timeout)
    raise typer.Exit(code)


@app.command()
def profiles(name: Optional[str] = typer.Argument(None, help="Show this profile's settings.")):
    """List the named run configurations, or show one."""
    from .tool.profiles import available, find
    if name is None:
        table = Table(title="profiles")
        table.add_column("name")
        table.add_column("description")
        table.add_column("file")
        for n, path in available().items():
            table.add_row(n, find(n).description, str(path))
        console.print(table)
        return
    try:
        prof = find(name)
    except ValueError as exc:
        raise typer.BadParameter(str(exc))
    console.print(f"[bold]{prof.name}[/bold]: {prof.description}  ({prof.path})")
    for i, settings in enumerate(prof.resolve({})):
        console.print(f"group {i + 1}: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(settings).items()))


@app.command()
def doctor(
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when visible)."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
):
    """Show the environment and which comm x softmax x backend x dtype x layout cells run here."""
    from .tool.doctor import diagnose, render
    if fmt not in ("table", "json"):
        raise typer.BadParameter(f"--format {fmt!r}: use table or json")
    if device not in (None, "cpu", "cuda"):
        raise typer.BadParameter(f"--device {device!r}: use cpu or cuda")
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("--device cuda: no CUDA device is visible here")
    report = diagnose(device)
    if fmt == "json":
        print(json.dumps(report.to_json(), indent=2))
    else:
        render(report, console)


@app.command()
def bench(
    profile: Optional[str] = PROFILE,
    comm: Optional[str] = COMM,
    a2a_size: Optional[int] = A2A_SIZE,
    softmax: Optional[str] = SOFTMAX,
    mask: Optional[str] = MASK,
    qkv_format: Optional[str] = QKV_FORMAT,
    dtype: Optional[str] = DTYPE,
    sink_strategy: Optional[str] = SINK_STRATEGY,
    sink_grad: Optional[str] = SINK_GRAD,
    window: Optional[str] = WINDOW,
    bias: Optional[bool] = BIAS,
    b: Optional[int] = SHAPE_B,
    s: Optional[int] = SHAPE_S,
    h: Optional[int] = SHAPE_H,
    g: Optional[int] = SHAPE_G,
    d: Optional[int] = SHAPE_D,
    nproc: Optional[int] = NPROC,
    device: Optional[str] = DEVICE,
    backend: Optional[str] = BACKEND,
    dist_backend: str = DIST_BACKEND,
    seed: Optional[int] = SEED,
    warmup: int = typer.Option(2, min=0, help="Iterations run before measuring."),
    iters: int = typer.Option(5, min=1, help="Measured iterations."),
    phase: str = typer.Option("fwdbwd", help="fwd, bwd or fwdbwd."),
    csv_path: Optional[str] = typer.Option(None, "--csv", help="Write every timed span here (tidy CSV, whole file)."),
    trace: Optional[str] = typer.Option(None, help="Write a torch.profiler Chrome trace per rank into this folder."),
    use_nvtx: bool = typer.Option(True, "--nvtx/--no-nvtx", help="Emit NVTX ranges (domain sinkprof)."),
    simulate: Optional[str] = typer.Option(None, help="CP sizes (e.g. 8,16,32) whose every rank's compute schedule "
                                                      "runs on this one device, without communication."),
    inject: Optional[str] = typer.Option(None, help="stall or crash rank 1 on the second measured iteration."),
    timeout: float = TIMEOUT,
    run_timeout: float = RUN_TIMEOUT,
):
    """Time CP attention per ring step (compute, communication, overlap) with NVTX ranges; CSV export.

    For Nsight Systems: torchrun --nproc-per-node N --no-python nsys profile -t cuda,nvtx,nccl
    --capture-range=cudaProfilerApi -o rank%q{RANK} sinkprof bench ...
    """
    from .tool import launcher as rt
    from .tool.bench import PHASES, BenchOptions, bench_job
    from .tool.bench import simulate as run_simulation
    from .faults import Fault

    if phase not in PHASES:
        raise typer.BadParameter(f"--phase {phase!r}: use fwd, bwd or fwdbwd")
    try:
        fault = Fault.parse(inject, "--inject") if inject else None
        if fault not in (None, Fault.STALL, Fault.CRASH):
            raise ValueError(f"--inject {inject!r}: bench injects only stall or crash; the others belong to check")
        sims = tuple(split_list(simulate, "--simulate", _positive_int)) if simulate else ()
    except (ValueError, typer.BadParameter) as exc:
        raise typer.BadParameter(str(exc))
    options = dict(comm=comm, softmax=softmax, mask=mask, qkv_format=qkv_format, dtype=dtype,
                   sink_strategy=sink_strategy, sink_grad=sink_grad, window=window, bias=bias, b=b, s=s, h=h, g=g,
                   d=d, device=device, backend=backend, seed=seed, a2a_size=a2a_size)
    opts = BenchOptions(warmup, iters, phase, csv_path, trace, use_nvtx, sims, fault, timeout)
    if sims:
        groups = _resolve_groups(profile, dist_backend, 1, options)
        for n in sims:
            for settings in groups:
                try:
                    from .testing import Shape
                    Shape(settings.b, settings.s, settings.h, settings.g, settings.d).validate(n)
                except ValueError as exc:
                    raise typer.BadParameter(f"--simulate {n}: {exc}")
        import torch
        try:
            code = run_simulation(groups, opts, torch.device(groups[0].device))
        except ValueError as exc:
            raise typer.BadParameter(str(exc))
        raise typer.Exit(code)
    groups = _resolve_groups(profile, dist_backend, nproc, options)
    first = groups[0]
    code = rt.launch(bench_job, (groups, opts), nproc=first.nproc, device=first.device, backend=dist_backend,
                     timeout=timeout, run_timeout=run_timeout)
    raise typer.Exit(code)


@app.command()
def report(
    csv_files: list[str] = typer.Argument(..., help="CSV files written by `sinkprof bench --csv`."),
    plot: Optional[str] = typer.Option(None, help="Write one PNG per case and phase into this folder."),
):
    """Summarise bench CSVs: per-step compute, communication, overlap, exposed time, TFLOP/s."""
    from .tool.report import report as run
    try:
        written = run(csv_files, plot, console)
    except ValueError as exc:
        raise typer.BadParameter(str(exc))
    for path in written:
        console.print(f"wrote {path}")
