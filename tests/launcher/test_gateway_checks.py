"""`gateway.*` values that cannot work stop the launch with what to change (launcher/checks.py `gateway_errors`),
and the gateway's spec takes what it needs of the config. <1 s.

    .venv/bin/python -m pytest tests/launcher/test_gateway_checks.py -q -p no:cacheprovider
"""

from __future__ import annotations

import pytest

from agentstream.config import Config
from gateway.spec import GatewaySpec
from launcher.checks import config_errors, gateway_errors


def test_the_defaults_pass_and_the_bundled_tools_template_is_found() -> None:
    cfg = Config()
    assert gateway_errors(cfg) == []
    cfg.gateway.chat_template = "gateway/templates/chatml_tools.jinja"  # relative to the repository
    assert gateway_errors(cfg) == []
    assert "<tool_call>" in GatewaySpec.from_config(cfg).chat_template()
    assert GatewaySpec.from_config(Config()).chat_template() is None


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"host": "0.0.0.0"}, "gateway.host='0.0.0.0' is not a loopback address and gateway.key_file is empty"),
        ({"key_file": "/nonexistent/gateway.key"}, "gateway.key_file='/nonexistent/gateway.key' cannot be read"),
        ({"port": 70000}, "gateway.port=70000: must be a TCP port"),
        ({"max_body_bytes": 10}, "gateway.max_body_bytes=10 (>= 1024)"),
        ({"max_episodes": 0}, "gateway.max_episodes=0 (>= 1)"),
        ({"admission_timeout_s": 0.0}, "gateway.admission_timeout_s=0.0 (> 0)"),
        ({"retry_after_s": 0}, "gateway.retry_after_s=0 (>= 1)"),
        ({"tool_parser": "mistral"}, "gateway.tool_parser='mistral' is unknown; use one of hermes, json, qwen."),
        ({"chat_template": "no/such.jinja"}, "gateway.chat_template='no/such.jinja' is not a file"),
    ],
)
def test_each_bad_value_is_named_with_what_to_change(values: dict, needle: str) -> None:
    cfg = Config()
    for key, value in values.items():
        setattr(cfg.gateway, key, value)
    errors = gateway_errors(cfg)
    assert len(errors) == 1 and needle in errors[0], errors
    assert errors[0] in config_errors(cfg)  # and the launch's checks include it


def test_no_actors_only_with_the_gateway_and_role_gateway_joins_by_address() -> None:
    cfg = Config()
    cfg.actors.count = 0
    assert any("actors.count=0: must be at least 1 (or 0 with gateway.enabled=true" in e for e in config_errors(cfg))
    cfg.gateway.enabled = True
    assert config_errors(cfg) == []  # agent code alone plays the episodes
    cfg.run.role = "gateway"
    assert any("run.role=gateway joins a running run: set broker.address" in e for e in config_errors(cfg))
    cfg.broker.address = "tcp://127.0.0.1:5555"
    assert config_errors(cfg) == []


def test_the_gateway_is_wired_on_a_fixed_port_and_started_like_an_actor(tmp_path) -> None:
    from launcher.supervisor import Launcher
    from launcher.wiring import resolved, wire

    cfg = Config()
    assert wire(cfg).gateway == "" and wire(cfg).gateway_port == 0  # off: no gateway, no port taken
    cfg.gateway.enabled = True
    cfg.engines.external_urls, cfg.engines.count = ["http://127.0.0.1:9"], 1
    w = wire(cfg)
    assert w.gateway == f"http://127.0.0.1:{w.gateway_port}" and w.gateway_port > 0
    assert resolved(cfg, w).gateway.port == w.gateway_port  # the run's config.yaml names the port in use
    launcher = Launcher(cfg, tmp_path, w)
    child = launcher.commands.gateway(incarnation=2)
    assert (child.name, child.role, child.incarnation) == ("gateway-0", "gateway", 2)
    argv = child.argv[child.argv.index("-m") + 1 :]
    assert argv == [
        "gateway",
        "--config",
        str(tmp_path / "config.yaml"),
        "--name",
        "gateway-0",
        "--incarnation",
        "2",
        "--broker",
        str(tmp_path / "broker.json"),
        "--port",
        str(w.gateway_port),
        "--engine",
        "http://127.0.0.1:9",
    ]


def test_a_gateway_off_loopback_needs_a_key_of_32_characters(tmp_path) -> None:
    cfg = Config()
    cfg.gateway.host, cfg.gateway.key_file = "0.0.0.0", str(tmp_path / "gateway.key")
    (tmp_path / "gateway.key").write_text("short\n")
    assert [e for e in gateway_errors(cfg) if "first line must be a key of 32 or more" in e]
    (tmp_path / "gateway.key").write_text("k" * 32 + "\nanything after the first line is ignored\n")
    assert gateway_errors(cfg) == [] and GatewaySpec.from_config(cfg).key == "k" * 32
