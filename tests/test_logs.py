"""collector/logs.py: every line a process logs is one JSON object carrying its context."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest

from collector import logs


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_line_carries_the_context_the_extras_and_survives_quotes_and_newlines(restore_root_logger):
    out = io.StringIO()
    logs.configure("INFO", stream=out, job="j1", rank=5)
    logging.getLogger("resihp.trainer").info('reshape "to" %s\nnext', "TP2", extra={"epoch": 3})
    line = json.loads(out.getvalue())
    assert (line["job"], line["rank"], line["epoch"], line["level"], line["logger"]) == \
           ("j1", 5, 3, "INFO", "resihp.trainer")
    assert line["msg"] == 'reshape "to" TP2\nnext'
    assert out.getvalue().count("\n") == 1


def test_an_exception_is_kept_in_the_same_line(restore_root_logger):
    out = io.StringIO()
    logs.configure("WARNING", stream=out, rank=0)
    try:
        raise RuntimeError("gloo pair closed")
    except RuntimeError:
        logging.getLogger("resihp.trainer").exception("device %d failed", 0)
    line = json.loads(out.getvalue())
    assert line["msg"] == "device 0 failed" and "RuntimeError: gloo pair closed" in line["exc"]


def test_the_level_filters_and_text_format_is_plain(restore_root_logger):
    out = io.StringIO()
    logs.configure("WARNING", fmt="text", stream=out)
    logging.getLogger("x").info("hidden")
    logging.getLogger("x").warning("shown")
    assert "hidden" not in out.getvalue() and out.getvalue().rstrip().endswith("WARNING x: shown")


def test_an_unknown_format_names_the_variable():
    with pytest.raises(ValueError, match="RESIHP_LOG_FORMAT"):
        logs.configure(fmt="xml")


@pytest.mark.processes
def test_a_worker_process_entry_logs_json_lines_with_its_rank(tmp_path):
    """The trainer's rank entry point configures JSON logs before it does anything else: a spec
    that cannot start still leaves a parseable line naming the rank."""
    code = ("from trainer.reference.spec import RunSpec\n"
            "from trainer.reference.worker import process_main\n"
            "spec = RunSpec(job='jlog', store_port=1, iterations=1, rendezvous_timeout_s=2, pg_timeout_s=1)\n"
            "process_main(3, spec.model_dump_json())\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "RESIHP_LOG": "INFO"})
    lines = [json.loads(x) for x in run.stderr.splitlines() if x.startswith("{")]
    assert run.returncode != 0 and lines, run.stderr[-2000:]
    assert all(x["rank"] == 3 and x["job"] == "jlog" for x in lines)
    assert any(x["level"] == "ERROR" and "device 3 failed" in x["msg"] for x in lines)
