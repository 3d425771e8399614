"""The processes' specs (actors/spec.py): what the actor and the evaluator take from the run config. <1 s."""

from __future__ import annotations

from actors.spec import ActorSpec, EvaluatorSpec
from agentstream.config import Config


def test_the_specs_take_their_values_from_the_config_once() -> None:
    cfg = Config()
    cfg.engines.max_model_len, cfg.sampling.max_tokens, cfg.sampling.temperature = 1024, 24, 1.0
    cfg.memory.max_prompt_tokens, cfg.validation.temperature = 0, 0.0
    cfg.trainer.groups_per_step, cfg.env.group_size = 4, 3
    actor, evaluator = ActorSpec.from_config(cfg), EvaluatorSpec.from_config(cfg)
    # No memory budget set: the prompt gets what the context leaves after the answer, 1024 - 24 = 1000.
    assert actor.episode.max_prompt_tokens == evaluator.episode.max_prompt_tokens == 1000
    # The evaluator samples at the validation temperature; the actor at the run's.
    assert (actor.episode.sampling.temperature, evaluator.episode.sampling.temperature) == (1.0, 0.0)
    assert evaluator.trajectories_per_version == 12  # 4 groups of 3 per policy version
    assert (actor.group_size, actor.episodes_per_actor) == (3, cfg.actors.episodes_per_actor)
    # Copied: changing the config afterwards changes no spec.
    cfg.env.name, cfg.sampling.temperature = "elsewhere", 0.5
    assert actor.episode.env.name != "elsewhere" and actor.episode.sampling.temperature == 1.0


def test_an_explicit_prompt_budget_wins() -> None:
    cfg = Config()
    cfg.memory.max_prompt_tokens = 300
    assert ActorSpec.from_config(cfg).episode.max_prompt_tokens == 300


def test_self_play_trains_both_seats_and_validates_one_against_the_random_opponent() -> None:
    cfg = Config()
    cfg.env.name, cfg.env.kwargs = "agentstream/TextArena-v0", {"game": "KuhnPoker-v0", "opponent": "self"}
    actor, evaluator = ActorSpec.from_config(cfg), EvaluatorSpec.from_config(cfg)
    assert (actor.episode.seats, evaluator.episode.seats, ActorSpec.from_config(Config()).episode.seats) == (2, 1, 1)
    assert evaluator.episode.env.kwargs == {"game": "KuhnPoker-v0", "opponent": "random"}
    assert cfg.env.kwargs["opponent"] == "self"  # (the run's config is left as it is)
    env = evaluator.episode.make_env()  # what actors.evaluate.play_episode plays: one seat, the other random
    obs, info = env.reset(seed=10**9)
    seats = {info["seat"]}
    while True:
        move = "check" if "check" in info["admissible_actions"] else "call"
        obs, reward, terminated, truncated, info = env.step(f"<action>{move}</action>")
        seats.add(info["seat"])
        if terminated or truncated:
            break
    assert len(seats) == 1 and terminated and reward in (-1.0, 0.0, 1.0)
