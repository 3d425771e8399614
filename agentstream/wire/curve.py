"""CURVE encryption and an allow-list of client keys for the ZeroMQ sockets that leave loopback.

    python -m agentstream.wire.curve keygen KEYS                  # a new key folder for a run
    python -m agentstream.wire.curve keygen KEYS --client host-b --export KEYS-host-b
                                                           # one more allowed client, as a folder to copy
    python scripts/launch.py broker.curve_keys_dir=KEYS broker.host=0.0.0.0

A key folder holds, as `zmq.auth.create_certificates` writes them (z85 text, `*.key_secret` mode 0600):

    server.key, server.key_secret   the servers' key pair (broker ROUTER, learner weight ROUTER)
    client.key, client.key_secret   the key pair this machine's clients use (actors, learner, weight sidecars)
    allowed/NAME.key                public keys of the clients the servers accept

A server socket is a CURVE server with a ZAP handler (`CurveServer`) that accepts a client only if its
public key is in allowed/ (re-read when an unknown key knocks, so a key added there takes effect without a
restart) and counts and logs every refusal. A client socket (`secure_client`) needs its own key pair and
the server's public key. Another machine gets a folder made by `--export` (server.key and its own client
pair, named client.*), which is all its clients need.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth import create_certificates, load_certificate, load_certificates
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

SERVER, CLIENT, ALLOWED = "server", "client", "allowed"
KEYGEN_COMMAND = "python -m agentstream.wire.curve keygen KEYS"


class KeyFolderError(ValueError):
    """A key folder that is missing or incomplete; the text says which file and how to make it."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a socket on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything, so it counts as leaving the machine


# ---------------------------------------------------------------------------------------------- keys
def keygen(
    folder: str | os.PathLike[str], client: str = CLIENT, export: str | os.PathLike[str] | None = None
) -> list[Path]:
    """Make `folder`'s server pair (if absent) and a client pair named `client` that the servers allow.

    With `export`, the new pair is written there instead, as client.key/client.key_secret, beside a copy
    of server.key: the folder another machine's clients use as broker.curve_keys_dir (its secret never
    sits in `folder`). Returns the files written. Never overwrites a key (that would lock out its holder)."""
    root = Path(folder)
    allowed = root / ALLOWED / f"{client}.key"
    if allowed.exists():
        raise KeyFolderError(f"{allowed} exists already; pick another --client name")
    allowed.parent.mkdir(parents=True, exist_ok=True)
    written = [] if (root / f"{SERVER}.key_secret").exists() else _create_pair(root, SERVER)
    if export is None:
        written += _create_pair(root, client)
        shutil.copy(root / f"{client}.key", allowed)
    else:
        out = Path(export)
        out.mkdir(parents=True, exist_ok=True)
        written += _create_pair(out, CLIENT)
        shutil.copy(out / f"{CLIENT}.key", allowed)
        shutil.copy(root / f"{SERVER}.key", out / f"{SERVER}.key")
        written.append(out / f"{SERVER}.key")
    return [*written, allowed]


def _create_pair(folder: Path, name: str) -> list[Path]:
    if (folder / f"{name}.key_secret").exists():
        raise KeyFolderError(f"{folder / name}.key_secret exists already; refusing to overwrite a key")
    public, secret = create_certificates(folder, name)
    os.chmod(secret, 0o600)
    return [Path(public), Path(secret)]


@dataclass(frozen=True)
class ServerKeys:
    """What a CURVE server socket needs."""

    public: bytes
    """The server's public key (z85); clients must know it."""
    secret: bytes
    """The server's secret key (z85)."""
    allowed_dir: Path
    """Folder of the public keys of the clients it accepts."""


@dataclass(frozen=True)
class ClientKeys:
    """What a CURVE client socket needs."""

    public: bytes
    """The client's public key (z85); the server's allowed/ must hold it."""
    secret: bytes
    """The client's secret key (z85)."""
    server_public: bytes
    """The public key of the server it connects to (z85)."""


def keys_dir_errors(folder: str, server: bool) -> list[str]:
    """What is missing in key folder `folder` for clients (and, if `server`, for servers too)."""
    root = Path(folder)
    if not root.is_dir():
        return [f"broker.curve_keys_dir={folder!r} is not a folder; make one with `{KEYGEN_COMMAND}`."]
    need = [f"{SERVER}.key", f"{CLIENT}.key_secret"] + ([f"{SERVER}.key_secret"] if server else [])
    missing = [name for name in need if not (root / name).is_file()]
    if missing:
        return [
            (
                f"broker.curve_keys_dir={folder!r} has no {', '.join(missing)}; make the folder with "
                f"`{KEYGEN_COMMAND}` (another machine's clients: `... --client NAME --export DIR`)."
            )
        ]
    errors = []
    if server and not list((root / ALLOWED).glob("*.key")):
        errors.append(
            f"{root / ALLOWED} holds no client key (*.key): no client could connect; "
            f"add one with `python -m agentstream.wire.curve keygen {folder} --client NAME --export DIR`."
        )
    return errors


def load_server_keys(folder: str | os.PathLike[str]) -> ServerKeys:
    """The server pair and allow-list folder of key folder `folder`; raises KeyFolderError if incomplete."""
    errors = keys_dir_errors(str(folder), server=True)
    if errors:
        raise KeyFolderError(" ".join(errors))
    public, secret = load_certificate(Path(folder) / f"{SERVER}.key_secret")
    assert secret is not None
    return ServerKeys(public=public, secret=secret, allowed_dir=Path(folder) / ALLOWED)


def load_client_keys(folder: str | os.PathLike[str]) -> ClientKeys:
    """The client pair and the server's public key of key folder `folder`; raises KeyFolderError if incomplete."""
    errors = keys_dir_errors(str(folder), server=False)
    if errors:
        raise KeyFolderError(" ".join(errors))
    public, secret = load_certificate(Path(folder) / f"{CLIENT}.key_secret")
    server_public, _ = load_certificate(Path(folder) / f"{SERVER}.key")
    assert secret is not None
    return ClientKeys(public=public, secret=secret, server_public=server_public)


# ---------------------------------------------------------------------------------------------- sockets
def secure_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make `sock` a CURVE client of the server whose public key `keys` holds (before connect)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


class AllowList:
    """ZAP credentials provider (pyzmq `configure_curve_callback`): a client is accepted iff its public key
    is a *.key file of `folder`. An unknown key re-reads the folder (at most once per second), so keys
    added there take effect at once (a removed key only after a restart: known keys never re-read it).
    `denied` counts refused handshakes; each refused key is logged once."""

    def __init__(self, folder: Path, on_deny: Callable[[str], None] | None = None):
        self.folder = folder
        self.allowed = 0
        self.denied = 0
        self._on_deny = on_deny
        self._keys = load_certificates(folder)
        self._loaded_at = time.monotonic()
        self._logged: set[bytes] = set()

    def callback(self, domain: str, z85_key: bytes) -> bool:
        if z85_key not in self._keys and time.monotonic() - self._loaded_at > 1.0:
            self._keys = load_certificates(self.folder)
            self._loaded_at = time.monotonic()
        if z85_key in self._keys:
            self.allowed += 1
            return True
        self.denied += 1
        if z85_key not in self._logged and len(self._logged) < 1000:
            self._logged.add(z85_key)
            log.warning(
                "refused a CURVE client whose public key %s is not in %s", z85_key.decode(errors="replace"), self.folder
            )
        if self._on_deny is not None:
            self._on_deny(z85_key.decode(errors="replace"))
        return False


class CurveServer:
    """CURVE for the server sockets of one ZeroMQ context: a ZAP handler with the folder's allow-list.

    One per context (ZeroMQ has one ZAP endpoint per context); an asyncio context gets the asyncio
    authenticator (create it inside the running loop), any other a thread. `stop()` after closing sockets."""

    def __init__(self, ctx: zmq.Context, folder: str | os.PathLike[str], on_deny: Callable[[str], None] | None = None):
        self.keys = load_server_keys(folder)
        self.allow = AllowList(self.keys.allowed_dir, on_deny)
        auth_cls = AsyncioAuthenticator if isinstance(ctx, zmq.asyncio.Context) else ThreadAuthenticator
        self._auth = auth_cls(ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self.allow)

    def secure(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server (before bind)."""
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()


# ---------------------------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentstream.wire.curve", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    k = sub.add_parser("keygen", help="make a key folder, or add an allowed client to one")
    k.add_argument("folder", help="the key folder (broker.curve_keys_dir)")
    k.add_argument("--client", default=CLIENT, help="name of the new client key pair (default: client)")
    k.add_argument(
        "--export",
        default=None,
        help="also write server.key and the new pair as client.* into this folder (for another machine)",
    )
    args = p.parse_args(argv)
    try:
        written = keygen(args.folder, args.client, args.export)
    except KeyFolderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(f"use it with: python scripts/launch.py broker.curve_keys_dir={Path(args.export or args.folder).resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
