"""Actor side of an engine: token ids in, token ids + behaviour log-probs + version interval out.

    async with aiohttp.ClientSession() as session:
        engine = EngineClient("http://127.0.0.1:8000", session, timeout_s=120)
        gen = await engine.generate(prompt_ids, SamplingConfig(max_tokens=24), seed=7)
        gen.response_ids, gen.logprobs, gen.text, gen.version_lo, gen.version_hi

Token ids go to vLLM's token-in-token-out route `/inference/v1/generate` (`--enable-scale-out`, as
`engines.server` starts every engine): its answer says which weight version sampled each token (the versions
the weight sidecar labels with `/update_weight_version`), so the interval is exact and costs no request of its
own. Any other vLLM OpenAI-compatible server works through `/v1/completions` with a token-id prompt; the
interval then brackets the call with reads of the dev endpoint `/weight_info` (VLLM_SERVER_DEV_MODE=1).

With `decode` (the policy tokenizer's decode, as the actors pass it), GENERATE answers token ids only: vLLM then
skips its incremental detokenizer and the per-token text of the log-probs (~30% of its API server's CPU at 64
requests of 32 tokens, measured with py-spy), and the text is decoded here, once per answer. A request with stop
strings (the gateway's) still takes vLLM's text: stop strings need it.

Images (a vision-language policy): `generate(prompt_ids, sampling, images=[...])` sends each image as a lossless
PNG data URI in GENERATE's `content_parts`, with `prompt_ids` holding one unexpanded image placeholder per image
(the model's `<image>`; vLLM expands it, as `learner.vision.expand_images` does for the learner). Only GENERATE
takes images: /v1/completions would answer while ignoring them, so a server without GENERATE is an error.

Shapes: T = tokens of one response.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import numpy as np

from agentstream.config import SamplingConfig
from agentstream.models import SERVED_MODEL_NAME

log = logging.getLogger("engines")


class EngineError(RuntimeError):
    """An engine request failed; the message names the URL and what the server said."""


class RouteMissing(EngineError):
    """The server has no such route (FastAPI's bare 404): an engine started without `--enable-scale-out`."""


GENERATE = "/inference/v1/generate"
_NO_ROUTE = '{"detail":"Not Found"}'  # FastAPI's 404 body for a route it does not have


class EngineStalled(EngineError):
    """An engine left a request unanswered and then a probe too (`EngineClient.alive`): stopped, frozen or wedged."""


@dataclass(frozen=True)
class Generation:
    """One sampled response, exactly as the engine produced it."""

    response_ids: np.ndarray  # [T] int32, generated token ids (the EOS token included when it stopped on it)
    logprobs: np.ndarray  # [T] float32, log-prob of each generated token under the sampling policy
    text: str  # decoded response without special tokens: for the env's action parser only, never re-tokenised
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens reached)
    version_lo: int  # the oldest policy version that may have produced a token of the response
    version_hi: int  # the newest


def clamp_to_grant(version_lo: int, version_hi: int, min_version: int) -> tuple[int, int]:
    """A response's version interval as its transition carries it (an actor's step, a gateway call): both ends
    raised to `min_version`, the oldest version its group's grant lets its tokens come from (`GroupGrant`). The
    broker admitted the group only while its engines served that version or newer (broker/buffer.py
    `admissible`); a lower label (an engine that restarted since, say) counts as `min_version`."""
    return max(version_lo, min_version), max(version_hi, min_version)


def parse_version(value: Any, url: str) -> int:
    """`/weight_info`'s weight_version -> int. None or vLLM's "default" (no sidecar has set one) -> 0."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineError(
            f"{url}/weight_info reports weight_version={value!r}, not an integer: something other than "
            f"agentstream's weight sidecar set it"
        ) from None


class EngineClient:
    """Client of one engine. Safe to share between the tasks of one event loop."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        timeout_s: float,
        extra_body: Mapping[str, Any] | None = None,
        model: str = SERVED_MODEL_NAME,
        base_model: str | None = None,
        versioned: bool = True,
        decode: Callable[[list[int]], str] | None = None,
        base_while_absent: bool = False,
    ):
        """`extra_body`: more vLLM sampling fields sent with every request (e.g. {"stop": ["</action>"]},
        {"ignore_eos": True}); it cannot override the fields the log-probs depend on.
        `model`: the served name to request (`agentstream.models.served_model_name(cfg.model)`).
        `base_model`: with LoRA, the name to request while the engine serves version 0, before any adapter
        is loaded (SERVED_MODEL_NAME: the base model, which is exactly version 0 since peft starts B = 0).
        `versioned=False`: a server whose weights never change (an LLM judge, actors/judge.py): no `/weight_info`
        reads, every generation is version 0.
        `decode`: token ids -> the response's text, special tokens skipped (the policy tokenizer's); with it GENERATE
        answers token ids only and the text is decoded here (the module docstring).
        `base_while_absent`: `model` is an adapter the engine loads at some later version only (the frozen copy,
        `agentstream.models.FROZEN_ADAPTER_NAME`): while the engine answers 404 for it, whatever its version, requests
        go to `base_model` (one 404 per engine version at most)."""
        self.url = url.rstrip("/")
        self._decode = decode
        self.versioned = versioned
        self.model = model
        self.base_model = base_model
        self.base_while_absent = base_while_absent
        self._absent_at: int | None = None  # base_while_absent: the engine version at which `model` was absent
        self._session = session
        self._timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._extra = dict(extra_body or {})
        # The newest version this client has read from the engine. Versions only grow, so a cached
        # value is a safe lower bound for what produces the next request's first token.
        self._known_version: int | None = None
        # The fresh read after each answer is shared by every answer that arrived before it started
        # (`_version_after`): one /weight_info request for the answers of one event-loop round.
        self._next_read: asyncio.Future[int] | None = None
        self.version_reads = 0
        self.token_route: bool | None = None  # whether the server has GENERATE (None: not asked yet)
        self._probe: asyncio.Task[bool] | None = None  # the liveness probe under way (`alive`), shared

    def with_model(self, model: str, base_while_absent: bool = False) -> EngineClient:
        """A client of the same engine, session, timeout, fields and decode that requests `model` (`base_while_absent`:
        as the constructor's), with the same `base_model`."""
        return EngineClient(
            self.url,
            self._session,
            self._timeout_s,
            self._extra,
            model,
            self.base_model,
            self.versioned,
            self._decode,
            base_while_absent,
        )

    def _name(self, version: int | None) -> str:
        """The name to request of an engine known to serve `version`: with a `base_model`, that one at version 0 (no
        adapter loaded yet) and, `base_while_absent`, at the version it was last found absent at; else `model`."""
        absent = self.base_while_absent and self._absent_at is not None and version == self._absent_at
        if self.base_model is not None and (version == 0 or absent):
            return self.base_model
        return self.model

    def alive(self, timeout_s: float) -> asyncio.Task[bool]:
        """A liveness probe: True once the server answers a 1-token generation (with any HTTP status), False if
        it cannot be reached or says nothing within `timeout_s`. A generation, not /health: vLLM's API server answers
        /health without asking its engine core, which may be the part that is stopped. Every caller meanwhile
        shares one probe."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_once(timeout_s))
        return self._probe

    async def _probe_once(self, timeout_s: float) -> bool:
        name = self.base_model if self.base_model is not None and not self._known_version else self.model
        body = self._completion_body([0], SamplingConfig(max_tokens=1), None, name)
        try:
            async with self._session.post(
                self.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                await resp.read()
                return True
        except (asyncio.TimeoutError, aiohttp.ClientError):
            return False

    async def version(self) -> int:
        """The policy version the engine serves now (a fresh read; also refreshes the cache)."""
        self.version_reads += 1
        body = await self._request("GET", "/weight_info")
        v = parse_version(body.get("weight_version"), self.url)
        # Assign, don't max(): out-of-order answers can only make the cache lower (still a lower bound),
        # and an engine that restarted at version 0 must not be credited with its old version.
        self._known_version = v
        return v

    async def prompt_logprobs(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """[P - 1] float32: the log-prob of each of `ids[1:]` given the ids before it, under the served model (vLLM's
        `prompt_logprobs=0` on /v1/completions, one token generated and thrown away). A teacher's view of a student's
        sample (actors/teacher.py)."""
        body = {
            "model": self.model,
            "prompt": np.asarray(ids, dtype=np.int64).tolist(),  # token ids: never re-tokenised
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,  # the given token's log-prob at each position (and no other)
        }
        answer = await self._request("POST", "/v1/completions", body)
        try:
            rows = answer["choices"][0]["prompt_logprobs"]
            given = [int(i) for i in np.asarray(ids)[1:]]
            out = np.asarray([row[str(tok)]["logprob"] for row, tok in zip(rows[1:], given, strict=True)], np.float32)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(
                f"{self.url}/v1/completions answered no prompt log-probs for the given tokens ({exc!r}); the server "
                f"must be vLLM: {str(answer)[:300]}"
            ) from None
        return out  # [P - 1]

    async def generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        sampling: SamplingConfig,
        seed: int | None = None,
        extra: Mapping[str, Any] | None = None,
        images: Sequence[np.ndarray] | None = None,
    ) -> Generation:
        """Sample one response to `prompt_ids` ([P] token ids, chat template already applied). `extra`: more
        vLLM fields for this request only (the gateway's `stop`, `structured_outputs`), like `extra_body`.
        `images`: [H, W, 3] uint8 arrays, one per unexpanded image placeholder in `prompt_ids`, in order."""
        return (await self.sample(prompt_ids, sampling, 1, seed, extra, images))[0]

    async def sample(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        sampling: SamplingConfig,
        n: int,
        seed: int | None = None,
        extra: Mapping[str, Any] | None = None,
        images: Sequence[np.ndarray] | None = None,
    ) -> list[Generation]:
        """`n` independent responses to one prompt in one request (vLLM's `n`: the engine runs them as n
        sequences, its API server and this client handle one request): a group's first turn, whose prompt is the
        same for all its episodes. Each response carries its own versions. Otherwise as `generate`."""
        if images:
            return await self._generate_images(prompt_ids, sampling, n, seed, extra, images)
        if not self.versioned:
            body = await self._request(
                "POST", "/v1/completions", self._completion_body(prompt_ids, sampling, seed, self.model, extra, n)
            )
            return [Generation(*c, version_lo=0, version_hi=0) for c in self._parse_choices(body, n)]
        if self.token_route is not False:
            try:
                gens = await self._generate_tokens(prompt_ids, sampling, n, seed, extra)
                self.token_route = True
                return gens
            except RouteMissing:
                self.token_route = False
                log.info(
                    "%s has no %s (started without --enable-scale-out): /v1/completions with version reads",
                    self.url,
                    GENERATE,
                )
        # Version bracketing (DESIGN.md): lo = what we knew before sending (<= the truth), hi = a fresh
        # read after the answer (>= the version of the last token, since an update is labelled before
        # the engine resumes generating).
        lo = self._known_version if self._known_version is not None else await self.version()
        name = self._name(lo)
        body, to_base = await self._post(
            "/v1/completions", name, lambda model: self._completion_body(prompt_ids, sampling, seed, model, extra, n)
        )
        lo = 0 if to_base else lo
        choices = self._parse_choices(body, n)
        hi = await self._version_after()
        # hi < lo only if the engine restarted (its version went back) while we held an old read.
        return [Generation(*c, version_lo=min(lo, hi), version_hi=hi) for c in choices]

    async def _generate_images(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        sampling: SamplingConfig,
        n: int,
        seed: int | None,
        extra: Mapping[str, Any] | None,
        images: Sequence[np.ndarray],
    ) -> list[Generation]:
        """`n` generations with images: on GENERATE only (the one route that takes token ids and images)."""
        missing = EngineError(
            f"{self.url} has no {GENERATE} (started without --enable-scale-out), the only route "
            f"that takes token ids with images: start it with engines.server.server_command"
        )
        if self.token_route is False:
            raise missing
        parts = [{"type": "image_url", "url": png_data_uri(image)} for image in images]
        try:
            gens = await self._generate_tokens(prompt_ids, sampling, n, seed, extra, parts)
        except RouteMissing:
            self.token_route = False
            raise missing from None
        self.token_route = True
        return gens if self.versioned else [replace(g, version_lo=0, version_hi=0) for g in gens]

    async def _generate_tokens(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        sampling: SamplingConfig,
        n: int,
        seed: int | None,
        extra: Mapping[str, Any] | None,
        content_parts: list[dict[str, str]] | None = None,
    ) -> list[Generation]:
        """`n` generations on GENERATE; their versions are the labels of the weights that sampled their tokens.
        `content_parts`: the images of the prompt's placeholders, as vLLM's image_url parts."""
        if self.base_model is not None and self._known_version is None:
            await self.version()  # (once: with LoRA, which name to ask for)
        name = self._name(self._known_version)

        def body_for(model: str) -> dict[str, Any]:
            body = self._generate_body(prompt_ids, sampling, seed, model, extra, n)
            return {**body, "content_parts": content_parts} if content_parts else body

        body, _ = await self._post(GENERATE, name, body_for)
        tokens_only = body.get("output_mode", "text") == "tokens"
        assert self._decode is not None or not tokens_only  # (tokens are asked for only with `decode`)
        gens, newest = [], []
        for choice, (ids, logprobs, text, finish) in zip(body["choices"], self._parse_choices(body, n)):
            if tokens_only:
                text = self._decode(ids.tolist())  # type: ignore[misc]
            try:
                spans = choice.get("weight_versions") or []
                versions = [parse_version(span["version"], self.url) for span in spans] or [0]  # none: unlabelled
            except (KeyError, TypeError, AttributeError):
                raise EngineError(
                    f"{self.url}{GENERATE} answered weight_versions that are not spans: "
                    f"{str(choice.get('weight_versions'))[:200]}"
                ) from None
            newest.append(versions[-1])
            gens.append(Generation(ids, logprobs, text, finish, version_lo=min(versions), version_hi=max(versions)))
        self._known_version = max(newest)  # the engine's newest (a lower bound for its next request)
        return gens

    async def _post(self, path: str, name: str, body: Callable[[str], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
        """The answer to `body(name)` at `path`, and whether it came from the base model instead: with LoRA, an
        engine that restarted (back at version 0) has no adapter yet and answers 404 for it; so does an engine that
        has not loaded a `base_while_absent` adapter yet, at any version."""
        try:
            return await self._request("POST", path, body(name)), False
        except RouteMissing:
            raise
        except EngineError as exc:
            if self.base_model is None or name == self.base_model or "HTTP 404" not in str(exc):
                raise
            if self.base_while_absent:
                self._absent_at = self._known_version  # (asked for again once the engine serves another version)
            elif await self.version():
                raise
            return await self._request("POST", path, body(self.base_model)), True

    async def _version_after(self) -> int:
        """A version read that starts after this call: every caller of this event-loop round shares one
        (single flight), which starts at the loop's next round, so it is fresh for all of them."""
        if self._next_read is None:
            loop = asyncio.get_running_loop()
            fut = self._next_read = loop.create_future()

            def start() -> None:
                self._next_read = None  # callers from now on need a read that starts after them
                loop.create_task(self.version()).add_done_callback(settle)

            def settle(task: asyncio.Task[int]) -> None:
                if task.cancelled():
                    fut.cancel()
                elif task.exception() is not None:
                    fut.set_exception(task.exception())  # type: ignore[arg-type]
                else:
                    fut.set_result(task.result())

            loop.call_soon(start)
        return await asyncio.shield(self._next_read)

    # ------------------------------------------------------------------------------------ internal
    def _completion_body(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        sampling: SamplingConfig,
        seed: int | None,
        model: str,
        extra: Mapping[str, Any] | None = None,
        n: int = 1,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            **self._extra,
            **(extra or {}),
            "model": model,
            "prompt": np.asarray(prompt_ids, dtype=np.int64).tolist(),  # token ids: never re-tokenised
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,  # only the sampled token's log-prob
            "return_token_ids": True,
            # skip_special_tokens stays at its default (true): `text` feeds the action parser, which must
            # not see <|im_end|>; the learner trains on response_ids, which keep every token.
        }
        if seed is not None:
            body["seed"] = int(seed)
        if n != 1:
            body["n"] = n
        return body

    def _generate_body(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        sampling: SamplingConfig,
        seed: int | None,
        model: str,
        extra: Mapping[str, Any] | None = None,
        n: int = 1,
    ) -> dict[str, Any]:
        """GENERATE's body: the same sampling as `_completion_body`, as vLLM's SamplingParams."""
        params = self._completion_body(prompt_ids, sampling, seed, model, extra, n)
        ids, model = params.pop("prompt"), params.pop("model")
        params.pop("return_token_ids")
        tokens = self._decode is not None and not params.get("stop")
        if tokens:
            params["detokenize"] = False
        return {
            "token_ids": ids,
            "model": model,
            "sampling_params": params,
            "output_mode": "tokens" if tokens else "text",
            "return_token_ids": True,
        }

    def _parse_choices(self, body: dict[str, Any], n: int) -> list[tuple[np.ndarray, np.ndarray, str, str]]:
        """(token ids [T], log-probs [T], text, finish reason) of each of the answer's `n` choices."""
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            raise EngineError(
                f"{self.url} answered {len(choices) if isinstance(choices, list) else 'no'} choices "
                f"where {n} were asked for: {str(body)[:300]}"
            )
        return [self._parse_choice(choice, body) for choice in choices]

    def _parse_choice(self, choice: Any, body: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, str, str]:
        try:
            ids = np.asarray(choice["token_ids"], dtype=np.int32)  # [T]
            lps = choice["logprobs"]
            # /v1/completions: {"token_logprobs": [...]}; GENERATE (text mode): {"content": [{"logprob": ...}]}
            lps = lps["token_logprobs"] if "token_logprobs" in lps else [x["logprob"] for x in lps["content"]]
            logprobs = np.asarray([-np.inf if x is None else x for x in lps], dtype=np.float32)  # [T]
            text, finish = str(choice.get("text") or ""), str(choice.get("finish_reason") or "")
        except (KeyError, IndexError, TypeError) as exc:
            raise EngineError(
                f"{self.url}/v1/completions answered without token ids or log-probs ({exc!r}); the server "
                f"must be vLLM with return_token_ids support: {str(body)[:300]}"
            ) from None
        if ids.shape != logprobs.shape:
            raise EngineError(f"{self.url}: {ids.size} token ids but {logprobs.size} log-probs in one answer")
        return ids, logprobs, text, finish

    async def _request(self, method: str, path: str, json: dict[str, Any] | None = None) -> dict[str, Any]:
        url = self.url + path
        try:
            try:
                return await self._request_once(method, url, json)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                # Typically a pooled keep-alive connection that the server closed just as we sent on it
                # (uvicorn's idle timeout; "Server disconnected" or "Connection reset"): the request did
                # not run. Once more, on a fresh connection; a generation has no side effect to repeat.
                return await self._request_once(method, url, json)
        except aiohttp.ContentTypeError as exc:
            raise EngineError(f"{method} {url} answered something that is not JSON: {exc.message}") from None
        except asyncio.TimeoutError:
            raise EngineError(
                f"{method} {url}: no answer within {self._timeout.total} s (engines.request_timeout_s)"
            ) from None
        except aiohttp.ClientError as exc:
            raise EngineError(f"{method} {url}: cannot reach the engine: {exc.__class__.__name__}: {exc}") from None

    async def _request_once(self, method: str, url: str, json: dict[str, Any] | None) -> dict[str, Any]:
        async with self._session.request(method, url, json=json, timeout=self._timeout) as resp:
            if resp.status != 200:
                text = await resp.text()
                error = RouteMissing if resp.status == 404 and text.strip() == _NO_ROUTE else EngineError
                raise error(f"{method} {url} failed: HTTP {resp.status}: {text[:500]}")
            return await resp.json()


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`EngineClient`'s `decode` from a Hugging Face tokenizer, giving vLLM's text: special tokens skipped, and
    a last character whose bytes are incomplete left out (vLLM's incremental detokenizer waits for the rest of it;
    the tokenizer writes U+FFFD)."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")

    return decode


def png_data_uri(image: np.ndarray) -> str:
    """An [H, W, 3] uint8 image as a PNG data URI: lossless, so the engine sees exactly these pixels."""
    from PIL import Image

    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"an image must be an [H, W, 3] uint8 array (RGB); got {image.dtype} {image.shape}")
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
