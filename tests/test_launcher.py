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
        proc.kill()
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)


def test_a_run_stopped_by_sigterm_reports_the_cases_it_finished():
    """The parent's SIGTERM reaches the ranks; rank 0, stuck in the p2p case's exchange, reports
    the a2a case before it (no ring: it finishes) and where it was stopped, and the run ends 143."""
    proc, ranks, _ = _start_stalled_run(extra=("--comm", "a2a,p2p", "--format", "json"))
    try:
        time.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 143, err
        doc = json.loads(out)
        assert doc["passed"] is False and "stopped by SIGTERM" in doc["stopped"]["reason"]
        assert (doc["stopped"]["number"], doc["stopped"]["of"]) == (len(doc["cases"]) + 1, 2)
        assert all(c["comm"] == "a2a" and c["passed"] for c in doc["cases"])
        assert "Traceback" not in err
    finally:
        proc.kill()
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)


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
        proc.kill()
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)


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
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)


def test_the_watchdog_reports_a_rank_stuck_in_the_forward_ring_there(cli):
    res = cli("check", "--softmax", "learnable", "--mask", "causal", "--dtype", "fp64", "--inject", "stall",
              "--timeout", "60", "--run-timeout", "4", timeout=120)
    assert res.returncode == 1
    line = next(l for l in res.stderr.splitlines() if "rank 1: run timed out" in l)
    assert "fwd" in line and "setup" not in line and "reference" not in line


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
