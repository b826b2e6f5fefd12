"""Named run configurations (``sinkprof/profiles/*.toml``, package data) for ``check`` and ``bench``.

A profile sets any ``check.Settings`` field at its top level; an optional ``[[cases]]`` array adds
groups that override those fields (TransformerEngine's sink tests are four such groups). Command
line options override both. The CPU default is embedded (``Settings()``), so ``sinkprof check``
needs no file.
"""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
import tomllib
from importlib import resources
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..options import CommType
from .cases import CaseOptions, Settings, check_pack_layer, expand, list_value, merge_layers
from .launcher import torchrun_env
from .output import STDOUT, Output, same_target
from .preflight import check_dist_backend

FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(Settings)}   # annotations as strings
LIST_FIELDS = {name for name, kind in FIELD_TYPES.items() if kind == "tuple"}
FIELDS = set(FIELD_TYPES)


@dataclass
class Profile:
    name: str
    path: Optional[Path]
    description: str
    settings: dict
    groups: list

    def resolve(self, overrides: dict) -> list[Settings]:
        """One ``Settings`` per group: profile, then group, then command line (``merge_layers``:
        a later ``seqlens`` replaces an earlier ``seq_len`` and ``docs``, and the other way round)."""
        check_pack_layer(self.settings, f" in profile {self.path}")
        out = []
        for i, group in enumerate(self.groups or [{}]):
            check_pack_layer(group, f" in profile {self.path} [[cases]] #{i + 1}")
            out.append(Settings(**merge_layers([self.settings, group, overrides])))
        return out


def profile_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("SINKPROF_PROFILES", "").split(os.pathsep) if p]
    dirs.append(Path(str(resources.files("sinkprof").joinpath("profiles"))))   # shipped in the wheel
    return dirs


def not_folders() -> str:
    """What the user should hear of ``SINKPROF_PROFILES`` entries that are not folders (a profile
    file named there is not read), or ""."""
    wrong = [str(d) for d in profile_dirs() if not d.is_dir()]
    return (f"SINKPROF_PROFILES names {', '.join(wrong)}, not a folder of profiles (it takes folders, separated "
            f"by {os.pathsep!r}; a profile file is run as --profile PATH)") if wrong else ""


def _expected(key: str, value) -> Optional[str]:
    """What a profile value of ``key`` must be, when ``value`` is not that; None when it is."""
    kind = FIELD_TYPES[key]
    if key in LIST_FIELDS:
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        return None if ok else 'a string or a list of strings, e.g. ["fp64", "bf16"]'
    if key == "window":
        ok = isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)
        return None if ok else "a list of two integers [LEFT, RIGHT], -1 unbounded, e.g. [128, 0]"
    if key == "seqlens":
        ok = isinstance(value, list) and value and all(type(v) is int and v >= 1 for v in value)
        return None if ok else "a list of document lengths, positive integers, e.g. [96, 160, 256]"
    if key == "docs":
        return None if type(value) is int else "an integer, the number of random documents (no quotes)"
    if kind == "bool":
        return None if isinstance(value, bool) else "a TOML boolean: true or false (no quotes)"
    if kind == "int":
        return None if type(value) is int else "an integer (no quotes, no decimal point)"
    if kind == "str":
        return None if isinstance(value, str) else "a string in quotes"
    return None


def _normalize(data: dict, where: str) -> dict:
    out = {}
    for key, value in data.items():
        if key not in FIELDS:
            raise ValueError(f"{where}: unknown setting {key!r}; known: {', '.join(sorted(FIELDS))}")
        expected = _expected(key, value)
        if expected is not None:
            raise ValueError(f"{where}: {key} = {value!r} must be {expected}")
        if key in LIST_FIELDS:   # a list, or a string as --dtype takes one ("fp64,bf16", "all")
            value = list_value(key, value)
        elif key in ("window", "seqlens") and value is not None:
            value = tuple(value)
        out[key] = value
    return out


def load(path: Path, name: Optional[str] = None) -> Profile:
    try:
        if path.exists() and not path.is_file():   # a FIFO's read would wait for a writer, a device's never end
            raise ValueError(f"profile {path}: {_kind(path)}, not a regular file; name a profile file")
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"profile {path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ValueError(f"profile {path}: invalid TOML: nested too deeply") from None
    except OSError as exc:
        raise ValueError(f"profile {path}: cannot be read ({exc.strerror or exc}); name a profile file you can "
                         f"read") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"profile {path}: cannot be read: {exc}; save it as UTF-8 text") from None
    description = data.pop("description", "")
    groups = data.pop("cases", [])
    if not isinstance(description, str):
        raise ValueError(f"profile {path}: description = {description!r} must be a string in quotes")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"profile {path}: cases must be an array of tables, [[cases]]")
    return Profile(name or path.stem, path, description, _normalize(data, f"profile {path}"),
                   [_normalize(g, f"profile {path} [[cases]] #{i + 1}") for i, g in enumerate(groups)])


def available() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in profile_dirs():
        if d.is_dir():
            for p in sorted(d.glob("*.toml")):
                found.setdefault(p.stem, p)
    return found


def find(name: Optional[str], option: str = "--profile") -> Profile:
    """A profile by name (from the profile directories) or by path; None is the embedded default.
    Errors name ``option``, the way the user gave the name."""
    if name is None:
        return Profile("cpu-default (embedded)", None, "CPU, gloo, 2 ranks: p2p x 3 softmax types x 2 masks", {}, [])
    path = locate(name, option)
    return load(path, None if _is_path(name) else name)


def _kind(path: Path) -> str:
    """What a path that is not a regular file is, in words."""
    mode = path.stat().st_mode
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device")


def _is_path(name: str) -> bool:
    return name.endswith(".toml") or os.sep in name


def locate(name: str, option: str = "--profile") -> Path:
    """The file of the profile ``name`` (a name from the profile directories, or a path), unread."""
    if _is_path(name):
        path = Path(name)
        try:
            path.stat()
        except FileNotFoundError:
            raise ValueError(f"{option} {name!r}: " + ("a symlink to no file" if path.is_symlink() else "no such file")) from None
        except OSError as exc:   # a folder that cannot be entered, a symlink loop
            raise ValueError(f"{option} {name!r}: {exc.strerror or exc}; name a profile file you can read "
                             f"(or a named profile, see sinkprof profiles)") from None
        if not path.is_file():
            raise ValueError(f"{option} {name!r}: {_kind(path)}, not a regular file; name a profile file")
        return path
    known = available()
    if name not in known:
        note = not_folders()
        hint = f"; {note}" if note else ""
        raise ValueError(f"{option} {name!r} is unknown; available: {', '.join(known) or 'none'} "
                         f"(or pass a path to a .toml file){hint}")
    return known[name]


def settings_for(options: CaseOptions, ranks: Optional[int] = None, cps: tuple = ()) -> list[Settings]:
    """The validated ``Settings`` groups of a ``check`` or ``bench`` run: the profile, then the
    command line (``ranks`` overrides ``options.ranks``; under torchrun the world size is it).
    A thd pack of random documents is drawn here, its lengths multiples of ``2 * cp`` for every cp
    of ``cps`` (``bench --simulate``; default: the ranks)."""
    overrides = options.overrides()
    if ranks is not None:
        overrides["ranks"] = ranks
    env = torchrun_env()
    if env is not None and cps and env.world > 1:
        raise ValueError(f"--simulate under torchrun (WORLD_SIZE={env.world}): a simulation replays every rank on "
                         f"one process, and each of torchrun's {env.world} processes would run all of it; run "
                         f"sinkprof bench --simulate without torchrun")
    if env is not None:
        world = env.world
        if overrides.get("ranks", world) != world:
            raise ValueError(f"--ranks {overrides['ranks']} differs from torchrun's WORLD_SIZE={world}; drop --ranks")
        overrides["ranks"] = world
    profile = find(options.profile)
    groups = profile.resolve(overrides)
    if cps:   # before validate, whose a2a rules would speak of the one rank a simulation runs as
        check_simulated_comm(profile, overrides, options.comm)
    for i, settings in enumerate(groups):
        try:
            settings.validate("--ranks" if env is None else "WORLD_SIZE")
            # the thd pack drawn once, here: every rank (and --simulate's every cp) gets these lengths
            groups[i] = settings.with_documents(cps)
        except ValueError as exc:
            if profile.path is None:
                raise
            raise _in_profile(exc, profile, i) from None
    if options.a2a_size is not None and not any("a2a+p2p" in g.comm for g in groups):
        raise ValueError(f"--a2a-size {options.a2a_size}: no case of this run is --comm a2a+p2p, the only one that "
                         f"reads it; add a2a+p2p to --comm, or drop --a2a-size")
    cases = [case for g in groups for case in expand(g)]
    softmax = ",".join(dict.fromkeys(s for g in groups for s in g.softmax))
    if options.sink_strategy is not None and not any(case.softmax.has_sink for case in cases):
        raise ValueError(f"--sink-strategy {options.sink_strategy}: no case of this run has a sink (--softmax "
                         f"{softmax}), the only cases it applies to; add off-by-one or learnable to --softmax, or "
                         f"drop --sink-strategy")
    if options.sink_grad is not None and not any(case.has_grad_contract for case in cases):
        raise ValueError(f"--sink-grad {options.sink_grad}: no case of this run has a replicated gradient (a sink, or "
                         f"--bias on bshd or sbhd; here --softmax {softmax}), the only cases it applies to; add "
                         f"off-by-one or learnable to --softmax, or --bias, or drop --sink-grad")
    if options.batch not in (None, 1) and all(set(g.qkv_format) == {"thd"} for g in groups):
        raise ValueError(f"--batch {options.batch}: a thd pack is one sequence of documents, its cases run with "
                         f"b = 1; drop --batch, or add bshd or sbhd to --qkv-format (their cases take it)")
    first = groups[0]
    if any(gr.ranks != first.ranks or gr.device != first.device for gr in groups):
        raise ValueError(f"profile {profile.path}: all [[cases]] must share ranks and device; set them at its "
                         f"top level (or on the command line)")
    if first.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            if options.device is not None or profile.path is None:
                raise ValueError("--device cuda: no CUDA device is visible here; use --device cpu")
            raise ValueError(f"--profile {options.profile}: the profile runs on a CUDA GPU (device = \"cuda\" in "
                             f"{profile.path}) and no CUDA device is visible here; run it on a GPU machine, or "
                             f"use a CPU profile (sinkprof profiles lists them)")
    check_dist_backend(options.dist_backend, first.device, first.ranks)
    return groups


def check_not_the_profile(options: CaseOptions, path: Optional[str], option: str) -> None:
    """``path``, a file the run writes, is not the profile file it reads (the result would replace it)."""
    if path in (None, STDOUT) or options.profile is None:
        return
    if same_target(path, str(locate(options.profile))):
        raise ValueError(f"{option} {path}: is the profile this run reads (--profile {options.profile}); "
                         f"write the result to another file")


def check_simulated_comm(profile: Profile, overrides: dict, typed: Optional[str]) -> None:
    """``bench --simulate`` replays the p2p ring: each group's comm, parsed from the command line
    (``typed`` is --comm as given) or taken from the profile, must be p2p. The error names where the
    comm came from; an unknown or empty comm is left to ``Settings.validate``, which names it."""
    others = {c.value for c in CommType} - {CommType.P2P.value}
    why = "a simulation replays the p2p ring"
    if "comm" in overrides:
        if others & set(overrides["comm"]):
            raise ValueError(f"--comm {typed} with --simulate: {why}; use --comm p2p (or drop --simulate)")
        return
    for i, group in enumerate(profile.groups or [{}]):
        where, layer = (f" [[cases]] #{i + 1}", group) if "comm" in group else ("", profile.settings)
        if others & set(layer.get("comm", ())):
            raise ValueError(f"profile {profile.path}{where}: comm = {json.dumps(list(layer['comm']))} with "
                             f"--simulate: {why}; add --comm p2p (it overrides the profile's comm), or drop "
                             f"--simulate")


def _in_profile(exc: ValueError, profile: Profile, i: int) -> ValueError:
    """A settings group's error, saying which profile file (and which of its groups) it came from."""
    group = f" [[cases]] #{i + 1}" if profile.groups else ""
    return ValueError(f"{exc} (with the settings of profile {profile.path}{group})")


def show(name: Optional[str], output: Output) -> None:
    """The command: list the profiles, or show the settings groups of one (checked as check and
    bench check them, before anything is printed)."""
    def table(console):
        from rich.markup import escape
        from rich.table import Table
        if name is None:
            t = Table(title="profiles")
            for col in ("name", "description", "file"):
                t.add_column(col)
            for n, path in available().items():
                try:
                    description = find(n).description
                except ValueError as exc:  # one broken file does not hide the others
                    description = f"(cannot be used: {exc})"
                t.add_row(escape(n), escape(description), escape(str(path)))
            console.print(t)
            return
        console.print(f"[bold]{escape(prof.name)}[/bold]: {escape(prof.description)}  ({escape(str(prof.path))})")
        for i, settings in enumerate(groups):
            console.print(f"group {i + 1}: " + escape(", ".join(f"{k}={v}" for k, v in
                                                              dataclasses.asdict(settings).items())))

    note = not_folders() if name is None else ""
    if note:
        print(f"sinkprof profiles: note: {note}", file=sys.stderr)
    prof = None if name is None else find(name, "sinkprof profiles")
    groups = [] if prof is None else prof.resolve({})
    for i, settings in enumerate(groups):
        try:
            settings.validate(here=False)   # a profile for another machine shows here
        except ValueError as exc:
            raise (exc if prof.path is None else _in_profile(exc, prof, i)) from None
    output.emit(table=table)
