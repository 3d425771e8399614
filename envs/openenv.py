"""OpenEnv environments: the game of an `openenv-core` server, played by the actors, one WebSocket session per episode.

    env.name=agentstream/OpenEnv-v0 +env.kwargs.base_url=http://127.0.0.1:8001          # a server already up
    env.name=agentstream/OpenEnv-v0 +env.kwargs.app=examples.openenv_game.server:app    # one the launcher serves

    env = envs.make("agentstream/OpenEnv-v0", base_url="http://127.0.0.1:8001", max_steps=6)
    obs, info = env.reset(seed=3)               # opens a session on the server and resets its game with seed 3
    obs, reward, terminated, truncated, info = env.step("<action>4</action>")
    env.close()                                 # ends the session: the server's slot is free again

Why an env, not a runner on the gateway: an OpenEnv server is reset/step, the loop the actors already run for every
env. As an env it gets the actors' groups (G sessions reset to the group's seed), memory, token-exact prompts, the
step timeout and the retry-then-drop path of a failed episode, with no agent program in between; the gateway is for
agent code that owns its loop.

Per episode: `reset(seed=...)` opens a session through openenv's own client (`GenericEnvClient`, its `.sync()`
wrapper: the actor runs a blocking env's calls in threads, so `blocking` is True) and resets the server's env with the
seed; `step(text)` sends the action, `{action_field: text}` (or what `parser` makes of the text), and returns the
server's observation as text, its reward (None counts 0) and its `done` (terminated; the run's env.max_steps
truncates); `close()` ends the session. HTTP's /reset and /step would not do: the server builds a fresh env for each
request. A server holds `max_concurrent_envs` sessions at once (1 unless it was built for more); an episode that finds
them all taken waits for a free one, up to `session_wait_s`.

The observation's text is its field `observation_field`, or (""), its one text field, or else the whole observation as
JSON. Its bool fields `valid` and `success`, where it has them, are the step's `info["valid"]` (False: an invalid
action, the actor's penalty) and `info["success"]`; without `success`, an episode that ends with a positive reward
succeeded. An action the server refuses (its validation error) is an invalid action too. `instructions` (the system
prompt): the kwarg, else the server's own description (`GET /metadata`).

Faults: a connection refused or dropped, a reply that does not come within `timeout_s`, an error of the server's env,
or a malformed reply (an observation without its text, a reward that is no number, a `done` that is no bool) raise
`OpenEnvError`; the actor counts it (`infra_failures_raised`; a call past env.step_timeout_s: `_timeout`), plays the
episode again on the same seed, and after actors.episode_retries drops its group (actors/actor.py). A refused
connection fails after REFUSED_PAUSE_S: the retries give a restarting server (the launcher's, on its port) time.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any

import gymnasium as gym

from envs.base import EnvTraits, ParseFailure, ParseResult, StepResult, text_space

OPENENV = "agentstream/OpenEnv-v0"
DOCS = "docs/your_env.md#openenv-environments"
INSTALL = "pip install openenv-core==0.3.0 (the project's envs extra: bash scripts/setup.sh full installs it)"
REFUSED_PAUSE_S = 1.0
"""How long an episode whose connection was refused waits before it fails (the actor then plays it again)."""
_CODE = re.compile(r"\(code: (\w+)\)\s*$")
"""The error code at the end of openenv's RuntimeError for an error reply ('Server error: ... (code: X)')."""


class OpenEnvError(RuntimeError):
    """The server failed the episode: the connection, a timeout, its env's error or a malformed reply."""


def traits(kwargs: Mapping[str, Any]) -> EnvTraits:
    """One seat, played on a server: the launcher serves env.kwargs.app when it is given."""
    return EnvTraits(remote=True, serve=str(kwargs.get("app") or ""))


class OpenEnvText(gym.Env):
    """An OpenEnv server's game as a text env (the module docstring says how each call maps to the server)."""

    metadata = {"render_modes": []}
    blocking = True
    """Network calls: the actor runs reset/step in threads, each bounded by env.step_timeout_s."""

    def __init__(
        self,
        base_url: str = "",
        app: str = "",
        action_field: str = "message",
        observation_field: str = "",
        instructions: str = "",
        parser: str = "",
        max_steps: int | None = None,
        timeout_s: float = 60.0,
        session_wait_s: float = 60.0,
    ):
        """`base_url`: the server (http:// or ws://). `app`: `module:attr` of the app the launcher serves (it then
        sets base_url). `action_field`: the action's field the answer's text goes to. `observation_field`: the
        observation's field read as text ("": its one text field, else all of it as JSON). `instructions`: the system
        prompt ("": the server's description). `parser`: `module:function`, the answer's text -> `Action(dict)`, the
        action's fields, or `ParseFailure` ("": no parser, the text goes as it is). `timeout_s`: how long one reply
        may take. `session_wait_s`: how long an episode waits for a free session."""
        if not base_url:
            if app:
                raise ValueError(
                    f"env.kwargs.app={app!r} is served by the launcher, which gives its URL as env.kwargs.base_url; "
                    f"outside a launch, serve it (python -m uvicorn {app} --host 127.0.0.1 --port 8001) and give "
                    f"base_url='http://127.0.0.1:8001' ({DOCS})"
                )
            raise ValueError(NO_SERVER)
        self.base_url = base_url.rstrip("/")
        self.action_field, self.observation_field = action_field, observation_field
        self.max_steps, self.timeout_s, self.session_wait_s = max_steps, timeout_s, session_wait_s
        self._instructions = instructions
        self._parse = load_parser(parser) if parser else None
        self.observation_space = text_space()
        self.action_space = text_space()
        self._client: Any = None  # openenv's SyncEnvClient while a session is open
        self._observation, self._steps = "", 0

    @property
    def instructions(self) -> str:
        """The system prompt: env.kwargs.instructions, else the server's description (read at the first reset)."""
        return self._instructions

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._steps = 0
        kwargs = {} if seed is None else {"seed": int(seed)}
        if self._client is None:  # a new session; a second reset reuses the open one
            self._client, result = self._open(kwargs)
        else:
            result = self._call("reset", self._client.reset, **kwargs)
        if not self._instructions:
            self._instructions = server_description(self.base_url, self.timeout_s)
        self._observation, _, _, info = self._read(result, "reset")
        return self._observation, info

    def step(self, action: str) -> StepResult:
        if self._client is None:
            raise RuntimeError("call reset() before step()")
        self._steps += 1
        cut = self.max_steps is not None and self._steps >= self.max_steps
        payload: dict[str, Any] = {self.action_field: action}
        if self._parse is not None:
            parsed = self._parse(action)
            if isinstance(parsed, ParseFailure):
                return self._invalid(parsed.reason, cut)
            if not isinstance(parsed.value, dict):
                raise TypeError(f"the parser returned Action({parsed.value!r}); an OpenEnv action is a dict of fields")
            payload = parsed.value
        try:
            result = self._client.step(payload)
        except Exception as exc:
            if error_code(exc) == "VALIDATION_ERROR":  # the server's action schema refused it: the model's fault
                return self._invalid(f"the server refused the action: {exc}", cut)
            raise self._failure("step", exc) from exc
        self._observation, reward, done, info = self._read(result, "step")
        return self._observation, reward, done, cut and not done, info

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)

    # ------------------------------------------------------------------ the session
    def _open(self, reset_kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """A new session, reset with `reset_kwargs`: (the client, the reset's result). A server with every session
        taken accepts the connection, says so (CAPACITY_REACHED) and closes it: wait and try again, up to
        session_wait_s. A refused connection (the server is down, or restarting) fails after REFUSED_PAUSE_S, so that
        the actor's retries of the episode give a restarting server time instead of dropping groups as fast as it
        can; anything else fails at once."""
        deadline, delay = time.monotonic() + self.session_wait_s, 0.05
        while True:
            client = _client_class()(
                base_url=self.base_url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s
            ).sync()
            try:
                client.connect()
            except Exception as exc:
                _close_quietly(client)
                time.sleep(REFUSED_PAUSE_S)
                raise self._failure("reset", exc) from exc
            try:
                return client, client.reset(**reset_kwargs)
            except Exception as exc:
                _close_quietly(client)
                if not _no_free_session(exc):
                    raise self._failure("reset", exc) from exc
                if time.monotonic() + delay > deadline:
                    raise OpenEnvError(
                        f"the OpenEnv server at {self.base_url} had no free session for {self.session_wait_s:g} s "
                        f"(env.kwargs.session_wait_s): it holds max_concurrent_envs sessions, and a run plays up to "
                        f"actors.count x actors.episodes_per_actor episodes at once, plus validation's. Build its app "
                        f"with a larger max_concurrent_envs (its env must set SUPPORTS_CONCURRENT_SESSIONS = True), "
                        f"or lower actors.episodes_per_actor ({DOCS})"
                    ) from exc
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise self._failure(what, exc) from exc

    def _failure(self, what: str, exc: BaseException) -> OpenEnvError:
        said = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return OpenEnvError(f"OpenEnv server {self.base_url}: {what} failed ({said})")

    # ------------------------------------------------------------------ replies
    def _read(self, result: Any, what: str) -> tuple[str, float, bool, dict[str, Any]]:
        """(text, reward, done, info) of a reset's or step's result; OpenEnvError when the reply is malformed."""
        obs, reward, done = result.observation, result.reward, result.done
        if not isinstance(obs, dict) or not obs:
            raise self._malformed(what, f"an observation {_short(obs)}, not a dict of fields")
        if reward is None:
            reward = 0.0
        if not isinstance(reward, Real) or not math.isfinite(float(reward)):
            raise self._malformed(what, f"reward {_short(reward)}, not a finite number")
        if not isinstance(done, bool):
            raise self._malformed(what, f"done {_short(done)}, not a bool")
        text = self._text(obs, what)
        valid = obs.get("valid") if isinstance(obs.get("valid"), bool) else True
        success = obs["success"] if isinstance(obs.get("success"), bool) else bool(done and float(reward) > 0)
        return text, float(reward), done, {"valid": valid, "success": success, "anchor": text}

    def _text(self, obs: dict[str, Any], what: str) -> str:
        if self.observation_field:
            text = obs.get(self.observation_field)
            if not isinstance(text, str):
                raise self._malformed(
                    what,
                    f"an observation whose field {self.observation_field!r} (env.kwargs.observation_field) is "
                    f"{_short(text)}, not text; its fields: {sorted(obs)}",
                )
            return text
        texts = [v for v in obs.values() if isinstance(v, str)]
        return texts[0] if len(texts) == 1 else json.dumps(obs, sort_keys=True, default=str)

    def _malformed(self, what: str, detail: str) -> OpenEnvError:
        return OpenEnvError(f"OpenEnv server {self.base_url}: {what} returned {detail}")

    def _invalid(self, reason: str, cut: bool) -> StepResult:
        """The game does not move: the same observation, reward 0, the reason for the memory's feedback line."""
        info = {"valid": False, "success": False, "anchor": self._observation, "parse_error": reason}
        return self._observation, 0.0, False, cut, info


NO_SERVER = (
    f"{OPENENV} plays on an OpenEnv server: give env.kwargs.base_url (one already up, e.g. "
    f"+env.kwargs.base_url=http://127.0.0.1:8001) or env.kwargs.app (module:attr of its app, which the launcher "
    f"serves, e.g. +env.kwargs.app=examples.openenv_game.server:app; {DOCS})"
)


def error_code(exc: BaseException) -> str:
    """The code of an error reply as openenv's client raises it ('Server error: ... (code: X)'), else ""."""
    match = _CODE.search(str(exc)) if isinstance(exc, RuntimeError) else None
    return match.group(1) if match else ""


def _no_free_session(exc: BaseException) -> bool:
    """Whether opening a session failed because the server holds as many as it may: it says CAPACITY_REACHED, or
    (when its close overtook our first message) it closed the fresh connection at once."""
    from websockets.exceptions import ConnectionClosed

    return error_code(exc) == "CAPACITY_REACHED" or isinstance(exc, ConnectionClosed)


@functools.cache
def _client_class() -> type:
    """openenv's `GenericEnvClient` with `end_session` (imported on first use: the registry imports this module)."""
    from openenv.core import GenericEnvClient

    class Client(GenericEnvClient):
        async def end_session(self, timeout_s: float) -> None:
            """Ask the server to end the session and wait (up to `timeout_s`) until it closes the connection. openenv
            0.3.0's own `close` sends the same request but drops the connection at once: the server, closing a socket
            already gone, logs a traceback for every session (~50 lines an episode in logs/env-server.log)."""
            if self._ws is None:
                return
            await self._send({"type": "close"})
            await asyncio.wait_for(self._ws.wait_closed(), timeout_s)

    return Client


def _close_quietly(client: Any) -> None:
    """End the session (the server frees its slot), then the client's event-loop thread."""
    try:
        client.end_session(2.0)  # (run on the client's loop by its sync wrapper)
    except Exception:  # noqa: BLE001 (a dead or busy server: the connection is dropped below)
        pass
    try:
        client.close()
    except Exception:  # noqa: BLE001 (a dropped connection cannot close cleanly; nothing is left to free here)
        pass


@functools.lru_cache(maxsize=None)
def server_description(base_url: str, timeout_s: float) -> str:
    """The server's own description of its env (`GET /metadata`), once per process."""
    try:
        with _OPENER.open(f"{_http(base_url)}/metadata", timeout=timeout_s) as resp:
            description = json.loads(resp.read()).get("description")
    except (OSError, ValueError, AttributeError) as exc:
        raise OpenEnvError(f"OpenEnv server {base_url}: GET /metadata failed ({exc})") from exc
    if not isinstance(description, str) or not description.strip():
        raise OpenEnvError(
            f"OpenEnv server {base_url}: its /metadata has no description; give env.kwargs.instructions, the "
            f"system prompt that says what the game is and how to answer"
        )
    return description


def load_parser(path: str) -> Callable[[str], ParseResult]:
    """`module:function` imported (ValueError says why it did not resolve)."""
    module, _, name = path.partition(":")
    try:
        parse = getattr(importlib.import_module(module), name) if name else None
    except ImportError as exc:
        raise ValueError(f"env.kwargs.parser={path!r}: importing {module!r} failed ({exc})") from None
    if not callable(parse):
        raise ValueError(f"env.kwargs.parser={path!r} names no function; give module:function")
    return parse


def kwargs_errors(kwargs: Mapping[str, Any], serving: bool) -> list[str]:
    """Why `kwargs` cannot play (empty: they can), checked at launch: openenv-core is installed, a server is named,
    the app to serve imports (`serving`: this launch serves it), or the server at base_url answers; the parser
    resolves."""
    try:
        import openenv.core  # noqa: F401
    except ImportError as exc:
        return [f"env.name={OPENENV} needs openenv-core ({exc}): {INSTALL}."]
    app, base_url = str(kwargs.get("app") or ""), str(kwargs.get("base_url") or "")
    errors = []
    if app and serving:
        errors += _app_errors(app)
    elif base_url:
        errors += _health_errors(base_url.rstrip("/"))
    elif app:
        errors.append(
            f"env.kwargs.app={app!r}: only the launch that starts the run (role=all) serves it; a joining launch "
            f"plays on it at env.kwargs.base_url (the URL in the run folder's config.yaml, env.kwargs.base_url)."
        )
    else:
        errors.append(NO_SERVER + ".")
    if kwargs.get("parser"):
        try:
            load_parser(str(kwargs["parser"]))
        except ValueError as exc:
            errors.append(f"{exc}.")
    return errors


def _app_errors(app: str) -> list[str]:
    module, _, attr = app.partition(":")
    if not attr:
        return [
            f"env.kwargs.app={app!r}: give module:attr, as uvicorn takes it (e.g. examples.openenv_game.server:app)."
        ]
    from envs.user import _import

    try:
        found = getattr(_import(module), attr, None)
    except Exception as exc:  # its import fails: say why, before any process starts
        return [
            f"env.kwargs.app={app!r}: importing {module!r} failed ({type(exc).__name__}: {exc}); run from the folder "
            f"that holds it, or put that folder on PYTHONPATH ({DOCS})."
        ]
    if not callable(found):
        return [f"env.kwargs.app={app!r}: {module!r} has no app {attr!r} (create_app's result, an ASGI app)."]
    return []


def _health_errors(base_url: str) -> list[str]:
    try:
        with _OPENER.open(f"{_http(base_url)}/health", timeout=5) as resp:
            if resp.status == 200:
                return []
            said = f"HTTP {resp.status}"
    except (OSError, urllib.error.URLError) as exc:
        said = str(exc)
    return [
        f"env.kwargs.base_url={base_url!r}: the OpenEnv server does not answer GET /health ({said}); start it first "
        f"(e.g. python -m uvicorn PACKAGE.server.app:app --host 127.0.0.1 --port 8001), or give env.kwargs.app "
        f"instead, and the launcher serves it ({DOCS})."
    ]


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Plain HTTP, no proxy: the server is on loopback or the run's network (openenv's client bypasses proxies too)."""


def _http(base_url: str) -> str:
    """`base_url` as HTTP (openenv's client takes ws:// too)."""
    if base_url.startswith(("ws://", "wss://")):
        return "http" + base_url[2:]
    return base_url if "://" in base_url else f"http://{base_url}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["OPENENV", "OpenEnvError", "OpenEnvText", "error_code", "kwargs_errors", "traits"]
