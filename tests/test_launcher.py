"""The self-launched ranks stay local, stop with their parent, and agree on the configuration."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _listening(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that these processes hold (/proc/net)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except (FileNotFoundError, PermissionError):
            continue
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:      # 0A: LISTEN
                    addr = bytes.fromhex(cols[1].split(":")[0])
                    words = b"".join(addr[i:i + 4][::-1] for i in range(0, len(addr), 4))
                    found.append(socket.inet_ntop(family, words))
    return found


def _reap(proc, ranks) -> None:
    """Kill a test's launcher and whatever of its ranks is left."""
    proc.kill()
    for r in ranks:
        if _alive(r):
            os.kill(r, signal.SIGKILL)


def _start_stalled_run(extra=()):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sinkprof", "check", "--softmax", "learnable", "--mask", "causal",
                             "--dtype", "fp64", "--inject", "stall", "--timeout", "60", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    ranks, sockets = [], []
    while time.monotonic() < deadline:       # wait until both ranks hold their gloo sockets
        ranks = [c for c in _children(proc.pid) if "resource_tracker" not in open(f"/proc/{c}/cmdline").read()]
        sockets = _listening(ranks)
        if len(ranks) == 2 and len(sockets) >= 2:
            break
        time.sleep(0.2)
    assert len(ranks) == 2, "the ranks did not start"
    time.sleep(1.0)
    return proc, ranks, _listening(ranks)


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_ranks_listen_on_loopback_only_and_stop_with_a_signal_to_the_parent(signum, code):
    proc, ranks, sockets = _start_stalled_run()
    try:
        assert sockets and all(a in ("127.0.0.1", "::1") for a in sockets), sockets
        start = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=20)
        assert time.monotonic() - start < 8
        assert proc.returncode == code, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err
        assert f"stopped by {signal.Signals(signum).name}" in err
        time.sleep(0.5)
        assert not any(_alive(r) for r in ranks)
    finally:
        _reap(proc, ranks)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_run_stopped_by_a_signal_reports_the_cases_it_finished_and_names_the_signal(signum):
    """The parent passes its signal on to the ranks; rank 0, stuck in the p2p case's exchange,
    reports the a2a case before it (no ring: it finishes) and where it was stopped, by which signal
    (after a Ctrl-C it said SIGTERM), and the run ends 128 + the signal."""
    proc, ranks, _ = _start_stalled_run(extra=("--comm", "a2a,p2p", "--format", "json"))
    try:
        time.sleep(2.0)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 128 + signum, err
        doc = json.loads(out)
        assert doc["passed"] is False and f"stopped by {signum.name}" in doc["stopped"]["reason"]
        assert (doc["stopped"]["number"], doc["stopped"]["of"]) == (len(doc["cases"]) + 1, 2)
        assert all(c["comm"] == "a2a" and c["passed"] for c in doc["cases"])
        assert "Traceback" not in err
    finally:
        _reap(proc, ranks)


def test_under_torchrun_a_sigterm_leaves_the_report_of_the_cases_it_finished(tmp_path):
    """torchrun forwards its SIGTERM to the workers (a scheduler's stop, Ctrl-C's cousin); rank 0,
    stuck in the p2p case's exchange, still writes the a2a case and where the run stopped."""
    script = shutil.which("sinkprof") or str(Path(sys.executable).parent / "sinkprof")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "check.json"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--no-python", script, "check", "--comm", "a2a,p2p", "--softmax", "learnable", "--mask",
                             "causal", "--dtype", "fp64", "--inject", "stall", "--timeout", "60", "--format", "json",
                             "--output", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ranks = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:       # the workers hold their gloo sockets: the a2a case runs
            ranks = [c for c in _children(proc.pid) if "sinkprof" in open(f"/proc/{c}/cmdline").read()]
            if len(ranks) == 2 and len(_listening(ranks)) >= 2:
                break
            time.sleep(0.2)
        assert len(ranks) == 2, "the workers did not start"
        time.sleep(3.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0
        doc = json.loads(out.read_text())
        assert doc["passed"] is False and "stopped by SIGTERM" in doc["stopped"]["reason"], doc["stopped"]
        assert (doc["stopped"]["number"], doc["stopped"]["of"]) == (len(doc["cases"]) + 1, 2)
        assert all(c["comm"] == "a2a" and c["passed"] for c in doc["cases"])
    finally:
        _reap(proc, ranks)


def test_ranks_whose_parent_died_exit_on_their_own():
    proc, ranks, _ = _start_stalled_run()
    try:
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(r) for r in ranks):
            time.sleep(0.2)
        assert not any(_alive(r) for r in ranks)
    finally:
        _reap(proc, ranks)


def test_the_watchdog_reports_a_rank_stuck_in_the_forward_ring_there(cli):
    res = cli("check", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--inject", "stall",
              "--timeout", "60", "--run-timeout", "4", timeout=120)
    assert res.returncode == 1
    line = next(l for l in res.stderr.splitlines() if "rank 1: run timed out" in l)
    assert "fwd" in line and "setup" not in line and "reference" not in line
    # before: "fwd step 0, the check that every rank passed the same arguments", the last exchange it made
    assert line.endswith("fwd step 0, the injected stall"), line


def test_bench_names_where_a_rank_hangs_not_where_it_last_exchanged(cli, tmp_path):
    """Before: "hung at ... bwd step 1, dkv exchange", left from the iteration before the stall."""
    res = cli("bench", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--inject", "stall",
              "--timeout", "60", "--run-timeout", "6", "--iters", "3", "--warmup", "1", "--csv", str(tmp_path / "b.csv"),
              timeout=120)
    assert res.returncode == 1
    line = next(l for l in res.stderr.splitlines() if "rank 1: run timed out" in l)
    assert line.endswith("fwd step 0, the injected stall"), line


def test_ranks_started_with_different_options_stop_with_exit_2_naming_the_option():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, softmax in ((0, "off-by-one"), (1, "vanilla")):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "sinkprof", "check", "--softmax", softmax, "--dtype",
                                       "bf16", "--mask", "causal", "--timeout", "30", "--format", "json"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 2, err
        assert "--softmax" in err and "'vanilla'" in err and "'off-by-one'" in err, err
        assert "Traceback" not in err
        assert '"passed"' not in out


def test_ctrl_c_while_the_ranks_import_torch_is_exit_130_without_a_traceback():
    """A Ctrl-C (SIGINT to the whole process group) while the spawned ranks start used to print
    each rank's KeyboardInterrupt traceback; the ranks now start with it blocked until they handle
    it, and the parent stops them."""
    proc = subprocess.Popen([sys.executable, "-m", "sinkprof", "check", "--seq-len", "64", "--heads", "2",
                             "--head-dim", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ranks = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ranks:
            ranks = [c for c in _children(proc.pid) if "resource_tracker" not in open(f"/proc/{c}/cmdline").read()]
            time.sleep(0.02)
        assert ranks, "the ranks did not start"
        time.sleep(0.3)                        # importing torch
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert err.strip().splitlines()[-1].startswith("sinkprof: stopped by SIGINT"), err
    finally:
        _reap(proc, ranks)


_SIGNAL_DURING_START = """
import multiprocessing.context, os, signal, sys
start = multiprocessing.context.SpawnProcess.start
def start_under_a_ctrl_c(self):
    rank = self._args[0]
    os.kill({target}, signal.{signum})   # the Ctrl-C comes in the moment a rank starts
    start(self)
    {after}
multiprocessing.context.SpawnProcess.start = start_under_a_ctrl_c
sys.argv = ["sinkprof", "check", "--seq-len", "64", "--heads", "2", "--head-dim", "8", "--format", "json"]
from sinkprof.__main__ import main
main()
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_ctrl_c_in_the_moment_a_rank_starts_stops_the_run(signum):
    """A SIGINT was lost: the parent ignored it while it started a rank (so that the rank inherits
    the ignoring) and the run went on to exit 0. A SIGTERM stopped the run in the middle of the
    start, leaving a rank with no pid, which read half a message and printed a traceback."""
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_DURING_START.format(target="os.getpid()", after="",
                                                                             signum=signum.name)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signum, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"sinkprof: stopped by {signum.name}; ended rank(s) 0", proc.stderr


def test_a_ctrl_c_to_a_rank_while_it_starts_ends_it_with_its_last_words():
    """A rank starts with SIGINT blocked: a SIGINT that reaches it before it handles
    signals waits (no traceback from its imports), then ends it with exit 130; the parent names the
    signal and stops the run with exit 1. It was lost, and the run went on to exit 0."""
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_DURING_START.format(
        target="os.getpid()", signum="SIGINT", after="rank == 1 and os.kill(self.pid, signal.SIGINT)   # rank 1").replace(
        "os.kill(os.getpid(), signal.SIGINT)   # the Ctrl-C comes in the moment a rank starts", "pass")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert "rank 1 was stopped by SIGINT (exit 130)" in proc.stderr, proc.stderr


def test_a_rank_that_cannot_be_started_is_one_line_and_the_started_ones_stop():
    """A fork the system refuses for rank 1 was a traceback, and rank 0, started, waited for its
    peer while the parent waited for it (a hang until the timeout)."""
    script = _SIGNAL_DURING_START.replace(
        "    os.kill({target}, signal.{signum})   # the Ctrl-C comes in the moment a rank starts\n",
        "    if rank == 1: raise OSError(11, 'Resource temporarily unavailable')\n").format(after="")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ("sinkprof: rank 1 of 2 could not be started: Resource temporarily unavailable; the ranks "
                           "started before it were stopped\n")


def test_a_signal_held_while_a_rank_failed_to_start_still_stops_the_run():
    """The SIGTERM that came during the failed start is the run's end (exit 143), not the start
    error, and rank 0, started, is stopped."""
    script = _SIGNAL_DURING_START.replace(
        "    os.kill({target}, signal.{signum})   # the Ctrl-C comes in the moment a rank starts\n",
        "    if rank == 1: os.kill(os.getpid(), signal.SIGTERM); raise OSError(11, 'Resource temporarily unavailable')\n"
    ).format(after="")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr == "sinkprof: stopped by SIGTERM; ended rank(s) 0\n"


def test_a_signal_while_the_started_ranks_are_stopped_after_a_failed_start_does_not_interrupt_it():
    """A SIGTERM during the stopping that follows a rank's failed start could raise in the middle of
    it: a traceback, and rank 0 left running while the parent waited for it at exit. The stopping
    goes on and the start error stands."""
    script = _SIGNAL_DURING_START.replace(
        "    os.kill({target}, signal.{signum})   # the Ctrl-C comes in the moment a rank starts\n",
        "    if rank == 1: raise OSError(11, 'Resource temporarily unavailable')\n"
    ).format(after="").replace("multiprocessing.context.SpawnProcess.start = start_under_a_ctrl_c", """\
multiprocessing.context.SpawnProcess.start = start_under_a_ctrl_c
join = multiprocessing.context.SpawnProcess.join
def join_under_a_sigterm(self, timeout=None):
    if not getattr(join_under_a_sigterm, "sent", False):   # the first join is the stopping's
        join_under_a_sigterm.sent = True
        os.kill(os.getpid(), signal.SIGTERM)
    return join(self, timeout)
multiprocessing.context.SpawnProcess.join = join_under_a_sigterm""")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ("sinkprof: rank 1 of 2 could not be started: Resource temporarily unavailable; the ranks "
                           "started before it were stopped\n")


def test_a_rank_started_after_the_resource_tracker_died_starts_with_sigint_blocked():
    """``proc.start()`` restarts a dead resource tracker, which unblocks SIGINT: the rank started
    then had SIGINT unblocked (a Ctrl-C while it imports torch: a KeyboardInterrupt traceback)."""
    script = _SIGNAL_DURING_START.replace(
        "    os.kill({target}, signal.{signum})   # the Ctrl-C comes in the moment a rank starts\n", ""
    ).format(after="""\
blocked = int(next(line for line in open(f"/proc/{self.pid}/status") if line.startswith("SigBlk")).split()[1], 16)
    print(f"rank {rank}: SIGINT blocked: {bool(blocked & (1 << (signal.SIGINT - 1)))}", file=sys.stderr, flush=True)
    import multiprocessing.resource_tracker as tracker
    if rank == 0:   # the tracker dies between the starts of rank 0 and rank 1
        os.kill(tracker._resource_tracker._pid, signal.SIGKILL)
        os.waitpid(tracker._resource_tracker._pid, 0)""")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: SIGINT blocked: True\n" in proc.stderr and "rank 1: SIGINT blocked: True\n" in proc.stderr, \
        proc.stderr


def test_a_rank_whose_peer_never_joins_says_so_in_one_line(tmp_path):
    """It was a ``DistStoreError: ... 1/2 clients joined`` traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    res = subprocess.run([sys.executable, "-m", "sinkprof", "check", "--seq-len", "64", "--timeout", "2"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"sinkprof: rank 0: the 2 ranks did not meet at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
                           f"within --timeout 2s (")
    assert "1/2 clients joined" in line and line.endswith("start every rank, with the same WORLD_SIZE, MASTER_ADDR "
                                                          "and MASTER_PORT")


def test_a_rank_whose_rank_0_never_starts_its_store_says_so_in_one_line_and_one_that_waits_joins():
    """Rank 1 without rank 0 printed c10d's C++ stack frames at every retry before the one line; a
    rank 1 started before rank 0 still joins it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    cmd = [sys.executable, "-m", "sinkprof", "check", "--seq-len", "32", "--heads", "2", "--head-dim", "8",
           "--softmax", "learnable", "--mask", "causal"]
    res = subprocess.run([*cmd, "--timeout", "2"], capture_output=True, text=True, env={**env, "RANK": "1"},
                         timeout=120)
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"sinkprof: rank 1: the 2 ranks did not meet at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} within --timeout "
        f"2s (no store answered there, last connection refused: rank 0 never started it, or this host cannot reach "
        f"MASTER_ADDR); start every rank, with the same WORLD_SIZE, MASTER_ADDR and MASTER_PORT"]
    res = subprocess.run([*cmd, "--timeout", "2"], capture_output=True, text=True, timeout=120,
                         env={**env, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert res.returncode == 1 and "last connection refused: torchrun's agent never started it" in res.stderr
    late = subprocess.Popen([*cmd, "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "RANK": "1"})
    try:
        time.sleep(3)   # rank 1 waits for the store
        first = subprocess.run([*cmd, "--timeout", "60"], capture_output=True, text=True, env={**env, "RANK": "0"},
                               timeout=120)
        _, err = late.communicate(timeout=120)
    finally:
        late.kill()
    assert (first.returncode, late.returncode, err) == (0, 0, ""), first.stderr + err
    assert "2 passed, 0 failed" in first.stdout   # fp64 and bf16


def _run_into(stdout, *args):
    return subprocess.run([sys.executable, "-m", "sinkprof", "check", "--seq-len", "64", "--heads", "2", "--head-dim",
                           "8", *args], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=180)


def test_a_result_that_cannot_be_written_is_one_line_from_rank_0_and_nothing_from_rank_1(tmp_path):
    """Rank 1, waiting in the last barrier for rank 0, printed 'Process SpawnProcess-2: Traceback
    ... Connection closed by peer' after rank 0's one line."""
    res = _run_into(subprocess.PIPE, "--output", "/dev/full")
    assert (res.returncode, res.stderr.strip()) == (1, "sinkprof: cannot write /dev/full: No space left on device")
    with open("/dev/full", "w") as full:
        res = _run_into(full, "--format", "json")
    assert (res.returncode, res.stderr.strip()) == (1, "sinkprof: write error: No space left on device")


@pytest.mark.parametrize("args", [["check", "--format", "table"], ["check", "--format", "json"],
                                  ["bench", "--iters", "3", "--warmup", "0", "--csv", "-"]])
def test_a_closed_pipe_ends_the_run_quietly(args):
    """``check | head -1``: as Python advises for a reader that went away, exit 1 and nothing said.
    bench streams its CSV while the ranks run: before, rank 0 said "writing the CSV None failed:
    Broken pipe" and rank 1 blamed an exchange that failed or hung."""
    proc = subprocess.Popen([sys.executable, "-m", "sinkprof", *args, "--seq-len", "64", "--heads", "2",
                             "--head-dim", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert (proc.wait(timeout=180), err) == (1, "")


def test_the_longest_timeouts_run():
    """A year is the longest --timeout and --run-timeout: datetime.timedelta and gloo hold it (1e10
    failed every exchange at once; inf was an OverflowError)."""
    res = _run_into(subprocess.PIPE, "--timeout", "31536000", "--run-timeout", "31536000", "--softmax", "learnable",
                    "--mask", "causal", "--dtype", "fp64")
    assert res.returncode == 0, res.stderr


def test_a_ranks_run_timeout_is_what_its_peers_report_not_their_broken_exchange(tmp_path, monkeypatch):
    """The watchdog of the rank that started first ends it first; its peer's exchange with it then
    fails at once, and rank 0 reported that ("reference dk sum failed or hung (timeout 120s) ...
    Connection reset by peer") as why the run stopped. The watchdog leaves a marker its peers read."""
    from sinkprof.tool import launcher
    store = tmp_path / "store"
    script = ("import time; from sinkprof.tool.launcher import Watchdog; from sinkprof.dist import where\n"
              "where.case, where.phase, where.step, where.op = 'c', 'fwd', 2, 'kv exchange'\n"
              "Watchdog(0.2, rank=1); time.sleep(30)")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, launcher.STORE_ENV: str(store)})
    assert res.returncode == 1 and "rank 1: run timed out after 0.2s" in res.stderr
    assert launcher.run_timed_out() is None   # no store named here: none
    monkeypatch.setenv(launcher.STORE_ENV, str(store))
    assert launcher.run_timed_out() == ("the run timed out after 0.2s, hung at case c, fwd step 2, kv exchange on "
                                        "rank 1 (--run-timeout)")
