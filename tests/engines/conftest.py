"""Shared helpers for the engines tests: a fake vLLM server (HTTP only) for the fast tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from agentstream.wire.addresses import free_port


@dataclass
class FakeVLLM:
    """Answers the endpoints engines/ uses, records every call, and fails where told to."""

    url: str = ""
    version: str | None = "default"
    calls: list[str] = field(default_factory=list)
    fail: dict[str, int] = field(default_factory=dict)  # path -> HTTP status to answer instead
    bump_on_completion: bool = False  # an update lands while a completion is being served
    drop_connections: int = 0  # close this many connections without answering (a keep-alive race)
    completion: dict[str, Any] = field(
        default_factory=lambda: {
            "token_ids": [5, 6, 2],
            "text": "ab",
            "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-0.5, -1.25, -0.125]},
        }
    )
    bodies: list[Any] = field(default_factory=list)
    token_route: bool = False  # serves /inference/v1/generate (else FastAPI's bare 404, as vLLM without
    # --enable-scale-out); its answer's weight_versions: `spans`, or one span of the current version
    spans: list[dict[str, Any]] | None = None
    choice_spans: list[list[dict[str, Any]]] | None = None  # choice i's weight_versions (for n > 1), else `spans`
    choices: int | None = None  # answer this many choices (None: the `n` asked for, 1 if none)
    models: set[str] | None = None  # the names it serves (None: any), as vLLM answers 404 for another; a LoRA adapter
    # loaded (/v1/load_lora_adapter) adds its name

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        self.calls.append(path)
        if self.drop_connections > 0:
            self.drop_connections -= 1
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)  # never reaches the client
        if path in self.fail:
            return web.Response(status=self.fail[path], text=f"injected failure of {path}")
        body = await request.json() if request.can_read_body else None
        self.bodies.append(body)
        if self.models is not None and path in ("/v1/completions", "/inference/v1/generate", "/v1/load_lora_adapter"):
            if path == "/v1/load_lora_adapter":
                self.models.add(body["lora_name"])
            elif body["model"] not in self.models:
                return web.json_response(
                    {
                        "error": {
                            "message": f"The model `{body['model']}` does not exist.",
                            "type": "NotFoundError",
                            "code": 404,
                        }
                    },
                    status=404,
                )
        if path == "/weight_info":
            return web.json_response({"weight_version": self.version})
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return web.json_response({"success": True})
        if path == "/v1/completions":
            if self.bump_on_completion:
                self.version = str(int(self.version) + 1)
            return web.json_response({"choices": [self.completion] * (self.choices or body.get("n", 1))})
        if path == "/inference/v1/generate":
            if not self.token_route:
                return web.Response(status=404, text='{"detail":"Not Found"}', content_type="application/json")
            n = len(self.completion["token_ids"])
            labelled = None if self.version in (None, "default") else [{"version": self.version, "start": 0, "end": n}]
            lps = [
                {"token_id": t, "logprob": lp}
                for t, lp in zip(self.completion["token_ids"], self.completion["logprobs"]["token_logprobs"])
            ]
            spans = [self.spans if self.spans is not None else labelled] * (
                self.choices or body["sampling_params"].get("n", 1)
            )
            choices = [
                {
                    **self.completion,
                    "index": i,
                    "logprobs": {"content": lps},
                    "weight_versions": self.choice_spans[i] if self.choice_spans else s,
                }
                for i, s in enumerate(spans)
            ]
            return web.json_response({"output_mode": "text", "choices": choices})
        if path == "/collective_rpc":
            return web.json_response({"results": [{"retied": True}]})
        if path == "/reset_prefix_cache":
            return web.json_response({"success": True})
        return web.json_response({"status": "ok"})


@pytest.fixture
async def fake_vllm():
    fake = FakeVLLM()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    await runner.cleanup()
