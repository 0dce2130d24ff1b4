"""``resihp ui --tls-cert/--tls-key`` hands Streamlit its HTTPS options, and refuses a key others can read."""

from __future__ import annotations

import argparse
import os

import pytest

from infra import tls
from resihp.commands.ui import register, tls_flags


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["ui", *argv])


def test_the_console_serves_https_with_an_owner_only_key_and_refuses_a_shared_one(tmp_path) -> None:
    files = tls.ensure_tls(tmp_path / "tls")
    assert tls_flags(_args()) == []
    flags = tls_flags(_args("--tls-cert", str(files.broker_cert), "--tls-key", str(files.broker_key)))
    assert flags == ["--server.sslCertFile", str(files.broker_cert), "--server.sslKeyFile", str(files.broker_key)]
    with pytest.raises(ValueError, match="go together"):
        tls_flags(_args("--tls-cert", str(files.broker_cert)))
    os.chmod(files.broker_key, 0o644)
    with pytest.raises(ValueError, match=f"chmod 600 {files.broker_key}"):
        tls_flags(_args("--tls-cert", str(files.broker_cert), "--tls-key", str(files.broker_key)))
