"""CURVE and the allow-list on real sockets, the keygen command, and the config rule for leaving loopback.

A broker (in-process, real tcp ROUTER) and a learner weight publisher run with a key folder; a client
whose key is allowed is served, one whose key is not (or one without CURVE) gets nothing and the refusal
is counted. Runs in ~8 s (three 1.5 s waits for answers that must not come, one 1.1 s allow-list reload).
"""

import asyncio
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from agentstream.config import Config, ConfigError
from agentstream.wire import messages as P
from agentstream.wire.addresses import free_port
from agentstream.wire.client import SyncClient
from agentstream.wire.curve import is_loopback, keygen, load_client_keys, load_server_keys, secure_client
from broker.server import Broker
from broker.spec import broker_spec
from launcher.checks import check_config

REPO = Path(__file__).resolve().parents[3]


def keygen_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentstream.wire.curve", "keygen", *args],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_keygen_command_writes_usable_keys(tmp_path) -> None:
    keys = tmp_path / "keys"
    done = keygen_cli(str(keys))
    assert done.returncode == 0, done.stderr
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret", "allowed/client.key"):
        assert (keys / name).is_file(), name
    assert stat.S_IMODE((keys / "server.key_secret").stat().st_mode) == 0o600  # secrets readable by the owner only
    server, client = load_server_keys(keys), load_client_keys(keys)
    assert len(server.public) == len(server.secret) == 40  # z85 of 32-byte curve25519 keys
    assert client.server_public == server.public and client.public != server.public
    assert (keys / "allowed" / "client.key").read_bytes() == (keys / "client.key").read_bytes()
    # Another machine's folder: its own pair as client.*, the server's public key, and allowed by the server.
    done = keygen_cli(str(keys), "--client", "host-b", "--export", str(tmp_path / "host-b"))
    assert done.returncode == 0, done.stderr
    other = load_client_keys(tmp_path / "host-b")
    assert other.server_public == server.public and other.public != client.public
    assert not (tmp_path / "host-b" / "server.key_secret").exists()  # the server's secret stays home
    assert (keys / "allowed" / "host-b.key").read_bytes() == (tmp_path / "host-b" / "client.key").read_bytes()
    # Never overwrites a key: whoever holds it would be locked out.
    done = keygen_cli(str(keys))
    assert done.returncode == 2 and "exists already" in done.stderr


def broker_config(keys: Path) -> Config:
    cfg = Config()
    cfg.env.group_size, cfg.trainer.groups_per_step, cfg.learner.world_size = 2, 1, 1
    cfg.broker.curve_keys_dir = str(keys)
    return cfg


async def ask_group(client: SyncClient, timeout_s: float) -> P.Message:
    """EngineStatus, then GroupRequest: the broker's answer. In a thread: the broker's ZAP handler runs on
    this event loop, and a blocking send waits for the handshake it decides."""

    def ask() -> P.Message:
        client.send(P.EngineStatus(engine="e", url="u", version=0))
        return client.request(P.GroupRequest(actor=client.name), timeout_s)

    return await asyncio.to_thread(ask)


def refused(address: str, keys: Path | None, wait_s: float = 1.5) -> bool:
    """Whether a DEALER with the client pair of `keys` (None: no CURVE) gets no answer from the broker.
    A send only leaves once the handshake succeeded: a refused client's send would block, so it must not."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(wait_s * 1000))
    if keys is not None:
        secure_client(sock, load_client_keys(keys))
    sock.connect(address)
    try:
        sock.send_multipart(P.encode(P.GroupRequest(actor="intruder")))
        return not sock.poll(int(wait_s * 1000))
    except zmq.Again:
        return True
    finally:
        sock.close()


async def test_curve_broker_serves_allowed_keys_only(tmp_path) -> None:
    keys, stranger = tmp_path / "keys", tmp_path / "stranger"
    keygen(keys)
    keygen(stranger)  # a valid key pair, but not in keys/allowed
    shutil.copy(keys / "server.key", stranger / "server.key")  # it even knows the right server key
    port = free_port()
    broker = Broker(broker_spec(broker_config(keys)), port, free_port())
    task = asyncio.create_task(broker.serve())
    while broker.status != "running":
        await asyncio.sleep(0.01)
    address = f"tcp://127.0.0.1:{port}"
    clients = [SyncClient(address, "friend", curve_keys_dir=str(keys))]
    try:
        assert isinstance(await ask_group(clients[0], 5), P.GroupGrant)
        # In threads: the broker's ZAP handler runs on this event loop.
        assert await asyncio.to_thread(refused, address, stranger)
        assert await asyncio.to_thread(refused, address, None)  # plain TCP cannot talk to a CURVE server
        assert broker.rejected.get("curve_denied", 0) >= 1  # the stranger's handshakes (it retries)
        assert broker.summary()["groups_admitted"] == 1  # only the friend's request got through
        # A key added to allowed/ is taken at its next handshake: no restart needed.
        shutil.copy(stranger / "client.key", keys / "allowed" / "stranger.key")
        await asyncio.sleep(1.1)  # the allow-list re-reads its folder at most once a second
        clients.append(SyncClient(address, "late", curve_keys_dir=str(stranger)))
        assert isinstance(await ask_group(clients[1], 5), P.GroupGrant)
    finally:
        for client in clients:
            client.close()
        broker.stop()
        await task


def test_weight_publisher_accepts_allowed_agents_only(tmp_path) -> None:
    from learner.publish import WeightPublisher

    keys, stranger = tmp_path / "keys", tmp_path / "stranger"
    keygen(keys)
    keygen(stranger)
    shutil.copy(keys / "server.key", stranger / "server.key")
    ctx = zmq.Context.instance()
    with WeightPublisher("tcp://127.0.0.1:0", curve_keys_dir=str(keys)) as pub:
        socks = []
        for name, folder in (("engine-ok", keys), ("engine-bad", stranger)):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, name.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 2000)  # a refused client's send waits for a handshake that never comes
            secure_client(sock, load_client_keys(folder))
            sock.connect(pub.address)
            socks.append(sock)
            try:
                sock.send_multipart(P.encode(P.EngineStatus(engine=name, url="u", version=0)))
            except zmq.Again:
                assert name == "engine-bad"  # refused before its message could even be queued
        deadline = time.monotonic() + 5
        while "engine-ok" not in pub.engine_versions() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the stranger has had time to try (and fail) too
        assert pub.engine_versions() == {"engine-ok": 0}
        assert pub._curve is not None and pub._curve.allow.denied >= 1
        for sock in socks:
            sock.close()


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("gpu-node-3", False),
    ],
)
def test_loopback_addresses(host, loopback) -> None:
    assert is_loopback(host) is loopback


def test_config_refuses_to_leave_loopback_without_keys(tmp_path) -> None:
    cfg = Config()
    check_config(cfg)  # the default binds everything to 127.0.0.1
    cfg.broker.host = "0.0.0.0"
    with pytest.raises(ConfigError, match=r"broker.host .*python -m agentstream.wire.curve keygen"):
        check_config(cfg)
    cfg.broker.allow_insecure_bind = True  # said explicitly: a trusted network
    check_config(cfg)
    cfg.broker.allow_insecure_bind = False
    cfg.broker.curve_keys_dir = str(tmp_path / "keys")
    with pytest.raises(ConfigError, match="is not a folder"):
        check_config(cfg)
    keygen(tmp_path / "keys")
    check_config(cfg)
    (tmp_path / "keys" / "server.key_secret").unlink()
    with pytest.raises(ConfigError, match="has no server.key_secret"):
        check_config(cfg)
    cfg.broker.curve_keys_dir, cfg.broker.host, cfg.learner.weight_host = "", "127.0.0.1", "192.168.1.4"
    with pytest.raises(ConfigError, match="learner.weight_host"):
        check_config(cfg)
    # vLLM's HTTP has no authentication: CURVE keys do not cover it, only the explicit opt-in does.
    keygen(tmp_path / "keys2")
    cfg.learner.weight_host, cfg.broker.curve_keys_dir, cfg.engines.host = (
        "127.0.0.1",
        str(tmp_path / "keys2"),
        "0.0.0.0",
    )
    with pytest.raises(ConfigError, match="engines.host"):
        check_config(cfg)
    cfg.broker.allow_insecure_bind = True
    check_config(cfg)
