"""The learner's weight publisher without engines: safetensors payloads (full weights, a LoRA adapter) and the
ROUTER that hands each version to every weight sidecar (fake sidecars here: DEALER sockets)."""

from __future__ import annotations

import time

import pytest
import torch
import zmq
from safetensors.torch import load

from agentstream.wire.messages import EngineStatus, WeightUpdate, decode, encode
from learner.publish import WeightPublisher, serialize_state_dict

ADAPTER = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(8, 128),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(128, 8),
}
CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj"]}


# ------------------------------------------------------------------------------------ serialisation
def test_serialize_drops_exact_aliases_and_copies_views():
    embed = torch.randn(6, 4)
    base = torch.arange(10.0)
    sd = {"model.embed_tokens.weight": embed, "a": base[:5], "b": base[5:], "lm_head.weight": embed}
    out = load(serialize_state_dict(sd))
    # lm_head.weight is the very tensor of the embedding (tied): left out, as save_pretrained does.
    assert sorted(out) == ["a", "b", "model.embed_tokens.weight"]
    assert torch.equal(out["model.embed_tokens.weight"], embed)
    # a and b share one storage but are different tensors: both kept, values intact.
    assert out["a"].tolist() == [0, 1, 2, 3, 4] and out["b"].tolist() == [5, 6, 7, 8, 9]


def test_serialize_keeps_equal_copies_and_casts():
    embed = torch.randn(6, 4)
    sd = {"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone(), "step": torch.tensor([3])}
    out = load(serialize_state_dict(sd, dtype=torch.bfloat16))
    assert sorted(out) == ["lm_head.weight", "model.embed_tokens.weight", "step"]
    assert out["lm_head.weight"].dtype == torch.bfloat16 and out["step"].dtype == torch.int64  # ints untouched


# ------------------------------------------------------------------------------------ publisher
def _fake_agent(address: str, name: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _recv_update(sock: zmq.Socket, timeout_s: float = 5.0) -> WeightUpdate:
    assert sock.poll(int(timeout_s * 1000)), "no weight update arrived"
    msg = decode(sock.recv_multipart())
    assert isinstance(msg, WeightUpdate)
    return msg


def test_publisher_late_registration_restart_and_timeout():
    state = {"w": torch.ones(3)}
    with WeightPublisher("tcp://127.0.0.1:*") as pub:
        pub.publish(3, state)  # nobody registered yet
        agent = _fake_agent(pub.address, "engine-a")
        agent.send_multipart(encode(EngineStatus(engine="engine-a", url="http://a", version=0)))
        assert pub.wait_for(0, 1, 5) == {"engine-a": 0}  # the registration is taken, and answered:
        update = _recv_update(agent)
        assert update.version == 3 and torch.equal(load(update.payload)["w"], torch.ones(3))
        # A heartbeat at the old version while the update is on its way must not resend the payload.
        agent.send_multipart(encode(EngineStatus(engine="engine-a", url="http://a", version=0)))
        time.sleep(0.2)
        assert pub.engine_versions() == {"engine-a": 0}
        assert not agent.poll(300)
        agent.send_multipart(encode(EngineStatus(engine="engine-a", url="http://a", version=3)))
        assert pub.wait_for(3, 1, 5) == {"engine-a": 3}
        # The agent restarted (its version went back to 0): it gets the newest weights again.
        agent.send_multipart(encode(EngineStatus(engine="engine-a", url="http://a", version=0)))
        time.sleep(0.2)  # the publisher has no thread: it takes messages whenever it is called
        assert pub.engine_versions() == {"engine-a": 0}
        assert _recv_update(agent).version == 3
        with pytest.raises(TimeoutError, match=r"0 of 1 engines run version >= 4.*'engine-a': 0"):
            pub.wait_for(4, 1, 0.3)
        with pytest.raises(ValueError, match="not newer"):
            pub.publish(3, state)
        agent.close()


def test_publisher_sends_the_newest_again_on_a_new_connection_and_only_then():
    """A sidecar whose connection to the learner was made again (EngineStatus.link went up: a partition, a
    handover) lost what was queued on the old one: the newest weights go out again. Its first connection (link
    0 -> 1) and heartbeats on the same link do not resend."""
    with WeightPublisher("tcp://127.0.0.1:*") as pub:
        old = _fake_agent(pub.address, "engine-a")
        old.send_multipart(encode(EngineStatus(engine="engine-a", url="", version=0)))  # before its handshake
        pub.wait_for(0, 1, 5)
        pub.publish(1, {"w": torch.zeros(2)})
        assert _recv_update(old).version == 1
        for link in (1, 1):  # its first connection counted, then a heartbeat: the update is on its way already
            old.send_multipart(encode(EngineStatus(engine="engine-a", url="", version=0, link=link)))
            time.sleep(0.2)
            assert pub.engine_versions() == {"engine-a": 0} and not old.poll(200)
        new = _fake_agent(pub.address, "engine-a")  # the same sidecar, connected again (ROUTER_HANDOVER)
        new.send_multipart(encode(EngineStatus(engine="engine-a", url="", version=0, link=2)))
        time.sleep(0.2)
        assert pub.engine_versions() == {"engine-a": 0}
        assert _recv_update(new).version == 1  # (to the new connection: the old one was handed over)
        for sock in (old, new):
            sock.close()


def test_publisher_sends_each_version_to_every_agent():
    with WeightPublisher("tcp://127.0.0.1:*") as pub:
        agents = [_fake_agent(pub.address, f"engine-{i}") for i in range(2)]
        for i, a in enumerate(agents):
            a.send_multipart(encode(EngineStatus(engine=f"engine-{i}", url="", version=0)))
        assert pub.wait_for(0, 2, 5) == {"engine-0": 0, "engine-1": 0}
        pub.publish(1, {"w": torch.zeros(2)})
        assert [_recv_update(a).version for a in agents] == [1, 1]
        for a in agents:
            a.close()


def test_publisher_sends_adapters_as_peft_adapter_format():
    with WeightPublisher("tcp://127.0.0.1:*") as pub:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"e")
        sock.connect(pub.address)
        sock.send_multipart(encode(EngineStatus(engine="e", url="u", version=0)))
        pub.wait_for(0, 1, 5)
        pub.publish_adapter(1, ADAPTER, CONFIG)
        assert sock.poll(5000)
        msg = decode(sock.recv_multipart())
        sock.close(0)
    assert isinstance(msg, WeightUpdate) and msg.version == 1 and msg.format == "peft_adapter"
    assert set(load(msg.payload)) == set(ADAPTER)
