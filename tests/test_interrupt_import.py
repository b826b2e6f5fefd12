"""A Ctrl-C while the command line loads (torch's import: seconds) ends the command as one while it
runs does: exit 130 and the one line ``sinkprof: stopped by SIGINT``, never a traceback. That needs
``import sinkprof`` to import nothing heavy, so the entry's handling is set before torch loads, and
the entry to end the command itself rather than trust a KeyboardInterrupt through torch's import
(sinkprof/__main__.py). The SIGINT comes at fixed moments and at moments read from the process's
mapped libraries (/proc/PID/maps): inside torch's import, and inside the import of numpy under it,
where a KeyboardInterrupt became an ImportError traceback; and, once the command line has loaded,
while typer parses it."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["check", "--device", "cpu", "--seq-len", "64", "--heads", "2", "--head-dim", "8"]

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")


def _console_script() -> str:
    """What pip writes for the ``sinkprof`` entry of pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["sinkprof"]
    module, _, function = entry.partition(":")
    return f"import sys\nfrom {module} import {function}\nsys.argv[0] = 'sinkprof'\nsys.exit({function}())\n"


def _mapped(pid: int, library: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return library in f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _sigint_as_at_a_terminal() -> None:
    """SIGINT's default action in the command: a shell starts a background job (``pytest &``, as a
    CI runner may) with SIGINT ignored, its children inherit that, and Python then keeps it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupted(command: list, args: list, moment, delay: float = 0.0) -> None:
    """Start the CLI, send it SIGINT ``delay`` seconds after ``moment`` (seconds from the start, or
    the name of a library: once it is mapped), and check that it ended as a Ctrl-C does."""
    proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_sigint_as_at_a_terminal)
    try:
        if isinstance(moment, float):
            time.sleep(moment)
        else:
            deadline = time.monotonic() + 60
            while not _mapped(proc.pid, moment) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            assert proc.poll() is None and _mapped(proc.pid, moment), f"{moment} was never mapped"
        time.sleep(delay)
        assert proc.poll() is None, "the command ended before the SIGINT"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)   # a lost Ctrl-C runs the command to the end: exit 0
    finally:
        proc.kill()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines() == ["sinkprof: stopped by SIGINT"], (proc.returncode, err)
    assert proc.returncode == 130, (proc.returncode, err)
    assert out == ""


@pytest.mark.parametrize("entry,when", [
    ("-m", 0.1), ("-m", 0.3), ("-m", 0.5), ("-m", 0.7),
    ("-m", "libtorch_cpu"),         # torch's import has loaded its C++ library
    ("-m", "_multiarray_umath"),    # torch's import is importing numpy
    ("script", 0.3), ("script", "libtorch_cpu"),
])
def test_ctrl_c_while_the_command_line_loads_is_one_line_and_exit_130(entry, when):
    if when == "_multiarray_umath":
        pytest.importorskip("numpy")
    command = [sys.executable, "-m", "sinkprof"] if entry == "-m" else [sys.executable, "-c", _console_script()]
    _interrupted(command, ARGS, when)


# A command that runs seconds in this process after typer parses it (no ranks): a SIGINT at any of
# the delays below comes while typer parses the command line or while the command runs.
IN_PROCESS = ["emulate", "--cp", "2,4,8", "--seq-len", "128"]


@pytest.mark.parametrize("entry,delay", [
    ("-m", 0.0), ("-m", 0.01), ("-m", 0.03), ("-m", 0.06), ("-m", 0.1), ("-m", 0.2), ("-m", 0.4),
    ("script", 0.0), ("script", 0.06),
])
def test_ctrl_c_while_typer_parses_the_command_line_is_one_line_and_exit_130(entry, delay):
    """After the imports, typer parses the command line (and imports pydantic for it: its library
    being mapped is the moment the delays count from) before the command runs; it took the
    KeyboardInterrupt there for an exit 130 without a word (and once the interpreter ended by SIGINT,
    -2). The entry's handling now lasts until the command's own begins (``errors.take_ctrl_c``)."""
    pytest.importorskip("pydantic_core")
    command = [sys.executable, "-m", "sinkprof"] if entry == "-m" else [sys.executable, "-c", _console_script()]
    _interrupted(command, IN_PROCESS, "_pydantic_core", delay)


# ``python -m`` of this module: the ``profiles`` command meets a Ctrl-C inside a string ``exec``
# (dataclasses, namedtuple and typing build their code so), and handles it as any other.
STOPPED_IN_EXEC = """
import sys
import sinkprof.tool.profiles
from sinkprof.__main__ import main


def show(name, output):
    exec("raise KeyboardInterrupt", {})


sinkprof.tool.profiles.show = show
sys.argv = ["sinkprof", "profiles"]
main()
"""


def test_a_ctrl_c_that_ended_a_string_exec_is_exit_130_under_python_m(tmp_path):
    """The command said its line and exited 130, and the interpreter ended by SIGINT (-2) anyway:
    CPython's ``Py_RunMain`` (``python -m``) checks a flag that a KeyboardInterrupt ending any
    string ``exec`` sets, caught or not. Seen once in ~40 Ctrl-Cs of ``python -m sinkprof emulate``."""
    (tmp_path / "stopped_in_exec.py").write_text(STOPPED_IN_EXEC)
    res = subprocess.run([sys.executable, "-m", "stopped_in_exec"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert res.stderr.strip().splitlines() == ["sinkprof: stopped by SIGINT"], res.stderr
    assert res.returncode == 130, (res.returncode, res.stderr)


SETTLES = """
import sys
import sinkprof
assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")], "import sinkprof imported torch"
assert [m for m in sys.modules if m.startswith("sinkprof")] == ["sinkprof"], sorted(sys.modules)
settled = []
original = sinkprof._settle
sinkprof._settle = lambda: settled.append(1) or original()
import torch
assert settled == [1], "importing torch after sinkprof did not settle the vector math (sinkprof/cpu_math.py)"
assert torch.__loader__ is torch.__spec__.loader and type(torch.__loader__).__module__ != "sinkprof"
assert not [f for f in sys.meta_path if type(f).__module__ == "sinkprof"], sys.meta_path
from sinkprof import cp_attention, shard
assert sinkprof.cp_attention is cp_attention and sinkprof.shard is shard and settled == [1]
assert set(sinkprof.__all__) <= set(dir(sinkprof))
print("ok")
"""


def test_import_sinkprof_is_light_and_torch_is_settled_when_it_comes():
    """``import sinkprof`` imports no torch and no submodule; the torch imported after it is
    settled once (what ``import sinkprof`` did before it was light), and the public names load."""
    res = subprocess.run([sys.executable, "-c", SETTLES], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["ok"], res.stderr
