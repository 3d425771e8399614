"""An actor process: K episodes at once on one asyncio loop, G per group, streaming every step.

    python -m actors.actor --config RUN/config.yaml --name actor-0 --incarnation 0 \
        --broker tcp://127.0.0.1:5555 --engine http://127.0.0.1:8000 [--engine ...] [--judge URL ...]

Per step (the data flow env -> memory -> engine -> actor -> broker): the memory module builds the chat
prompt; the chat template turns it into token ids; an engine samples response ids with their log-probs
and the policy-version interval that produced them; the env's parser turns the text into an action (an
unparseable answer is an invalid action: the game does not move and the step gets the configured
penalty); the env steps; the transition goes to the broker. Episodes never wait for one another.
Faults outside the model (docs/reliability.md): a request its engine leaves unanswered for engines.stall_timeout_s
while a probe goes unanswered too moves to another engine (engine_stalls); an episode whose env step raises or
outlasts env.step_timeout_s, or whose engines all fail, is played again on the same seed under a new traj_id
(actors.episode_retries; an abandon marker has the broker drop what the failed attempt sent), then its group is
dropped whole (infra_failures_<cause>).
With LLM judges (judges.count > 0, `--judge URL`), an episode's last transition waits for the judge's verdict
on the whole episode, whose score joins that step's reward (actors/judge.py); the other episodes play on.
With distillation (distill.count > 0, `--teacher URL`), every transition waits for a teacher's log-probs of its
response tokens, whose reverse-KL signal are its token rewards (actors/teacher.py); a step no teacher answered
drops its group whole (distill_dropped), never sent without the signal.
The step loop itself is `actors.episode.play`, shared with the evaluator and the warm start's demonstrations;
what the actor needs of the run config is an `ActorSpec` (actors/spec.py), taken from it once in `main()`.
The engine calls (which engine, failover, the shared first turn, the frozen copy) are `actors.sampling.Sampler`'s.
Self-play (an env whose traits declare 2 seats, `EpisodeSpec.seats`: TextArena with `opponent=self`): an episode is a
match (`actors.episode.play_match`) with the policy in both seats; each grant opens one group per seat (ids
grant.group_id + seat), and seat s's turns of the group's G matches are the G trajectories of group grant.group_id + s:
each seat gets its own baseline. A frozen seat (`EnvTraits.frozen_seat`: TextArena's `opponent=frozen`, LoRA runs): the
same match, but only the env's `trained_seat` (drawn from the seed) is the policy's: one trajectory per match, one group
per grant; the other seat's turns are sampled from the engine's frozen copy (`agentstream.models.FROZEN_ADAPTER_NAME`,
the base model until the engine has loaded it) and never sent.
SIGTERM: stop starting steps, send the final stats, exit.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from actors import episode
from actors.episode import EnvCalls, EnvFailure, EpisodeOutcome, MatchEnv, StepRecord
from actors.judge import EpisodeRecord, Judge, JudgedStep, Verdict, combine, verdict_counters
from actors.sampling import Sampler
from actors.spec import ActorSpec
from actors.teacher import Teacher, TeacherFailure
from actors.token_rewards import TokenRewards, TokenRewardStep
from agentstream import config as config_mod
from agentstream.process import on_stop_signals, run_process
from agentstream.wire.client import AsyncClient
from agentstream.wire.messages import GroupGrant, Stats, Transition
from engines.client import EngineClient, EngineError, Generation, clamp_to_grant, text_decoder
from engines.pool import connect, engines_from_broker, follow_engines, goodbye, process_arguments, report_stats
from envs.base import TextEnv
from envs.latency import sample_latency

log = logging.getLogger("actor")


class _GroupDropped(Exception):
    """Another episode of the group gave up (its env or engines failed every attempt): the group is dropped."""


@dataclass
class _Trajectory:
    """A trajectory while its episode plays (a match plays one per seat): where its steps go, what they earned."""

    traj_id: str
    group_id: int
    instructions: Callable[[], str]
    """The task as the judge reads it: the env's instructions (its seat's, in a match), known after reset."""
    total: float = 0.0
    judged: list[JudgedStep] = field(default_factory=list)
    """The trajectory so far, as the judge will see it."""
    verdict: Verdict | None = None


@dataclass(frozen=True)
class _Seats:
    """Who plays one episode's seats: `match` is its env where it is a match (None: one seat); with a frozen seat
    (`frozen`), the env's `trained_seat` (known once it is reset) is the policy's and the other the frozen copy's."""

    env: TextEnv
    match: MatchEnv | None
    frozen: bool

    def plays_frozen(self, seat: int) -> bool:
        """Whether `seat`'s turns are the frozen copy's (counted, never sent)."""
        return self.match is not None and self.frozen and seat != self.match.trained_seat

    def instructions(self, seat: int) -> str:
        """The task, as the judge reads it: in a match, the seat's own rules (a frozen match's env instructions are
        its trained seat's)."""
        if self.match is None or self.frozen:
            return self.env.instructions
        return self.match.seat_instructions[seat]

    def trained(self, outcomes: list[EpisodeOutcome]) -> list[EpisodeOutcome]:
        """The outcomes of the trained seats: a frozen match's trained seat's only."""
        if self.match is None or not self.frozen:
            return outcomes
        return [outcomes[cast(int, self.match.trained_seat)]]  # (set by the frozen match's reset)


@dataclass
class EpisodeResult:
    """How an actor's episode ended; `total_reward` includes the invalid-action penalties."""

    steps: int
    total_reward: float
    success: bool


class Actor:
    """Runs K episode lanes; each takes the next episode of the groups the broker granted this actor."""

    def __init__(
        self,
        spec: ActorSpec,
        name: str,
        incarnation: int,
        broker: AsyncClient,
        engines: list[EngineClient],
        tokenizer: Any,
        judge: Judge | None = None,
        teacher: Teacher | None = None,
    ):
        self.spec, self.name, self.incarnation = spec, name, incarnation
        self.broker, self.engines, self.tokenizer = broker, engines, tokenizer
        self.judge = judge  # scores finished episodes (spec.judge); None: no judge
        self.teacher = teacher  # scores every step's tokens (spec.teacher, distillation); None: no teacher
        # rewards on response tokens (trainer.token_reward); None: none
        self.token_rewards = (
            TokenRewards.load(spec.token_reward, spec.token_reward_kwargs) if spec.token_reward else None
        )
        self.counters: Counter[str] = Counter()
        self.in_flight = 0
        # The engine calls; it shares `engines` (engines that join later are appended) and the counters.
        self.sampler = Sampler(self.engines, spec.client, spec.episode.sampling, spec.group_size, self.counters, name)
        self.env_calls = EnvCalls(spec.episode.env.step_timeout_s, spec.max_hung_steps)
        self._failed_groups: set[int] = set()  # groups given up (an episode failed every attempt), while in play
        self._steps_sent: dict[str, int] = {}  # traj_id -> steps sent, while its episode plays
        # Simulated step latencies draw from their own stream, seeded per actor incarnation: a rerun replays them.
        self._latency_rng = random.Random(f"{spec.seed}/{name}/{incarnation}")
        # Episodes of granted groups not yet started: (grant, index in the group, the group's engine).
        self._pending: collections.deque[tuple[GroupGrant, int, EngineClient]] = collections.deque()
        self._open: dict[int, int] = {}  # group id -> its episodes not yet finished
        self._deal = asyncio.Condition()
        # At most K/G + 1 groups in play: one group ahead of the K/G that K lanes fill, so a lane whose group's
        # other episodes still run starts the next group instead of idling, while what a paused learner lets
        # pile up in the broker stays bounded (K/G + 1 groups of G episodes per actor).
        self.max_open_groups = spec.episodes_per_actor // spec.group_size + 1

    @property
    def requests_in_flight(self) -> int:
        """Engine requests awaited now (a gauge)."""
        return self.sampler.requests_in_flight

    @property
    def policy_version(self) -> int:
        """The newest policy version an answer came from (a gauge; -1: none yet)."""
        return self.sampler.policy_version

    async def run(self) -> None:
        """Play groups until cancelled: K = actors.episodes_per_actor lanes, one episode each at a time.

        Episodes of one group end at different steps (a hole at step 1, the goal at step 9); a lane that ends
        its episode takes the next one at once, from the next group if its own has none left to start, so K
        requests stay in flight instead of K minus the episodes that wait for their group's slowest."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(report_stats(self.broker, self.stats, self.spec.log_interval_s))
            for _ in range(self.spec.episodes_per_actor):
                tg.create_task(self._lane())

    async def _lane(self) -> None:
        while True:
            grant, i, engine = await self._next_episode()
            try:
                await self._episode(grant, i, engine)
            finally:
                async with self._deal:
                    self._open[grant.group_id] -= 1
                    if not self._open[grant.group_id]:
                        del self._open[grant.group_id]
                        self._failed_groups.discard(grant.group_id)
                        self.sampler.close_first_turn(grant.group_id)
                    self._deal.notify_all()

    async def _episode(self, grant: GroupGrant, i: int, engine: EngineClient) -> None:
        """Episode `i` of the group, played again on the same seed (traj_id ....r1, .r2, ...) when its env fails
        (a step raised or timed out) or its engines do, up to actors.episode_retries times; the group stays whole
        and unbiased: the retry replaces the failed attempt, whose sent steps the broker drops (an abandon marker).
        After the last attempt fails, the group is dropped whole and its other episodes stop at their next step.
        A match (self-play) is one episode whose seats' trajectories belong to groups grant.group_id + seat: it is
        retried, or dropped, in all of them at once (a match with a frozen seat has one trajectory, in group_id)."""
        bases = [
            f"{self.name}.{self.incarnation}.g{grant.group_id + seat}.{i}"
            for seat in range(self.spec.episode.trained_seats)
        ]
        for attempt in range(self.spec.episode_retries + 1):
            if grant.group_id in self._failed_groups:
                return
            traj_ids = [base if attempt == 0 else f"{base}.r{attempt}" for base in bases]
            self._steps_sent.update(dict.fromkeys(traj_ids, 0))
            share = attempt == 0 and self.spec.share_first_turn
            try:
                if self.spec.episode.seats == 1:
                    await self.play(grant, traj_ids[0], engine, share_first_turn=share)
                else:
                    await self.play_match(grant, traj_ids, engine, share_first_turn=share)
                return
            except _GroupDropped:
                self.counters["episodes_cut"] += 1
                return
            except (EnvFailure, EngineError, TeacherFailure) as exc:
                cause = "engine" if isinstance(exc, EngineError) else exc.cause
                self.counters.update({"infra_failures": 1, f"infra_failures_{cause}": 1})
                if grant.group_id in self._failed_groups:  # given up meanwhile: dropped with what this attempt sent
                    log.warning("%s: %s failed (%s); its group is dropped already", self.name, traj_ids[0], exc)
                    return
                # no teacher signal after its retries: the group is dropped, never trained without it
                give_up = attempt == self.spec.episode_retries or cause == "teacher"
                log.warning(
                    "%s: %s failed (%s); %s",
                    self.name,
                    traj_ids[0],
                    exc,
                    "dropping its group" if give_up else "playing it again on the same seed",
                )
                if give_up:
                    self._failed_groups.add(grant.group_id)  # (before the marker's send: no new step of it follows)
                    self.counters["distill_dropped"] += cause == "teacher"
                else:
                    self.counters["episode_retries"] += 1
                    if cause == "engine":
                        engine = self.sampler.pick_engine()
                for seat, traj_id in enumerate(traj_ids):
                    sent = self._steps_sent[traj_id]
                    if sent or give_up:  # nothing sent: nothing to drop, the retry takes the place
                        await self.broker.send_transition(
                            Transition.abandon_marker(
                                traj_id,
                                grant.group_id + seat,
                                self.name,
                                sent,
                                grant.min_version,
                                cause,
                                whole_group=give_up,
                            )
                        )
            finally:
                for traj_id in traj_ids:
                    self._steps_sent.pop(traj_id, None)

    async def _next_episode(self) -> tuple[GroupGrant, int, EngineClient]:
        """The next episode to play: an unstarted one of a granted group, else the first of a new group (one
        grant request at a time, made while fewer than max_open_groups are in play)."""
        async with self._deal:
            await self._deal.wait_for(lambda: bool(self._pending) or len(self._open) < self.max_open_groups)
            if not self._pending:
                # (others wait on the lock: this grant may serve them); self-play: one group per seat
                grant = await self.broker.request_group(self.spec.episode.trained_seats)
                engine = self.sampler.pick_engine()
                self._open[grant.group_id] = self.spec.group_size
                self._pending.extend((grant, i, engine) for i in range(self.spec.group_size))
            return self._pending.popleft()

    async def play(
        self, grant: GroupGrant, traj_id: str, engine: EngineClient, share_first_turn: bool = False
    ) -> EpisodeResult:
        """One episode from the group's seed to done/truncated (`actors.episode.play`); every step goes to the
        broker as soon as it is taken. `share_first_turn`: its first turn is one of the group's shared answers
        (`_shared_answer`)."""
        (result,) = await self._play(grant, [traj_id], engine, share_first_turn)
        return result

    async def play_match(
        self, grant: GroupGrant, traj_ids: Sequence[str], engine: EngineClient, share_first_turn: bool = False
    ) -> list[EpisodeResult]:
        """Self-play: one game from the group's seed with the policy in every seat (`actors.episode.play_match`).
        Seat s's steps are trajectory traj_ids[s] of group grant.group_id + s, each sent once what followed it is
        known (the other seat's reply, or the game's end). `share_first_turn`: the match's first turn is one of the
        group's shared answers. Returns each seat's result. With a frozen seat: traj_ids[0] is the trained seat's
        (`env.trained_seat`), the other seat's turns come from the frozen copy and are counted (frozen_steps), never
        sent; returns the trained seat's result."""
        return await self._play(grant, traj_ids, engine, share_first_turn)

    async def _play(
        self, grant: GroupGrant, traj_ids: Sequence[str], engine: EngineClient, share_first_turn: bool
    ) -> list[EpisodeResult]:
        """`play` (one trajectory) or `play_match` (one per trained seat): one env, a memory per seat, a trajectory per
        trained seat. With a frozen seat (`EpisodeSpec.frozen`), traj_ids[0] is the env's `trained_seat` (known once it
        is reset) and the other seat's turns are sampled from the engine's frozen copy; its steps are never sent."""
        spec = self.spec.episode
        env = spec.make_env()
        mems = [spec.make_memory(self.tokenizer) for _ in range(spec.seats)]
        # (an env whose traits declare two seats is a match: `actors.episode.MatchEnv`)
        seats = _Seats(env, cast(MatchEnv, env) if len(mems) > 1 else None, spec.frozen)
        trajs = [
            _Trajectory(traj_id, grant.group_id + i, functools.partial(seats.instructions, i))
            for i, traj_id in enumerate(traj_ids)
        ]
        generate = self.sampler.episode(engine, grant.group_id if share_first_turn else None, seats.plays_frozen)
        senders = [functools.partial(self._on_step, grant, seats, trajs, seat) for seat in range(len(mems))]
        self.in_flight += 1
        timed_out = False
        try:
            if seats.match is None:
                outcomes = [
                    await episode.play(env, mems[0], generate, senders[0], seed=grant.seed, calls=self.env_calls)
                ]
            else:
                outcomes = await episode.play_match(
                    seats.match, mems, generate, senders, seed=grant.seed, calls=self.env_calls
                )
        except EnvFailure as exc:
            timed_out = exc.cause == "timeout"
            raise
        finally:
            self.in_flight -= 1
            for mem in mems:
                self.counters.update(memory_dropped_steps=mem.dropped_steps, memory_truncated_steps=mem.truncated_steps)
            self.env_calls.close(env, abandoned=timed_out)
        return self._results(seats.trained(outcomes), trajs)

    async def _on_step(
        self, grant: GroupGrant, seats: _Seats, trajs: Sequence[_Trajectory], seat: int, step: StepRecord[Generation]
    ) -> None:
        """A step of `seat`: sent as its trajectory's (a frozen match's one trajectory is its trained seat's), or, the
        frozen copy's, counted and never sent."""
        if seats.plays_frozen(seat):
            self.counters.update(frozen_steps=1, frozen_invalid_actions=int(not step.valid))
        else:
            await self._send_step(grant, trajs[0 if seats.frozen else seat], step)

    def _results(self, outcomes: Sequence[episode.EpisodeOutcome], trajs: Sequence[_Trajectory]) -> list[EpisodeResult]:
        """Each trajectory's result, counted (episodes, successes, returns, the judge's verdicts)."""
        results = []
        for outcome, traj in zip(outcomes, trajs, strict=True):
            self.counters.update(episodes=1, successes=int(outcome.success))
            if traj.verdict is not None:  # counted with the episode: judge_requests == episodes whenever stats are read
                self.counters.update(verdict_counters(traj.verdict))
            self.counters["episode_return_sum"] += traj.total
            results.append(EpisodeResult(outcome.steps, traj.total, outcome.success))
        return results

    async def _send_step(self, grant: GroupGrant, traj: _Trajectory, step: StepRecord[Generation]) -> None:
        """One step of `traj` to the broker, with the judge's verdict on a last step, the invalid-action penalty and
        the token rewards in its reward."""
        env_spec = self.spec.episode.env
        if env_spec.step_latency_mean_s:  # simulated tool/web latency (benchmarks); never blocks the loop
            await asyncio.sleep(
                sample_latency(self._latency_rng, env_spec.step_latency_mean_s, env_spec.step_latency_sigma)
            )
        reward, info = step.reward, {}
        if self.judge is not None:
            traj.judged.append(JudgedStep(step.turn.observation, step.response.text, step.reward))
            if step.done:  # the judged reward is the last step's: its transition waits for the verdict
                record = EpisodeRecord(
                    traj.instructions(),
                    tuple(traj.judged),
                    step.next_observation,
                    bool(step.info.get("success", False)),
                )
                traj.verdict = verdict = await self.judge.judge(record)
                j = self.judge.spec
                reward = combine(j.combine, step.reward, verdict.score, j.weight)
                info = {"env_reward": step.reward, "judge_score": verdict.score, "judge_outcome": verdict.outcome}
                if verdict.outcome != "parsed":
                    log.debug("%s: judge %s (%s)", traj.traj_id, verdict.outcome, verdict.detail)
        reward += 0.0 if step.valid else self.spec.invalid_action_penalty
        token_rewards = self._token_rewards(step)
        if self.teacher is not None:
            reward, token_rewards = await self._teacher_signal(grant, step, reward, token_rewards, info)
        reward += float(token_rewards.sum(dtype=np.float64))  # a transition's reward is its step's whole reward
        if grant.group_id in self._failed_groups:  # (checked with no await before the send: nothing of the
            raise _GroupDropped  # group is sent after the marker that dropped it)
        await self.broker.send_transition(self._transition(grant, traj, step, reward, info, token_rewards))
        self._steps_sent[traj.traj_id] = self._steps_sent.get(traj.traj_id, 0) + 1
        self._count_step(len(step.response.response_ids), step.valid)
        traj.total += reward

    async def _teacher_signal(
        self,
        grant: GroupGrant,
        step: StepRecord[Generation],
        reward: float,
        token_rewards: np.ndarray,
        info: dict[str, Any],
    ) -> tuple[float, np.ndarray]:
        """The step's reward and token rewards with the teacher's signal on its response tokens (distillation;
        actors/teacher.py): `info` gets the step's mean reverse KL per token (`teacher_kl`); with distill.task_reward
        =drop the task's reward (env, penalty, judge) goes, the env's kept in info as `env_reward`. TeacherFailure
        when no teacher answered (the caller drops the group)."""
        assert self.teacher is not None
        if grant.group_id in self._failed_groups:  # given up meanwhile: not worth a teacher's time
            raise _GroupDropped
        gen = step.response
        signal = await self.teacher.signal(step.turn.prompt_ids, gen.response_ids, gen.logprobs)
        info["teacher_kl"] = signal.kl
        if self.teacher.spec.drop_task_reward:
            info.setdefault("env_reward", step.reward)
            reward = 0.0
        return reward, token_rewards + signal.rewards if token_rewards.size else signal.rewards

    def _token_rewards(self, step: StepRecord[Generation]) -> np.ndarray:
        """The step's rewards on its response tokens [T] ([0]: none, or the function failed: counted)."""
        if self.token_rewards is None:
            return np.zeros(0, np.float32)
        values, _ = self.token_rewards(
            TokenRewardStep(
                step.turn.observation,
                step.response.text,
                step.response.response_ids,
                self.tokenizer,
                step.reward,
                step.valid,
                step.info,
            )
        )
        return values

    def _transition(
        self,
        grant: GroupGrant,
        traj: _Trajectory,
        step: StepRecord[Generation],
        reward: float,
        info: dict[str, Any],
        token_rewards: np.ndarray,
    ) -> Transition:
        """The message to the broker of one step of `traj` (reward: the env's, or the judged one of a last step, plus
        the actor's invalid-action penalty and the token rewards' sum; `info`: the judge's verdict on a judged last
        step)."""
        gen = step.response
        version_lo, version_hi = clamp_to_grant(gen.version_lo, gen.version_hi, grant.min_version)
        return Transition(
            traj_id=traj.traj_id,
            group_id=traj.group_id,
            actor=self.name,
            step=step.turn.step,
            prompt_ids=np.asarray(step.turn.prompt_ids, dtype=np.int32),
            response_ids=gen.response_ids,
            logprobs=gen.logprobs,
            version_lo=version_lo,
            version_hi=version_hi,
            reward=reward,
            done=step.terminated,
            truncated=step.truncated,
            valid=step.valid,
            anchor=step.turn.anchor,
            info={"success": bool(step.info.get("success", False)), **info},
            token_rewards=token_rewards,
            **({"images": np.stack(step.turn.images)} if step.turn.images else {}),  # one size: one env's pictures
        )

    def _count_step(self, n_tokens: int, valid: bool) -> None:
        self.counters.update(
            env_steps=1, transitions_sent=1, tokens_generated=n_tokens, invalid_actions=0 if valid else 1
        )

    def stats(self, final: bool = False) -> Stats:
        # This actor plays one env: its outcome counters, again under env/<name>/ (broker.stats.env_outcomes).
        per_env = {
            f"env/{self.spec.episode.env.name}/{k}": self.counters[k]
            for k in ("episodes", "successes", "episode_return_sum", "env_steps", "invalid_actions")
        }
        delivery = {k: float(v) for k, v in self.broker.counters.items()}  # resends after a broker restart
        tokens = dict(self.token_rewards.counters) if self.token_rewards is not None else {}
        if self.teacher is not None:
            tokens.update(self.teacher.counters)
        return Stats(
            source=self.name,
            role="actor",
            counters={**self.counters, **per_env, **delivery, **tokens},
            gauges={
                "episodes_in_flight": self.in_flight,
                "incarnation": self.incarnation,
                "unacked_transitions": self.broker.unacked,
                "requests_in_flight": self.requests_in_flight,
                "policy_version": self.policy_version,
                "env_steps_hung": self.env_calls.hung,
            },
            final=final,
        )


async def _main(
    spec: ActorSpec,
    name: str,
    incarnation: int,
    broker_address: str,
    engine_urls: list[str],
    judge_urls: list[str],
    teacher_urls: list[str],
) -> int:
    from transformers import AutoTokenizer

    if spec.judge is not None and not judge_urls:
        log.error("%s: judges.count > 0 but no --judge URL was given; the launcher passes its judges' URLs", name)
        return 2
    if spec.teacher is not None and not teacher_urls:
        log.error("%s: distill.count > 0 but no --teacher URL was given; the launcher passes its teachers' URLs", name)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(spec.client.model_path)
    async with connect(
        name,
        incarnation,
        broker_address,
        spec.client,
        spec.max_unacked,
        spec.ack_timeout_s,
        decode=text_decoder(tokenizer),
    ) as links:
        judge = None
        if spec.judge is not None:  # its own servers, tokenizer and timeout; its weights never change
            j = spec.judge
            judge_tokenizer = (
                tokenizer if j.model_path == spec.client.model_path else AutoTokenizer.from_pretrained(j.model_path)
            )
            judge = Judge(
                j,
                [EngineClient(url, links.session, j.timeout_s, versioned=False) for url in judge_urls],
                judge_tokenizer,
            )
        teacher = None
        if spec.teacher is not None:  # its own servers (the student's tokenizer: checked at launch)
            t = spec.teacher
            teacher = Teacher(
                t, [EngineClient(url, links.session, t.timeout_s, versioned=False) for url in teacher_urls]
            )
        actor = Actor(spec, name, incarnation, links.broker, [], tokenizer, judge, teacher)
        task = asyncio.current_task()
        assert task is not None  # run_process runs this coroutine as a task
        on_stop_signals(task.cancel)  # before any wait: a stopped actor always sends its final stats
        follower: asyncio.Task[None] | None = None
        code = 0
        try:
            actor.engines.extend(links.engine(url) for url in engine_urls or await engines_from_broker(links.broker))
            follower = asyncio.create_task(follow_engines(links.broker, actor, links.engine))  # engines joining later
            await actor.run()
        except asyncio.CancelledError:
            log.info("%s: stopping (signal)", name)
        except ExceptionGroup as group:  # an episode failed: say which error, exit non-zero (restarted)
            log.error("%s: episode failed: %r", name, group.exceptions[0])
            code = 3
        finally:
            if follower is not None:
                follower.cancel()
            await goodbye(links.broker, lambda: actor.stats(final=True), spec.shutdown_timeout_s / 2)
    return code


def main() -> None:
    parser = process_arguments(
        __doc__,
        name_help="actor name (its identity at the broker)",
        engine_help="engine base URL (repeatable); none: learn them from the broker. Engines "
        "that join later (role=engines) are used too",
    )
    parser.add_argument(
        "--judge",
        action="append",
        default=[],
        help="LLM judge server base URL (repeatable; needed with judges.count > 0)",
    )
    parser.add_argument(
        "--teacher",
        action="append",
        default=[],
        help="distillation teacher server base URL (repeatable; needed with distill.count > 0)",
    )
    args = parser.parse_args()
    run_process(
        args.name,
        log,
        lambda: _main(
            ActorSpec.from_config(config_mod.load(args.config)),
            args.name,
            args.incarnation,
            args.broker,
            args.engine,
            args.judge,
            args.teacher,
        ),
    )


if __name__ == "__main__":
    main()
