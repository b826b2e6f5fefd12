"""Two blocks: the library (everything in sinkprof/ but the tool and the CLI) never imports the
tool (sinkprof/tool/, sinkprof/cli.py, sinkprof/__main__.py), and its modules import each other
without a cycle. Imports are read from the source (ast), so lazy imports inside functions count."""
import ast
from pathlib import Path

import sinkprof

ROOT = Path(sinkprof.__file__).resolve().parent
TOOL = ("sinkprof.tool", "sinkprof.cli", "sinkprof.__main__")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_tool(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TOOL)


def imports_of(path: Path) -> set[str]:
    """Every sinkprof module ``path`` imports, absolute or relative, at any depth of the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)  # `from . import ring` names a module
    return {m for m in found if m == "sinkprof" or m.startswith("sinkprof.")}


def library_modules() -> dict[str, Path]:
    mods = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {n: p for n, p in mods.items() if not _is_tool(n)}


def _graph() -> dict[str, set[str]]:
    """Edges between library modules. A module's own ancestor packages are left out: Python has
    initialised them before the module runs (``from . import faults`` reads ``sinkprof.faults``)."""
    mods = library_modules()

    def ancestor(m: str, n: str) -> bool:
        return n.startswith(m + ".")
    return {n: {m for m in imports_of(p) if m in mods and m != n and not ancestor(m, n)} for n, p in mods.items()}


def test_the_library_is_found():
    mods = library_modules()
    assert {"sinkprof.ring", "sinkprof.context_parallel", "sinkprof.faults", "sinkprof.kernels",
            "sinkprof.kernels.torch_tiles"} <= set(mods)
    assert not any(_is_tool(n) for n in mods)


def test_no_library_module_imports_the_tool():
    bad = {n: sorted(m for m in imports_of(p) if _is_tool(m)) for n, p in library_modules().items()}
    bad = {n: ms for n, ms in bad.items() if ms}
    assert not bad, f"library modules import the tool: {bad}"


def test_the_library_has_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = path[path.index(m):] + [m]
                raise AssertionError(f"import cycle among library modules: {' -> '.join(cycle)}")
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_the_walker_sees_a_tool_import(tmp_path):
    """The rule can fail: a module importing the tool, relatively or absolutely, is caught."""
    pkg = tmp_path / "sinkprof"
    pkg.mkdir()
    bad = pkg / "bad.py"
    bad.write_text("def f():\n    from .tool.check import run_case\n    import sinkprof.cli\n")
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        found = imports_of(bad)
    finally:
        ROOT = saved
    assert "sinkprof.tool.check" in found and "sinkprof.cli" in found
    assert all(_is_tool(m) for m in ("sinkprof.tool.check", "sinkprof.cli"))


def test_the_packages_lazy_names_are_the_librarys():
    """``sinkprof/__init__.py`` loads its public names on first use, by module name (PEP 562),
    which the walker cannot read: each must come from a library module."""
    library = library_modules()
    names = [n for n in sinkprof.__all__ if n != "__version__"]
    assert names
    for name in names:
        assert getattr(sinkprof, name).__module__ in library, name
