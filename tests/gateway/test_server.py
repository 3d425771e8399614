"""The gateway against real parts: the session's vLLM server of the tiny model (`tiny_engine`), a broker on real
ZeroMQ sockets, the gateway's aiohttp server, and agent code using the real `openai` client and
gateway/episode_client.py in a thread of its own (as agent code runs: synchronous, beside the service).

    .venv/bin/python -m pytest tests/gateway/test_server.py -q -p no:cacheprovider     # ~40 s for vLLM, then ~15 s

Checked: a chat completion with tools round-trips (a forced call comes back as `tool_calls`, its result goes back
as a tool message); the transitions at the broker carry exactly the ids the engine was given and produced (the
learner's batch against the gateway's answers, and against the engine asked directly with the same seed); a
multi-turn prompt extends the previous prompt + answer ids without re-tokenising the answer (whose text would
tokenise differently); every bad-input class gets its 4xx, an OpenAI error body, and a count; a group the
staleness bound does not admit yet answers 429 with Retry-After, and a held open goes through once it is.
"""

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import numpy as np
import openai
import pytest
from e2e_testing import dealer
from transformers import AutoTokenizer

from agentstream.config import Config, SamplingConfig
from agentstream.wire import messages as P
from agentstream.wire.addresses import free_port
from agentstream.wire.client import AsyncClient
from broker.server import Broker
from broker.spec import broker_spec
from engines.client import EngineClient
from gateway.episode_client import GatewayError, open_episode
from gateway.server import Gateway
from gateway.spec import GatewaySpec

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The country a city is in.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


@dataclass
class Stack:
    gateway: Gateway
    url: str
    broker: Broker
    broker_address: str
    engine: EngineClient
    tokenizer: object
    session: aiohttp.ClientSession


@pytest.fixture
async def stack(tiny_engine) -> AsyncIterator[Stack]:
    model, engine_url = tiny_engine
    cfg = Config()
    cfg.model.path = model
    cfg.env.group_size = 2
    cfg.trainer.groups_per_step = 1
    cfg.trainer.max_staleness = 0  # one group admitted before the learner's version 1: the 429 path
    cfg.learner.world_size = 1
    cfg.sampling.max_tokens = 16
    cfg.gateway.chat_template = "gateway/templates/chatml_tools.jinja"  # the tiny model's own ignores tools
    cfg.gateway.admission_timeout_s = 0.5
    cfg.gateway.max_body_bytes = 64 * 1024
    port = free_port()
    broker = Broker(broker_spec(cfg), port, free_port())
    serving = asyncio.create_task(broker.serve())
    while broker.status != "running":
        await asyncio.sleep(0.01)
    address = f"tcp://127.0.0.1:{port}"
    client = AsyncClient(address, name="gateway-0")
    await client.start(0, 64, 5.0)
    session = aiohttp.ClientSession()
    engine = EngineClient(engine_url, session, 60)
    tokenizer = AutoTokenizer.from_pretrained(model)
    gw = Gateway(GatewaySpec.from_config(cfg), client, [engine], tokenizer)
    url = await gw.start()
    try:
        yield Stack(gw, url, broker, address, engine, tokenizer, session)
    finally:
        await gw.close()
        await client.close()
        await session.close()
        broker.stop()
        await serving


def chat(base_url: str, api_key: str, **kwargs):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return client.chat.completions.create(model="policy", extra_body={"return_token_ids": True}, **kwargs)


async def test_tool_calls_round_trip_and_the_broker_gets_the_engines_exact_ids(stack: Stack) -> None:
    tok = stack.tokenizer
    system = {"role": "system", "content": "Answer with a tool call."}

    def agent() -> dict:
        out: dict = {}
        ep, ep2 = open_episode(stack.url, "task-a"), open_episode(stack.url, "task-a")
        assert ep.group_id == ep2.group_id and ep.seed == ep2.seed  # one task id: one group
        # Turn 1, the call forced (the random tiny model would never write one by itself): a real tool call back.
        msgs = [system, {"role": "user", "content": "Where is paris?"}]
        r1 = chat(
            ep.base_url,
            ep.api_key,
            messages=msgs,
            tools=TOOLS,
            max_tokens=400,
            seed=1,
            logprobs=True,
            tool_choice={"type": "function", "function": {"name": "lookup"}},
        )
        ep.reward(0.25)
        call = r1.choices[0].message.tool_calls[0]
        # Turn 2: the call and its result go back, as agent code does it.
        msgs2 = msgs + [
            r1.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "France"},
        ]
        r2 = chat(ep.base_url, ep.api_key, messages=msgs2, tools=TOOLS, max_tokens=16, seed=2, logprobs=True)
        out["return"] = ep.finish(reward=1.0)
        # The other episode of the group: plain chat, two turns, the second asked with the bearer key on /v1.
        msgs3 = [{"role": "user", "content": "Say something."}]
        r3 = chat(ep2.base_url, ep2.api_key, messages=msgs3, max_tokens=24, seed=3, logprobs=True)
        msgs4 = msgs3 + [
            {"role": "assistant", "content": r3.choices[0].message.content},
            {"role": "user", "content": "More."},
        ]
        r4 = chat(
            stack.url + "/v1",
            ep2.api_key,
            messages=msgs4,
            max_tokens=8,
            seed=4,
            logprobs=True,
            temperature=0.7,
            stop=["!"],
        )
        ep2.finish(reward=0.0)
        out.update(r1=r1, r2=r2, r3=r3, r4=r4, call=call, msgs4=msgs4)
        return out

    out = await asyncio.to_thread(agent)
    r1, r2, r3, r4, call = out["r1"], out["r2"], out["r3"], out["r4"], out["call"]
    assert out["return"] == 1.25
    assert r1.choices[0].finish_reason == "tool_calls" and call.function.name == "lookup"
    assert json.loads(call.function.arguments)["city"] in ("paris", "rome")
    # The tools reached the prompt through the template (their schema is in the prompt text).
    assert '"name": "lookup"' in tok.decode(r1.prompt_token_ids)

    # Token fidelity. Turn 2's prompt is turn 1's prompt + answer ids + the tool message's ids only; the suffix,
    # worked out from the template: the answer ended with <|im_end|> (which the model wrote), so "\n" closes it,
    # then the tool result as a user turn, then the generation prompt.
    p1, a1 = r1.prompt_token_ids, r1.choices[0].token_ids
    assert a1[-1] == tok.eos_token_id
    assert r2.prompt_token_ids[: len(p1) + len(a1)] == p1 + a1
    assert tok.decode(r2.prompt_token_ids[len(p1) + len(a1) :]) == (
        "\n<|im_start|>user\n<tool_response>\nFrance\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    p3, a3 = r3.prompt_token_ids, r3.choices[0].token_ids
    assert r4.prompt_token_ids[: len(p3) + len(a3)] == p3 + a3
    # ... and the answer's text would have tokenised differently: rendering the chat again gives other ids.
    rendered = stack.gateway.renderer.full(out["msgs4"], [])
    assert rendered != r4.prompt_token_ids
    assert stack.gateway.counters["prompts_extended"] == 2

    # The learner's batch: the group's 4 transitions carry exactly the ids and log-probs the answers reported.
    learner = dealer(stack.broker_address, "learner-0")
    try:
        await learner.send_multipart(P.encode(P.BatchRequest(step=0, rank=0, world_size=1)))
        batch = P.decode(await asyncio.wait_for(learner.recv_multipart(), 10))
    finally:
        learner.close()
    assert isinstance(batch, P.Batch)
    got = {}
    p = r = 0
    for i in range(len(batch.traj_index)):
        n_p, n_r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        got[(int(batch.traj_index[i]), int(batch.step_index[i]))] = (
            batch.prompt_ids[p : p + n_p].tolist(),
            batch.response_ids[r : r + n_r].tolist(),
            batch.logprobs[r : r + n_r],
            float(batch.rewards[i]),
            bool(batch.dones[i]),
        )
        p, r = p + n_p, r + n_r
    assert len(got) == 4
    by_prompt = {tuple(v[0]): v for v in got.values()}
    for resp, reward, done in ((r1, 0.25, False), (r2, 1.0, True), (r3, 0.0, False), (r4, 0.0, True)):
        prompt_ids, response_ids, logprobs, got_reward, got_done = by_prompt[tuple(resp.prompt_token_ids)]
        assert response_ids == resp.choices[0].token_ids and (got_reward, got_done) == (reward, done)
        reported = np.array([t.logprob for t in resp.choices[0].logprobs.content], np.float32)
        np.testing.assert_array_equal(logprobs, reported)
    # And against the engine itself: the same prompt ids and seed sample the same ids the batch holds.
    gen = await stack.engine.generate(r3.prompt_token_ids, SamplingConfig(max_tokens=24), seed=3)
    assert gen.response_ids.tolist() == by_prompt[tuple(r3.prompt_token_ids)][1]
    c = stack.gateway.counters
    assert (c["episodes_opened"], c["episodes_finished"], c["calls"], c["transitions_sent"], c["tool_calls"]) == (
        2,
        2,
        4,
        4,
        1,
    )


async def post(url: str, data: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers or {}) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def test_every_bad_input_gets_its_4xx_and_count_and_admission_holds_or_answers_429(stack: Stack) -> None:
    url, gw = stack.url, stack.gateway
    user = [{"role": "user", "content": "hi"}]

    def agent() -> dict:
        seen: dict = {}

        def status(fn, **kwargs):
            try:
                fn(**kwargs)
            except openai.APIStatusError as exc:
                code = exc.body.get("code") if isinstance(exc.body, dict) else None
                seen.setdefault(exc.status_code, []).append(code)
                return exc.status_code
            return 200

        ep, other = open_episode(url, "t0"), open_episode(url, "t0")
        seen["other"] = other.id
        assert status(chat, base_url=url + "/episodes/nope/v1", api_key="x", messages=user) == 404
        assert status(chat, base_url=url + "/v1", api_key="not-an-episode", messages=user) == 404
        bad_tools = [{"type": "function", "function": {"name": "", "parameters": {}}}]
        assert status(chat, base_url=ep.base_url, api_key="x", messages=user, tools=bad_tools) == 400
        assert status(chat, base_url=ep.base_url, api_key="x", messages=[{"role": "wizard", "content": "hi"}]) == 400
        assert status(chat, base_url=ep.base_url, api_key="x", messages=user, n=2) == 400
        huge = [{"role": "user", "content": "x" * (70 * 1024)}]  # over gateway.max_body_bytes = 64 KiB
        assert status(chat, base_url=ep.base_url, api_key="x", messages=huge) == 413
        with pytest.raises(GatewayError, match="no model call"):
            ep.finish(reward=1.0)  # no step to end yet
        assert status(chat, base_url=ep.base_url, api_key="x", messages=user, max_tokens=4) == 200
        raw = openai.OpenAI(base_url=other.base_url, api_key="x", max_retries=0)  # /v1/completions, /v1/models
        c = raw.completions.create(model="policy", prompt="Hello", max_tokens=4, logprobs=0, stop=["!"])
        assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens >= 1
        assert raw.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=2).usage.prompt_tokens == 3
        assert [m.id for m in raw.models.list()] == ["policy"]
        ep.finish(reward=1.0)
        assert status(chat, base_url=ep.base_url, api_key="x", messages=user) == 409  # a late call
        with pytest.raises(GatewayError, match="finished"):
            ep.finish(reward=1.0)
        return seen

    seen = await asyncio.to_thread(agent)
    other = seen.pop("other")
    assert seen == {
        404: ["unknown_episode", "unknown_episode"],
        400: ["invalid_request"] * 3,
        413: ["body_too_large"],
        409: ["episode_finished"],
    }
    status, body, _ = await post(url + "/episodes/x/v1/chat/completions", b"{}")
    assert status == 404  # the episode is looked up first
    status, body, _ = await post(f"{url}/episodes/{other}/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    assert body["error"]["type"] == "invalid_request_error"
    status, body, _ = await post(url + "/episodes", json.dumps({"task": 1}).encode())
    assert status == 400 and body["error"]["param"] == "task_id"

    # Admission: group 0 (t0) was admitted; with max_staleness 0 the next waits for the learner's version 1.
    status, body, headers = await post(url + "/episodes", json.dumps({"task_id": "t1"}).encode())
    assert status == 429 and headers["Retry-After"] == "1" and body["error"]["type"] == "rate_limit_error"
    held = asyncio.create_task(asyncio.to_thread(open_episode, url, "t1", 30.0))
    await asyncio.sleep(1.0)
    assert not held.done()  # held (retrying after Retry-After), not lost
    control = dealer(stack.broker_address, "control")
    try:
        await control.send_multipart(P.encode(P.VersionUpdate(version=1)))
        await control.send_multipart(P.encode(P.EngineStatus(engine="e", url="u", version=1)))
        ep = await asyncio.wait_for(held, 20)
    finally:
        control.close()
    assert ep.group_id == 1
    c = gw.counters
    assert {k: c[k] for k in c if k.startswith("rejected_")} == {
        "rejected_unknown_episode": 3,
        "rejected_invalid_request": 4,
        "rejected_body_too_large": 1,
        "rejected_no_step": 1,
        "rejected_episode_finished": 2,
        "rejected_invalid_json": 1,
        "rejected_busy": c["rejected_busy"],
    }
    assert c["rejected_busy"] >= 2  # the first 429, and at least one while held
    # Closing says so to the broker (final stats), which settles the groups of the episodes left open (t0's other
    # episode, t1's) as a departed actor's: none stays open.
    assert stack.broker.buffer.open
    await gw.close()
    for _ in range(100):
        if not stack.broker.buffer.open:
            break
        await asyncio.sleep(0.05)
    assert not stack.broker.buffer.open


async def test_a_silent_agents_group_is_dropped_whole_and_its_late_calls_refused(stack: Stack) -> None:
    """An agent that stops calling (dead, or hung) would hold its group open for good: after
    gateway.episode_idle_timeout_s without a request the gateway drops the group whole with an abandon marker (the
    broker counts what it held as dropped `infra_agent_silent`, as a dead actor's groups), and a late call gets 410."""
    url, gw, buffer = stack.url, stack.gateway, stack.broker.buffer
    user = [{"role": "user", "content": "hi"}]

    def agent() -> tuple:
        done, silent = open_episode(url, "t0"), open_episode(url, "t0")  # group 0, both of its places
        chat(done.base_url, "x", messages=user, max_tokens=4)
        done.finish(reward=1.0)  # a whole trajectory: its one step goes to the broker
        chat(silent.base_url, "x", messages=user, max_tokens=4)  # its step is held until the next call... none comes
        return done, silent

    done, silent = await asyncio.to_thread(agent)
    gw.cfg.episode_idle_timeout_s = 1.5  # (only now: a slow call of `done` must not make `silent` look dead)
    assert buffer.open and buffer.counts["transitions_ingested"] == 1
    for _ in range(60):
        if buffer.counts["groups_dropped_infra_agent_silent"]:
            break
        await asyncio.sleep(0.25)
    assert gw.counters["episodes_abandoned"] == 1  # (the finished one was not open)
    # Dropped: the finished trajectory's step and the marker (ingested, so that acked = ingested + rejected holds);
    # the silent episode's held step was never sent. Nothing of the group is served.
    assert buffer.counts["groups_dropped_infra_agent_silent"] == 1
    assert buffer.counts["transitions_dropped_infra_agent_silent"] == 2 == buffer.counts["transitions_ingested"]
    assert not buffer.open and not buffer.ready

    def late() -> list:
        codes = []
        for call in (lambda: chat(silent.base_url, "x", messages=user, max_tokens=4), lambda: silent.finish(1.0)):
            try:
                call()
            except openai.APIStatusError as exc:
                codes.append((exc.status_code, exc.body.get("code")))
            except GatewayError as exc:
                codes.append((410, str(exc)))
        return codes

    codes = await asyncio.to_thread(late)
    assert codes[0] == (410, "episode_abandoned") and "given up" in codes[1][1]
    assert gw.counters["rejected_episode_abandoned"] == 2


async def test_with_a_run_key_only_its_holder_opens_episodes(stack: Stack) -> None:
    """gateway.key_file: opening an episode needs `Authorization: Bearer <run key>` (401 `bad_key` without it or
    with another); the episode's calls then go with the episode's own key, as without a run key."""
    url, gw, key = stack.url, stack.gateway, "k" * 40
    gw.spec = dataclasses.replace(gw.spec, key=key)
    for headers in ({}, {"Authorization": "Bearer " + "x" * 40}, {"Authorization": key}):
        status, body, _ = await post(url + "/episodes", json.dumps({"task_id": "t0"}).encode(), headers)
        assert (status, body["error"]["code"]) == (401, "bad_key"), headers

    def agent() -> int:
        with pytest.raises(GatewayError, match="gateway key"):
            open_episode(url, "t0")
        ep = open_episode(url, "t0", key=key)
        answer = chat(ep.base_url, ep.api_key, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        ep.finish(reward=1.0)
        return answer.usage.completion_tokens

    assert await asyncio.to_thread(agent) >= 1
    assert gw.counters["rejected_bad_key"] == 4 and gw.counters["episodes_finished"] == 1


async def test_an_episode_whose_engine_is_gone_moves_to_another_and_its_chain_holds(stack: Stack) -> None:
    """Two engines, the first one gone (nothing listens at its port): an episode opened on it gets its answer from
    the other (the same prompt ids, counted as a failover) and stays there; its next call still extends the
    previous prompt + answer ids. With no engine left that answers, the call is a 502 `engine_error`."""
    gw = stack.gateway
    gone = EngineClient(f"http://127.0.0.1:{free_port()}", stack.session, 5)
    gw.engines[:] = [gone, stack.engine]
    gw.pool.picks = 0  # the next episode opens on `gone`
    user = [{"role": "user", "content": "hi"}]

    def agent() -> tuple:
        ep = open_episode(stack.url, "t0")
        first = chat(ep.base_url, ep.api_key, messages=user, max_tokens=4, seed=3)
        again = user + [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "more"},
        ]
        second = chat(ep.base_url, ep.api_key, messages=again, max_tokens=4, seed=4)
        ep.finish(reward=1.0)
        return first, second

    first, second = await asyncio.to_thread(agent)
    assert gw.counters["engine_failovers"] == 1 and gw.counters["engine_errors"] == 1
    p1, r1 = first.prompt_token_ids, first.choices[0].token_ids
    assert second.prompt_token_ids[: len(p1) + len(r1)] == p1 + r1
    assert gw.counters["prompts_extended"] == 1
    gw.engines[:] = [gone]  # no engine that answers: the agent hears so, in OpenAI's form

    def lost() -> tuple:
        ep = open_episode(stack.url, "t0")  # (the group's second place: the bound admits no second group)
        with pytest.raises(openai.APIStatusError) as exc:
            chat(ep.base_url, ep.api_key, messages=user, max_tokens=4)
        return exc.value.status_code, exc.value.body.get("code")

    assert await asyncio.to_thread(lost) == (502, "engine_error")
