"""The OpenAI-compatible gateway: agent code written against the OpenAI API plays training episodes through it.

The process is `python -m gateway` (gateway/__main__.py). In a program:

    gw = Gateway(GatewaySpec.from_config(cfg), broker, [EngineClient(url, session, 120)], tokenizer)
    url = await gw.start()                      # http://127.0.0.1:PORT
    ...                                         # agents: gateway.episode_client.open_episode(url, task_id)
    await gw.close()

HTTP API:
    POST /episodes {"task_id": str}        -> {"id", "base_url", "api_key", "group_id", "seed", ...}
                                              (G episodes of one task id form one group the broker admitted;
                                              waits for admission up to gateway.admission_timeout_s, else 429)
    POST /episodes/<id>/reward {"reward"}  -> adds to the latest step's reward (per-step rewards)
    POST /episodes/<id>/finish {"reward", "truncated"?} -> the last step gets `reward` and ends the trajectory
    POST /episodes/<id>/abandon {"reason"?} -> the agent gives up (its env failed): the episode's group is dropped
    POST /episodes/<id>/v1/chat/completions, POST /episodes/<id>/v1/completions, GET /episodes/<id>/v1/models
    POST /v1/chat/completions, ... with `Authorization: Bearer <episode id>` instead of the path
    GET  /health

Each call goes to an engine as token ids (the chat template with tools applied here, once) and its answer
becomes one transition of the episode, streamed to the broker as an actor's are (`AsyncClient`, acknowledged,
resent after a broker restart). A call that continues the episode's previous one builds its prompt from the
previous prompt's and answer's ids plus the new messages' ids only (`gateway.render`). Bad input gets a 4xx
with an OpenAI error body and is counted (`Gateway.counters`, `rejected_<code>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from agentstream.config import SamplingConfig
from agentstream.wire.client import AsyncClient
from agentstream.wire.messages import Hello, Stats, Transition
from engines.client import EngineClient, EngineError, Generation
from engines.pool import EnginePool, goodbye, report_stats
from envs.toolcalls import get_parser
from gateway import protocol
from gateway.episodes import ENDED_KEPT, ChatTurn, GatewayEpisode, Registry, Slot
from gateway.protocol import ApiError, Sampling
from gateway.render import Renderer, ended_with_eos
from gateway.spec import GatewaySpec

log = logging.getLogger("gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SHARED_COUNTERS = ("tokens_generated", "transitions_sent", "episode_return_sum", "engine_errors", "engine_failovers")
"""Counters reported under the names actors use (the others as gateway_<name>)."""


class Gateway:
    """The gateway service: episodes, their groups, the HTTP API. One per process, on one event loop."""

    def __init__(
        self,
        spec: GatewaySpec,
        broker: AsyncClient,
        engines: list[EngineClient],
        tokenizer: Any,
        name: str = "gateway-0",
        incarnation: int = 0,
    ):
        if not engines:
            raise ValueError("the gateway needs at least one engine")
        self.spec, self.cfg, self.broker, self.engines = spec, spec.gateway, broker, engines
        self.name, self.incarnation = name, incarnation
        self.tokenizer = tokenizer
        self.renderer = Renderer(tokenizer, spec.chat_template())
        self.parse_tools = get_parser(self.cfg.tool_parser)
        self.counters: Counter[str] = Counter()
        self.episodes = Registry(ENDED_KEPT)
        self._slots: dict[str, Slot] = {}  # task id -> the group of it still taking episodes
        self.pool = EnginePool(self.engines)  # the engine of each new episode, and of one moving off a failed one
        self.requests_in_flight = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._reporter: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        app.router.add_get("/health", self._health)
        app.router.add_post("/episodes", self._open)
        app.router.add_post("/episodes/{eid}/reward", self._reward)
        app.router.add_post("/episodes/{eid}/finish", self._finish)
        app.router.add_post("/episodes/{eid}/abandon", self._abandon)
        for prefix in ("/episodes/{eid}/v1", "/v1"):
            app.router.add_post(prefix + "/chat/completions", self._chat)
            app.router.add_post(prefix + "/completions", self._completions)
            app.router.add_get(prefix + "/models", self._models)
        return app

    async def start(self, hello: bool = True) -> str:
        """Say hello to the broker (unless the caller did: `main` does, to learn the engines), start reporting
        stats, serve HTTP; returns the gateway's base URL."""
        if hello:
            await self.broker.send(Hello(role="actor", name=self.name, incarnation=self.incarnation, pid=os.getpid()))
        self._reporter = asyncio.create_task(
            report_stats(self.broker, self.stats, self.spec.log_interval_s), name=f"{self.name}-stats"
        )
        self._sweeper = asyncio.create_task(self._sweep_loop(), name=f"{self.name}-idle-episodes")
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.cfg.host}:{port}"
        return self.url

    async def close(self, drain_timeout_s: float = 5.0) -> None:
        """Stop serving, wait (bounded) until the broker acknowledged what was sent, send the final stats: the
        broker then settles the groups of episodes left open as it does a departed actor's. Closing twice is a no-op."""
        if self._runner is None:
            return
        await self._runner.cleanup()
        self._runner = None
        for task in (self._reporter, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for slot in self._slots.values():
            slot.grant.cancel()
        await goodbye(self.broker, lambda: self.stats(final=True), drain_timeout_s)

    def stats(self, final: bool = False) -> Stats:
        """Reported as an actor's: the counters actors share under their names (an episode is one finished
        episode, a step one model call; a call whose tool calls did not parse is an invalid action), again under
        env/gateway/ (the dashboard's per-environment rows), and the gateway's own as gateway_<name>."""
        c = self.counters
        delivery = {k: float(v) for k, v in self.broker.counters.items()}
        shared = {
            "episodes": c["episodes_finished"],
            "env_steps": c["calls"],
            "invalid_actions": sum(v for k, v in c.items() if k.startswith("tool_parse_")),
            **{k: c[k] for k in SHARED_COUNTERS},
        }
        per_env = {
            f"env/gateway/{k}": shared[k] for k in ("episodes", "episode_return_sum", "env_steps", "invalid_actions")
        }
        own = {f"gateway_{k}": v for k, v in c.items() if k not in SHARED_COUNTERS}
        own.update(
            gateway_rejected=sum(v for k, v in c.items() if k.startswith("rejected_")),
            gateway_tool_parse_failures=shared["invalid_actions"],
        )
        return Stats(
            source=self.name,
            role="actor",
            counters={**shared, **per_env, **own, **delivery},
            gauges={
                "episodes_in_flight": len(self.episodes),
                "requests_in_flight": self.requests_in_flight,
                "incarnation": self.incarnation,
                "unacked_transitions": self.broker.unacked,
            },
            final=final,
        )

    async def _sweep_loop(self) -> None:
        """Once a second: an open episode with no request for gateway.episode_idle_timeout_s (and none in progress)
        belongs to an agent taken for dead, and its group goes whole, as a dead actor's does."""
        while True:
            await asyncio.sleep(1.0)
            limit = time.monotonic() - self.cfg.episode_idle_timeout_s
            silent = [e for e in self.episodes.open.values() if not e.lock.locked() and e.last_request < limit]
            for episode in silent:
                if not episode.finished:  # (an earlier one of its group took it along)
                    why = (
                        f"its group {episode.grant.group_id} was dropped: episode {episode.id[:12]}... made no "
                        f"request for {self.cfg.episode_idle_timeout_s:g} s (gateway.episode_idle_timeout_s), its "
                        f"agent taken for dead"
                    )
                    await self._abandon_group(episode, "agent_silent", why)

    async def _abandon_group(self, silent: GatewayEpisode, cause: str, why: str) -> int:
        """Drop `silent`'s group whole: an abandon marker for it (agentstream.wire.messages.ABANDON_GROUP; the
        broker counts what it held as dropped `infra_<cause>`), its open episodes refused from now on (410),
        and no new episode joins the group. Returns the episodes given up."""
        gid = silent.grant.group_id
        log.warning("%s", why)
        for task_id, slot in list(self._slots.items()):
            if slot.grant.done() and not slot.grant.cancelled() and slot.grant.result().group_id == gid:
                del self._slots[task_id]
        members = [e for e in self.episodes.open.values() if e.grant.group_id == gid]
        sent = {e.id: e.abandon(why) for e in members}
        for e in members:
            self.episodes.ended(e)
        self.counters["episodes_abandoned"] += len(members)
        await self.broker.send_transition(
            Transition.abandon_marker(
                silent.traj_id, gid, self.name, sent[silent.id], silent.grant.min_version, cause, whole_group=True
            )
        )
        self.counters["transitions_sent"] += 1
        return len(members)

    # ------------------------------------------------------------------------------------ errors
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every refusal as an OpenAI error body, counted under rejected_<code>; never a bare 500."""
        self.counters["requests"] += 1
        try:
            return await handler(request)
        except ApiError as exc:
            err = exc
        except web.HTTPRequestEntityTooLarge:
            err = ApiError(413, f"request body over gateway.max_body_bytes={self.cfg.max_body_bytes}", "body_too_large")
        except web.HTTPException as exc:  # no such route (404), wrong method (405)
            code = {404: "unknown_route", 405: "method_not_allowed"}.get(exc.status, f"http_{exc.status}")
            err = ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}", code)
        except EngineError as exc:
            self.counters["engine_errors"] += 1
            body = {"error": {"message": str(exc), "type": "api_error", "param": None, "code": "engine_error"}}
            return web.json_response(body, status=502)
        except Exception as exc:  # a bug or a broker gone: said in OpenAI's form, counted, logged with its trace
            log.exception("%s %s failed", request.method, request.path)
            self.counters["internal_errors"] += 1
            body = {
                "error": {
                    "message": f"internal error: {exc!r}",
                    "type": "api_error",
                    "param": None,
                    "code": "internal_error",
                }
            }
            return web.json_response(body, status=500)
        self.counters[f"rejected_{err.code}"] += 1
        return web.json_response(err.body(), status=err.status, headers=err.headers)

    async def _json(self, request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > self.cfg.max_body_bytes:
            raise ApiError(
                413,
                f"request body of {request.content_length} bytes is over gateway.max_body_bytes="
                f"{self.cfg.max_body_bytes}",
                "body_too_large",
            )
        raw = await request.read()
        try:
            return json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            raise ApiError(400, "the request body is not valid JSON", "invalid_json") from None

    def _episode(self, request: web.Request) -> GatewayEpisode:
        """The episode a call is for: its id in the path, else the bearer key."""
        eid = request.match_info.get("eid")
        if eid is None:
            eid = protocol.bearer(request.headers)
            if not eid:
                raise ApiError(
                    401,
                    "say which episode this call is for: use the episode's base_url "
                    "(/episodes/<id>/v1) or its api_key as the bearer token",
                    "no_episode",
                )
        episode = self.episodes.get(eid)
        episode.last_request = time.monotonic()
        return episode

    # ------------------------------------------------------------------------------------ episodes
    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _open(self, request: web.Request) -> web.Response:
        key = protocol.bearer(request.headers).encode()
        if self.spec.key and not hmac.compare_digest(key, self.spec.key.encode()):
            raise ApiError(
                401,
                "opening an episode needs the run's gateway key: send `Authorization: Bearer <key>` "
                "with the key in the run's gateway.key_file",
                "bad_key",
            )
        body = await self._json(request)
        task_id = body.get("task_id") if isinstance(body, dict) else None
        if not isinstance(task_id, str) or not task_id or len(task_id) > 200:
            raise ApiError(
                400,
                "POST /episodes needs {'task_id': a non-empty string of at most 200 characters}; "
                "episodes of one task id form a group",
                "invalid_request",
                "task_id",
            )
        if len(self.episodes) >= self.cfg.max_episodes:
            raise self._busy(f"{self.cfg.max_episodes} episodes are open (gateway.max_episodes); finish some first")
        while True:
            slot = self._slots.get(task_id)
            if slot is None or slot.members >= self.spec.group_size:
                slot = self._slots[task_id] = Slot(task_id, asyncio.create_task(self.broker.request_group()))
            try:
                async with asyncio.timeout(self.cfg.admission_timeout_s):  # (not wait_for: see actors/episode.py)
                    grant = await asyncio.shield(slot.grant)
            except TimeoutError:
                raise self._busy(
                    "the broker admits no new group now (the learner is behind: staleness bound); "
                    "retry after Retry-After seconds"
                ) from None
            if slot.members < self.spec.group_size:  # others waiting on the same grant may have filled it
                break
        index = slot.members
        slot.members += 1
        if slot.members == self.spec.group_size and self._slots.get(task_id) is slot:
            del self._slots[task_id]
        eid = secrets.token_urlsafe(18)
        engine = self.pool.pick()
        traj_id = f"{self.name}.{self.incarnation}.g{grant.group_id}.{index}"
        self.episodes.add(GatewayEpisode(eid, task_id, grant, index, traj_id, engine))
        self.counters["episodes_opened"] += 1
        return web.json_response(
            {
                "id": eid,
                "api_key": eid,
                "base_url": f"{self.url}/episodes/{eid}/v1",
                "task_id": task_id,
                "group_id": grant.group_id,
                "index": index,
                "seed": grant.seed,
            },
            status=201,
        )

    def _busy(self, message: str) -> ApiError:
        return ApiError(429, message, "busy", headers={"Retry-After": str(self.cfg.retry_after_s)})

    async def _reward(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        value = protocol.reward_of(await self._json(request), required=True)
        async with episode.lock:
            if episode.pending is None:
                raise ApiError(409, "no model call in this episode yet: a reward belongs to a step", "no_step")
            episode.reward(value)
        return web.json_response({"id": episode.id, "step": episode.steps - 1, "return": episode.total_reward})

    async def _finish(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        body = await self._json(request)
        value = protocol.reward_of(body, required=False)
        truncated = body.get("truncated", False) if isinstance(body, dict) else False
        if not isinstance(truncated, bool):
            raise ApiError(400, "'truncated' must be a boolean", "invalid_request", "truncated")
        async with episode.lock:
            if episode.finished:
                raise ApiError(409, f"episode {episode.id!r} is finished already", "episode_finished")
            if episode.pending is None:
                raise ApiError(
                    409, "this episode made no model call: it has no step to end (make one call first)", "no_step"
                )
            last = episode.finish(value, truncated)
            self.episodes.ended(episode)
            await asyncio.shield(self.broker.send_transition(last))  # recorded as finished: it must go out
        self.counters.update(episodes_finished=1, transitions_sent=1)
        self.counters["episode_return_sum"] += episode.total_reward
        return web.json_response({"id": episode.id, "steps": episode.steps, "return": episode.total_reward})

    async def _abandon(self, request: web.Request) -> web.Response:
        """The agent gives up on an episode because something outside the model failed (its env's reward raised or
        is not a number, its rollout crashed): the episode's group is dropped whole at once, as a silent agent's is
        after gateway.episode_idle_timeout_s (counted as `episodes_abandoned`; the broker's `infra_agent_failed`)."""
        episode = self._episode(request)
        body = await self._json(request)
        reason = body.get("reason", "") if isinstance(body, dict) else ""
        if not isinstance(reason, str):
            raise ApiError(400, "'reason' must be a string", "invalid_request", "reason")
        async with episode.lock:
            if episode.finished:
                raise ApiError(409, f"episode {episode.id!r} is finished already", "episode_finished")
            gid = episode.grant.group_id
            why = (
                f"its group {gid} was dropped: the agent gave up on episode {episode.id[:12]}...: "
                f"{reason[:300] or 'no reason given'}"
            )
            given_up = await self._abandon_group(episode, "agent_failed", why)
        return web.json_response({"id": episode.id, "group_id": gid, "abandoned": given_up})

    # ------------------------------------------------------------------------------------ OpenAI API
    async def _models(self, request: web.Request) -> web.Response:
        if "eid" in request.match_info:
            self._episode(request)
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.spec.model_name, "object": "model", "created": 0, "owned_by": "agentstream"}],
            }
        )

    def _limits(self) -> tuple[int, int]:
        return self.spec.default_max_tokens, self.spec.max_model_len - 1

    async def _chat(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        body = await self._json(request)
        req = protocol.chat_request(body, *self._limits())
        async with episode.lock:
            if episode.finished:
                raise ApiError(409, f"episode {episode.id!r} is finished", "episode_finished")
            new = episode.next_prompt(req.messages, req.tools)
            if (
                new is not None
                and (
                    tail := self.renderer.suffix(
                        new, req.tools, ended_with_eos(episode.last.response_ids, self.renderer.eos_id)
                    )
                )
                is not None
            ):  # type: ignore[union-attr]
                prompt = episode.last.prompt_ids + episode.last.response_ids + tail  # type: ignore[union-attr]
                self.counters["prompts_extended"] += 1
            else:
                if episode.last is not None:
                    self.counters["prompts_rendered_anew"] += 1  # history edited, tools changed: whole chat again
                prompt = self.renderer.full(req.messages, req.tools)
            forced = (
                [req.tool_choice]
                if req.tool_choice not in ("none", "auto", "required")
                else (req.tool_names if req.tool_choice == "required" else [])
            )
            extra: dict[str, Any] = {"stop": req.sampling.stop} if req.sampling.stop else {}
            if forced:  # the engine writes one call as JSON under its schema (vLLM structured outputs; compact
                # with the engines' --structured-outputs-config, engines/server.py)
                extra["structured_outputs"] = {"json": protocol.tool_call_schema(req.tools, forced)}
            gen = await self._generate(episode, prompt, req.sampling, extra)
            parsed = None
            if req.tools and req.tool_choice != "none":
                parsed = get_parser("json")(gen.text, forced) if forced else self.parse_tools(gen.text, req.tool_names)
                if parsed.error is not None:
                    self.counters[f"tool_parse_{parsed.error}"] += 1
                self.counters["tool_calls"] += len(parsed.tool_calls)
            content = gen.text if parsed is None else parsed.content
            calls = [] if parsed is None else parsed.tool_calls
            message = protocol.assistant_message(content, calls)
            answer = protocol.messages([message])[0]
            episode.last = ChatTurn(req.messages, req.tools, prompt, gen.response_ids.tolist(), answer)
            await self._record(
                episode,
                prompt,
                gen,
                valid=parsed is None or parsed.error is None,
                info={"tool_calls": len(calls), "finish_reason": gen.finish_reason},
            )
        finish = "tool_calls" if calls else gen.finish_reason
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": {"content": self._logprobs(gen)} if req.sampling.logprobs else None,
        }
        out = protocol.envelope(
            "chat.completion",
            "chatcmpl",
            self.spec.model_name,
            prompt,
            gen.response_ids.tolist(),
            choice,
            req.return_token_ids,
        )
        return web.json_response(out)

    async def _completions(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        req = protocol.completion_request(await self._json(request), *self._limits())
        async with episode.lock:
            if episode.finished:
                raise ApiError(409, f"episode {episode.id!r} is finished", "episode_finished")
            prompt = (
                list(req.prompt)
                if isinstance(req.prompt, list)
                else list(self.tokenizer(req.prompt, add_special_tokens=True)["input_ids"])
            )
            extra: dict[str, Any] = {"stop": req.sampling.stop} if req.sampling.stop else {}
            gen = await self._generate(episode, prompt, req.sampling, extra)
            episode.last = None  # a raw completion is not a chat turn: the next chat call renders anew
            await self._record(episode, prompt, gen, valid=True, info={"finish_reason": gen.finish_reason})
        choice: dict[str, Any] = {"index": 0, "text": gen.text, "finish_reason": gen.finish_reason, "logprobs": None}
        if req.sampling.logprobs:
            lps = self._logprobs(gen)
            choice["logprobs"] = {
                "tokens": [x["token"] for x in lps],
                "token_logprobs": [x["logprob"] for x in lps],
                "top_logprobs": None,
                "text_offset": None,
            }
        out = protocol.envelope(
            "text_completion",
            "cmpl",
            self.spec.model_name,
            prompt,
            gen.response_ids.tolist(),
            choice,
            req.return_token_ids,
        )
        return web.json_response(out)

    async def _generate(
        self, episode: GatewayEpisode, prompt: list[int], s: Sampling, extra: dict[str, Any]
    ) -> Generation:
        if len(prompt) + s.max_tokens > self.spec.max_model_len:
            raise ApiError(
                400,
                f"the prompt is {len(prompt)} tokens and max_tokens {s.max_tokens}: more than the "
                f"engines' context of {self.spec.max_model_len} (engines.max_model_len)",
                "context_length_exceeded",
                "messages",
            )
        self.requests_in_flight += 1
        try:
            tries = len(self.engines)  # (at least one)
            for tried in range(1, tries + 1):
                try:
                    return await episode.engine.generate(
                        prompt, SamplingConfig(s.max_tokens, s.temperature, s.top_p), seed=s.seed, extra=extra
                    )
                except EngineError as exc:
                    if tried == tries:
                        raise
                    self._fail_over(episode, exc)
        finally:
            self.requests_in_flight -= 1

    def _fail_over(self, episode: GatewayEpisode, exc: EngineError) -> None:
        """`episode`'s engine failed a call: the episode moves to another engine, which gets the same prompt ids
        (the episode's chain of ids is unchanged; the answer's versions are the new engine's)."""
        episode.engine = self.pool.pick(leaving=episode.engine)
        self.counters.update(engine_errors=1, engine_failovers=1)
        log.warning("%s: %s; episode %s... moves to %s", self.name, exc, episode.id[:8], episode.engine.url)

    def _logprobs(self, gen: Generation) -> list[dict[str, Any]]:
        return protocol.token_logprobs(gen.response_ids.tolist(), gen.logprobs.tolist(), self.tokenizer.decode)

    async def _record(
        self, episode: GatewayEpisode, prompt: list[int], gen: Generation, valid: bool, info: dict[str, Any]
    ) -> None:
        """The answered call becomes the episode's latest step; the one before it, now final, goes to the broker."""
        ready = episode.step(
            prompt, gen.response_ids, gen.logprobs, gen.version_lo, gen.version_hi, self.name, info, valid
        )
        self.counters.update(calls=1, tokens_generated=int(gen.response_ids.size), prompt_tokens=len(prompt))
        if ready is not None:  # shielded: a caller that hangs up must not lose a step already taken from the episode
            await asyncio.shield(self.broker.send_transition(ready))
            self.counters["transitions_sent"] += 1


__all__ = ["Gateway"]
