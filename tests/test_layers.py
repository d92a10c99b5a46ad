"""The library (``hisparse``) and its tools (``hisparse_tools``) kept apart.

- The library's import graph has no arrow into the tools.
- The tools and the benchmarks import only names the library exports, and no package
  exports a name one of its modules also has (importing that module would replace it).
- ``hisparse whatif`` runs without importing the cache, a kernel or Triton.

The first two read the source (every import statement, at any depth: module level, in a
function, under ``try``); the third runs the command in a fresh interpreter.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "hisparse"
TOOLS = ROOT / "hisparse_tools"
BENCHMARKS = ROOT / "benchmarks"
# the tools' package, and where they lived inside the library before issue 44
TOOL_PACKAGES = ("hisparse_tools", "hisparse.tools")


def _module_name(path: pathlib.Path) -> tuple[str, bool]:
    """(dotted module name, is a package) of a source file under ROOT."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts.pop()
    return ".".join(parts), is_pkg


def _imports(path: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """Every import in a file as (line, absolute module, imported name or None).

    ``import a.b`` gives (line, "a.b", None); ``from a import b, c`` gives one entry per
    name; relative imports are resolved against the file's package."""
    mod, is_pkg = _module_name(path)
    package = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            out += [(node.lineno, src, a.name) for a in node.names]
    return out


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_library_imports_nothing_of_the_tools():
    """No module of ``hisparse/`` imports ``hisparse_tools`` (nor holds the tools itself),
    and the library has no ``__main__`` of its own that would run them: the command is
    ``hisparse`` or ``python -m hisparse_tools``."""
    assert not (LIBRARY / "__main__.py").exists(), "hisparse/__main__.py would run the tools from the library"
    arrows = []
    files = sorted(LIBRARY.rglob("*.py"))
    assert len(files) > 20, "the library's sources were not found"
    for path in files:
        for line, module, name in _imports(path):
            full = f"{module}.{name}" if name else module
            if _under(module, TOOL_PACKAGES) or _under(full, TOOL_PACKAGES):
                arrows.append(f"{path.relative_to(ROOT)}:{line} imports {full}")
    assert not arrows, "the library imports the tools:\n" + "\n".join(arrows)


def _exported() -> tuple[set[str], dict[str, set[str]]]:
    """(the library's public modules, module -> the names it exports).

    Public modules: ``hisparse`` and its first-level modules and packages whose names do
    not start with ``_`` (``hisparse.config``, ``hisparse.cache``, ...). What a public
    module exports is its ``__all__`` (none: nothing)."""
    public = {"hisparse"} | {
        f"hisparse.{p.stem if p.suffix else p.name}" for p in LIBRARY.iterdir()
        if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").is_file())}
    names = {m: set(getattr(importlib.import_module(m), "__all__", ())) for m in sorted(public)}
    return public, names


def test_no_package_exports_a_name_of_one_of_its_modules():
    """A package never exports a name that one of its modules also has (``resolve_triton``
    in a ``resolve_triton.py``): importing that module sets the package's attribute of
    that name to the module, and ``from package import name`` then gives the module."""
    public, exports = _exported()
    clashes = []
    for module in sorted(public):
        folder = LIBRARY.joinpath(*module.split(".")[1:])
        if (folder / "__init__.py").is_file():
            subs = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}
            clashes += [f"{module}.{n}" for n in sorted(exports[module] & subs)]
    assert not clashes, "exported names that are also module names: " + ", ".join(clashes)


@pytest.mark.parametrize("folder, at_least", [(TOOLS, 10), (BENCHMARKS, 20)], ids=["tools", "benchmarks"])
def test_tools_import_only_exported_library_names(folder, at_least):
    """A tool or a benchmark may import a public library module (``import
    hisparse.metrics``, ``from hisparse import metrics``) or a name that module exports
    (``from hisparse.cache import HiSparseCache``); nothing else of the library (no
    ``hisparse._checks``, no ``hisparse.cache.state``, no name left out of an
    ``__all__``). The benchmarks that drive kernels and launchers directly import the
    kernel level that ``hisparse.cache``, ``hisparse.kernels`` and ``hisparse.attention``
    export for them."""
    public, exports = _exported()
    files = sorted(folder.rglob("*.py"))
    assert len(files) > at_least, f"the sources were not found under {folder}"
    bad = []
    for path in files:
        for line, module, name in _imports(path):
            if not _under(module, ("hisparse",)):
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            if module not in public:
                bad.append(f"{where} imports from {module}, which is not a public library module")
            elif name is not None and name not in exports[module] and f"{module}.{name}" not in public:
                bad.append(f"{where} imports {name} from {module}, which does not export it")
    assert not bad, f"{folder.name}/ reaches past the library's exports:\n" + "\n".join(bad)


_WHATIF = """
import json, runpy, sys
sys.argv = ["hisparse"] + json.loads(sys.argv[1])
try:
    runpy.run_module("hisparse_tools", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
else:
    code = 0
loaded = sorted(m for m in sys.modules
                if m.split(".")[0] == "triton" or m.startswith(("hisparse.cache", "hisparse.kernels")))
print("MODULES " + json.dumps({"exit": code, "loaded": loaded}))
"""


@pytest.mark.parametrize("argv", [
    ["whatif", "--trace", "uniform", "--requests", "2", "--context", "256", "--layers", "2", "--top-k", "16",
     "--steps", "4", "--buffer", "32", "--json"],
    ["whatif", "--help"],
])
def test_whatif_loads_neither_the_cache_nor_a_kernel(argv):
    """``python -m hisparse_tools whatif`` (the same command as ``hisparse whatif``) on a tiny
    generated trace, in a fresh interpreter: afterwards no ``hisparse.cache*``,
    ``hisparse.kernels*`` or ``triton*`` module is loaded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _WHATIF, json.dumps(argv)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("MODULES ")]
    assert lines, f"no report (rc {p.returncode}): {p.stderr[-2000:]}"
    got = json.loads(lines[-1][len("MODULES "):])
    assert got["exit"] == 0, p.stderr[-2000:]
    assert got["loaded"] == [], f"whatif loaded {got['loaded']}"
