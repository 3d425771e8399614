"""Every YAML under conf/ composes against the typed schema; values that cannot work stop the launch."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from agentstream import config as C
from launcher.checks import check_config

CONF = Path(__file__).resolve().parents[2] / "conf"
C.register_schemas()


def compose_cfg(name: str = "config", overrides: list[str] | None = None) -> C.Config:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name=name, overrides=overrides or [])
    cfg.run.output_dir = "runs/test"  # `now` is a Hydra run-time resolver
    return C.to_object(cfg)


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_composes_and_validates(path: Path) -> None:
    cfg = compose_cfg(path.stem)
    assert isinstance(cfg, C.Config)
    check_config(cfg)


def test_launcher_overrides_reach_their_fields() -> None:
    cfg = compose_cfg(
        overrides=[
            "actors.count=3",
            "actors.episodes_per_actor=12",
            "env.name=agentstream/FrozenLake-v0",
            "env.group_size=6",
            "engines.count=2",
            "learner.world_size=1",
            "trainer.total_steps=7",
            "broker.dashboard_port=0",
        ]
    )
    assert (cfg.actors.count, cfg.actors.episodes_per_actor, cfg.env.group_size) == (3, 12, 6)
    assert (cfg.engines.count, cfg.learner.world_size, cfg.trainer.total_steps) == (2, 1, 7)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["env.group_size=16"], "actors.episodes_per_actor=8 must be a positive multiple of env.group_size=16"),
        (["env.name=Nope-v0"], "is not registered; known: "),
        (["model.path=/nonexistent/model"], "is not a Hugging Face model directory"),
        (["trainer.groups_per_step=1"], "every rank needs at least one whole group"),
        (["trainer.max_staleness=-1"], "must be >= 0"),
        (["env.name=agentstream/Sokoban-v0", "+env.kwargs.map_size=5"], "env.kwargs has ['map_size'], which"),
        (  # a user's env (envs/check.py; its refusals: tests/envs/test_user_env.py)
            ["env.name=examples.my_env.guess:GuessEnv", "+env.kwargs.hi=5"],
            "env.kwargs has ['hi'], which its constructor does not take; it takes ['high']",
        ),
        (["env.name=examples.my_env.guess:Nope"], "does not resolve: module 'examples.my_env.guess' has no attribute"),
        (["engines.cpu_executor=ray"], "engines.cpu_executor='ray': use uni"),
        (["learner.logprob_chunk_tokens=-1"], "learner.logprob_chunk_tokens=-1: must be >= 0"),
        (["learner.mini_batches=0"], "learner.mini_batches=0: must be at least 1"),
        (["learner.ppo_epochs=0"], "learner.ppo_epochs=0: must be at least 1"),
        (["learner.betas=[0.9,1.0]"], "learner.betas=[0.9, 1.0]: give two numbers in [0, 1)"),
        (["learner.eps=0"], "learner.eps=0.0: must be > 0"),
        (["engines.cpu_threads_bind=0"], "engines.cpu_threads_bind='0' needs engines.cpu_executor=mp"),
        (["learner.torch_threads=-1"], "learner.torch_threads=-1: must be >= 0"),
        (
            ["broker.logger=[jsonl,neptune]"],
            "broker.logger: 'neptune' is not a logger; the loggers are jsonl, tensorboard",
        ),
    ],
)
def test_values_that_cannot_work_say_what_to_change(overrides, needle) -> None:
    with pytest.raises(C.ConfigError, match=re.escape(needle)):
        check_config(compose_cfg(overrides=overrides))


def test_a_user_env_by_import_path_passes_the_launch_check() -> None:
    check_config(compose_cfg(overrides=["env.name=examples.my_env.guess:GuessEnv", "+env.kwargs.high=4"]))


def test_learner_threads_are_every_core_only_when_training_is_synchronous(monkeypatch) -> None:
    monkeypatch.setattr(C.os, "sched_getaffinity", lambda _pid: set(range(8)))
    cases = [  # (overrides, threads per rank): 8 cores
        (["learner.torch_threads=3"], 3),  # given: as given, whatever the staleness
        (["learner.torch_threads=0", "trainer.max_staleness=2"], 1),  # beside the engines
        (["learner.torch_threads=0", "trainer.max_staleness=0", "learner.world_size=1"], 8),
        (["learner.torch_threads=0", "trainer.max_staleness=0", "learner.world_size=2"], 4),
        (["learner.torch_threads=0", "trainer.max_staleness=0", "learner.world_size=4", "learner.nnodes=2"], 4),
        (
            [
                "learner.torch_threads=0",
                "trainer.max_staleness=0",
                "learner.world_size=16",
                "trainer.groups_per_step=16",
            ],
            1,
        ),
    ]
    for overrides, threads in cases:
        assert C.learner_threads(compose_cfg(overrides=overrides)) == threads, overrides
    assert compose_cfg().learner.torch_threads == 0  # the default preset (cpu_tiny) lets the launcher choose


def test_wrong_type_is_refused_by_the_schema() -> None:
    with pytest.raises(Exception, match="actors.count"):
        compose_cfg(overrides=["actors.count=many"])


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    cfg = compose_cfg(overrides=["trainer.total_steps=5"])
    C.save(cfg, tmp_path / "c.yaml")
    assert C.load(tmp_path / "c.yaml") == cfg


def test_a_fresh_launch_into_an_earlier_runs_folder_is_refused(tmp_path: Path) -> None:
    # The earlier run's broker log would be recovered (its buffer, the learner at version N) while a fresh learner
    # starts at 0: the broker would wait forever for an engine at version N. Found by relaunching into a folder.
    cfg = compose_cfg()
    cfg.run.output_dir = str(tmp_path)
    check_config(cfg)  # an empty folder is a fresh run's
    (tmp_path / "broker-wal").mkdir()
    check_config(cfg)  # so is an empty log folder
    (tmp_path / "broker-wal" / "wal-000001.log").write_bytes(b"\0" * 8)
    with pytest.raises(C.ConfigError, match="holds an earlier run .*checkpoint.resume_from=latest"):
        check_config(cfg)
    cfg.checkpoint.resume_from = "latest"  # continuing that run is what its log is for
    check_config(cfg)
    cfg.checkpoint.resume_from, cfg.broker.wal = "", False  # no log: nothing is recovered
    check_config(cfg)


def test_a_frozen_seat_needs_lora_and_its_sidecars_refresh_the_copy(tmp_path: Path) -> None:
    """env.kwargs.opponent=frozen: refused without LoRA (vLLM serves one full model per server), saying what to set;
    with LoRA, every weight sidecar refreshes the frozen copy every engines.frozen_every versions (0 without one)."""
    from launcher.supervisor import Launcher
    from launcher.wiring import wire

    frozen = ["env.name=agentstream/TextArena-v0", "+env.kwargs.game=KuhnPoker-v0", "+env.kwargs.opponent=frozen"]
    with pytest.raises(
        C.ConfigError, match=re.escape("env.kwargs.opponent=frozen needs model.lora_rank > 0 (e.g. model.lora_rank=8)")
    ):
        check_config(compose_cfg(overrides=frozen))
    with pytest.raises(C.ConfigError, match=re.escape("engines.frozen_every=0: must be at least 1")):
        check_config(compose_cfg(overrides=[*frozen, "model.lora_rank=8", "engines.frozen_every=0"]))
    for opponent, every in (("frozen", "5"), ("self", "0")):
        cfg = compose_cfg(
            overrides=[*frozen[:2], f"+env.kwargs.opponent={opponent}", "model.lora_rank=8", "engines.frozen_every=5"]
        )
        check_config(cfg)
        argv = Launcher(cfg, tmp_path, wire(cfg)).commands.sidecar(0).argv
        assert argv[argv.index("--frozen-every") + 1] == every


def test_a_built_in_env_whose_package_is_missing_names_the_full_set_up() -> None:
    # The main job's set-up (scripts/setup.sh) leaves out ALFWorld, TextWorldExpress and SkyRL-Gym: an env whose
    # module cannot import says which package and the command that installs it.
    import gymnasium as gym

    from launcher.checks import _env_kwargs_errors

    name = "agentstream-test/Missing-v0"
    gym.register(id=name, entry_point="no_such_package_xyz.games:Game")
    try:
        (message,) = _env_kwargs_errors(name, {})
    finally:
        del gym.registry[name]
    assert "no_such_package_xyz" in message and "bash scripts/setup.sh full" in message, message
