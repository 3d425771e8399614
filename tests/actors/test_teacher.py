"""On-policy distillation, actor side (actors/teacher.py): the per-token reverse-KL signal against values worked out
by hand, and a real vLLM server of the tiny model asked as a teacher: its log-probs of a response are the model's own
(transformers, same weights), a dead teacher is avoided while another answers, and with none alive the request fails
after its retries; an actor's steps with distill.task_reward=drop carry the teacher's signal alone, and a step no
teacher answered drops its group whole (tests/test_e2e_distill.py: the same in a launcher run). ~8 s once the
session's server is up.

    .venv/bin/python -m pytest tests/actors/test_teacher.py -q -p no:cacheprovider
"""

from __future__ import annotations

import math
from typing import Any

import aiohttp
import numpy as np
import pytest

from actors.actor import Actor
from actors.spec import ActorSpec, TeacherSpec
from actors.teacher import Teacher, TeacherFailure, reverse_kl_signal
from agentstream.config import Config
from agentstream.wire.addresses import free_port
from agentstream.wire.messages import GroupGrant, Transition
from engines.client import EngineClient, Generation


def test_the_signal_is_coef_times_the_teachers_minus_the_students_log_prob() -> None:
    # A vocabulary of two tokens A, B: the student samples from (1/2, 1/2), the teacher would from (1/4, 3/4).
    # The student's response is "A B": log pi_S = (ln 1/2, ln 1/2), log pi_T = (ln 1/4, ln 3/4).
    # Token rewards at coef 1: ln(1/4) - ln(1/2) = -ln 2 = -0.693147, ln(3/4) - ln(1/2) = ln 1.5 = 0.405465.
    # The KL: the mean of ln 2 and -ln 1.5 = ln(4/3) / 2 = 0.143841, which is here exactly KL(pi_S || pi_T) =
    # 1/2 ln((1/2)/(1/4)) + 1/2 ln((1/2)/(3/4)) = 1/2 ln(4/3) (each token drawn once: the sample mean is the mean).
    student = np.log(np.array([0.5, 0.5], np.float32))
    teacher = np.log(np.array([0.25, 0.75], np.float32))
    rewards, stats = reverse_kl_signal(teacher, student, coef=1.0)
    assert rewards.dtype == np.float32
    np.testing.assert_allclose(rewards, [-0.693147, 0.405465], atol=1e-6)
    assert stats == {"kl": pytest.approx(0.143841, abs=1e-6), "tokens": 2.0}
    # coef scales the rewards, never the KL: at coef 0.5 they are -0.346574 and 0.202733.
    half, stats_half = reverse_kl_signal(teacher, student, coef=0.5)
    np.testing.assert_allclose(half, [-0.346574, 0.202733], atol=1e-6)
    assert stats_half["kl"] == stats["kl"]
    # The return (the rewards' sum) is -coef * T * kl: -0.693147 + 0.405465 = -0.287682 = -2 * 0.143841.
    assert float(rewards.sum()) == pytest.approx(-2 * stats["kl"], abs=1e-6)
    # A student that samples like its teacher gets 0 everywhere.
    same, stats_same = reverse_kl_signal(student, student, coef=3.0)
    assert not same.any() and stats_same["kl"] == 0.0
    empty, stats_empty = reverse_kl_signal(np.zeros(0), np.zeros(0), coef=1.0)
    assert empty.size == 0 and stats_empty == {"kl": 0.0, "tokens": 0.0}
    with pytest.raises(ValueError, match="differ"):
        reverse_kl_signal(teacher, student[:1], coef=1.0)


def hf_logprobs(model_dir: str, ids: list[int]) -> np.ndarray:
    """[len(ids) - 1]: log p(ids[i] | ids[:i]) under transformers' forward of the model (float32, the slow path)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]  # [L - 1, V]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


SPEC = TeacherSpec(coef=1.0, drop_task_reward=False, timeout_s=30.0, retries=1)


async def test_a_real_teachers_log_probs_are_its_models_and_a_dead_one_is_avoided(tiny_engine) -> None:
    model_dir, url = tiny_engine
    prompt, response = [1, 17, 40, 99, 7], [33, 12, 250, 2]
    student = np.log(np.array([0.5, 0.25, 0.125, 0.5], np.float32))  # any sampling log-probs
    want = hf_logprobs(model_dir, prompt + response)[-len(response) :]  # [T] the response's tokens
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every request is refused
    async with aiohttp.ClientSession() as session:
        clients = [EngineClient(u, session, SPEC.timeout_s, versioned=False) for u in (dead, url)]
        teacher = Teacher(SPEC, clients)
        signals = [await teacher.signal(np.asarray(prompt), np.asarray(response), student) for _ in range(3)]
    for signal in signals:
        np.testing.assert_allclose(signal.rewards, want - student, atol=1e-4)  # coef 1: log pi_T - log pi_S
        assert signal.kl == pytest.approx(float(np.mean(student - want)), abs=1e-4)
    # At most the first request went to the dead one (asked again of the live one); then it is avoided.
    assert teacher.counters["distill_errors"] <= 1 and teacher.counters["distill_steps"] == 3
    assert teacher.counters["distill_tokens"] == 3 * len(response)
    assert teacher.counters["distill_kl_sum"] == pytest.approx(3 * len(response) * signals[0].kl, abs=1e-3)
    assert teacher.servers.load == {dead: 0, url: 0}


async def test_with_no_teacher_alive_the_request_fails_after_its_retries() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        teacher = Teacher(SPEC, [EngineClient(dead, session, SPEC.timeout_s, versioned=False)])
        with pytest.raises(TeacherFailure, match=r"no teacher signal after 2 attempt\(s\).*cannot reach"):
            await teacher.signal(np.asarray([1, 2]), np.asarray([3]), np.zeros(1, np.float32))
    # The first attempt and retries=1 more, 0.5 s apart; no signal counted.
    assert teacher.counters["distill_errors"] == 2 and teacher.counters["distill_retries"] == 1
    assert teacher.counters["distill_steps"] == 0 and not math.isnan(teacher.counters["distill_kl_sum"])


# ------------------------------------------------------------------------------------------------ the actor

RIGHT = "<action>right</action>"


class Corridor:
    """Cells 0..3 from cell `seed`, the goal at 3: RIGHT moves one cell (reward 1 and the end at the goal)."""

    instructions = "Walk right."
    blocking = False

    def __init__(self, max_steps: int = 8):
        self.max_steps = max_steps

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        self.pos = int(seed or 0)
        return f"at {self.pos}", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.pos += action == RIGHT
        done = self.pos == 3
        return f"at {self.pos}", float(done), done, False, {"valid": action == RIGHT, "success": done}

    def close(self) -> None:
        pass


class ByteTokenizer:
    """Prompt ids are the bytes of the messages (all < 256: token ids of the tiny model)."""

    chat_template = "(bytes)"

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> list[int]:
        return list("|".join(m["content"] for m in conversation).encode())


class Engine:
    """The student: always RIGHT, as bytes, each token at log-prob ln 1/2."""

    url = "http://student:0"

    async def generate(self, prompt_ids: Any, sampling: Any, seed: Any = None, images: Any = None) -> Generation:
        ids = np.frombuffer(RIGHT.encode(), dtype=np.uint8).astype(np.int32)
        return Generation(ids, np.full(len(ids), math.log(0.5), np.float32), RIGHT, "stop", 0, 0)

    async def sample(self, prompt_ids: Any, sampling: Any, n: int, seed: Any = None, images: Any = None) -> list:
        return [await self.generate(prompt_ids, sampling) for _ in range(n)]


class Broker:
    def __init__(self) -> None:
        self.sent: list[Transition] = []

    async def send_transition(self, t: Transition) -> None:
        self.sent.append(t)


def corridor_actor(monkeypatch: pytest.MonkeyPatch, session: aiohttp.ClientSession, url: str) -> tuple[Actor, Broker]:
    cfg = Config()
    cfg.memory.k, cfg.memory.max_prompt_tokens, cfg.env.group_size = 1, 10_000, 2
    cfg.distill.count, cfg.distill.model, cfg.distill.task_reward, cfg.distill.coef = 1, "teacher", "drop", 0.5
    cfg.distill.retries = 0
    monkeypatch.setattr("actors.spec.envs.make", lambda name, **kwargs: Corridor(**kwargs))
    spec = ActorSpec.from_config(cfg)
    assert spec.teacher is not None and spec.teacher.drop_task_reward
    teacher = Teacher(spec.teacher, [EngineClient(url, session, 30.0, versioned=False)])
    broker = Broker()
    actor = Actor(spec, "actor-0", 0, broker, [Engine()], ByteTokenizer(), teacher=teacher)  # type: ignore[arg-type]
    return actor, broker


async def test_with_task_reward_drop_a_step_is_its_teacher_signal_alone(tiny_engine, monkeypatch) -> None:
    model_dir, url = tiny_engine
    async with aiohttp.ClientSession() as session:
        actor, broker = corridor_actor(monkeypatch, session, url)
        await actor.play(GroupGrant(group_id=1, seed=1, min_version=0), "t", actor.engines[0])  # cells 1 -> 2 -> 3
    assert [t.step for t in broker.sent] == [0, 1] and broker.sent[-1].done
    for t in broker.sent:
        # 0.5 (log pi_T - ln 1/2) on each token; the env's reward (1 at the goal) dropped, kept in info.
        want = 0.5 * (hf_logprobs(model_dir, [*t.prompt_ids, *t.response_ids])[-t.response_ids.size :] - math.log(0.5))
        np.testing.assert_allclose(t.token_rewards, want, atol=1e-4)
        assert t.reward == pytest.approx(float(t.token_rewards.sum()), abs=1e-5)
        assert t.info["teacher_kl"] == pytest.approx(-float(t.token_rewards.mean()) / 0.5, abs=1e-5)
        assert t.info["env_reward"] == (1.0 if t.done else 0.0)
    assert actor.counters["distill_dropped"] == 0 and actor.teacher.counters["distill_steps"] == 2  # type: ignore[union-attr]


async def test_a_step_without_a_teacher_signal_drops_its_group_whole(monkeypatch) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        actor, broker = corridor_actor(monkeypatch, session, dead)
        await actor._episode(GroupGrant(group_id=1, seed=1, min_version=0), 0, actor.engines[0])
    # Nothing of the step was sent but the marker that drops its group whole, cause "teacher"; counted.
    (marker,) = broker.sent
    assert marker.info == {"abandon": "teacher", "abandon_group": True} and marker.group_id == 1
    assert actor.counters["distill_dropped"] == 1 and actor.counters["infra_failures_teacher"] == 1
    assert actor.counters["episode_retries"] == 0 and actor.counters["transitions_sent"] == 0
