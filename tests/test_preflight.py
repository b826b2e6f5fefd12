"""Every usage error is found before any rank starts: exit 2, a message naming the option (or the
profile file and key) and the fix, no traceback, in a second or two."""
import dataclasses
import itertools
import os
import re
import shlex
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sinkprof.cli import app
from sinkprof.faults import Fault
from sinkprof.options import KVSchedule
from sinkprof.tool import launcher, preflight
from sinkprof.tool.cases import Settings, expand

from conftest import fault_error

runner = CliRunner()
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a command gets as far as starting ranks."""
    started = []

    def launch(*args, **kwargs):
        started.append(kwargs)
        return 0
    monkeypatch.setattr(launcher, "launch", launch)
    return started


def _refused(args, message, started):
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output
    assert "Traceback" not in res.output
    assert not started
    return res.output


@pytest.mark.parametrize("args,message", [
    (["check", "--backend", "flash"], "--backend"),
    (["check", "--dtype", ""], "--dtype needs at least one value"),
    (["check", "--softmax", ","], "--softmax needs at least one value"),
    (["bench", "--mask", ""], "--mask needs at least one value"),
    (["check", "--dist-backend", "nccl"], "--dist-backend nccl needs"),
    (["check", "--dist-backend", "mpi"], "--dist-backend"),
    (["check", "--inject", "skip-sink-slice"], "--inject skip-sink-slice: the fault applies to none"),
    (["check", "--inject", "aliased-reference", "--softmax", "vanilla,off-by-one"], "--softmax learnable"),
    # faults that changed nothing, then passed with exit 0: partial has no all-reduce to skip, and a
    # group of one rank's first heads are its own
    (["check", "--softmax", "learnable", "--sink-grad", "partial", "--inject", "no-sink-reduce"],
     "--inject no-sink-reduce: the fault applies to none of the 4 case(s) of this run; it needs a replicated "
     "gradient (--softmax learnable or --bias) under the full contract"),
    (["check", "--comm", "a2a+p2p", "--a2a-size", "1", "--softmax", "learnable", "--inject", "skip-sink-slice"],
     "--inject skip-sink-slice: the fault applies to none"),
    (["check", "--comm", "a2a", "--ranks", "1", "--softmax", "learnable", "--inject", "skip-sink-slice"],
     "over a group of two ranks or more"),
    (["check", "--inject", "stall", "--ranks", "1", "--seq-len", "64"], "--ranks >= 2"),
    (["bench", "--inject", "crash", "--simulate", "4"], "--inject crash with --simulate: the fault stops a rank"),
    (["bench", "--simulate", ""], "--simulate needs at least one value"),
    # accepted and ignored, exit 0: no case read it
    (["check", "--a2a-size", "4"], "--a2a-size 4: no case of this run is --comm a2a+p2p, the only one that reads it; "
                                   "add a2a+p2p to --comm, or drop --a2a-size"),
    (["bench", "--comm", "p2p,a2a", "--a2a-size", "2"], "--a2a-size 2: no case of this run is --comm a2a+p2p"),
    (["check", "--softmax", "vanilla", "--sink-strategy", "post-merge"],
     "--sink-strategy post-merge: no case of this run has a sink (--softmax vanilla), the only cases it applies to; "
     "add off-by-one or learnable to --softmax, or drop --sink-strategy"),
    (["bench", "--softmax", "vanilla", "--sink-grad", "partial"],
     "--sink-grad partial: no case of this run has a replicated gradient (a sink, or --bias on bshd or sbhd; here "
     "--softmax vanilla), the only cases it applies to"),
    (["emulate", "--cp", "2", "--a2a-size", "4"], "--a2a-size 4 with --comm p2p: only a2a+p2p reads it"),
    (["bench", "--inject", "stall", "--iters", "1"], "--inject stall --iters 1: the fault stops rank 1 in the second "
                                                     "measured iteration, which this run has not; use --iters 2"),
    (["bench", "--simulate", "2", "--ranks", "4"], "--ranks 4 with --simulate"),
    (["bench", "--simulate", "2,3"], "--simulate 3: --seq-len 64 must be divisible by 2 * cp = 6 (load-balanced "
                                     "chunks); use --seq-len 60, or drop 3 from --simulate"),
    (["bench", "--simulate", "4,3"], "use --seq-len 48"),   # one every size takes
    (["bench", "--simulate", "2,3", "--qkv-format", "bshd,thd", "--seqlens", "32,32"],
     "--simulate 3: --seq-len 64 must be divisible by 2 * cp = 6 (load-balanced chunks); use --seq-len 60, or drop 3"),
    # a value given twice ran its cases twice, and bench summed their rows as one case's
    (["bench", "--dtype", "fp32,bf16,fp32"], "--dtype fp32,bf16,fp32: fp32 is given twice; give each value once"),
    (["check", "--softmax", " learnable,vanilla , learnable"], "--softmax learnable,vanilla,learnable: learnable is "
                                                                "given twice"),
    (["bench", "--simulate", "2,4,2"], "--simulate 2,4,2: 2 is given twice"),
    (["emulate", "--kv-schedule", "ring,ring"], "--kv-schedule ring,ring: ring is given twice"),
    (["bench", "--simulate", "4", "--comm", "a2a+p2p"], "--comm a2a+p2p with --simulate: a simulation replays the p2p"),
    (["check", "--inject", ""], "--inject='' is not supported"),
    (["emulate", "--cp", "2,--4"], "--cp: '--4' is not an integer"),
    (["emulate", "--cp", "3"], "--cp 3: --seq-len 64 must be divisible by 2 * cp = 6 (load-balanced chunks); use "
                               "--seq-len 60"),
    (["emulate", "--cp", "4,3"], "--cp 3: --seq-len 64 must be divisible by 2 * cp = 6 (load-balanced chunks); use "
                                 "--seq-len 48, or drop 3 from --cp"),   # one rule for --cp, --ranks, --simulate
    (["check", "--ranks", "3"], "--ranks 3: --seq-len 64 must be divisible by 2 * cp = 6 (load-balanced chunks); "
                                "use --seq-len 60"),
    (["check", "--qkv-format", "thd", "--seqlens", "\u00b3\u00b2,32"], "is not a document length"),
    (["bench", "--simulate", "2", "--link", "1e-320"], "--link '1e-320': the bandwidth must be 0.001 to 1e+06 GB/s"),
    (["report", "--plot", "-", "x.csv"], "--plot '-': name a folder"),
    # values that passed validation, then crashed every rank (an OverflowError, "Overflow when unpacking
    # long long", "can't convert negative int to unsigned") or failed every exchange at once
    (["check", "--seed", "99999999999999999999"], "--seed 99999999999999999999 is out of range: torch's generators "
                                                   "take a seed from -2**63 to 2**64-1"),
    (["check", "--seed", str(-2 ** 63 - 1)], "--seed"),
    (["bench", "--seed", str(2 ** 64)], "--seed"),
    (["emulate", "--seed", "99999999999999999999"], "--seed 99999999999999999999 is out of range"),
    (["check", "--timeout", "inf"], "--timeout inf: give a number of seconds from 1 to 31536000 (365 days)"),
    (["check", "--timeout", "1e14"], "--timeout 1e+14: give a number of seconds from 1 to 31536000"),
    (["check", "--timeout", "1e10"], "--timeout"),
    (["check", "--timeout", "nan"], "--timeout nan"),
    (["check", "--timeout", "0.5"], "--timeout 0.5"),
    (["bench", "--run-timeout", "inf"], "--run-timeout inf"),
    (["check", "--mask", "no_mask", "--window", "99999999999999999999,0"],
     "left 99999999999999999999 is past the largest window, 2**63-1 = 9223372036854775807; use -1 for unbounded"),
    (["check", "--mask", "no_mask", "--window", "4,9223372036854775808"], "right 9223372036854775808 is past"),
    (["emulate", "--mask", "no_mask", "--window", "99999999999999999999,0"], "--window"),
    (["check", "--heads", "4", "--kv-heads", "3"], "--heads 4 must be a multiple of --kv-heads 3"),
    (["check", "--mask", "causal", "--window", "3,5"], "--window 3,5: right 5 contradicts --mask causal (it implies "
                                                       "right = 0); use --window 3,0 or --mask no_mask"),
    (["check", "--seq-len", "66"], "use --seq-len 64"),
    (["check", "--batch", "0"], "--batch 0 must be >= 1"),
    (["check", "--ranks", "0"], "--ranks 0 must be >= 1"),
    (["check", "--window", "5"], "--window"),
    (["check", "--device", "tpu"], "--device"),
    (["check", "--seq-len", "16777216", "--heads", "64", "--head-dim", "256"], "GiB of host memory"),
    (["check", "--qkv-format", "thd", "--seq-len", "1000000000000"], "GiB of host memory"),
    (["emulate", "--cp", "2", "--qkv-format", "thd", "--seq-len", "1000000000000"], "GiB of host memory"),
    # a pack past sys.maxsize units was an OverflowError traceback (random.sample of a range)
    (["check", "--qkv-format", "thd", "--seq-len", "40000000000000000000"], "about 2.89e+31 GiB of host memory"),
    (["emulate", "--cp", "2", "--qkv-format", "thd", "--seq-len", "40000000000000000000"], "GiB of host memory"),
    (["check", "--qkv-format", "thd", "--docs", "2000000", "--seq-len", "400000000"],
     "--docs 2000000: at most 1048576 random documents"),
    # the label of a long pack was every length, one line of 600 kB
    (["check", "--qkv-format", "thd", "--docs", "1000", "--seq-len", "40000000"],
     "largest case p2p/vanilla/causal/thd/docs=1000 documents/fp64, s=40000000)"),
])
def test_usage_errors_name_the_option_and_start_no_rank(no_launch, args, message):
    _refused(args, message, no_launch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's answer")
@pytest.mark.parametrize("backend", ["cudnn", "fa4"])
def test_a_gpu_backend_on_the_cpu_is_refused_before_launch(no_launch, backend):
    out = _refused(["check", "--backend", backend], f"--backend {backend} cannot run here", no_launch)
    assert "--backend torch" in out


@pytest.mark.parametrize("option,extra", [("--output", ["check"]), ("--csv", ["bench"]), ("--output", ["emulate"])])
def test_an_output_path_under_a_regular_file_is_refused_before_the_run(no_launch, tmp_path, option, extra):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _refused([*extra, option, str(blocker / "sub" / "out.json")], f"{blocker} is a file, not a folder", no_launch)


def test_trace_and_plot_folders_that_cannot_be_created_are_refused(no_launch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _refused(["bench", "--trace", str(blocker / "t")], "--trace", no_launch)
    _refused(["bench", "--trace", str(blocker)], "is a file, not a folder", no_launch)
    csv = tmp_path / "x.csv"
    csv.write_text("a\n")
    _refused(["report", str(csv), "--plot", str(blocker / "plots")], "--plot", no_launch)


def test_an_output_that_is_a_folder_is_refused(no_launch, tmp_path):
    _refused(["check", "--output", str(tmp_path)], "is a folder", no_launch)


@pytest.mark.parametrize("text,message", [
    ('bias = "no"\n', 'bias = \'no\' must be a TOML boolean'),
    ('bias = "false"\n', "TOML boolean"),
    ('ranks = "two"\n', "ranks = 'two' must be an integer"),
    ("window = 128\n", "window = 128 must be a list of two integers"),
    ("seq_len = 64.0\n", "seq_len = 64.0 must be an integer"),
    ('dtype = [1]\n', "dtype = [1] must be a string or a list of strings"),
    ("[[cases]]\nheads = true\n", "[[cases]] #1: heads = True must be an integer"),
    ("x = [\n", "invalid TOML"),
    ("a = " + "{b = " * 400 + "1" + "}" * 400 + "\n", "nested too deeply"),
    ("a = " + "[" * 2000 + "]" * 2000 + "\n", "nested too deeply"),
    ("seq_len = 66\n", "(with the settings of profile"),
    ('dtype = ["fp64", "fp64"]\n', "--dtype fp64,fp64: fp64 is given twice; give each value once (with the settings of "
                                   "profile"),
    ("ranks = 2\n[[cases]]\n[[cases]]\nranks = 4\n", "bad.toml: all [[cases]] must share ranks and device"),
])
def test_profile_values_of_the_wrong_type_name_the_file_and_key(no_launch, tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    out = _refused(["check", "--profile", str(path)], message, no_launch)
    assert "bad.toml" in out
    assert len(out.splitlines()) < 20


def test_a_profile_takes_a_list_as_a_string_as_the_command_line_does(no_launch, tmp_path):
    """``dtype = "all"`` and ``softmax = "vanilla,learnable"`` were refused as ``--dtype='all' is not
    supported``, naming an option the user had not typed."""
    from sinkprof.tool.cases import CaseOptions
    from sinkprof.tool.profiles import settings_for
    path = tmp_path / "lists.toml"
    path.write_text('dtype = "all"\nsoftmax = " vanilla, learnable"\n')
    (group,) = settings_for(CaseOptions(profile=str(path)))
    assert group.dtype == ("fp64", "fp32", "bf16", "fp16") and group.softmax == ("vanilla", "learnable")
    path.write_text('dtype = ["all"]\nsoftmax = [" learnable "]\n')   # a TOML list is read the same way
    (group,) = settings_for(CaseOptions(profile=str(path)))
    assert group.dtype == ("fp64", "fp32", "bf16", "fp16") and group.softmax == ("learnable",)


def test_a_broken_profile_does_not_break_the_list(monkeypatch, tmp_path):
    (tmp_path / "broken.toml").write_text("x = [\n")
    (tmp_path / "fine.toml").write_text('description = "a fine one"\nranks = 2\n')
    monkeypatch.setenv("SINKPROF_PROFILES", str(tmp_path))
    res = runner.invoke(app, ["profiles"])
    assert res.exit_code == 0, res.output
    assert "a fine one" in res.output and "cpu-default" in res.output
    assert "broken" in res.output and "invalid TOML" in res.output


def test_under_torchrun_the_errors_name_world_size_not_ranks(no_launch, monkeypatch):
    """torchrun's world size is WORLD_SIZE, and --ranks is refused under it: the errors named
    ``--ranks 3``, which the user had not given and could not."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
        monkeypatch.setenv(name, value)
    _refused(["check"], "WORLD_SIZE=3: --seq-len 64 must be divisible by 2 * cp = 6 (load-balanced chunks); use "
                        "--seq-len 60", no_launch)
    _refused(["check", "--comm", "a2a+p2p", "--seq-len", "60"], "--a2a-size 2 must divide WORLD_SIZE=3 (a2a+p2p "
                                                                 "runs a ring", no_launch)
    _refused(["bench", "--qkv-format", "thd", "--seqlens", "32,28"], "--seqlens 32,28 at WORLD_SIZE=3:", no_launch)


def test_under_torchrun_a_fault_that_needs_two_ranks_names_world_size(no_launch, monkeypatch):
    """A torchrun world of one with ``--inject stall`` said it needs ``--ranks >= 2``, an option
    torchrun refuses."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
        monkeypatch.setenv(name, value)
    out = _refused(["check", "--inject", "stall"], "it needs a ring of two ranks or more (--comm p2p with WORLD_SIZE "
                                                   ">= 2, or --comm a2a+p2p with WORLD_SIZE >= 2 * --a2a-size)",
                   no_launch)
    assert "--ranks" not in out
    _refused(["check", "--softmax", "learnable", "--inject", "no-sink-reduce"], "and WORLD_SIZE >= 2", no_launch)
    _refused(["bench", "--inject", "crash"], "(--comm p2p with WORLD_SIZE >= 2", no_launch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's answer")
def test_a_gpu_profile_on_the_cpu_names_the_profile(no_launch):
    """It said ``--device cuda: ... use --device cpu``, an option the user had not given, whose
    advice ran te-sink's shapes in fp64 on the CPU for minutes."""
    _refused(["check", "--profile", "te-sink"], "--profile te-sink: the profile runs on a CUDA GPU (device = \"cuda\" "
                                                "in", no_launch)
    _refused(["bench", "--profile", "gpt-oss-120b", "--simulate", "8"], "run it on a GPU machine, or use a CPU "
                                                                         "profile", no_launch)
    _refused(["check", "--device", "cuda"], "--device cuda: no CUDA device is visible here; use --device cpu",
             no_launch)
    _refused(["doctor", "--device", "cuda"], "--device cuda: no CUDA device is visible here; run doctor on the GPU "
                                             "machine, or drop --device", no_launch)


def test_a_profile_that_is_a_fifo_is_named_not_waited_for(no_launch, monkeypatch, tmp_path):
    """A FIFO named *.toml in $SINKPROF_PROFILES hung ``sinkprof profiles`` (its read waits for a
    writer), and ``--profile ./f.toml`` said ``no such file`` of it."""
    os.mkfifo(tmp_path / "f.toml")
    monkeypatch.setenv("SINKPROF_PROFILES", str(tmp_path))
    res = runner.invoke(app, ["profiles"])
    assert res.exit_code == 0 and "a FIFO, not a regular file" in " ".join(res.output.split()), res.output
    _refused(["check", "--profile", "f"], f"profile {tmp_path / 'f.toml'}: a FIFO, not a regular file; name a "
                                          f"profile file", no_launch)
    _refused(["check", "--profile", str(tmp_path / "f.toml")], "a FIFO, not a regular file", no_launch)
    _refused(["bench", "--profile", "/dev/null"], "--profile '/dev/null': a device, not a regular file", no_launch)


def test_profiles_name_prints_its_text_as_written_and_refuses_a_profile_check_would_refuse(monkeypatch, tmp_path):
    """A ``[`` in a description or a value was read as Rich markup (a traceback, or restyled
    text); a profile that check refuses (``ranks = -3``) was shown with exit 0, and one refused
    while it printed left half its output on stdout before exit 2."""
    (tmp_path / "markup.toml").write_text('description = "uses [/x] and [red]markup[/red]"\n')
    (tmp_path / "negranks.toml").write_text('description = "d"\nranks = -3\n')
    (tmp_path / "badval.toml").write_text('description = "d"\ndtype = "[/x]"\n')
    (tmp_path / "elsewhere.toml").write_text('description = "d"\ndevice = "cuda"\nbackend = "fa4"\nranks = 8\n')
    monkeypatch.setenv("SINKPROF_PROFILES", str(tmp_path))
    res = runner.invoke(app, ["profiles", "markup"])
    assert res.exit_code == 0, res.output
    assert "markup: uses [/x] and [red]markup[/red]" in res.output
    res = runner.invoke(app, ["profiles", "elsewhere"])   # for a GPU machine with FA4: shown on any
    assert res.exit_code == 0 and "backend=fa4" in res.output, res.output
    for name, says in (("negranks", "--ranks -3 must be >= 1 (with the settings of profile"),
                       ("badval", "--dtype='[/x]' is not supported")):
        res = runner.invoke(app, ["profiles", name])
        assert res.exit_code == 2 and says in " ".join(res.output.split()), res.output
        assert not res.stdout.strip(), res.stdout
    monkeypatch.setenv("SINKPROF_PROFILES", str(tmp_path / "markup.toml"))
    res = runner.invoke(app, ["profiles", "markup"])
    assert res.exit_code == 2 and f"SINKPROF_PROFILES names {tmp_path / 'markup.toml'}, not a folder of profiles" \
        in " ".join(res.output.split())
    res = runner.invoke(app, ["profiles"])   # before: the shipped profiles alone, and not a word of the file
    assert res.exit_code == 0 and "cpu-default" in res.stdout and "markup" not in res.stdout, res.output
    assert (f"sinkprof profiles: note: SINKPROF_PROFILES names {tmp_path / 'markup.toml'}, not a folder of profiles "
            f"(it takes folders, separated by ':'; a profile file is run as --profile PATH)") in " ".join(res.stderr.split())

def test_a_profile_path_that_is_a_symlink_loop_or_dangling_says_so(no_launch, tmp_path):
    """Both read ``no such file``, though ``ls`` lists the name."""
    (tmp_path / "loop.toml").symlink_to("loop.toml")
    (tmp_path / "dangling.toml").symlink_to("gone.toml")
    _refused(["check", "--profile", str(tmp_path / "loop.toml")], "loop.toml': Too many levels of symbolic links; "
                                                                   "name a profile file you can read", no_launch)
    _refused(["bench", "--profile", str(tmp_path / "dangling.toml")], "dangling.toml': a symlink to no file",
             no_launch)
    _refused(["check", "--profile", str(tmp_path / "none.toml")], "none.toml': no such file", no_launch)


def test_usage_errors_in_a_real_process_take_seconds_and_print_no_traceback(cli):
    for args in (["check", "--backend", "flash"], ["check", "--dtype", ""], ["check", "--ranks", "64", "--seq-len",
                 str(2 ** 24), "--heads", "64"], ["bench", "--csv", "/proc/version/x.csv"]):
        start = time.monotonic()
        res = cli(*args, timeout=60)
        assert res.returncode == 2, (args, res.stderr)
        assert time.monotonic() - start < 15
        assert "Traceback" not in res.stderr and "rank" not in res.stdout


def test_allgather_is_counted_with_the_whole_sequences_kv_and_its_wider_tiles():
    """Each rank of an allgather run holds every rank's K/V and their dK/dV, and a chunk's tile reads
    its whole document: the estimate grows by at least the sequence's K/V and dK/dV."""
    ring, gather = (expand(Settings(seq_len=4096, kv_schedule=(kind,), ranks=4))[0] for kind in ("ring", "allgather"))
    sh = ring.shape
    kv_all = sh.b * sh.s * 2 * sh.g * sh.d
    for tiles in (False, True):
        host, device = preflight.case_need(ring, 4, False, tile_scores=tiles)
        host_g, device_g = preflight.case_need(gather, 4, False, tile_scores=tiles)
        assert host_g == host and device_g >= device + kv_all * (3 + 3) * 8   # fp64 by default: elem = acc = 8
    one = expand(Settings(seq_len=4096, kv_schedule=("allgather",), ranks=1))[0]
    assert preflight.case_need(one, 1, False) == preflight.case_need(
        expand(Settings(seq_len=4096, kv_schedule=("ring",), ranks=1))[0], 1, False)   # a ring of one gathers nothing


def test_direct_is_counted_with_the_dkv_parts_it_keeps_until_the_end():
    """Under direct an owner keeps the dK/dV parts that return in K/V's dtype until the backward
    ends (``ring.DirectDKV``): up to a shard from each of the other ranks, beyond the ring's need.
    Where the ring joins runs of steps (b = 1 here), its two K/V buffers hold a run, here three
    shards' rows, not one (two shards more each), and in the backward so do its two dK/dV parts, in
    the accumulator dtype, while the kept parts come in: all of them count."""
    def need(kind, dtype, ranks=4, batch=2):
        return preflight.case_need(expand(Settings(seq_len=4096, kv_schedule=(kind,), dtype=(dtype,),
                                                   ranks=ranks, batch=batch))[0], ranks, False)
    sh = expand(Settings(seq_len=4096, ranks=4))[0].shape
    assert sh.b == 2                                            # bshd with b = 2: nothing joined
    shard = sh.b * (sh.s // 4) * 2 * sh.g * sh.d
    assert need("direct", "bf16")[1] - need("ring", "bf16")[1] == 3 * shard * 2
    assert need("direct", "fp64") == need("ring", "fp64")      # K/V's dtype is the accumulator's: nothing kept
    one = shard // 2                                            # b = 1
    assert need("direct", "bf16", batch=1)[1] - need("ring", "bf16", batch=1)[1] == 2 * 2 * one * (2 + 4) + 3 * one * 2
    assert need("direct", "fp64", batch=1)[1] - need("ring", "fp64", batch=1)[1] == 2 * 2 * one * (8 + 8)
    assert need("direct", "bf16", ranks=1) == need("ring", "bf16", ranks=1)


def test_the_balanced_layouts_tile_scores_count_a_ranks_pieces_of_a_document_together():
    """Without a mask a rank's head and tail of a document are one tile of both pieces' rows against
    the whole document: the torch tiles' scores of the largest such tile."""
    docs = (14, 6, 12)
    settings = Settings(qkv_format=("thd",), seqlens=docs, seq_len=32, pack_layout="balanced", mask=("no_mask",),
                        softmax=("vanilla",), dtype=("fp64",), ranks=8)
    case = expand(settings)[0]
    with_scores = preflight.case_need(case, 8, False, tile_scores=True)[1]
    without = preflight.case_need(case, 8, False, tile_scores=False)[1]
    from sinkprof.plan import balanced_layout, gather_plan
    from sinkprof.options import Band
    layout = balanced_layout(8, docs)
    largest = max((t.q_rows.stop - t.q_rows.start) * (t.kv_rows.stop - t.kv_rows.start)
                  for r in range(8) for t in gather_plan(8, r, layout, Band()).steps[0].tiles)
    sh = case.shape
    assert with_scores - without == 3 * sh.b * sh.h * largest * 8


def test_memory_estimate_is_linear_without_a_bias_and_refuses_what_does_not_fit():
    base = Settings(softmax=("vanilla",), mask=("causal",), dtype=("fp64",), seq_len=4096, ranks=2)
    big = Settings(softmax=("vanilla",), mask=("causal",), dtype=("fp64",), seq_len=8192, ranks=2)
    small_need = preflight.case_need(expand(base)[0], 2, True)
    big_need = preflight.case_need(expand(big)[0], 2, True)
    assert big_need[0] == 2 * small_need[0]           # host: the inputs, linear in the sequence
    preflight.check_memory([base], 2, "cpu", True, host_free=64 * 2 ** 30)
    with pytest.raises(ValueError, match=r"needs about .* GiB of host memory .* and 0.5 GiB is available"):
        preflight.check_memory([base], 2, "cpu", True, host_free=2 ** 29)
    with pytest.raises(ValueError, match="x 64 rank"):
        preflight.check_memory([Settings(ranks=64, seq_len=128)], 64, "cpu", True, host_free=8 * 2 ** 30)
    with pytest.raises(ValueError, match="GPU memory"):
        preflight.check_memory([base], 2, "cuda", True, host_free=64 * 2 ** 30, device_free=2 ** 20)


def test_flash_tiles_keep_the_device_estimate_linear_and_a_simulation_is_one_process():
    base = Settings(softmax=("vanilla",), mask=("causal",), dtype=("bf16",), seq_len=2 ** 15, ranks=4)
    big = Settings(softmax=("vanilla",), mask=("causal",), dtype=("bf16",), seq_len=2 ** 17, ranks=4)
    flash = [preflight.case_need(expand(s)[0], 4, False, tile_scores=False)[1] for s in (base, big)]
    torch_tiles = [preflight.case_need(expand(s)[0], 4, False, tile_scores=True)[1] for s in (base, big)]
    assert flash[1] == 4 * flash[0]                   # cuDNN and FA4 tiles hold no scores: linear
    assert torch_tiles[1] > 10 * torch_tiles[0]       # the torch tiles' scores: quadratic in the chunk
    # bench --simulate 8: one process replays every rank on the device, each rank a ring of 8's shard
    one = preflight.case_need(expand(big)[0], 8, False)[1]
    preflight.check_memory([big], 8, "cpu", False, procs=1, host_free=int(1.5 * one) + 2 ** 30)
    with pytest.raises(ValueError, match=r"x 8 rank"):
        preflight.check_memory([big], 8, "cpu", False, host_free=int(1.5 * one) + 2 ** 30)


def test_the_forwards_buffers_of_later_results_are_counted(monkeypatch):
    """A rank of a 4-rank ring keeps up to 2 x 3 later tiles' results in q's dtype (ring.ForwardState);
    with no buffers at all every later result would go through the fp32 accumulator instead."""
    case = expand(Settings(softmax=("vanilla",), mask=("causal",), dtype=("bf16",), seq_len=2 ** 15, ranks=4))[0]
    sh = case.shape
    o_local = sh.b * sh.s * sh.h * sh.d // 4
    with_parts = preflight.case_need(case, 4, False, tile_scores=False)[1]
    monkeypatch.setattr(preflight, "PARTS", 0)
    without = preflight.case_need(case, 4, False, tile_scores=False)[1]
    assert with_parts - without == o_local * (6 * 2 - 4)


def test_a_packs_tile_memory_is_its_longest_documents_so_a_pack_of_short_ones_fits():
    def pack(seqlens):
        return Settings(softmax=("vanilla",), mask=("causal",), dtype=("fp64",), qkv_format=("thd",),
                        seqlens=seqlens, seq_len=sum(seqlens), ranks=2)

    short = pack((4096,) * 16)                    # 64k tokens in 16 documents: 2k x 2k tiles at most
    mixed = pack((4096,) * 8 + (2048,) * 16)      # the same pack, the same longest document
    long = pack((2 ** 16,))                       # 64k tokens in one document: 32k x 32k at step 0
    need = {name: preflight.case_need(expand(s)[0], 2, False) for name, s in
            (("short", short), ("mixed", mixed), ("long", long))}
    assert need["short"] == need["mixed"]
    assert need["long"][1] - need["short"][1] == 3 * 4 * ((2 * 16384) ** 2 - (2 * 1024) ** 2) * 8
    preflight.check_memory([short], 2, "cpu", False, host_free=8 * 2 ** 30)
    with pytest.raises(ValueError, match=r"needs about .* GiB of host memory .*docs=65536.* and 8.0 GiB is available; "
                                         r"shorten the pack or its longest document \(--seqlens"):
        preflight.check_memory([long], 2, "cpu", False, host_free=8 * 2 ** 30)


def test_every_fault_applies_to_the_case_that_would_show_it():
    learnable = Settings(softmax=("learnable",), comm=("a2a",), qkv_format=("thd",), seqlens=(16, 32, 16), ranks=2)
    cases = expand(learnable)
    # a2a runs a ring of one rank: no K/V rows to drop, no row that a second tile sees, no ring rank 1
    ring_faults = (Fault.DROP_HALO, Fault.SINK_EVERY_TILE, Fault.STALL, Fault.CRASH)
    assert [f for f in Fault if preflight.applies(f, cases[0], 2)] == [f for f in Fault if f not in ring_faults]
    hierarchical = expand(dataclasses.replace(learnable, comm=("a2a+p2p",), seqlens=(32, 64, 32), seq_len=128,
                                              ranks=4))[0]
    assert [preflight.applies(f, hierarchical, 4) for f in ring_faults[1:]] == [True, True, True]
    assert not any(preflight.applies(f, hierarchical, 2) for f in ring_faults[1:])   # ranks == --a2a-size 2
    # doc-leak needs two documents, and a window that lets a row see a key before its own position
    one_doc = expand(Settings(softmax=("learnable",), qkv_format=("thd",), seqlens=(64,)))[0]
    bshd = expand(Settings(softmax=("learnable",)))[0]
    diagonal = expand(Settings(softmax=("learnable",), qkv_format=("thd",), seqlens=(32, 32), window=(0, 0)))[0]
    left = expand(Settings(softmax=("learnable",), qkv_format=("thd",), seqlens=(32, 32), window=(1, 0)))[0]
    assert [preflight.applies(Fault.DOC_LEAK, c, 2) for c in (one_doc, bshd, diagonal, left)] == [
        False, False, False, True]
    direct = expand(Settings(softmax=("vanilla",), window=(3, 0), kv_schedule=("direct",), ranks=2))[0]
    ring = expand(Settings(softmax=("vanilla",), window=(3, 0), kv_schedule=("ring",), ranks=2))[0]
    assert preflight.applies(Fault.DROP_HALO, direct, 2) and not preflight.applies(Fault.DROP_HALO, ring, 2)
    vanilla_p2p = expand(Settings(softmax=("vanilla",)))[0]
    assert not any(preflight.applies(f, vanilla_p2p, 2) for f in
                   (Fault.SINK_EVERY_TILE, Fault.NO_SINK_REDUCE, Fault.ALIASED_REFERENCE, Fault.VANILLA_FALLBACK,
                    Fault.SKIP_SINK_SLICE))


def test_sink_every_tile_applies_exactly_where_the_emulator_under_it_fails():
    """The preflight's answer agrees with the emulator run under the fault, case by case: a ring of
    one rank (cp 1, or a2a+p2p with cp = --a2a-size, or plain a2a) or a diagonal window hides it."""
    seen = set()
    for mask, window, fmt, cp, comm, kv in itertools.product(
            ["causal", "no_mask"], [None, (0, 0), (1, 0), (0, 2)], ["bshd", "thd"], [1, 2, 4], ["p2p", "a2a", "a2a+p2p"],
            ["auto", "allgather"]):
        if (mask == "causal" and window is not None and window[1] != 0) or (comm != "p2p" and cp == 1):
            continue
        s = Settings(softmax=("learnable",), mask=(mask,), window=window, qkv_format=(fmt,), comm=(comm,), ranks=cp,
                     seq_len=32, seqlens=(8, 16, 8) if fmt == "thd" else None, heads=4, kv_heads=4, head_dim=8,
                     dtype=("fp64",), kv_schedule=(kv,))
        case, err = fault_error(Fault.SINK_EVERY_TILE, s, cp, comm)
        applies = preflight.applies(Fault.SINK_EVERY_TILE, case, cp)
        assert applies == (err > 1e-6), (mask, window, fmt, cp, comm, kv, err)
        seen.add((applies, preflight.ring_ranks(case, cp) > 1, kv))
    # hidden by one rank, by the window, or by allgather (each row's keys in one tile)
    assert seen == {(True, True, "auto"), (False, True, "auto"), (False, False, "auto"), (False, True, "allgather"),
                    (False, False, "allgather")}


@pytest.mark.parametrize("args,message", [
    (["check", "--comm", "a2a+p2p", "--a2a-size", "2", "--ranks", "2", "--inject", "sink-every-tile"],
     "--comm a2a+p2p with --ranks >= 2 * --a2a-size"),
    (["check", "--comm", "a2a", "--ranks", "2", "--inject", "crash"], "ring rank 1 crashes"),
    (["bench", "--comm", "a2a+p2p", "--ranks", "4", "--a2a-size", "4", "--kv-heads", "4", "--inject", "stall"], "ring rank 1 stalls"),
    (["check", "--softmax", "learnable", "--window", "0,0", "--inject", "sink-every-tile"], "wider than the diagonal"),
])
def test_a_fault_a_one_rank_ring_cannot_show_is_refused(no_launch, args, message):
    out = _refused(args, message, no_launch)
    assert f"--inject {args[args.index('--inject') + 1]}: the fault applies to none" in out


def _readme_commands(name):
    text = README.read_text().replace("\\\n", " ")
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line.split(" # ")[0].split("  #")[0])
            if name in words:
                yield words[words.index(name) + 1:]


def test_every_readme_check_and_bench_line_is_valid_as_written(no_launch, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    seen = 0
    for args in _readme_commands("sinkprof"):
        if not args or args[0] not in ("check", "bench"):
            continue
        seen += 1
        res = runner.invoke(app, args)
        if "no CUDA device is visible here" in res.output:     # the README says these need a GPU
            assert not torch.cuda.is_available()
            continue
        assert res.exit_code == 0, (args, res.output)
    assert seen >= 8 and no_launch


def test_the_largest_torch_tile_is_step_0s_on_the_outer_ring_with_the_heads_left_after_the_a2a():
    def need(comm, a2a_size=2, scores=True):
        s = Settings(softmax=("vanilla",), mask=("causal",), dtype=("fp64",), comm=(comm,), seq_len=4096, heads=4,
                     kv_heads=4, ranks=4, a2a_size=a2a_size, batch=1)
        return preflight.case_need(expand(s)[0], 4, False, tile_scores=scores)[1]

    tile = {comm: need(comm) - need(comm, scores=False) for comm in ("p2p", "a2a", "a2a+p2p")}
    assert tile["p2p"] == 3 * 4 * (2 * 512) ** 2 * 8        # a ring of 4: c = 512, all 4 heads
    assert tile["a2a"] == 3 * 1 * 4096 ** 2 * 8             # a ring of one rank on the whole sequence, 1 head
    assert tile["a2a+p2p"] == 3 * 2 * (2 * 1024) ** 2 * 8   # a ring of 2 (c = 1024), 2 heads


def test_the_largest_seed_timeout_and_window_are_accepted(no_launch):
    for args in (["--seed", str(2 ** 64 - 1)], ["--seed", str(-2 ** 63)], ["--timeout", "31536000"],
                 ["--run-timeout", "31536000"], ["--mask", "no_mask", "--window", "9223372036854775807,0"]):
        res = runner.invoke(app, ["check", "--seq-len", "64", *args])
        assert res.exit_code == 0, (args, res.output)
    assert len(no_launch) == 5


@pytest.mark.parametrize("value", ["1", "0", "abc"])
def test_a_leftover_local_world_size_outside_torchrun_is_ignored(monkeypatch, value):
    """It changed the memory check (1 divided the estimate by the ranks, 0 turned it off, abc was
    'invalid literal for int()'); only torchrun's RANK and WORLD_SIZE make it count."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(ValueError, match=r"x 8 rank\(s\)"):
        preflight.check_memory([Settings(ranks=8, seq_len=128)], 8, "cpu", True, host_free=2 ** 30)


def test_the_memory_check_gives_the_numbers_it_gave_when_it_asked_every_case_for_its_plan():
    """The figures the check gave before it bounded ``auto`` by ring and direct (it built every
    rank's plan for every case: 17 s at 256 ranks, hours at 1000): each case's (host, device) need,
    and the refusal at 1 GiB free."""
    before = [
        (Settings(ranks=8, seq_len=512, heads=4, kv_heads=2, head_dim=16, dtype=("bf16",), mask=("causal",),
                  window=(32, 0)), {(1966080, 71680000)},
         "this run needs about 3.7 GiB of host memory (0.5 GiB per rank x 8 rank(s), largest case "
         "p2p/vanilla/causal/bshd/bf16/window=32,0, s=512) and 1.0 GiB is available"),
        (Settings(ranks=16, seq_len=2048, heads=2, kv_heads=2, head_dim=8, dtype=("fp16",), mask=("no_mask", "causal"),
                  window=(100, -1)), {(2621440, 274530304)},
         "this run needs about 10.4 GiB of host memory (0.6 GiB per rank x 16 rank(s), largest case "
         "p2p/vanilla/no_mask/bshd/fp16/window=100,-1, s=2048) and 1.0 GiB is available"),
        (Settings(ranks=8, seq_len=1024, heads=2, kv_heads=1, head_dim=8, dtype=("bf16",), mask=("causal",), bias=True,
                  kv_schedule=("ring", "direct", "allgather", "auto")),
         {(21954560, 187367424), (21954560, 187424768), (21954560, 193462272)},
         "this run needs about 4.7 GiB of host memory (0.6 GiB per rank x 8 rank(s), largest case "
         "p2p/vanilla/causal/bshd/bf16/grad=full/bias/kv=allgather, s=1024) and 1.0 GiB is available"),
        (Settings(ranks=4, seq_len=384, heads=2, kv_heads=2, head_dim=8, dtype=("bf16",), qkv_format=("thd",),
                  seqlens=(128, 256)), {(245760, 10113024)},
         "this run needs about 1.6 GiB of host memory (0.4 GiB per rank x 4 rank(s), largest case "
         "p2p/vanilla/causal/thd/docs=128,256/bf16, s=384) and 1.0 GiB is available"),
    ]
    for settings, needs, refusal in before:
        settings.validate()
        assert {preflight.case_need(c, settings.ranks, True) for c in expand(settings)} == needs
        with pytest.raises(ValueError) as refused:
            preflight.check_memory([settings], settings.ranks, "cpu", True, host_free=2 ** 30)
        assert str(refused.value).split(";")[0] == refusal


def test_the_schedule_a_case_runs_is_known_without_its_plan_unless_auto_must_weigh_ring_and_direct(monkeypatch):
    from sinkprof.tool.check import case_traffic
    cases = [c for kv in ("ring", "direct", "allgather", "auto") for comm in ("p2p", "a2a", "a2a+p2p")
             for c in expand(Settings(ranks=4, seq_len=128, heads=4, kv_heads=4, comm=(comm,), kv_schedule=(kv,),
                                      mask=("causal", "no_mask"), window=(8, 0)))]
    cases += expand(Settings(ranks=4, seq_len=384, qkv_format=("thd",), seqlens=(128, 256), pack_layout="balanced"))
    planned = {c.label: (case_traffic(c, 4).schedule.kind if case_traffic(c, 4).schedule else None) for c in cases}
    asked = []
    real = preflight._case_schedule
    monkeypatch.setattr(preflight, "_case_schedule", lambda case, ranks: asked.append(case.label) or real(case, ranks))
    for c in cases:
        assert preflight._ring_schedule(c, 4) is (planned[c.label] or KVSchedule.RING), c.label
    assert asked and all("kv=" not in label and "docs=" not in label and "a2a/" not in label for label in asked)


def test_a_run_of_1000_ranks_is_refused_at_once_without_any_plan(no_launch, monkeypatch):
    """``check --ranks 1000`` ran for minutes building every rank's plan before its refusal."""
    monkeypatch.setattr(preflight, "host_available", lambda: 64 * 2 ** 30)
    monkeypatch.setattr(preflight, "_case_schedule", lambda case, ranks: pytest.fail("built the plan"))
    start = time.monotonic()
    out = _refused(["check", "--seq-len", "64000", "--ranks", "1000", "--heads", "2", "--head-dim", "8"],
                   "of host memory", no_launch)
    assert time.monotonic() - start < 2
    assert "x 1000 rank(s)" in " ".join(out.split())


def test_no_result_replaces_the_profile_the_run_reads_or_a_rank_s_trace(no_launch, tmp_path):
    profile = tmp_path / "mine.toml"
    text = 'description = "mine"\nranks = 2\nseq_len = 64\nheads = 2\nkv_heads = 1\nhead_dim = 8\n'
    profile.write_text(text)
    link = tmp_path / "link.toml"
    link.symlink_to(profile)
    _refused(["check", "--profile", str(profile), "--format", "json", "-o", str(link)],
             f"--output {link}: is the profile this run reads (--profile {profile})", no_launch)
    _refused(["bench", "--profile", str(profile), "--csv", str(profile)],
             f"--csv {profile}: is the profile this run reads", no_launch)
    assert profile.read_text() == text
    _refused(["bench", "--ranks", "2", "--trace", str(tmp_path / "t"), "--csv", str(tmp_path / "t" / "rank1.json")],
             f"is rank 1's trace file in --trace {tmp_path / 't'}", no_launch)
    assert not (tmp_path / "t").exists()


def test_the_profiles_command_and_a_trace_folder_name_what_the_user_typed(no_launch):
    _refused(["profiles", "nope"], "sinkprof profiles 'nope' is unknown", no_launch)
    _refused(["bench", "--trace", "-"], "--trace '-': name a folder (the files written into it cannot go to stdout)",
             no_launch)
