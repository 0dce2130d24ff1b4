"""Every relative link (and image) in the README and docs/ reaches a file, every #anchor a heading in it,
and every project file a doc names (`remediation/planner.py`) exists.

The docs cross-reference each other by section (a table's provenance, a design choice, a
benchmark's command) and name the modules they describe; a section renamed or a module moved
silently strands them. Anchors follow GitHub's rule: the heading's text (a link counts by its
words) lowercased, punctuation other than ``-`` and ``_`` dropped, each space a ``-``, and a
repeated heading suffixed ``-1``, ``-2``, ...
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()  # a link counts by its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of ``path`` outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, line


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        if not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(path: Path) -> list[tuple[int, str]]:
    return [(number, target) for number, line in prose_lines(path) for target in LINK.findall(line)]


def test_slug_follows_githubs_rule() -> None:
    assert slug("Lifecycle (`remediation/lifecycle.py`, `remediation/engine.py`)") == (
        "lifecycle-remediationlifecyclepy-remediationenginepy")
    assert slug("Closed loop — `resihp bench recover [--gpus N]`") == "closed-loop--resihp-bench-recover---gpus-n"
    assert slug("The goals, honestly") == "the-goals-honestly"
    assert slug("Bus — `resihp bench bus` ([architecture](architecture.md))") == "bus--resihp-bench-bus-architecture"


def test_a_missing_heading_is_caught(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text("# Title\n\n## Part one\n\n## Part one\n\n```\n# not a heading\n```\n")
    assert anchors(doc) == {"title", "part-one", "part-one-1"}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(path: Path) -> None:
    broken = []
    for number, target in links(path):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"line {number}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{path.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


TOP_DIRS = "analytics|bench|collector|remediation|resihp|trainer|ui|tests|examples|scenarios|docs|infra"
SOURCE_PATH = re.compile(rf"(?<![\w./-])((?:{TOP_DIRS})/[\w./-]*\w\.(?:py|md|yaml|yml|png|json|toml|parquet|sh))\b")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_project_file_named_exists(path: Path) -> None:
    """A doc that names a module or a file of this repository (``remediation/planner.py``) names
    one that exists: a moved or deleted module otherwise leaves the reader looking for it."""
    missing = sorted({m for m in SOURCE_PATH.findall(path.read_text()) if not (ROOT / m).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"


def test_a_named_file_that_is_gone_is_caught() -> None:
    text = "see `remediation/planner.py`, `bench/_gone.py` and /etc/resihp/users.toml"
    assert [m for m in SOURCE_PATH.findall(text) if not (ROOT / m).exists()] == ["bench/_gone.py"]
