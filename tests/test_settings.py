"""collector/settings.py is the one reader of the platform's environment (docs/settings.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from collector.bus import open_bus
from collector.settings import Environment, environment

ROOT = Path(__file__).resolve().parents[1]
# infra/ is a leaf that imports none of our packages, so it reads its own variables (docs/settings.md)
PACKAGES = ["collector", "analytics", "remediation", "trainer", "ui", "resihp", "bench"]


def test_a_variable_set_after_import_is_read_at_the_next_use(monkeypatch, tmp_path):
    monkeypatch.setenv("RESIHP_EMBEDDED_PATH", str(tmp_path / "x.sqlite"))
    monkeypatch.setenv("RESIHP_UI_PAGE_SIZE", "7")
    env = environment()
    assert (env.embedded_path, env.ui_page_size) == (str(tmp_path / "x.sqlite"), 7)
    with open_bus("embedded") as bus:
        assert bus is not None
    assert (tmp_path / "x.sqlite").exists()


def test_a_number_that_is_not_one_names_the_variable(monkeypatch):
    monkeypatch.setenv("RESIHP_KAFKA_REPLICATION", "three")
    with pytest.raises(ValidationError, match="kafka_replication"):
        environment()


def test_no_module_reads_the_environment_around_the_settings():
    readers = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "collector" / "settings.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"os\.environ\.get|os\.getenv|os\.environ\[", line):
                    readers.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not readers, "read these through collector.settings.environment():\n" + "\n".join(readers)


def test_every_variable_is_documented():
    doc = (ROOT / "docs" / "settings.md").read_text()
    missing = [f"RESIHP_{name.upper()}" for name in Environment.model_fields if f"`RESIHP_{name.upper()}`" not in doc]
    assert not missing, f"add to docs/settings.md: {missing}"
