"""Named run configurations (``profiles/*.toml``) for ``check`` and ``bench``.

A profile sets any ``check.Settings`` field at its top level; an optional ``[[cases]]`` array adds
groups that override those fields (TransformerEngine's sink tests are four such groups). Command
line options override both. The CPU default is embedded (``Settings()``), so ``sinkprof check``
needs no file.
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .cases import CaseOptions, Settings
from .launcher import under_torchrun
from .output import Output

LIST_FIELDS = {f.name for f in dataclasses.fields(Settings) if f.type == "tuple"}
FIELDS = {f.name for f in dataclasses.fields(Settings)}


@dataclass
class Profile:
    name: str
    path: Optional[Path]
    description: str
    settings: dict
    groups: list

    def resolve(self, overrides: dict) -> list[Settings]:
        """One ``Settings`` per group: profile, then group, then command line."""
        out = []
        for group in self.groups or [{}]:
            merged = {**self.settings, **group, **{k: v for k, v in overrides.items() if v is not None}}
            out.append(Settings(**merged))
        return out


def profile_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("SINKPROF_PROFILES", "").split(os.pathsep) if p]
    dirs.append(Path(__file__).resolve().parents[2] / "profiles")
    return dirs


def _normalize(data: dict, where: str) -> dict:
    out = {}
    for key, value in data.items():
        if key not in FIELDS:
            raise ValueError(f"{where}: unknown setting {key!r}; known: {', '.join(sorted(FIELDS))}")
        if key in LIST_FIELDS:
            value = tuple(value) if isinstance(value, list) else (value,)
        elif key == "window" and value is not None:
            value = tuple(value)
        out[key] = value
    return out


def load(path: Path, name: Optional[str] = None) -> Profile:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"profile {path}: invalid TOML: {exc}") from None
    description = data.pop("description", "")
    groups = data.pop("cases", [])
    return Profile(name or path.stem, path, description, _normalize(data, str(path)),
                   [_normalize(g, f"{path} [[cases]] #{i + 1}") for i, g in enumerate(groups)])


def available() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in profile_dirs():
        if d.is_dir():
            for p in sorted(d.glob("*.toml")):
                found.setdefault(p.stem, p)
    return found


def find(name: Optional[str]) -> Profile:
    """A profile by name (from the profile directories) or by path; None is the embedded default."""
    if name is None:
        return Profile("cpu-default (embedded)", None, "CPU, gloo, 2 ranks: p2p x 3 softmax types x 2 masks", {}, [])
    if name.endswith(".toml") or os.sep in name:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"--profile {name!r}: no such file")
        return load(path)
    known = available()
    if name not in known:
        raise ValueError(f"--profile {name!r} is unknown; available: {', '.join(known) or 'none'} "
                         f"(or pass a path to a .toml file)")
    return load(known[name], name)


def settings_for(options: CaseOptions, ranks: Optional[int] = None) -> list[Settings]:
    """The validated ``Settings`` groups of a ``check`` or ``bench`` run: the profile, then the
    command line (``ranks`` overrides ``options.ranks``; under torchrun the world size is it)."""
    if options.dist_backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"--dist-backend {options.dist_backend!r}: use auto, gloo or nccl")
    overrides = options.overrides()
    if ranks is not None:
        overrides["ranks"] = ranks
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if overrides.get("ranks", world) != world:
            raise ValueError(f"--ranks {overrides['ranks']} differs from torchrun's WORLD_SIZE={world}; drop --ranks")
        overrides["ranks"] = world
    try:
        groups = find(options.profile).resolve(overrides)
        for settings in groups:
            settings.validate()
    except TypeError as exc:  # a profile value of the wrong type
        raise ValueError(f"--profile {options.profile!r}: {exc}") from None
    first = groups[0]
    if any(gr.ranks != first.ranks or gr.device != first.device for gr in groups):
        raise ValueError("all [[cases]] of a profile must share ranks and device")
    if first.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible here; use --device cpu")
    return groups


def show(name: Optional[str], output: Output) -> None:
    """The command: list the profiles, or show the settings groups of one."""
    def table(console):
        from rich.table import Table
        if name is None:
            t = Table(title="profiles")
            for col in ("name", "description", "file"):
                t.add_column(col)
            for n, path in available().items():
                t.add_row(n, find(n).description, str(path))
            console.print(t)
            return
        console.print(f"[bold]{prof.name}[/bold]: {prof.description}  ({prof.path})")
        for i, settings in enumerate(prof.resolve({})):
            console.print(f"group {i + 1}: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(settings).items()))

    prof = None if name is None else find(name)
    output.emit(table=table)
