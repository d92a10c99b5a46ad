"""The docs hold current figures, not a dated log (CPU only, a few file reads).

- BENCHMARKS.md, the current-figures document, stays under 400 lines.
- No file of the project (Python, Markdown, shell, ``dev``, ``.ci/run``) cites a
  numbered log section: "session 23", "sessions 25 and 27", "§4", or a run named by
  its date and number ("2026-12-04 s25", a folder ``2026-12-04-s27``). Code and docs
  say what is; where a figure comes from, they name a BENCHMARKS.md section by title.
- Every ``benchmarks/results/...`` path a Markdown doc names exists (a path after a
  commit, ``6a5886d:benchmarks/results/...``, is git history and is not checked); every
  result file BENCHMARKS.md names by itself lies in ``benchmarks/results/current/``,
  and every file there is named by BENCHMARKS.md (none kept that no figure cites).
- A BENCHMARKS.md section a doc names by title (``BENCHMARKS.md, "Title"``) or links
  (``BENCHMARKS.md#anchor``) exists.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "results"
CURRENT = RESULTS / "current"
MAX_LINES = 400

# "session 23", "Sessions 25 and 27", "§ 4", "2026-12-04 s25", "2026-12-04-s27"
LOG_CITATION = re.compile(r"\b[Ss]essions?\s+\d+|§\s*\d+|\b\d{4}-\d\d-\d\d[ -]s\d+\b")
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__", ".gpu-deps",
             ".pytest_cache", ".hypothesis", "results"}  # results: data files, not prose
RESULT_PATH = re.compile(r"(?<![0-9a-f]:)(?<![\w/.-])benchmarks/results/[\w./-]*[\w/]")
RESULT_NAME = re.compile(r"`([\w.-]+\.(?:json|xml|txt|log|gz|png))`")
SECTION_TITLE = re.compile(r'BENCHMARKS\.md[,:]?\s+"([^"]+)"')
SECTION_LINK = re.compile(r"BENCHMARKS\.md#([\w-]+)")


def _project_files() -> list[Path]:
    """The repo's .py / .md / .sh files (and dev, .ci/run): what git tracks or would add
    (ignored virtualenvs such as .venv-triton-latest, which CI creates here, are not the
    project's); outside a git checkout, a walk that skips SKIP_DIRS and virtualenvs."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.splitlines()
        paths = [ROOT / rel for rel in listed if rel]
    except (OSError, subprocess.CalledProcessError):
        paths = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")
                       and not d.startswith(".venv")]
            paths += [Path(folder, name) for name in files]
    out = []
    for path in paths:
        rel = path.relative_to(ROOT).as_posix()
        if any(part in SKIP_DIRS for part in Path(rel).parts[:-1]):
            continue
        if path.is_file() and (path.suffix in {".py", ".md", ".sh"} or rel in {"dev", ".ci/run"}):
            out.append(path)
    return sorted(out)


def _docs() -> list[Path]:
    return [p for p in _project_files() if p.suffix == ".md"]


def log_citations(text: str) -> list[str]:
    """Each line of ``text`` that cites a numbered log section (the line, stripped)."""
    return [line.strip() for line in text.splitlines() if LOG_CITATION.search(line)]


def result_paths(text: str) -> list[str]:
    """The ``benchmarks/results/...`` paths ``text`` names that are not git history."""
    return [m.group(0).rstrip(".") for m in RESULT_PATH.finditer(text)]


def _slug(title: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _headings() -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", FIGURES.read_text(encoding="utf-8"), re.M)]


# ------------------------------------------------------------------ the patterns themselves
@pytest.mark.parametrize("text", ["BENCHMARKS.md, session 23", "sessions 25 and 27", "Session 12:",
                                  "see §4", "| 2026-12-04 s25 |", "2026-12-04-s27/layer_final.json"])
def test_the_citation_pattern_finds_a_log_section(text):
    assert log_citations(text)


@pytest.mark.parametrize("text", ["s0, s1, s2, s3 = _steps(...)", "this session's device time",
                                  "a session of the project", "`hisparse stress --steps 12`",
                                  "measured on 2026-12-04, tree `f153a53`", "sessions, stages"])
def test_the_citation_pattern_spares_ordinary_text(text):
    assert not log_citations(text)


def test_result_paths_leave_git_history_alone():
    text = ("`benchmarks/results/current/layer.json`, `6a5886d:benchmarks/results/old/x.json` "
            "and benchmarks/results/current/.")
    assert result_paths(text) == ["benchmarks/results/current/layer.json", "benchmarks/results/current/"]


# ------------------------------------------------------------------ the repository
def test_the_figures_document_is_short():
    lines = FIGURES.read_text(encoding="utf-8").count("\n")
    assert lines < MAX_LINES, f"BENCHMARKS.md has {lines} lines; the current figures fit in {MAX_LINES}"


def test_no_file_cites_a_numbered_log_section():
    me = Path(__file__).resolve()
    found = {}
    for p in _project_files():
        hits = [] if p.resolve() == me else log_citations(p.read_text(encoding="utf-8", errors="replace"))
        if hits:
            found[str(p.relative_to(ROOT))] = hits
    assert not found, "cite a BENCHMARKS.md section by title, or say what was measured: " + \
        "; ".join(f"{path}: {hits[0][:120]!r} (+{len(hits) - 1})" for path, hits in sorted(found.items()))


def test_every_result_path_in_the_docs_exists():
    missing = sorted({f"{p.relative_to(ROOT)}: {path}" for p in _docs()
                      for path in result_paths(p.read_text(encoding="utf-8"))
                      if not (ROOT / path).exists()})
    assert not missing, missing


def test_the_result_files_are_the_ones_benchmarks_md_cites():
    text = FIGURES.read_text(encoding="utf-8")
    named = set(RESULT_NAME.findall(text))
    kept = {p.name for p in CURRENT.rglob("*") if p.is_file()} if CURRENT.is_dir() else set()
    assert named <= kept, f"named in BENCHMARKS.md, not in {CURRENT.relative_to(ROOT)}: {sorted(named - kept)}"
    assert kept <= named, f"kept but cited by no figure: {sorted(kept - named)}"
    others = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")
                    if p.is_file() and CURRENT not in p.parents)
    assert not others, f"result files outside {CURRENT.relative_to(ROOT)} (superseded ones live in git): {others[:5]}"


def test_every_benchmarks_md_section_a_doc_names_exists():
    titles = set(_headings())
    anchors = {_slug(t) for t in titles}
    bad = []
    me = Path(__file__).resolve()
    for p in _project_files():
        if p.resolve() == me:
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        named = [" ".join(t.split()) for t in SECTION_TITLE.findall(text)]  # a title wrapped over lines
        bad += [f"{p.relative_to(ROOT)}: {t!r}" for t in named if t not in titles]
        bad += [f"{p.relative_to(ROOT)}: #{a}" for a in SECTION_LINK.findall(text) if a not in anchors]
    assert not bad, f"no such BENCHMARKS.md section: {bad}"
