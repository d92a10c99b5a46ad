"""README.md and the code can't drift apart.

- The module table ("Other entry points"): every name a row lists imports from the
  module the row names, or is a method / field of a class the same row lists
  (``.begin(...)``, ``decode(...)``), or a name of the top-level ``hisparse`` package
  (``HiSparseCache`` in a usage example); every keyword a row shows in a call
  (``FlashMLABackend(library_path=)``) is a parameter of what it calls.
- The Public API block: its imports resolve, and the block runs as written on CPU.

What a cell lists: each backticked span's leading identifier (after a leading '.', a
member), and every capitalised name called inside the span (``BlockTable(...)``);
spans holding a path (``docs/ENGINE.md``) or a bare keyword (``kernels=``) list nothing.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SPAN = re.compile(r"`([^`]+)`")
ROW = re.compile(r"^\| `(hisparse(?:\.\w+)*)` \| (.*) \|$")


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def module_table(text: str) -> list[tuple[str, str]]:
    """(module, what) of each row of README's module table."""
    return [(m.group(1), m.group(2)) for m in map(ROW.match, text.splitlines()) if m]


@dataclasses.dataclass(frozen=True)
class Listed:
    name: str
    member: bool  # written as ``.name(...)``: a method of a class of the row
    keywords: tuple[str, ...]  # keywords of the call right after the name


def _call_args(span: str, start: int) -> str | None:
    """The text inside the parentheses that open at ``span[start]`` (nesting honoured),
    or None when no call starts there."""
    if start >= len(span) or span[start] != "(":
        return None
    depth = 0
    for i in range(start, len(span)):
        depth += {"(": 1, ")": -1}.get(span[i], 0)
        if depth == 0:
            return span[start + 1:i]
    return None


def _keywords(args: str | None) -> tuple[str, ...]:
    """Keyword names at the top level of a call's argument text."""
    if args is None:
        return ()
    depth, top = 0, []
    for ch in args:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        top.append(ch if depth == 0 else " ")
    return tuple(re.findall(r"(?:^|[,\s])([A-Za-z_]\w*)=(?!=)", "".join(top)))


def listed_names(cell: str) -> list[Listed]:
    out = []
    for span in SPAN.findall(cell):
        if re.fullmatch(r"[\w.-]*/[\w./-]*", span) or span.endswith("="):  # a path, a keyword
            continue
        m = re.match(r"(\.?)([A-Za-z_]\w*)", span)
        if m is None:
            continue
        out.append(Listed(m.group(2), bool(m.group(1)), _keywords(_call_args(span, m.end()))))
        for inner in re.finditer(r"(?<![\w.])([A-Z]\w*)(?=\()", span[m.end():]):
            end = m.end() + inner.end()
            out.append(Listed(inner.group(1), False, _keywords(_call_args(span, end))))
    return out


def _has_member(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    return dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}


def _check_keywords(obj: object, keywords: tuple[str, ...], what: str) -> None:
    if not keywords:
        return
    target = obj.__init__ if isinstance(obj, type) else obj
    params = inspect.signature(target).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    missing = [k for k in keywords if k not in params]
    assert not missing, f"README shows {what}({', '.join(k + '=' for k in missing)}), " \
                        f"not parameters of it: {list(params)}"


def test_the_module_table_is_found():
    rows = dict(module_table(_readme()))
    assert {"hisparse.attention", "hisparse.attention.miss", "hisparse.decode",
            "hisparse.engine", "hisparse.staging", "hisparse.formats"} <= set(rows), rows


@pytest.mark.parametrize("module_name,cell", module_table(_readme()),
                         ids=[m for m, _ in module_table(_readme())])
def test_every_name_in_the_module_table_exists(module_name, cell):
    module = importlib.import_module(module_name)
    top = importlib.import_module("hisparse")
    listed = listed_names(cell)
    found: dict[str, object] = {}
    for item in listed:  # names of the module first: the classes members belong to
        if not item.member and item.name in getattr(module, "__all__", dir(module)):
            found[item.name] = getattr(module, item.name)
    assert found, f"{module_name}: the row lists none of the module's names: {listed}"
    classes = [v for v in found.values() if isinstance(v, type)]
    for item in listed:
        what = f"{module_name}: {item.name}"
        if item.name in found:
            obj = found[item.name]
        elif owners := [c for c in classes if _has_member(c, item.name)]:
            obj = getattr(owners[0], item.name, None)  # a method, or a dataclass field
        elif not item.member and item.name in (*top.__all__, "HiSparseCache"):
            obj = getattr(top, item.name)
        else:
            raise AssertionError(f"{what} is listed in README but is neither exported by "
                                 f"{module_name} nor a member of {[c.__name__ for c in classes]}")
        if callable(obj):
            _check_keywords(obj, item.keywords, what)


def test_readme_exports_import_from_their_module():
    """The names the README rows promise, imported the way a user writes them."""
    ns: dict = {}
    exec("from hisparse.attention import (choose_backend, TritonBackend, FlashMLABackend, "
         "FlashInferBackend, ReferenceBackend, TritonMLAConfig, default_config)", ns)
    assert ns["ReferenceBackend"].name == "reference" and callable(ns["choose_backend"])


def test_importing_hisparse_attention_loads_no_kernel_or_optional_library():
    """The package's names load on first use: importing it (or its base module) pulls
    in neither Triton nor FlashMLA / FlashInfer (checked in a fresh interpreter)."""
    code = ("import os, sys; os.environ.pop('TRITON_INTERPRET', None);"
            "import hisparse.attention, hisparse.attention.base;"
            "from hisparse.attention import ReferenceBackend, choose_backend;"
            "print(sorted(m for m in ('triton', 'flashinfer', 'vllm', 'sgl_kernel') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_hisparse_cache_exports_load_on_first_use():
    """``hisparse.cache`` names what its calls return; importing the package loads none
    of its modules and no Triton (checked in a fresh interpreter)."""
    code = ("import os, sys; os.environ.pop('TRITON_INTERPRET', None);"
            "import hisparse.cache as c;"
            "print(sorted(m for m in sys.modules if m.startswith('hisparse.cache.') or m == 'triton'));"
            "from hisparse.cache import ResolveResult, SplitResult, StepPlan, WriteBatch, HostPool;"
            "import hisparse; print(c.HiSparseCache is hisparse.HiSparseCache)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "True"], r.stdout


# ------------------------------------------------------------------ the Public API block
def public_api_block(text: str) -> str:
    """The first python block of README's "Public API" section."""
    section = text.split("\n## Public API\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m is not None, "no python block in README's Public API section"
    return m.group(1)


def test_public_api_block_imports_resolve():
    for line in public_api_block(_readme()).splitlines():
        m = re.match(r"from (\S+) import (.+)$", line.split("#")[0].strip())
        if m:
            module = importlib.import_module(m.group(1))
            for name in (n.strip() for n in m.group(2).strip("()").split(",")):
                assert hasattr(module, name), f"README: from {m.group(1)} import {name}"


def test_public_api_block_runs_on_cpu(capsys):
    """README's example, executed as written: it must define every name it uses, run on
    CPU, and its CapacityError case must really raise (it prints the message)."""
    code = public_api_block(_readme())
    assert 'device="cpu"' in code
    ns: dict = {"__name__": "readme_public_api"}
    exec(compile(code, str(README), "exec"), ns)
    assert "host pool full" in capsys.readouterr().out  # the CapacityError branch ran
    cache, stats = ns["cache"], ns["stats"]
    assert cache.live_requests() == [9] and stats["live_requests"] == 1
    assert stats["total"]["resolves"] > 0 and stats["total"]["hits"] + stats["total"]["misses"] > 0
    assert ns["host"].shape == (3, 656) and ns["first"] == 0
