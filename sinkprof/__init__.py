"""sinkprof: context-parallel attention with attention sinks, and the proof that it is right.

``import sinkprof`` is light: it imports neither torch (seconds) nor any submodule, so the command's
entry has set its handling of a Ctrl-C before torch loads (``sinkprof/__main__.py``). The public
names load on first use (PEP 562); ``from sinkprof import cp_attention`` and
``sinkprof.cp_attention`` work as before.

What ``import sinkprof`` promised when it imported torch still holds: torch's vector math is
settled on one thread before any multi-threaded ``exp`` or ``log`` of this process
(``sinkprof/cpu_math.py``). With torch already imported that is done here; otherwise it is done
the moment torch is imported, by whoever imports it (``_SettleAfterTorch``).
"""
import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the library module that defines it
_LAZY = {
    "attention": "reference",
    "comm_bytes": "schedule",
    "cp_attention": "context_parallel",
    "pad_pack": "plan",
    "shard": "plan",
    "unshard": "plan",
    "Transfer": "schedule",
}
__all__ = ["attention", "comm_bytes", "cp_attention", "pad_pack", "shard", "unshard", "Transfer", "__version__"]

if TYPE_CHECKING:   # for type checkers and editors; at run time ``__getattr__`` loads them
    from .context_parallel import cp_attention
    from .plan import pad_pack, shard, unshard
    from .reference import attention
    from .schedule import Transfer, comm_bytes


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value   # the next look-up is an ordinary one
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


def _settle() -> None:
    from .cpu_math import settle_vector_math
    settle_vector_math()


class _SettleAfterTorch:
    """A finder at the head of ``sys.meta_path`` that finds nothing of its own: when torch is
    imported it lets the other finders find it, and its loader settles the vector math as soon as
    torch's own code has run, before the importer gets torch back. Then it leaves ``sys.meta_path``.
    A torch import that fails (a Ctrl-C in it) leaves it there for the next try."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)   # by the other finders: this one steps aside
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenSettle(spec.loader, self)
        return spec


class _ThenSettle:
    """torch's own loader, then ``_settle()``; torch keeps its own loader as ``__loader__``."""

    def __init__(self, loader, finder: _SettleAfterTorch) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        _settle()


if "torch" in sys.modules:
    _settle()
else:
    sys.meta_path.insert(0, _SettleAfterTorch())
