"""The one output path: symlinks, devices and FIFOs, the umask, ``-``, ``FILE.partial``."""
import contextlib
import csv
import errno
import io
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sinkprof.cli import app
from sinkprof.tool.output import CsvStream, Format, Output, OutputError, check_folder, check_writable, write_text

COLUMNS = ["a", "b"]


def test_writing_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path):
    real = tmp_path / "real" / "out.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    assert not list(tmp_path.glob(".*tmp*")) and not list(real.parent.glob(".*tmp*"))


def test_a_fifo_is_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    write_text(fifo, "through the pipe")
    reader.join(10)
    assert got == ["through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_dev_null_stays_a_device():
    write_text("/dev/null", "discarded")
    stream = CsvStream("/dev/null", COLUMNS)
    stream.append([{"a": 1, "b": 2}])
    stream.close()
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert not os.path.exists("/dev/null.partial")


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_files_honour_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_text(tmp_path / "out.json", "{}")
        stream = CsvStream(tmp_path / "rows.csv", COLUMNS)
        assert stat.S_IMODE(os.stat(stream.partial).st_mode) == mode
        stream.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out.json").st_mode) == mode
    assert stat.S_IMODE(os.stat(tmp_path / "rows.csv").st_mode) == mode


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664])
def test_a_file_replaced_keeps_its_mode(tmp_path, mode):
    """Before: the CSV took the umask's mode (0644) where the file it replaced had 0600."""
    for path in (tmp_path / "rows.csv", tmp_path / "out.json"):
        path.write_text("old")
        path.chmod(mode)
    stream = CsvStream(tmp_path / "rows.csv", COLUMNS)
    stream.append([{"a": 1, "b": 2}])
    stream.close()
    write_text(tmp_path / "out.json", "{}")
    for path in (tmp_path / "rows.csv", tmp_path / "out.json"):
        assert stat.S_IMODE(os.stat(path).st_mode) == mode, path
    assert (tmp_path / "rows.csv").read_text().splitlines() == ["a,b", "1,2"]


def test_a_folder_is_no_device_to_write_in_place(tmp_path):
    """A writer given a folder's name writes a temp file whose rename over the folder fails (before:
    the folder was handed to the writer as a device is, and torch's profiler, which renames a
    file of its own over the name, left its trace beside it and went on)."""
    from sinkprof.tool.output import atomic_path
    folder = tmp_path / "rank1.json"
    folder.mkdir()
    with pytest.raises(IsADirectoryError):
        with atomic_path(folder) as tmp:
            assert tmp != folder and tmp.parent == tmp_path
            tmp.write_text("{}")
    assert folder.is_dir() and not list(folder.iterdir()) and not list(tmp_path.glob(".*tmp*"))
    with pytest.raises(OutputError, match="rank1.json: Is a directory"):
        write_text(folder, "{}")


def test_a_cut_from_another_thread_leaves_whole_rows_whatever_the_writer_still_has_buffered(tmp_path):
    """A run a signal ends cuts FILE.partial back to its last whole row from the signal's thread
    while the main thread may hold rows in its buffer: flushed after a cut by path alone, they
    landed past the new end, behind a run of zero bytes."""
    stream = CsvStream(tmp_path / "rows.csv", COLUMNS)
    stream.append([{"a": 1, "b": 2}])
    stream._csv.writerows([{"a": "x" * 50, "b": "y" * 50}] * 200)   # a write in flight: buffered, not flushed
    cut = threading.Thread(target=stream.cut_to_whole)
    cut.start()
    cut.join(10)
    with contextlib.suppress(OSError):
        stream._file.flush()
    data = (tmp_path / "rows.csv.partial").read_bytes()
    assert data == b"a,b\r\n1,2\r\n"


def test_a_fifo_whose_reader_went_away_is_named_with_the_reason(tmp_path):
    """Before: "writing the CSV .../rows.fifo failed: " with the reason left out."""
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: open(fifo, "rb").close())
    reader.start()
    stream = CsvStream(fifo, COLUMNS)
    reader.join(10)
    with pytest.raises(OutputError, match=f"writing the CSV {fifo} failed: Broken pipe"):
        for _ in range(100):
            stream.append([{"a": "x" * 1000, "b": 2}])


def test_dash_is_stdout(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Output(Format.JSON, "-").emit(doc={"x": 1})
    stream = CsvStream("-", COLUMNS)
    stream.append([{"a": 1, "b": 2}])
    stream.close()
    out = capsys.readouterr().out
    assert '"x": 1' in out and "a,b\n1,2" in out.replace("\r\n", "\n")
    res = CliRunner().invoke(app, ["emulate", "--cp", "2", "--format", "json", "-o", "-"])
    assert res.exit_code == 0 and '"passed": true' in res.stdout
    assert not (tmp_path / "-").exists() and not list(tmp_path.iterdir())


def test_a_planted_partial_symlink_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "bench.csv"
    Path(str(out) + ".partial").symlink_to(victim)
    stream = CsvStream(out, COLUMNS)
    stream.append([{"a": 1, "b": 2}])
    stream.close()
    assert victim.read_text() == "precious"
    assert out.read_text().splitlines() == ["a,b", "1,2"]
    assert Path(str(out) + ".partial.1").is_symlink()


def test_an_earlier_runs_partial_rows_are_kept(tmp_path):
    out = tmp_path / "bench.csv"
    Path(str(out) + ".partial").write_text("a,b\n7,8\n")
    Path(str(out) + ".partial.1").write_text("a,b\n5,6\n")
    stream = CsvStream(out, COLUMNS)
    assert stream.kept == Path(str(out) + ".partial.2")
    stream.append([{"a": 1, "b": 2}])
    stream.close()
    assert Path(str(out) + ".partial.2").read_text() == "a,b\n7,8\n"
    assert Path(str(out) + ".partial.1").read_text() == "a,b\n5,6\n"


def test_a_removed_folder_stops_the_writes_at_once_with_the_rows_so_far(tmp_path):
    folder = tmp_path / "results"
    stream = CsvStream(folder / "bench.csv", COLUMNS)
    stream.append([{"a": 1, "b": 2}])
    shutil.rmtree(folder)
    with pytest.raises(OutputError, match="removed.*2 row.*bench.csv.partial"):
        stream.append([{"a": 3, "b": 4}])
    rows = list(csv.DictReader(io.StringIO((folder / "bench.csv.partial").read_text())))
    assert [r["a"] for r in rows] == ["1", "3"]


def test_a_failed_whole_write_names_the_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="cannot write"):
        write_text(tmp_path / "file" / "sub" / "out.json", "{}")


EMULATE = [sys.executable, "-m", "sinkprof", "emulate", "--cp", "2", "--mask", "causal", "--strategy", "step0",
           "--format", "json"]


def _shell(args: list, redirect: str = "", **kwargs) -> subprocess.CompletedProcess:
    """``args`` run by the shell with ``redirect`` (``3>FILE``) after them: the descriptors the
    command gets are those the redirect names, whatever pytest holds open."""
    return subprocess.run(" ".join(map(shlex.quote, map(str, args))) + " " + redirect, shell=True, text=True,
                          capture_output=True, timeout=120, **kwargs)


def test_dev_stdout_is_stdout_and_other_descriptors_are_refused(tmp_path):
    """/dev/stdout resolves to pipe:[N] for a pipe and to the file for a redirect: it is taken as
    ``-`` (the result alone on stdout). Another descriptor of this process, open (``3>FILE``) or
    closed, is refused, each with what it is (emulate has no ranks: the message says nothing of
    them), and a closed stdout's name would be replaced by a file: all exit 2."""
    piped = subprocess.run(EMULATE + ["--output", "/dev/stdout"], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["passed"] is True
    out = tmp_path / "out.json"
    with open(out, "w") as f:
        res = subprocess.run(EMULATE + ["--output", "/dev/stdout"], stdout=f, stderr=subprocess.PIPE, text=True,
                             timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["passed"] is True
    three = tmp_path / "three.json"
    res = _shell(EMULATE + ["--output", "/dev/fd/3"], f"3>{shlex.quote(str(three))}")
    said = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stderr
    assert "--output /dev/fd/3: names file descriptor 3, not a file" in said and f"({three})" in said, said
    assert "ranks" not in said and "closed" not in said and three.read_text() == ""
    res = _shell(EMULATE + ["--output", "/dev/fd/3"], "3>&-")
    assert res.returncode == 2 and "--output /dev/fd/3: names file descriptor 3, which is closed" in res.stderr, \
        res.stderr
    link = tmp_path / "stdout-link"
    link.symlink_to("/proc/self/fd/1")
    res = _shell(EMULATE + ["--output", link], ">&-")
    assert res.returncode == 2 and link.is_symlink(), res.stderr


def test_a_descriptor_of_another_process_is_named_as_such(tmp_path):
    """``/proc/PID/fd/1`` of another process is neither this process's descriptor nor a closed one
    (it said both, by turns)."""
    other = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL)
    try:
        res = _shell(EMULATE + ["--output", f"/proc/{other.pid}/fd/1"])
    finally:
        other.kill()
        other.wait()
    said = " ".join(res.stderr.split())
    assert res.returncode == 2, said
    assert f"--output /proc/{other.pid}/fd/1: names file descriptor 1 of another process (pid {other.pid})" in said
    assert "this process" not in said and "closed" not in said


def test_a_threads_descriptor_names_are_descriptor_names(tmp_path):
    """``/proc/thread-self/fd/1`` and ``/proc/PID/task/TID/fd/1`` are stdout as ``/dev/stdout`` is
    (they were taken as a folder to write a file named ``pipe:[N]`` into)."""
    res = _shell(EMULATE + ["--output", "/proc/thread-self/fd/1"])
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["passed"] is True
    res = _shell(EMULATE + ["--output", "/proc/thread-self/fd/3"], f"3>{tmp_path / 'f'}")
    assert res.returncode == 2 and "names file descriptor 3, not a file" in res.stderr, res.stderr
    with pytest.raises(ValueError, match=r"--plot /proc/\d+/task/\d+/fd/1: names a file descriptor; name a folder"):
        check_folder(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/fd/1", "--plot")


def test_a_link_that_cannot_be_read_is_a_usage_error_naming_the_option(tmp_path, monkeypatch):
    """``/proc/1/cwd`` of another user's process: os.readlink raises EACCES (it was a traceback)."""
    link = tmp_path / "guarded"
    link.symlink_to(tmp_path / "elsewhere")
    real_readlink = os.readlink

    def denied(path, *args, **kwargs):
        if str(path) == str(link):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_readlink(path, *args, **kwargs)
    monkeypatch.setattr(os, "readlink", denied)
    for args, option in ((["emulate", "--cp", "2", "-o", str(link)], "--output"),
                         (["report", str(tmp_path / "in.csv"), "--html", str(link)], "--html"),
                         (["report", str(tmp_path / "in.csv"), "--plot", str(link)], "--plot")):
        res = CliRunner().invoke(app, args)
        said = " ".join(res.stderr.split())
        assert res.exit_code == 2, said
        assert f"{option} {link}: the link {link} cannot be followed (Permission denied); choose another path" in said


@pytest.mark.skipif(os.access("/proc/1/cwd", os.R_OK) or not os.path.islink("/proc/1/cwd"),
                    reason="/proc/1/cwd can be read here")
def test_proc_1_cwd_is_refused_naming_the_option():
    res = _shell(EMULATE + ["--output", "/proc/1/cwd"])
    assert res.returncode == 2 and "--output /proc/1/cwd: the link /proc/1/cwd cannot be followed" in res.stderr, \
        res.stderr


def test_a_long_name_that_fits_is_written_and_one_whose_partial_does_not_is_refused(tmp_path):
    """The temp file of a whole write has a bounded name (a 252-byte name failed after the run, its
    temp name was 266 bytes); ``FILE.partial`` of a CSV stream must fit too, checked before."""
    name = tmp_path / ("a" * 247 + ".json")
    res = _shell(EMULATE + ["--output", name])
    assert res.returncode == 0, res.stderr
    assert json.loads(name.read_text())["passed"] is True
    csv_name = str(tmp_path / ("a" * 248 + ".csv"))
    check_writable(csv_name, "--csv")   # the file alone fits
    with pytest.raises(ValueError, match=r"--csv .*a\.csv: the run writes it first as '\.partial' beside it, a name "
                                         r"of 260 bytes, more than the 255 .* at most 247 bytes"):
        check_writable(csv_name, "--csv", partial=True)
    short = str(tmp_path / ("b" * 246 + ".csv"))   # 250 + .partial = 258: refused too
    with pytest.raises(ValueError, match="at most 247 bytes"):
        check_writable(short, "--csv", partial=True)
    fits = str(tmp_path / ("c" * 243 + ".csv"))    # 247 + .partial = 255: fits
    check_writable(fits, "--csv", partial=True)
    Path(fits + ".partial").write_text("an earlier run's rows")   # then moved to FILE.partial.1: 257
    with pytest.raises(ValueError, match=r"as '\.partial\.1' beside it"):
        check_writable(fits, "--csv", partial=True)


@pytest.mark.parametrize("check", [check_writable, check_folder])
def test_paths_the_system_refuses_are_usage_errors_naming_the_option(tmp_path, check):
    loop_a, loop_b = tmp_path / "a", tmp_path / "b"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    for path, says in ((loop_a, "a loop of symbolic links"), (tmp_path / ("x" * 300), "File name too long"),
                       ("", "--out ''")):
        with pytest.raises(ValueError, match="--out") as err:
            check(str(path), "--out")
        assert says in str(err.value)
    assert loop_a.is_symlink() and loop_b.is_symlink()


def test_a_disk_full_keeps_the_rows_written_before_and_says_where(tmp_path, monkeypatch):
    """When the rows cannot be written again either, FILE.partial is cut back to its last whole row
    and the message says how many it holds (it used to point at an empty FILE.partial beside a
    FILE.partial.1)."""
    stream = CsvStream(tmp_path / "bench.csv", COLUMNS)
    stream.append([{"a": 1, "b": 2}])

    def full(*args, **kwargs):   # half a row got out before the disk filled
        stream._file.write("3,")
        stream._file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(stream._csv, "writerows", full)
    def still_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("sinkprof.tool.output.atomic_path", still_full)
    with pytest.raises(OutputError, match="No space left.*bench.csv.partial holds the 1 row.s. written before"):
        stream.append([{"a": 3, "b": 4}])
    text = (tmp_path / "bench.csv.partial").read_text()
    assert text == "a,b\n1,2\n" and not list(tmp_path.glob("*.partial.*"))


def test_json_is_strict_with_non_finite_numbers_as_strings(tmp_path):
    path = tmp_path / "doc.json"
    Output(Format.JSON, str(path)).emit(doc={"worst": float("inf"), "errs": [float("-inf"), float("nan"), 1.5]})
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text) == {"worst": "inf", "errs": ["-inf", "nan", 1.5]}


def test_checking_a_path_makes_no_folder_and_the_write_makes_them(tmp_path):
    """A run refused after its paths were checked leaves nothing behind."""
    path = tmp_path / "a" / "b" / "out.json"
    check_writable(str(path), "--output")
    check_folder(str(tmp_path / "plots" / "deep"), "--plot")
    assert sorted(tmp_path.iterdir()) == []
    write_text(path, "{}")
    assert path.read_text() == "{}"


def test_a_path_ending_in_a_slash_that_is_no_folder_is_refused_and_nothing_is_made(tmp_path):
    """``notyet/`` names a folder: a shell's > and open() refuse it; it is not written as a file."""
    with pytest.raises(ValueError, match=r"--output .*notyet/: the name of a folder \(it ends in '/'\), and .* is no "
                                         r"folder; name a file"):
        check_writable(f"{tmp_path}/notyet/", "--output")
    with pytest.raises(ValueError, match=r"the name of a folder \(it ends in '/\.'\)"):
        check_writable(f"{tmp_path}/notyet/.", "--output")
    (tmp_path / "file.json").write_text("kept")
    with pytest.raises(ValueError, match=r"file.json is a file; name a file"):
        check_writable(f"{tmp_path}/file.json/", "--output")
    res = CliRunner().invoke(app, ["check", "--ranks", "1", "--seq-len", "16", "--heads", "2", "--kv-heads", "1",
                                   "--head-dim", "8", "--format", "json", "-o", f"{tmp_path}/notyet/"])
    assert res.exit_code == 2 and "the name of a folder" in res.output, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.json"] and (tmp_path / "file.json").read_text() == "kept"


def test_a_write_protected_file_is_refused_and_kept(tmp_path, monkeypatch):
    """The result replaces a file by a rename, which the file's own mode does not stop: a file the
    user may not write is refused first (as for a user without root's override; the tests may run
    as root, so the permission is what ``os.access`` answers)."""
    kept = tmp_path / "ro.json"
    kept.write_text("protected")
    kept.chmod(0o444)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == kept and mode & os.W_OK
                        else real_access(p, mode, **kw))
    with pytest.raises(ValueError, match=r"--output .*ro.json: cannot be written \(permission denied\)"):
        check_writable(str(kept), "--output")
    link = tmp_path / "link.json"
    link.symlink_to(kept)
    with pytest.raises(ValueError, match="permission denied"):
        check_writable(str(link), "--csv")
    assert kept.read_text() == "protected"


def test_a_dotdot_after_a_missing_folder_or_a_file_is_refused(tmp_path):
    """``missing/../out.csv``: the system (and a shell's >) finds no ``missing`` to step out of;
    realpath dropped it, and the file was written beside it."""
    (tmp_path / "file.csv").write_text("kept")
    (tmp_path / "there").mkdir()
    for first in ("missing", "file.csv"):
        with pytest.raises(ValueError, match=rf"--csv .*{first}/\.\./out.csv: .*{first} is no folder, so there is no "
                                             r"\.\. after it; name the file without it"):
            check_writable(f"{tmp_path}/{first}/../out.csv", "--csv")
    check_writable(f"{tmp_path}/there/../out.csv", "--csv")   # a folder that exists: as the system resolves it
    with pytest.raises(ValueError, match=r"--trace .*missing/\.\./traces: .*missing is no folder"):
        check_folder(f"{tmp_path}/missing/../traces", "--trace")
    check_folder(f"{tmp_path}/there/../traces", "--plot")
    res = CliRunner().invoke(app, ["check", "--ranks", "1", "--seq-len", "16", "--heads", "2", "--kv-heads", "1",
                                   "--head-dim", "8", "--format", "json", "-o", f"{tmp_path}/missing/../out.json"])
    assert res.exit_code == 2 and "is no folder, so there is no .. after it" in " ".join(res.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.csv", "there"]
