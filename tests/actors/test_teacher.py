"""On-policy distillation, actor side (actors/teacher.py): the per-token reverse-KL signal against values worked out
by hand, and a real vLLM server of the tiny model asked as a teacher: its log-probs of a response are the model's own
(transformers, same weights), a dead teacher is avoided while another answers, and with none alive the request fails
after its retries (the actor then drops the group: tests/test_e2e_distill.py). ~5 s once the session's server is up.

    .venv/bin/python -m pytest tests/actors/test_teacher.py -q -p no:cacheprovider
"""

from __future__ import annotations

import math

import aiohttp
import numpy as np
import pytest

from actors.spec import TeacherSpec
from actors.teacher import Teacher, TeacherFailure, reverse_kl_signal
from agentstream.wire.addresses import free_port
from engines.client import EngineClient


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
