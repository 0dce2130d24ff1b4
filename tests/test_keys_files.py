"""The key directory on disk (collector/keys.py) and the tooling that hands it out (``resihp keys``):
private keys only their owner reads, whatever the umask; processes starting together agree on one
set; an export holds public.json and only the private keys named."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from collector.keys import KeyDir, KeyFileError
from resihp.cli import main

REPO = Path(__file__).resolve().parents[1]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_set_the_people_and_an_export_are_written_private_whatever_the_umask(tmp_path: Path,
                                                                                 open_umask: None) -> None:
    keys = KeyDir(tmp_path / "state" / "keys")
    assert keys.create() and not keys.create()
    assert _mode(keys.path) == 0o700 and _mode(keys.path.parent) == 0o700  # the directories the platform made
    assert sorted(keys.private_ids()) == ["analytics", "console", "engine", "executor", "rank"]
    assert all(_mode(keys.private_path(k)) == 0o600 for k in keys.private_ids())
    assert _mode(keys.public_path) == 0o644  # public, but in a directory only its owner enters

    own = keys.add_person("alice", tmp_path / "alice" / "keys")
    assert _mode(own) == 0o600 and _mode(own.parent) == 0o700 and _mode(own.parent / "public.json") == 0o644
    assert "person.alice" in json.loads(keys.public_path.read_text())["keys"]
    assert keys.read_private("person.alice") is None  # the administrator keeps no copy of her key
    with pytest.raises(KeyFileError, match="--replace"):
        keys.add_person("alice")

    written = keys.export(["executor", "rank"], tmp_path / "trainer-host")
    assert sorted(p.name for p in written) == ["executor.key", "public.json", "rank.key"]
    assert sorted(p.name for p in (tmp_path / "trainer-host").iterdir()) == ["executor.key", "public.json", "rank.key"]
    assert _mode(tmp_path / "trainer-host") == 0o700 and _mode(tmp_path / "trainer-host" / "rank.key") == 0o600
    assert KeyDir(tmp_path / "trainer-host").read_public().keys() == keys.read_public().keys()
    with pytest.raises(KeyFileError, match="holds no private key for person.alice"):
        keys.export(["person.alice"], tmp_path / "nowhere")


@pytest.mark.processes
def test_processes_that_make_the_key_set_at_once_agree_on_one(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    code = "import sys; from collector.keys import KeyDir; print(KeyDir(__import__('pathlib').Path(sys.argv[1])).create())"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert sorted(out.strip() for out, _ in outs) == ["False", "False", "False", "True"]
    public = KeyDir(path).read_public()
    for key_id in public:  # every private key on disk is the half of the one public key everyone reads
        private = KeyDir(path).read_private(key_id)
        assert private is not None and private.public_key().public_bytes_raw() == public[key_id].public_bytes_raw()
    assert [p.name for p in tmp_path.iterdir()] == ["keys"]  # no half-made directory left behind


def test_resihp_keys_makes_lists_and_exports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = ["--dir", str(tmp_path / "keys")]
    assert main(["keys", "create", *where]) == 0
    assert main(["keys", "add-person", "bob", *where]) == 0
    capsys.readouterr()
    assert main(["keys", "list", "--json", *where]) == 0
    rows = {r["key_id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"analytics", "console", "engine", "executor", "rank", "person.bob"}
    assert rows["person.bob"]["signs_as"] == "cli:bob" and all(r["private_here"] for r in rows.values())
    assert main(["keys", "export", "--key", "rank", "--out", str(tmp_path / "ranks"), *where]) == 0
    capsys.readouterr()
    assert main(["keys", "list", "--json", "--dir", str(tmp_path / "ranks")]) == 0
    here = {r["key_id"] for r in map(json.loads, capsys.readouterr().out.splitlines()) if r["private_here"]}
    assert here == {"rank"}
    with pytest.raises(SystemExit, match="cannot name a key"):
        main(["keys", "add-person", "Bob Smith", *where])
