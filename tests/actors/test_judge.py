"""LLM judges as rewards (actors/judge.py): the score parser on hand-written answers, the template, each combine
rule, a judge that fails or never answers, and the actor holding back an episode's last transition until its
verdict while its other episodes go on. Fake servers and a byte tokenizer: every expected value is worked out by
hand. <1 s.

    .venv/bin/python -m pytest tests/actors/test_judge.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from actors.actor import Actor
from actors.judge import (
    EpisodeRecord,
    Judge,
    JudgedStep,
    ScoreParseFailure,
    combine,
    parse_score,
    pattern_errors,
    render,
    template_errors,
    verdict_counters,
)
from actors.spec import ActorSpec, JudgeSpec
from agentstream.config import Config
from agentstream.wire.messages import GroupGrant, Transition
from engines.client import EngineError, Generation

NUMBER = re.compile(Config().judges.score_pattern)  # the default: any number, the last one counts

# ------------------------------------------------------------------------------------------------ parse_score


@pytest.mark.parametrize(
    "answer, score",
    [
        ("0.7", 0.7),
        ("Score: 1", 1.0),
        ("-2", -2.0),
        # Several numbers: the last one counts (a judge reasons first, then gives its verdict).
        ("Step 3 was wrong, step 4 fixed it. Score: 0.25", 0.25),
        ("7/10", 10.0),  # the documented pitfall of "the last number": use a pattern like 'Score: (\d+)' for x/10
        # Unicode: a decimal comma is not a decimal point, so "0,8" holds the numbers 0 and 8: the last is 8.
        ("Évaluation : 0,8 ✓", 8.0),
        # \d matches any Unicode decimal digit, and float() reads it: fullwidth ７ is 7.
        ("スコア：７", 7.0),
    ],
)
def test_the_last_number_of_an_answer_is_its_score(answer: str, score: float) -> None:
    assert parse_score(answer, NUMBER) == score


@pytest.mark.parametrize("answer", ["", "no score here", "très bien ✓", "\x00\ufffd}{<|im_end|>", "²³"])
def test_an_answer_without_a_number_is_a_typed_failure(answer: str) -> None:
    # ² and ³ are digits (Unicode No) but not decimal digits (Nd): \d does not match them.
    failure = parse_score(answer, NUMBER)
    assert isinstance(failure, ScoreParseFailure) and "no match" in failure.reason


def test_a_match_that_is_not_a_finite_number_is_a_failure_too() -> None:
    anything = re.compile(r"Score: (\S+)")
    assert parse_score("Score: 0.5", anything) == 0.5
    for answer, why in [
        ("Score: good", "not a number"),
        ("Score: inf", "not a finite"),
        ("Score: nan", "not a finite"),
        ("Score: 1e999", "not a finite"),
    ]:
        failure = parse_score(answer, anything)
        assert isinstance(failure, ScoreParseFailure) and why in failure.reason, answer
    optional = re.compile(r"(\d+)|none")  # group 1 takes no part when "none" matches last
    assert parse_score("3 then none", optional) == ScoreParseFailure(
        f"group 1 of {optional.pattern!r} took no part in its last match"
    )


def test_score_patterns_are_checked() -> None:
    assert pattern_errors(r"Score: (\d+)") == []
    assert "is not a regular expression" in pattern_errors("Score: (")[0]
    assert "has no group" in pattern_errors(r"\d+")[0]


# ------------------------------------------------------------------------------------------------ the template

EPISODE = EpisodeRecord(
    "Walk right.", (JudgedStep("at 1", "left", 0.0), JudgedStep("at 1", "right", 0.5)), "at 2", True
)


def test_every_placeholder_renders_as_worked_out_by_hand() -> None:
    template = "T={task}|{transcript}|F={final_observation}|R={env_return}|N={steps}|S={success}|{{x}}"
    # env_return = 0.0 + 0.5; two steps; literal braces stay single.
    assert render(template, EPISODE) == (
        "T=Walk right.|Step 1\nObservation:\nat 1\nAction: left\nReward: 0\n\n"
        "Step 2\nObservation:\nat 1\nAction: right\nReward: 0.5|F=at 2|R=0.5|N=2|S=yes|{x}"
    )
    # Only the last step: numbered 2, after a line saying one was left out; {steps} still counts both.
    assert render("{transcript} ({steps})", EPISODE, keep_last=1) == (
        "(1 earlier steps left out)\n\nStep 2\nObservation:\nat 1\nAction: right\nReward: 0.5 (2)"
    )
    assert render("{transcript}", EPISODE, keep_last=0) == "(2 earlier steps left out)"
    assert render("{env_return:.2f}", EPISODE) == "0.50"


@pytest.mark.parametrize(
    "template, needle",
    [
        ("{task} {reward}", "names {reward}, which is not a placeholder"),
        ("{}", "names {}, which is not a placeholder"),
        ("{task.upper}", "names {task.upper}, which is not a placeholder"),
        ("{task", "does not parse"),
        ("{task:.2f}", "does not render"),
    ],
)
def test_templates_that_cannot_render_say_why(template: str, needle: str) -> None:
    errors = template_errors(template)
    assert len(errors) == 1 and needle in errors[0], errors
    assert "{transcript}" in errors[0]  # and list what may be named
    assert template_errors(Config().judges.template) == []


# ------------------------------------------------------------------------------------------------ combine


def test_each_combine_rule_as_worked_out_by_hand() -> None:
    # env reward r = 0.5, judge score s = 0.25, weight w = 2: w*s = 0.5.
    assert combine("add", 0.5, 0.25, 2.0) == 1.0  # r + w*s = 0.5 + 0.5
    assert combine("replace", 0.5, 0.25, 2.0) == 0.5  # w*s
    assert combine("multiply", 0.5, 0.25, 2.0) == 0.25  # r * w*s = 0.5 * 0.5
    assert combine("multiply", 0.0, 0.25, 2.0) == 0.0  # a failed episode stays at 0 whatever the judge says
    with pytest.raises(ValueError, match="known: add, replace, multiply"):
        combine("max", 0.5, 0.25, 2.0)


# ------------------------------------------------------------------------------------------------ Judge


class CharTokenizer:
    """No chat template: the ids are the text's code points (so the test reads the prompt back)."""

    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class JudgeServer:
    """A judge server: answers `answer`, after `gate` is set if one is given; or raises `error`."""

    def __init__(
        self, url: str, answer: str = "Score: 0.5", gate: asyncio.Event | None = None, error: Exception | None = None
    ):
        self.url, self.answer, self.gate, self.error = url, answer, gate, error
        self.prompts: list[str] = []

    async def generate(
        self, prompt_ids: list[int], sampling: Any, seed: int | None = None, images: Any = None
    ) -> Generation:
        self.prompts.append("".join(map(chr, prompt_ids)))
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        ids = np.asarray([1, 2], dtype=np.int32)
        return Generation(ids, np.zeros(2, np.float32), self.answer, "stop", 0, 0)


def judge_spec(**overrides: Any) -> JudgeSpec:
    cfg = Config()
    cfg.judges.count = 1
    for key, value in overrides.items():
        setattr(cfg.judges, key, value)
    spec = JudgeSpec.from_config(cfg)
    assert spec is not None
    return spec


async def test_an_answer_parses_and_a_garbled_one_gives_the_default_counted_as_a_parse_failure() -> None:
    spec = judge_spec(default_score=-1.0, template="{task}")
    verdict = await Judge(spec, [JudgeServer("http://j:0", "I'd say 0.75")], CharTokenizer()).judge(EPISODE)
    assert (verdict.score, verdict.outcome) == (0.75, "parsed")
    verdict = await Judge(spec, [JudgeServer("http://j:0", "hmm…")], CharTokenizer()).judge(EPISODE)
    assert (verdict.score, verdict.outcome) == (-1.0, "parse_failure")
    counters = verdict_counters(verdict)
    assert counters["judge_requests"] == counters["judge_parse_failures"] == counters["judge_latency_count"] == 1
    assert counters["judge_score_sum"] == -1.0 and "judge_errors" not in counters


async def test_a_timeout_gives_the_default_and_is_counted_as_an_error_not_a_parse_failure() -> None:
    never = JudgeServer("http://j:0", gate=asyncio.Event())  # never set: no answer, ever
    judge = Judge(judge_spec(default_score=0.125, timeout_s=0.05), [never], CharTokenizer())
    verdict = await judge.judge(EPISODE)
    assert (verdict.score, verdict.outcome) == (0.125, "error") and "judges.timeout_s=0.05" in verdict.detail
    assert verdict.latency_s >= 0.04
    # Counted as an error; its latency is not a judge's answer time, so it is left out of the mean.
    assert verdict_counters(verdict) == {"judge_requests": 1.0, "judge_errors": 1.0, "judge_score_sum": 0.125}
    assert judge.load == {"http://j:0": 0}  # nothing left in flight


async def test_a_failing_judge_is_avoided_while_another_answers() -> None:
    dead = JudgeServer("http://dead:0", error=EngineError("cannot reach the engine"))
    alive = JudgeServer("http://alive:0", "0.5")
    judge = Judge(judge_spec(template="{task}"), [dead, alive], CharTokenizer())
    outcomes = [(await judge.judge(EPISODE)).outcome for _ in range(4)]
    # At most the first request goes to the dead one (in turn); after its failure the live one takes them all.
    assert outcomes.count("error") <= 1 and len(dead.prompts) <= 1 and outcomes[-1] == "parsed"


async def test_the_least_loaded_judge_is_picked() -> None:
    gate = asyncio.Event()
    a, b = JudgeServer("http://a:0", gate=gate), JudgeServer("http://b:0", gate=gate)
    judge = Judge(judge_spec(template="{task}"), [a, b], CharTokenizer())
    tasks = [asyncio.create_task(judge.judge(EPISODE)) for _ in range(4)]
    await asyncio.sleep(0)
    assert judge.load == {"http://a:0": 2, "http://b:0": 2}  # never 3 and 1
    gate.set()
    assert [(await t).outcome for t in tasks] == ["parsed"] * 4


async def test_the_oldest_steps_are_left_out_when_the_prompt_would_not_fit() -> None:
    server = JudgeServer("http://j:0")
    # One character, one token. "{transcript}" with both steps: step 1's block "Step 1\nObservation:\nat 1\n
    # Action: left\nReward: 0" is 6+1+12+1+4+1+12+1+9 = 47, "\n\n", step 2's block 6+1+12+1+4+1+13+1+11 = 50:
    # 99. The last step alone: "(1 earlier steps left out)" 26 + 2 + 50 = 78. No step: 26.
    # A budget of 80 takes only the last step; a budget of 20 not even the line of none (26): an error, the default.
    spec = judge_spec(template="{transcript}")
    last_only = render("{transcript}", EPISODE, keep_last=1)
    assert (len(last_only), len(render("{transcript}", EPISODE))) == (78, 99)

    await Judge(replace(spec, max_prompt_tokens=80), [server], CharTokenizer()).judge(EPISODE)
    assert server.prompts == [last_only]
    verdict = await Judge(replace(spec, max_prompt_tokens=20), [server], CharTokenizer()).judge(EPISODE)
    assert verdict.outcome == "error" and "does not fit 20 tokens" in verdict.detail and len(server.prompts) == 1


# ------------------------------------------------------------------------------------------------ the actor

RIGHT = "<action>right</action>"


class Corridor:
    """Cells 0..3, the goal at 3, starting at cell `seed`: RIGHT moves one cell (reward 1 and the end at the goal),
    anything else is invalid (no move, reward 0)."""

    instructions = "Walk right."
    blocking = False

    def __init__(self, max_steps: int = 8):
        self.max_steps = max_steps

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        self.pos, self.steps = int(seed or 0), 0
        return f"at {self.pos}", {"anchor": f"cell{self.pos}"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        valid = action == RIGHT
        self.pos += valid
        done = self.pos == 3
        info = {"anchor": f"cell{self.pos}", "valid": valid, "success": done}
        return f"at {self.pos}", float(done), done, self.steps >= self.max_steps and not done, info

    def close(self) -> None:
        pass


class ByteTokenizer:
    chat_template = "(bytes)"

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> list[int]:
        return list("|".join(m["content"] for m in conversation).encode())


class Engine:
    url = "http://e:0"

    async def generate(
        self, prompt_ids: list[int], sampling: Any, seed: int | None = None, images: Any = None
    ) -> Generation:
        await asyncio.sleep(0)
        ids = np.frombuffer(RIGHT.encode(), dtype=np.uint8).astype(np.int32)
        return Generation(ids, np.zeros(len(ids), np.float32), RIGHT, "stop", 0, 0)

    async def sample(
        self, prompt_ids: list[int], sampling: Any, n: int, seed: int | None = None, images: Any = None
    ) -> list[Generation]:
        return [await self.generate(prompt_ids, sampling, seed, images) for _ in range(n)]


class Broker:
    def __init__(self) -> None:
        self.sent: list[Transition] = []

    async def send_transition(self, t: Transition) -> None:
        self.sent.append(t)


async def test_the_last_transition_waits_for_its_verdict_while_other_episodes_play_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = Config()
    cfg.memory.k, cfg.memory.max_prompt_tokens, cfg.trainer.invalid_action_penalty = 1, 10_000, -0.25
    cfg.judges.count, cfg.judges.combine, cfg.judges.weight, cfg.judges.template = 1, "add", 2.0, "{final_observation}"
    monkeypatch.setattr("actors.spec.envs.make", lambda name, **kwargs: Corridor(**kwargs))
    spec = ActorSpec.from_config(cfg)
    assert spec.judge is not None
    gate = asyncio.Event()
    server = JudgeServer("http://j:0", "Score: 0.25", gate=gate)
    broker = Broker()
    actor = Actor(
        spec,
        "actor-0",
        0,
        broker,
        [Engine()],
        ByteTokenizer(),  # type: ignore[arg-type]
        judge=Judge(spec.judge, [server], ByteTokenizer()),
    )
    grant = GroupGrant(group_id=1, seed=1, min_version=0)
    slow = asyncio.create_task(actor.play(grant, "slow", actor.engines[0]))  # cell 1 -> 2 -> 3: two steps
    while not server.prompts:
        await asyncio.sleep(0)
    # The judge has the slow episode; its first transition went out, its last waits. Another episode plays,
    # is judged too (the same gate) ...
    assert [(t.traj_id, t.step) for t in broker.sent] == [("slow", 0)]
    other = asyncio.create_task(actor.play(GroupGrant(group_id=2, seed=2, min_version=0), "other", actor.engines[0]))
    while len(server.prompts) < 2:
        await asyncio.sleep(0)
    assert actor.counters["judge_requests"] == 0  # counted with the episode, once it ends
    gate.set()
    await asyncio.gather(slow, other)
    last = {t.traj_id: t for t in broker.sent if t.done}
    assert server.prompts == ["at 3", "at 3"]  # the final observation, through the judge's chat template
    # Both reach the goal (env reward 1) with valid steps: add gives 1 + 2 * 0.25 = 1.5.
    assert last["slow"].reward == last["other"].reward == 1.5
    assert last["slow"].info == {"success": True, "env_reward": 1.0, "judge_score": 0.25, "judge_outcome": "parsed"}
    assert [t.reward for t in broker.sent if not t.done] == [0.0]  # slow's first step: unjudged, valid
    assert actor.counters["judge_requests"] == actor.counters["episodes"] == 2
    assert actor.counters["judge_parsed"] == 2 and actor.counters["episode_return_sum"] == 3.0


def test_the_judge_spec_takes_its_values_from_the_config() -> None:
    cfg = Config()
    assert JudgeSpec.from_config(cfg) is None and ActorSpec.from_config(cfg).judge is None  # judges.count = 0
    cfg.judges.count, cfg.judges.max_tokens, cfg.judges.temperature = 2, 32, 0.0
    cfg.engines.max_model_len = 1024
    spec = JudgeSpec.from_config(cfg)
    assert spec is not None and spec.model_path == cfg.model.path  # no judges.model: the initial policy's weights
    assert spec.max_prompt_tokens == 1024 - 32  # the judge's context less its answer
    assert (spec.sampling.max_tokens, spec.sampling.temperature, spec.sampling.top_p) == (32, 0.0, 1.0)
    cfg.judges.model = "/models/judge"
    assert JudgeSpec.from_config(cfg).model_path == "/models/judge"  # type: ignore[union-attr]
