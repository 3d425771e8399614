"""OpenEnv servers played as envs (envs/openenv.py), against real `openenv-core` servers: the example game
(examples/openenv_game/server.py) served by uvicorn on 127.0.0.1 in a process of its own, as a user serves it, with
what this test adds (`make_app`): how many sessions are open (`GET /test/sessions`) and faults on chosen seeds.

- a multi-step episode on one WebSocket session: the seed fixes the secret, each guess gets the server's answer and
  reward, an invalid answer is an invalid action, the session ends with the episode; the project's launch-time
  checker (envs/check.py, gymnasium's checker included) passes the adapter;
- concurrent sessions up to the server's limit: episodes beyond it wait for a free session instead of failing;
- faults through the actor itself (actors/actor.py: a real broker on this loop, answers scripted instead of an
  engine's): a malformed observation and a step past env.step_timeout_s each have their episode played again on the
  same seed (the group stays whole); the server killed under open sessions has its episodes retried, then their
  groups dropped and counted; once it is back on its port, groups complete again.

    .venv/bin/python -m pytest tests/envs/test_openenv.py -q
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import random
import signal
import sys
import threading
import time
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from openenv.core.env_server import create_app

import envs
from agentstream.wire.addresses import free_port
from envs.base import Action, ParseFailure
from envs.openenv import OPENENV, OpenEnvError, kwargs_errors
from examples.openenv_game.server import GuessAction, GuessEnvironment, GuessObservation

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SESSIONS_ENV, FAULTS_ENV = "OPENENV_TEST_SESSIONS", "OPENENV_TEST_FAULTS"


# ---------------------------------------------------------------------------------------------- the server's side
class FaultyObservation(GuessObservation):
    prompt: str | None  # type: ignore[assignment]  (None: the malformed observation a fault sends)


class FaultyGuess(GuessEnvironment):
    """The example game, counting its open sessions (one instance per session); `FAULTS` (seed -> fault) fires once
    per seed, in the first session reset to it: "malformed" sends an observation without its text at the second
    step, "hang" answers the first step after 8 s (the actor's env.step_timeout_s is 2.5 s)."""

    FAULTS: dict[int, str] = {}
    fired: set[int] = set()
    live = peak = 0
    lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        self._seed: int | None = None
        with FaultyGuess.lock:
            FaultyGuess.live += 1
            FaultyGuess.peak = max(FaultyGuess.peak, FaultyGuess.live)

    def close(self) -> None:
        with FaultyGuess.lock:
            FaultyGuess.live -= 1

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> FaultyObservation:
        self._seed = seed
        return FaultyObservation(**super().reset(seed, episode_id).model_dump())

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> FaultyObservation:  # type: ignore[override]
        obs = FaultyObservation(**super().step(action).model_dump())
        fault = self.FAULTS.get(self._seed) if self._seed is not None else None
        with FaultyGuess.lock:
            fire = fault is not None and self._seed not in self.fired
            step = self._state.step_count
            if fire and ((fault == "malformed" and step == 2) or (fault == "hang" and step == 1)):
                self.fired.add(self._seed)  # type: ignore[arg-type]
            else:
                fire = False
        if fire and fault == "hang":
            time.sleep(8.0)
        elif fire:
            obs.prompt = None
        return obs


def make_app() -> Any:
    """The test's server: `python -m uvicorn --app-dir tests/envs --factory test_openenv:make_app` (its session limit
    and faults from the environment)."""
    FaultyGuess.FAULTS = {
        int(seed): fault
        for seed, _, fault in (f.partition(":") for f in os.environ.get(FAULTS_ENV, "").split(",") if f)
    }
    app = create_app(FaultyGuess, GuessAction, FaultyObservation, max_concurrent_envs=int(os.environ[SESSIONS_ENV]))
    app.get("/test/sessions")(lambda: {"live": FaultyGuess.live, "peak": FaultyGuess.peak})
    return app


@dataclasses.dataclass
class Server:
    url: str
    proc: Any
    log: Path

    def sessions(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.url}/test/sessions", timeout=5) as resp:
            return json.loads(resp.read())


@contextlib.contextmanager
def serving(tmp_path: Path, sessions: int, faults: str = "", port: int = 0) -> Iterator[Server]:
    """The test's server under uvicorn on 127.0.0.1 (`port`, else a free one), until the block ends."""
    from launcher.procs import start, stop

    port = port or free_port()
    log = tmp_path / f"server-{port}-{time.monotonic_ns()}.log"
    argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(HERE), "--factory", "test_openenv:make_app"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = start(argv, log, env={SESSIONS_ENV: str(sessions), FAULTS_ENV: faults}, cwd=ROOT)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}"
            try:
                server.sessions()
                break
            except OSError:
                assert time.monotonic() < deadline, f"the server did not answer:\n{log.read_text()[-3000:]}"
                time.sleep(0.1)
        yield server
    finally:
        stop(proc, 5)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server that holds 3 sessions at once, no faults."""
    with serving(tmp_path_factory.mktemp("openenv"), sessions=3) as s:
        yield s


def secret(seed: int) -> int:
    """The example game's secret for `seed` (examples/openenv_game/server.py draws it so)."""
    return random.Random(seed).randint(1, 8)


# ---------------------------------------------------------------------------------------------- the adapter
def test_an_episode_is_one_session_of_several_steps(server: Server) -> None:
    assert secret(0) == 7  # random.Random(0).randint(1, 8): the game below is played against 7
    env = envs.make(OPENENV, base_url=server.url, max_steps=8)
    assert env.blocking  # network calls: the actor runs them in threads
    obs, info = env.reset(seed=0)
    assert obs == "Guess a number from 1 to 8. You have 6 guesses." and info["valid"]
    assert env.instructions.startswith("I am thinking of a number from 1 to 8.")  # the server's own description
    assert server.sessions()["live"] == 1
    # (answer, observation, reward, terminated, valid), worked out by hand from the game's rules: every answer costs a
    # guess; an answer without a number in range is invalid (the server says so), 4 and 6 are too low, 7 is right.
    script = [
        ("hello", "Answer with one number from 1 to 8 as <action>N</action>. 5 guesses left.", 0.0, False, False),
        ("<action>4</action>", "4 is too low. 4 guesses left.", 0.0, False, True),
        (
            "I say <action>9</action>",
            "Answer with one number from 1 to 8 as <action>N</action>. 3 guesses left.",
            0.0,
            False,
            False,
        ),
        ("<action>6</action>", "6 is too low. 2 guesses left.", 0.0, False, True),
        ("<action>7</action>", "7 is right!", 1.0, True, True),
    ]
    for answer, *expected in script:
        obs, reward, terminated, truncated, info = env.step(answer)
        assert [obs, reward, terminated, info["valid"]] == expected and not truncated
        assert info["anchor"] == obs
    assert info["success"]
    env.close()  # the session ends with the episode: the server's slot is free again
    deadline = time.monotonic() + 5
    while server.sessions()["live"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.sessions()["live"] == 0


def test_the_step_limit_a_second_reset_and_the_launch_checks(server: Server) -> None:
    from envs.check import env_errors

    env = envs.make(OPENENV, base_url=server.url, max_steps=2)
    try:
        env.reset(seed=1)  # secret 3
        assert env.step("<action>1</action>")[1:4] == (0.0, False, False)
        assert env.step("<action>2</action>")[1:4] == (0.0, False, True)  # cut at max_steps=2: truncated
        assert env.reset(seed=2)[0].startswith("Guess")  # a second reset: the same session, a new game (secret 1)
        assert env.step("<action>1</action>")[:3] == ("1 is right!", 1.0, True)
    finally:
        env.close()
    # The project's launch-time check of a user's env (the text protocol, then gymnasium's checker) passes it.
    assert env_errors(OPENENV, {"base_url": server.url}, max_steps=6) == []
    assert kwargs_errors({"base_url": server.url}, serving=False) == []
    assert kwargs_errors({"app": "examples.openenv_game.server:app"}, serving=True) == []
    dead = f"http://127.0.0.1:{free_port()}"
    (said,) = kwargs_errors({"base_url": dead}, serving=True)
    assert said.startswith(f"env.kwargs.base_url={dead!r}: the OpenEnv server does not answer GET /health")
    (said,) = kwargs_errors({"app": "examples.openenv_game.nothing:app"}, serving=True)
    assert "importing 'examples.openenv_game.nothing' failed" in said
    (said,) = kwargs_errors({}, serving=True)
    assert "give env.kwargs.base_url" in said and "or env.kwargs.app" in said
    with pytest.raises(OpenEnvError, match="reset failed"):  # nothing listens there: the actor retries the episode
        envs.make(OPENENV, base_url=dead).reset(seed=0)
    with pytest.raises(ValueError, match="served by the launcher"):
        envs.make(OPENENV, app="examples.openenv_game.server:app")


def test_a_parser_makes_the_action_and_one_the_server_refuses_is_invalid(server: Server, monkeypatch) -> None:
    parsers = types.ModuleType("openenv_parsers")  # env.kwargs.parser=openenv_parsers:...
    parsers.guess = lambda text: Action({"message": text}) if "<action>" in text else ParseFailure("no <action> tag")  # type: ignore[attr-defined]
    parsers.wrong_field = lambda text: Action({"guess": text})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "openenv_parsers", parsers)
    env = envs.make(OPENENV, base_url=server.url, parser="openenv_parsers:guess")
    try:
        first, _ = env.reset(seed=0)
        obs, reward, _, _, info = env.step("hello")  # refused by the parser: nothing is sent, the game does not move
        assert (obs, reward, info["valid"], info["parse_error"]) == (first, 0.0, False, "no <action> tag")
        assert env.step("<action>4</action>")[0] == "4 is too low. 5 guesses left."  # (the first guess it got)
    finally:
        env.close()
    env = envs.make(OPENENV, base_url=server.url, parser="openenv_parsers:wrong_field")
    try:
        first, _ = env.reset(seed=0)
        obs, reward, terminated, _, info = env.step("<action>7</action>")  # the action's schema has no field `guess`
        assert (obs, reward, terminated, info["valid"]) == (first, 0.0, False, False)
        assert "VALIDATION_ERROR" in info["parse_error"]
        assert env.reset(seed=1)[0] == first  # the session goes on
    finally:
        env.close()


def test_episodes_beyond_the_servers_sessions_wait_for_one(server: Server) -> None:
    """6 episodes at once on a server of 3 sessions: the first 3 hold a session each at the same time (they meet at
    a barrier after reset), the others wait in reset until one is free, and all 6 play their game out."""
    met = threading.Barrier(3, timeout=20)

    def episode(seed: int) -> tuple[float, int]:
        env = envs.make(OPENENV, base_url=server.url, max_steps=8)
        try:
            env.reset(seed=seed)
            met.wait()  # 3 sessions open at once (the next 3 meet here too, once sessions are free)
            for guess in range(1, 9):  # 1, 2, ...: right at the secret's guess, if it comes within 6 guesses
                _, reward, terminated, truncated, _ = env.step(f"<action>{guess}</action>")
                if terminated or truncated:
                    return reward, guess
            raise AssertionError("the game did not end")
        finally:
            env.close()

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(episode, range(6)))
    # Seeds 0..5 hide 7, 3, 1, 4, 4, 5 (`secret`): guessing 1, 2, ... finds each at its own guess, except 7, past
    # the 6 guesses (the game ends at guess 6 with reward 0).
    assert results == [(0.0, 6), (1.0, 3), (1.0, 1), (1.0, 4), (1.0, 4), (1.0, 5)]
    assert server.sessions()["peak"] == 3
    # No free session within session_wait_s: the episode fails, saying what to change.
    held = [envs.make(OPENENV, base_url=server.url) for _ in range(3)]
    try:
        for env in held:
            env.reset(seed=0)
        late = envs.make(OPENENV, base_url=server.url, session_wait_s=0.5)
        with pytest.raises(OpenEnvError, match="had no free session for 0.5 s"):
            late.reset(seed=0)
    finally:
        for env in held:
            env.close()


# ---------------------------------------------------------------------------------------------- faults, in the actor
class ByteTokenizer:
    """Chat template: the messages' contents joined by '|'; token ids: that text's UTF-8 bytes (tests/actors)."""

    eos_token_id = 0

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> list[int]:
        return list("|".join(m["content"] for m in conversation).encode())


def actor_config(url: str) -> Any:
    from agentstream.config import Config

    cfg = Config()
    cfg.env.name, cfg.env.kwargs = OPENENV, {"base_url": url, "observation_field": "prompt"}
    cfg.env.group_size, cfg.env.max_steps, cfg.env.step_timeout_s = 2, 3, 2.5  # (a loaded machine's call: < 2.5 s)
    cfg.actors.episodes_per_actor, cfg.actors.episode_retries, cfg.actors.share_first_turn = 4, 2, True
    cfg.trainer.groups_per_step, cfg.trainer.max_staleness = 1, 10_000  # no learner here: admission never waits
    cfg.learner.world_size = 1
    cfg.broker.track_keys = True
    cfg.broker.logger = []
    cfg.run.log_interval_s = 0.2
    return cfg


async def until(predicate: Any, timeout_s: float, what: str, task: asyncio.Task, counters: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if task.done():
            task.result()  # the actor failed: say why
            raise AssertionError(f"the actor stopped while waiting for {what}")
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}: {dict(counters)}"
        await asyncio.sleep(0.05)


MALFORMED_SEED, HANG_SEED = 1, 2  # groups 1 and 2 (the broker's seeds are run.seed * 1_000_003 + group id)


async def test_server_faults_retry_the_episode_then_drop_its_group(tmp_path: Path) -> None:
    from e2e_testing import broker_and_client, check_accounting

    from actors.actor import Actor
    from actors.spec import ActorSpec
    from engines.client import Generation

    gate = asyncio.Event()  # groups from 3 on wait at their second turn until the server was killed
    held: set[int] = set()

    def episode_sampler(engine: Any, group: int | None, frozen_seat: Any) -> Any:
        """The actor's `Sampler.episode`, scripted: guesses 1, 2, 3 (`group`: the episode's group on its first
        attempt, whose first turn the group shares; None on a retry)."""

        async def generate(turn: Any) -> Generation:
            if group is not None and group >= 3 and turn.step == 1:
                held.add(group)
                await gate.wait()
            text = f"<action>{turn.step + 1}</action>"
            ids = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
            return Generation(ids, np.full(len(ids), -0.5, np.float32), text, "stop", 0, 0)

        return generate

    with serving(tmp_path, sessions=8, faults=f"{MALFORMED_SEED}:malformed,{HANG_SEED}:hang") as server:
        port = int(server.url.rsplit(":", 1)[1])
        cfg = actor_config(server.url)
        async with broker_and_client(cfg) as (broker, client):
            engines: Any = [SimpleNamespace(url="-")]  # (never asked: the answers are scripted)
            actor = Actor(ActorSpec.from_config(cfg), "actor-0", 0, client, engines, ByteTokenizer())
            actor.sampler.episode = episode_sampler  # type: ignore[method-assign]
            task = asyncio.create_task(actor.run())
            restarted = contextlib.ExitStack()  # the server again, once killed: back on its port
            c, b = actor.counters, broker.buffer
            try:
                # Groups 0-2 complete: the malformed observation (group 1) and the step past env.step_timeout_s
                # (group 2) each failed one episode, played again on its seed (.r1) in its place.
                await until(lambda: b.counts["groups_completed"] >= 3 and len(held) >= 1, 30, "3 groups", task, c)
                ready = {g.group_id: g for g in b.ready}
                assert {0, 1, 2} <= set(ready)
                for gid in (1, 2):
                    assert sorted(t.endswith(".r1") for t in ready[gid].trajectories) == [False, True], gid
                assert sorted(t.endswith(".r1") for t in ready[0].trajectories) == [False, False]
                assert c["infra_failures_raised"] == 1 and c["infra_failures_timeout"] == 1
                # Guesses 1, 2, 3 against secrets 7, 3, 1 (`secret`): group 0 truncated at 3 steps with nothing,
                # group 1 right at the third guess, group 2 at the first.
                returns = {
                    gid: sorted(sum(s.reward for s in steps) for steps in ready[gid].trajectories.values())
                    for gid in (0, 1, 2)
                }
                assert returns == {0: [0.0, 0.0], 1: [1.0, 1.0], 2: [1.0, 1.0]}
                # The server dies under open sessions: their next step fails, the retries find nothing listening,
                # and their groups are dropped whole and counted.
                os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait(5)
                gate.set()
                await until(lambda: b.counts["groups_dropped_infra_raised"] >= 1, 20, "a group dropped", task, c)
                assert c["infra_failures_raised"] >= 1 + 3  # the malformed one, then a whole episode's 3 attempts
                completed = b.counts["groups_completed"]
                await asyncio.to_thread(restarted.enter_context, serving(tmp_path, sessions=8, port=port))  # (a thread:
                # the actor's loop goes on meanwhile)
                await until(lambda: b.counts["groups_completed"] > completed, 30, "a group after", task, c)
                print(
                    f"openenv faults: {b.counts['groups_completed']} groups completed, "
                    f"{b.counts['groups_dropped_infra_raised']} dropped; infra failures raised "
                    f"{c['infra_failures_raised']}, timed out {c['infra_failures_timeout']}"
                )
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await client.drain(5)
                await client.send(actor.stats(final=True))
                await asyncio.sleep(0.3)  # (the broker takes the final stats: the actor's open groups are settled)
                await asyncio.to_thread(restarted.close)  # (after the actor: no call of it fails meanwhile)
            check_accounting(broker.summary())
