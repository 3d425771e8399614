"""Every environment plays through the real engine, and a whole launcher run completes on ALFWorld.

One real vLLM server (the tiny model) serves every test. Each env plays episodes through the actors' own
episode loop (`actors.evaluate.play_episode`: the env, its memory, the chat template, the engine client), a few
seconds each. ALFWorld (a blocking env, stepped in a worker thread) also gets a whole launcher run through
`engines.external_urls` (broker, weight sidecar, learner with 1 rank, an actor); the learner first brings the server
to its own initial weights (version 0) before any group is admitted. Other envs' runs: FrozenLake in
tests/test_e2e.py, with the GiGPO preset in tests/test_ray.py, Sokoban with PPO (a critic) in tests/test_slurm.py.
What a run adds beyond the episode does not depend on the env, and a run costs ~30 s here: the suite's time. A user's
env loaded by import path (examples/my_env) gets one short run of its own: that path is the launcher's and the actor's;
so does an OpenEnv server's game (examples/openenv_game), served by the launcher from its app: that server is the
launcher's child.
TextArena self-play goes through the actor itself (a memory per seat, one grant opening a group per seat at a real
broker in the test's loop) and its validation through the evaluator's episode against the random opponent.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_testing import broker_and_client, play_until_ready

import envs
from agentstream.config import Config

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tiny_engine):
    """The session's tiny vLLM server (tests/conftest.py)."""
    return tiny_engine


def launch(tmp_path: Path, model: str, url: str, *overrides: str, steps: int = 1) -> dict:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "scripts/launch.py",
        f"run.output_dir={run_dir}",
        f"model.path={model}",
        "engines.count=1",
        f"engines.external_urls=[{url}]",
        "learner.world_size=1",
        "actors.count=1",
        "actors.episodes_per_actor=2",
        "env.group_size=2",
        "trainer.groups_per_step=1",
        f"trainer.total_steps={steps}",
        "env.max_steps=3",
        "sampling.max_tokens=12",
        "broker.dashboard_port=0",  # the OS picks a free port: a port picked here first can be taken meanwhile
        "run.shutdown_timeout_s=5",
        *overrides,
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the launcher stops its children; then report what it printed
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["processes_left"] == []
    assert summary["learner_version"] == steps and summary["engine_versions"] == {"engine-0": steps}
    assert summary["transitions_sent_reported"] == summary["transitions_sent"] == summary["transitions_ingested"] > 0
    assert summary["trained_group_shapes"] == {"2/2": steps}
    return summary


# The whole runs, with the algorithm preset each also covers (one run each instead of two).
# FrozenLake runs in tests/test_e2e.py, and with GiGPO in tests/test_ray.py; Sokoban with PPO in tests/test_slurm.py.
RUNS = {"agentstream/ALFWorld-v0": None}
EPISODES, MAX_STEPS = 2, 3
OPENENV = "agentstream/OpenEnv-v0"
USER_ENV = "examples.my_env.guess:GuessEnv"  # a user's env by import path (envs/user.py)
OPENENV_APP = "examples.openenv_game.server:app"  # an OpenEnv server's app (envs/openenv.py)


@pytest.fixture(scope="module")
def openenv_server(tmp_path_factory: pytest.TempPathFactory):
    """The example OpenEnv app under uvicorn on 127.0.0.1, as a user serves it: its base URL."""
    import time
    import urllib.request

    from agentstream.wire.addresses import free_port
    from launcher.procs import start, stop

    port = free_port()
    log = tmp_path_factory.mktemp("openenv") / "server.log"
    argv = [sys.executable, "-m", "uvicorn", OPENENV_APP, "--host", "127.0.0.1", "--port", str(port)]
    proc = start(argv, log, cwd=ROOT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    try:
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).close()
                break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        stop(proc, 5)


@pytest.mark.parametrize("name", envs.known_envs())
def test_every_env_plays_episodes_through_the_engine(server, name: str, request: pytest.FixtureRequest) -> None:
    import asyncio

    import aiohttp
    from transformers import AutoTokenizer

    from actors.evaluate import play_episode
    from actors.spec import EpisodeSpec
    from engines.client import EngineClient

    model, url = server
    cfg = Config()
    cfg.model.path, cfg.env.name, cfg.env.max_steps, cfg.sampling.max_tokens = model, name, MAX_STEPS, 12
    if envs.traits(name).remote:  # played on a server: the example OpenEnv app's
        cfg.env.kwargs = {"base_url": request.getfixturevalue("openenv_server")}
    spec, tokenizer = EpisodeSpec.from_config(cfg), AutoTokenizer.from_pretrained(model)

    async def play() -> list:
        async with aiohttp.ClientSession() as session:
            engine = EngineClient(url, session, timeout_s=120)
            return await asyncio.gather(*(play_episode(spec, engine, tokenizer, seed) for seed in range(EPISODES)))

    episodes = asyncio.run(play())
    for e in episodes:  # every episode ends within the step limit; an answer that did not parse is counted
        assert 1 <= e.steps <= MAX_STEPS and 0 <= e.invalid <= e.steps, e
        assert e.env_return == e.env_return  # not nan


def test_textarena_games_through_the_engine(server) -> None:
    """Kuhn Poker against the random opponent through the evaluator's episode loop and the real engine: both seats
    play (the seat comes from the seed), and each episode's return is its invalid answers' penalties plus, when the
    game ended, TextArena's outcome (-1, 0 or 1)."""
    import asyncio

    import aiohttp
    from transformers import AutoTokenizer

    from actors.evaluate import play_episode
    from actors.spec import EpisodeSpec
    from engines.client import EngineClient

    model, url = server
    cfg = Config()
    cfg.model.path, cfg.env.name, cfg.env.max_steps, cfg.sampling.max_tokens = model, "agentstream/TextArena-v0", 4, 12
    cfg.env.kwargs = {"game": "KuhnPoker-v0", "opponent": "random"}
    spec, tokenizer = EpisodeSpec.from_config(cfg), AutoTokenizer.from_pretrained(model)
    seeds = range(10**9, 10**9 + 4)  # validation seeds
    assert {envs.make(cfg.env.name, **cfg.env.kwargs).reset(seed=s)[1]["seat"] for s in seeds} == {0, 1}

    async def play() -> list:
        async with aiohttp.ClientSession() as session:
            engine = EngineClient(url, session, timeout_s=120)
            return await asyncio.gather(*(play_episode(spec, engine, tokenizer, seed) for seed in seeds))

    for e in asyncio.run(play()):
        assert 1 <= e.steps <= 4 and 0 <= e.invalid <= e.steps, e
        outcome = e.env_return + 0.2 * e.invalid
        assert min(abs(outcome - o) for o in (-1.0, 0.0, 1.0)) < 1e-9 and (outcome > 0) == e.success, e


async def test_textarena_self_play_matches_through_the_actor(server) -> None:
    """Kuhn Poker with the policy in both seats, through the actor's own path (`actors.actor.Actor`: the env, a memory
    per seat, the chat template, the real engine, transitions over ZeroMQ to a real broker in this loop). One grant
    opens a group per seat (groups_per_step 2 at bound 0, no learner: only that grant); its G = 2 matches fill both.
    Every match ends by the game's rules (an invalid answer costs -0.2 and a random legal move is played for it), so
    each trajectory ends done; its return is its invalid steps' penalties (-0.2 from the env, the actor's on top) plus
    its seat's outcome, and the two seats' outcomes are opposite. Validation of the same run plays one seat against
    the random opponent (`actors.evaluate.play_episode`)."""
    import aiohttp
    from e2e_testing import check_accounting
    from transformers import AutoTokenizer

    from actors.actor import Actor
    from actors.evaluate import play_episode
    from actors.spec import ActorSpec, EvaluatorSpec
    from engines.client import EngineClient

    model, url = server
    cfg = Config()
    cfg.model.path, cfg.env.name, cfg.env.max_steps, cfg.sampling.max_tokens = model, "agentstream/TextArena-v0", 9, 12
    cfg.env.kwargs = {"game": "KuhnPoker-v0", "opponent": "self"}
    cfg.env.group_size, cfg.actors.episodes_per_actor = 2, 2
    cfg.trainer.groups_per_step, cfg.trainer.max_staleness, cfg.learner.world_size = 2, 0, 1
    cfg.broker.track_keys, cfg.broker.logger = True, []
    tokenizer = AutoTokenizer.from_pretrained(model)
    async with aiohttp.ClientSession() as session:
        engine = EngineClient(url, session, timeout_s=120)
        async with broker_and_client(cfg) as (broker, client):
            actor = Actor(ActorSpec.from_config(cfg), "actor-0", 0, client, [engine], tokenizer)
            await play_until_ready(actor, broker, 2)
        validation = await play_episode(EvaluatorSpec.from_config(cfg).episode, engine, tokenizer, 10**9)
    b = broker.buffer
    assert b.counts["groups_admitted"] == 2 and sorted(g.group_id for g in b.ready) == [0, 1]
    trajectories = {traj: steps for g in b.ready for traj, steps in g.trajectories.items()}
    per_invalid = -0.2 + cfg.trainer.invalid_action_penalty
    for i in range(2):  # match i: seat 0 in group 0, seat 1 in group 1
        outcomes = []
        for seat in (0, 1):
            steps = sorted(trajectories[f"actor-0.0.g{seat}.{i}"], key=lambda t: t.step)
            assert [t.step for t in steps] == list(range(len(steps))) and 1 <= len(steps) <= 9
            assert steps[-1].done and not any(t.done or t.truncated for t in steps[:-1]) and not steps[-1].truncated
            assert all(t.anchor.startswith(f"seat {seat}:") for t in steps)
            outcomes.append(sum(t.reward for t in steps) - per_invalid * sum(not t.valid for t in steps))
        assert min(abs(outcomes[0] - o) for o in (-1.0, 0.0, 1.0)) < 1e-6 and abs(outcomes[0] + outcomes[1]) < 1e-6
    check_accounting(broker.summary())
    outcome = validation.env_return + 0.2 * validation.invalid  # (truncated with invalid answers only: 0)
    assert 1 <= validation.steps <= 9 and min(abs(outcome - o) for o in (-1.0, 0.0, 1.0)) < 1e-9


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_run_completes(server, tmp_path: Path, name: str) -> None:
    model, url = server
    algorithm = RUNS[name]
    launch(tmp_path, model, url, f"env.name={name}", *([f"algorithm={algorithm}"] if algorithm else []))


def test_a_user_env_by_import_path_trains(server, tmp_path: Path) -> None:
    """examples/my_env (a plain gymnasium.Env in a package of its own, docs/your_env.md) by its import path, with the
    one command a user runs plus the shared engine: the launcher's check passes it, the actor builds it from the path
    (the launch's working directory on sys.path) and two learner steps train on its groups."""
    model, url = server
    summary = launch(tmp_path, model, url, f"env.name={USER_ENV}", "env.max_steps=2", steps=2)
    assert summary["episodes"] >= 4  # two steps of one group of G = 2
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert f"success_rate/{USER_ENV}" in metrics  # the actors played the user's env, counted under its name


def test_an_openenv_app_served_by_the_launcher_trains(server, tmp_path: Path) -> None:
    """examples/openenv_game by its app, with the one command a user runs plus the shared engine: the launcher serves
    it (logs/env-server.log), the actors play it over WebSocket sessions, two learner steps train on its groups, and
    the server is stopped with the run (`launch` asserts no process is left)."""
    model, url = server
    summary = launch(tmp_path, model, url, f"env.name={OPENENV}", f"+env.kwargs.app={OPENENV_APP}", steps=2)
    assert summary["episodes"] >= 4 and summary["transitions_dropped"] == {}  # two steps of one group of G = 2
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert f"success_rate/{OPENENV}" in metrics
    assert (tmp_path / "run" / "logs" / "env-server.log").exists()
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "base_url: http://127.0.0.1:" in config  # the URL the launcher served it on, as the actors read it


def test_the_run_covers_a_blocking_env() -> None:
    assert set(RUNS.values()) == {None} and set(RUNS) <= set(envs.known_envs())
    assert envs.make("agentstream/ALFWorld-v0").unwrapped.blocking
