"""docs/events.md documents every event kind, and says what the models say."""

from __future__ import annotations

from pathlib import Path

from collector.events import PAYLOAD_TYPES
from collector.reference import render

DOC = Path(__file__).resolve().parent.parent / "docs" / "events.md"


def test_the_event_reference_matches_the_models():
    assert DOC.read_text() == render(), "docs/events.md is stale: run `python -m collector.reference > docs/events.md`"


def test_every_kind_is_documented_with_a_description():
    text = DOC.read_text()
    for payload in PAYLOAD_TYPES:
        assert f"### `{payload.KIND}`" in text
        assert (payload.__doc__ or "").strip(), f"{payload.__name__} has no docstring to document {payload.KIND}"
