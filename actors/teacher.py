"""On-policy distillation: a teacher model's log-prob of each token the student sampled, as a reward on that token.

    teacher = Teacher(spec.teacher, [EngineClient(url, session, spec.teacher.timeout_s, versioned=False) ...])
    signal = await teacher.signal(prompt_ids, response_ids, student_logprobs)   # TeacherFailure after the retries
    signal.rewards      # [T] coef * (log pi_teacher - log pi_student), the step's token rewards
    signal.kl           # mean over the T tokens of log pi_student - log pi_teacher

The actor asks after each policy step, before the step's transition goes to the broker (actors/actor.py): the learner
never waits for a teacher, the actor's other episodes play on meanwhile (as for LLM judges), and the broker stays a
router. A teacher is a vLLM server of a fixed model (teacher-<i>, started and restarted by the launcher like a judge)
asked for `prompt_logprobs` of prompt + response (`EngineClient.prompt_logprobs`). A request that fails or outlasts
distill.timeout_s is asked again, of another teacher when there are several, distill.retries times; then
`TeacherFailure`: the actor drops the step's group whole (distill_dropped), so nothing trains without the signal.

Shapes: P = prompt tokens, T = response tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from actors.servers import FixedServers
from actors.spec import TeacherSpec
from engines.client import EngineClient, EngineError

COUNTERS = (
    "distill_steps",
    "distill_tokens",
    "distill_kl_sum",
    "distill_latency_s_sum",
    "distill_errors",
    "distill_retries",
    "distill_dropped",
)
"""The actor's distillation counters: steps given the teacher's signal, their response tokens, the sum over those
tokens of log pi_student - log pi_teacher (distill_kl_sum / distill_tokens: the mean reverse KL per token), the
seconds of answered requests, failed requests, requests asked again, and groups dropped for want of a signal."""


class TeacherFailure(Exception):
    """No teacher gave a step's signal within distill.retries retries: the step's group is dropped."""

    cause = "teacher"  # counted as infra_failures_teacher, as EnvFailure's cause is


@dataclass(frozen=True)
class TeacherSignal:
    """One step's signal from the teacher."""

    rewards: np.ndarray
    """[T] float32: coef * (log pi_teacher - log pi_student) of each response token."""
    kl: float
    """Mean over the T tokens of log pi_student - log pi_teacher (0.0 for an empty response)."""


def reverse_kl_signal(
    teacher_logprobs: np.ndarray, student_logprobs: np.ndarray, coef: float
) -> tuple[np.ndarray, dict[str, float]]:
    """The per-token reverse-KL reward of one sampled response and its stats.

    On the student's own sample y ~ pi_S, log pi_S(y_t) - log pi_T(y_t) is the k1 estimate of the per-token reverse
    KL(pi_S || pi_T) (Gu et al. 2024, MiniLLM; Agarwal et al. 2024, GKD); its negative, scaled by coef, is each token's
    reward: r_t = coef * (log pi_T(y_t) - log pi_S(y_t)) (slime's and AReaL's policy-gradient form; maximising the
    return minimises the reverse KL).

    teacher_logprobs [T], student_logprobs [T] (float): log-probs of the sampled tokens. Returns (rewards [T] float32,
    {"kl": mean over T of log pi_S - log pi_T, "tokens": T}); kl is 0.0 when T = 0.
    """
    if teacher_logprobs.shape != student_logprobs.shape:
        raise ValueError(f"teacher log-probs {teacher_logprobs.shape} and student's {student_logprobs.shape} differ")
    gap = teacher_logprobs.astype(np.float64) - student_logprobs.astype(np.float64)  # [T] log pi_T - log pi_S
    kl = float(-gap.mean()) if gap.size else 0.0
    return (coef * gap).astype(np.float32), {"kl": kl, "tokens": float(gap.size)}


class Teacher:
    """Asks the teacher servers (`FixedServers`: least loaded first; a retry goes to another one when there is one)."""

    def __init__(self, spec: TeacherSpec, clients: Sequence[EngineClient]):
        self.spec = spec
        self.servers = FixedServers(clients, "teacher (distill.count >= 1)")
        self.counters: Counter[str] = Counter()

    async def signal(
        self, prompt_ids: np.ndarray | Sequence[int], response_ids: np.ndarray, student_logprobs: np.ndarray
    ) -> TeacherSignal:
        """The teacher's signal on one step (prompt_ids [P], response_ids [T], student_logprobs [T]: the log-probs the
        student's engine sampled them with); TeacherFailure when no teacher answered within the retries."""
        n = int(response_ids.size)
        if n == 0:
            return TeacherSignal(np.zeros(0, np.float32), 0.0)
        ids = np.concatenate([np.asarray(prompt_ids, np.int64), np.asarray(response_ids, np.int64)])  # [P + T]
        why, last = "", ""
        for attempt in range(self.spec.retries + 1):
            if attempt:  # a teacher being restarted takes seconds: back off a little (0.5 s, 1 s, 2 s, ... 5 s)
                self.counters["distill_retries"] += 1
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 5.0))
            client = self.servers.pick(avoid=last)
            started = time.monotonic()
            try:
                with self.servers.using(client):
                    async with asyncio.timeout(self.spec.timeout_s):
                        teacher = (await client.prompt_logprobs(ids))[-n:]  # [T] the response's tokens
            except (EngineError, TimeoutError) as exc:
                self.servers.failed(client)
                self.counters["distill_errors"] += 1
                why, last = (
                    str(exc) or f"{client.url}: no answer within distill.timeout_s={self.spec.timeout_s}",
                    client.url,
                )
                continue
            rewards, stats = reverse_kl_signal(teacher, np.asarray(student_logprobs), self.spec.coef)
            if not np.isfinite(rewards).all():  # (an impossible token under either model): no signal to train on
                self.counters["distill_errors"] += 1
                why = f"{client.url}: a log-prob that is not finite (an impossible token under either model)"
                break
            self.counters.update(distill_steps=1, distill_tokens=n)
            self.counters["distill_kl_sum"] += stats["kl"] * n
            self.counters["distill_latency_s_sum"] += time.monotonic() - started
            return TeacherSignal(rewards, stats["kl"])
        raise TeacherFailure(f"no teacher signal after {self.spec.retries + 1} attempt(s): {why}")


__all__ = ["COUNTERS", "Teacher", "TeacherFailure", "TeacherSignal", "reverse_kl_signal"]
