"""Lint (ruff) and types (mypy) run with the tests, so `make test` stays the one command.

Both read their configuration from pyproject.toml (`[tool.ruff]`, `[tool.mypy]`). A failure prints
the tool's findings; fix them in the code (never `ruff check --fix` over files others edit).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["collector", "analytics", "remediation", "trainer", "ui", "infra", "resihp", "bench"]
LINTED = [*PACKAGES, "tests", "examples"]


def _run(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.processes
def test_ruff_finds_nothing():
    result = _run("ruff", "check", "--no-cache", *LINTED, timeout_s=120)
    assert result.returncode == 0, f"ruff check {' '.join(LINTED)}:\n{result.stdout}{result.stderr}"


@pytest.mark.slow
def test_mypy_finds_nothing():
    result = _run("mypy", timeout_s=900)  # the packages to check come from [tool.mypy] in pyproject.toml
    assert result.returncode == 0, f"mypy:\n{result.stdout}{result.stderr}"


def test_every_package_is_linted_and_type_checked():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    on_disk = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    assert sorted(PACKAGES) == on_disk
    # tests/ has no __init__.py (pytest imports it from the root), so mypy reads it as a package
    # from its base, the root: explicit_package_bases
    assert sorted(config["tool"]["mypy"]["packages"]) == sorted([*on_disk, "tests"])
    assert config["tool"]["mypy"]["explicit_package_bases"] is True
