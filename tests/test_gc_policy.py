"""The streaming processes' garbage-collector settings (collector.gc_policy)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from collector.gc_policy import GC_ENV, STREAMING_THRESHOLDS, tune_for_streaming


@pytest.fixture
def restore_thresholds():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_streaming_is_the_default_and_raises_the_thresholds(monkeypatch, restore_thresholds):
    monkeypatch.delenv(GC_ENV, raising=False)
    gc.set_threshold(700, 10, 10)
    assert tune_for_streaming() == STREAMING_THRESHOLDS
    assert gc.get_threshold() == STREAMING_THRESHOLDS
    assert gc.isenabled()  # cycles are still collected, only less often


def test_python_keeps_cpythons_settings(monkeypatch, restore_thresholds):
    monkeypatch.setenv(GC_ENV, "python")
    gc.set_threshold(700, 10, 10)
    assert tune_for_streaming() == (700, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_an_unknown_value_is_refused_with_the_choices(monkeypatch, restore_thresholds):
    monkeypatch.setenv(GC_ENV, "off")
    with pytest.raises(ValueError, match=r"RESIHP_GC='off': choose 'streaming'.*or 'python'"):
        tune_for_streaming()


@pytest.mark.processes
def test_the_cli_applies_it_and_names_a_bad_value(tmp_path):
    code = ("import gc, sys; from resihp import cli; cli.main(['plans', 'list', '--bus-path', sys.argv[1]]); "
            "print(gc.get_threshold())")
    ok = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bus.sqlite")], capture_output=True, text=True,
                        env={"PATH": "", GC_ENV: "streaming"}, check=True)
    assert ok.stdout.strip().splitlines()[-1] == str(STREAMING_THRESHOLDS)
    bad = subprocess.run([sys.executable, "-m", "resihp.cli", "plans", "list"], capture_output=True, text=True,
                         env={"PATH": "", GC_ENV: "sometimes"})
    assert bad.returncode == 2
    assert "RESIHP_GC='sometimes'" in bad.stderr
