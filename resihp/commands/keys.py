"""``resihp keys``: the signing keys of control events — make the set, add a person, export what
one host needs, list them.

A key directory (``RESIHP_KEYS``, default ``.resihp/keys``, mode 0700) holds ``public.json``, every
signer's Ed25519 public key, which every process reads, and the private keys (``KEY_ID.key``, 0600)
of what the processes of this host sign. Key ids are the roles — ``engine``, ``analytics``,
``console`` (the web console), ``executor`` (launcher, agents, simulator, the integration API's
listener), ``rank`` (probe results only) — and ``person.NAME`` for an operator who decides from the
command line as ``cli:NAME``. The platform makes the set on first use; these commands hand it out:

  resihp keys create                                # the set, one key per role (if missing)
  resihp keys add-person alice --out /home/alice/.resihp/keys
  resihp keys export --key rank --out ranks-keys    # public.json + rank.key, for the training hosts
  resihp keys list

Copy an exported directory to its host as it is (mode 0700) and point ``RESIHP_KEYS`` at it there.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="make, hand out and list the keys that sign control events",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    acts = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    def with_dir(q: argparse.ArgumentParser) -> argparse.ArgumentParser:
        q.add_argument("--dir", type=Path, default=None,
                       help="the key directory (default: RESIHP_KEYS, else .resihp/keys)")
        return q

    c = with_dir(acts.add_parser("create", help="make the key set, one Ed25519 key pair per role, unless it exists"))
    c.set_defaults(func=_create)

    a = with_dir(acts.add_parser("add-person", help="a key pair for an operator who decides from the command line"))
    a.add_argument("name", metavar="NAME", help="the person (signs as cli:NAME; lower-case letters, digits, _.@+-)")
    a.add_argument("--out", type=Path, default=None,
                   help="put the private key (and a copy of public.json) in this directory, the person's own "
                        "(default: the key directory)")
    a.add_argument("--replace", action="store_true", help="give a person who has a key a new one (the old stops verifying)")
    a.set_defaults(func=_add_person)

    e = with_dir(acts.add_parser("export", help="public.json and only the named private keys, for one host"))
    e.add_argument("--key", dest="keys", action="append", default=[], metavar="KEY_ID",
                   help="a private key to include: a role (engine, analytics, console, executor, rank) or "
                        "person.NAME; repeat for several; none: public keys only (a host that only reads)")
    e.add_argument("--out", type=Path, required=True, help="the directory to write (made 0700)")
    e.set_defaults(func=_export)

    ls = with_dir(acts.add_parser("list", help="every key id, its fingerprint, and whether its private key is here"))
    ls.add_argument("--json", action="store_true", help="one JSON object per key")
    ls.set_defaults(func=_list)


def _dir(args: argparse.Namespace):  # collector.keys.KeyDir, imported late
    from collector.auth import key_path
    from collector.keys import KeyDir

    return KeyDir((args.dir or key_path()).expanduser())


def _refusing(action: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A key directory that cannot be used, or a file that cannot be written, ends the command with
    one line that names it (collector/keys.py's errors name the fix), never a traceback."""
    def run(args: argparse.Namespace) -> int:
        from collector.keys import KeyFileError

        try:
            return action(args)
        except (KeyFileError, OSError) as exc:
            raise SystemExit(f"resihp keys {args.action}: {exc}") from None

    return run


@_refusing
def _create(args: argparse.Namespace) -> int:
    keys = _dir(args)
    made = keys.create()
    print(f"{'made' if made else 'kept'} the key set in {keys.path}")
    return _list(argparse.Namespace(**{**vars(args), "json": False}))


@_refusing
def _add_person(args: argparse.Namespace) -> int:
    from collector.keys import person_key_id

    keys = _dir(args)
    key_id = person_key_id(args.name)
    path = keys.add_person(args.name, args.out, replace=args.replace)
    print(f"{key_id}: private key {path} (0600); its public key is in {keys.public_path}")
    print(f"{args.name} signs as cli:{args.name} with RESIHP_KEYS={path.parent} "
          f"(`resihp plans approve PLAN --as {args.name}`); hand the file to them alone")
    return 0


@_refusing
def _export(args: argparse.Namespace) -> int:
    written = _dir(args).export(args.keys, args.out)
    for path in written:
        print(path)
    print(f"copy {args.out} to the host (keep it 0700) and set RESIHP_KEYS to it there")
    return 0


@_refusing
def _list(args: argparse.Namespace) -> int:
    from collector.keys import fingerprint, person_of, role_of

    keys = _dir(args)
    public = keys.read_public()
    here = set(keys.private_ids())
    rows = [{"key_id": k, "signs_as": f"cli:{person_of(k)}" if person_of(k) else role_of(k),
             "fingerprint": fingerprint(v), "private_here": k in here} for k, v in sorted(public.items())]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"key directory {keys.path}")
    print(f"{'KEY ID':<28} {'SIGNS AS':<10} {'FINGERPRINT':<17} PRIVATE KEY HERE")
    for row in rows:
        print(f"{row['key_id']:<28} {row['signs_as']:<10} {row['fingerprint']:<17} {'yes' if row['private_here'] else '-'}")
    stray = sorted(here - set(public))
    if stray:
        print(f"private keys with no public key (nothing they sign verifies): {', '.join(stray)}")
    return 0
