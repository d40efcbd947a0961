"""CurveZMQ key pairs for the trajectory transport, and the ``t1async keys DIR`` command.

Layout written by :func:`write_keys` (zmq.auth certificate files, Z85 text)::

    DIR/learner.key          learner public key   (every actor machine needs it)
    DIR/learner.key_secret   learner key pair     (only the learner's machine)
    DIR/NAME.key             actor public key     (NAME = rollout unless --client is given)
    DIR/NAME.key_secret      actor key pair       (every actor machine)
    DIR/authorized/NAME.key  public keys the learner accepts (ZAP: anything else is refused)

Source: ZeroMQ RFC 26 (CurveZMQ), RFC 27 (ZAP) and pyzmq's ``zmq.auth`` helpers.
"""

from __future__ import annotations

import argparse
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

LEARNER = "learner"
DEFAULT_CLIENT = "rollout"
CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""An actor key name: a letter or digit, then letters, digits, ``_``, ``.``, ``-`` (no path separators)."""


class KeysError(ValueError):
    """A key file is missing or unreadable, or a keys folder or client name is unusable; the message
    names it and what to do."""


def check_client_name(name: str) -> str:
    """Return ``name`` if it can name an actor key pair.

    Raises:
        KeysError: empty, not a plain file name (path separators, ``..``), or ``learner``.
    """
    if name == LEARNER:
        raise KeysError(f"--client {name!r} is the learner's own key name; pick another name, e.g. rollout-1")
    if not CLIENT_NAME.fullmatch(name):
        raise KeysError(f"--client {name!r} is not a valid key name; use letters, digits, '_', '.', '-' "
                        "(starting with a letter or digit, at most 64 characters, no '/'), e.g. rollout-1")
    return name


@dataclass
class ServerKeys:
    """The learner's key pair (Z85 bytes) and the folder of authorized actor public keys."""

    public: bytes
    secret: bytes
    authorized_dir: Path


@dataclass
class ClientKeys:
    """An actor's key pair (Z85 bytes) and the learner's public key it expects."""

    public: bytes
    secret: bytes
    server_public: bytes


def write_keys(directory: str | Path, clients: list[str] | tuple[str, ...] = (DEFAULT_CLIENT,)) -> list[Path]:
    """Create the learner's key pair (if missing) and one pair per client name (if missing).

    Returns:
        The files written. Existing key pairs are kept, never overwritten.

    Raises:
        KeysError: a client name is invalid (see :func:`check_client_name`), or ``directory`` is
            a file or cannot be created.
    """
    for name in clients:
        check_client_name(name)
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise KeysError(f"keys folder {d} exists and is not a folder; pass a folder path (it is created if missing)")
    try:
        (d / "authorized").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KeysError(f"keys folder {d} cannot be created ({e.strerror or e}); pass a writable folder path") from None
    written: list[Path] = []
    try:
        for name in (LEARNER, *clients):
            if not (d / f"{name}.key_secret").exists():
                pub, sec = zmq.auth.create_certificates(str(d), name)
                (Path(sec)).chmod(0o600)
                written += [Path(pub), Path(sec)]
            if name != LEARNER and not (d / "authorized" / f"{name}.key").exists():
                shutil.copy(d / f"{name}.key", d / "authorized" / f"{name}.key")
                written.append(d / "authorized" / f"{name}.key")
    except OSError as e:
        raise KeysError(f"cannot write keys to {d} ({e.strerror or e}); pass a writable folder path "
                        f"(written so far: {[str(f) for f in written]})") from None
    return written


def run_keys_dir(run_dir: str | Path) -> Path:
    """The CurveZMQ keys of a run on one host: ``RUN_DIR/keys`` (owner-only, mode 0700), the learner's
    pair and the rollout actors' pair made on first use (:func:`write_keys`) and kept for a resume
    (the actors' spools are resent with the same keys). What launch uses when ``transport.curve`` is
    on and ``transport.keys_dir`` is empty.

    Raises:
        KeysError: the folder cannot be written.
    """
    d = Path(run_dir) / "keys"
    write_keys(d)
    d.chmod(0o700)
    return d


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeysError(f"key file {path} is missing; create the keys with `t1async keys {path.parent}` "
                        "(and copy the needed files to this machine)")
    try:
        return zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as e:
        raise KeysError(f"key file {path} is not a zmq.auth certificate: {e}") from None


def server_keys(keys_dir: str | Path) -> ServerKeys:
    """The learner's keys from ``keys_dir`` (``transport.keys_dir``).

    Raises:
        KeysError: ``learner.key_secret`` or ``authorized/`` is missing.
    """
    d = Path(keys_dir)
    pub, sec = _load(d / f"{LEARNER}.key_secret", True)
    if not (d / "authorized").is_dir():
        raise KeysError(f"{d / 'authorized'} is missing; run `t1async keys {d}`")
    assert sec is not None
    return ServerKeys(pub, sec, d / "authorized")


def client_keys(keys_dir: str | Path, name: str = DEFAULT_CLIENT) -> ClientKeys:
    """An actor's keys from ``keys_dir``: ``NAME.key_secret`` and the learner's ``learner.key``.

    Raises:
        KeysError: a file is missing.
    """
    d = Path(keys_dir)
    pub, sec = _load(d / f"{name}.key_secret", True)
    server_pub, _ = _load(d / f"{LEARNER}.key", False)
    assert sec is not None
    return ClientKeys(pub, sec, server_pub)


def register_keys(sub: argparse._SubParsersAction) -> None:
    """``t1async keys DIR [--client NAME ...]``."""
    p = sub.add_parser("keys", help="write CurveZMQ key pairs for transport.curve (learner + rollout actors)")
    p.add_argument("dir", help="folder to write the keys to (transport.keys_dir)")
    p.add_argument("--client", action="append", default=None,
                   help=f"name of an actor key pair to create (repeatable; default {DEFAULT_CLIENT}; letters, "
                        f"digits, '_', '.', '-'; not {LEARNER})")
    p.set_defaults(func=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    """Write the keys and list the files; returns 0."""
    written = write_keys(args.dir, args.client or [DEFAULT_CLIENT])
    for f in written:
        print(f)
    print(f"keys in {args.dir}: set transport.curve=true transport.keys_dir={args.dir}" if written else
          f"keys in {args.dir} already exist; nothing written")
    return 0
