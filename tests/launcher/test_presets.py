"""Every YAML under conf/ composes against the typed schema, every preset is selectable, and every config
field has a description that `scripts/launch.py --fields` prints. Runtime: ~5 s (no process is started
except one `--fields` and one `--cfg job`)."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from agentstream import config as C
from launcher.checks import check_config
from launcher.describe import attribute_docs, field_docs

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
C.register_schemas()
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())  # algorithm, preset


def compose_cfg(overrides: list[str]) -> C.Config:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    cfg.run.output_dir = "runs/test"  # `now` is a Hydra run-time resolver
    return C.to_object(cfg)


OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def test_every_yaml_under_conf_is_covered() -> None:
    # config.yaml (composed by test_config.py and below) plus one option per file of every group.
    files = sorted(CONF.rglob("*.yaml"))
    assert len(files) == 1 + len(OPTIONS)
    assert {"preset", "algorithm"} <= set(GROUPS)


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes(group: str, option: str, tmp_path: Path) -> None:
    # A preset may name a model directory that is not on this machine (gpu_one, multi_node): the tiny one (the
    # tiny VL one for a preset that shows images) stands in so that everything else is validated too. multi_node
    # needs CURVE keys: real ones, made here.
    from agentstream.wire.curve import keygen

    keygen(tmp_path / "keys")
    vision = compose_cfg([f"{group}={option}"]).memory.images != "none"
    tiny = C.TINY_VL_MODEL_DIR if vision else C.TINY_MODEL_DIR
    cfg = compose_cfg([f"{group}={option}", f"model.path={tiny}", f"broker.curve_keys_dir={tmp_path / 'keys'}"])
    check_config(cfg)


def test_presets_set_what_their_comments_promise() -> None:
    tiny = compose_cfg([])  # the default is cpu_tiny
    assert (tiny.learner.world_size, tiny.engines.count, tiny.actors.count, tiny.trainer.total_steps) == (2, 1, 2, 3)
    gpu = compose_cfg(["preset=gpu_one"])
    assert (gpu.learner.backend, gpu.learner.world_size, gpu.model.dtype, gpu.engines.count) == (
        "nccl",
        1,
        "bfloat16",
        1,
    )
    multi = compose_cfg(["preset=multi_node"])
    assert (multi.broker.host, multi.learner.weight_host, multi.engines.count) == ("0.0.0.0", "0.0.0.0", 0)
    assert multi.broker.port == 5555 and multi.learner.weight_port == 5556  # fixed: other hosts are told them
    vl = compose_cfg(["preset=cpu_tiny_vl"])
    assert (vl.model.path, vl.env.kwargs["observation"], vl.memory.images) == (
        ".cache/tiny-vl-model",
        "image",
        "current",
    )
    gpu_vl = compose_cfg(["preset=gpu_vl"])
    assert (gpu_vl.learner.backend, gpu_vl.model.dtype, gpu_vl.memory.images, gpu_vl.model.train_vision) == (
        "nccl",
        "bfloat16",
        "current",
        False,
    )
    # The command line wins over a preset.
    assert compose_cfg(["preset=gpu_one", "learner.world_size=2"]).learner.world_size == 2


def test_a_presets_missing_model_is_reported_with_the_fix() -> None:
    with pytest.raises(C.ConfigError, match="model.path='models/Qwen2.5-0.5B-Instruct' is not a Hugging Face"):
        check_config(compose_cfg(["preset=gpu_one"]))


def test_every_config_field_has_a_description() -> None:
    fields = field_docs()
    assert len(fields) > 80  # every section's fields, not just a few
    missing = [f.name for f in fields if len(f.doc) < 10]
    assert missing == [], f"fields without a one-line description in agentstream/config.py: {missing}"


def test_attribute_docs_reads_the_string_under_each_field() -> None:
    # RunConfig.seed's docstring, copied by hand from agentstream/config.py.
    assert attribute_docs(C.RunConfig)["seed"] == "Base seed for env seeds and sampling."


@pytest.mark.parametrize(
    "role, extra, needle",
    [
        ("actors", [], "set broker.address=tcp://HOST:PORT"),
        ("workers", [], "run.role='workers' is unknown; use one of all, actors, engines, learner"),
        ("all", ["broker.address=tcp://h:1"], "is only for role=actors, engines, learner or gateway"),
        ("engines", ["broker.address=tcp://h:1", "engines.count=0"], "engines.count=0: must be at least 1"),
        ("all", ["learner.world_size=3", "learner.nnodes=2"], "world_size must be a multiple of nnodes"),
        ("all", ["learner.nnodes=2", "learner.node_rank=1"], "the main launch runs node 0"),
        ("learner", ["broker.address=tcp://h:1"], "set learner.node_rank to 1..nnodes-1"),
        ("learner", ["broker.address=tcp://h:1", "learner.nnodes=2", "learner.node_rank=2"], "learner.node_rank=2 of"),
    ],
)
def test_role_mistakes_say_what_to_change(role: str, extra: list[str], needle: str) -> None:
    with pytest.raises(C.ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        check_config(compose_cfg([f"run.role={role}", *extra]))


def test_launch_script_prints_fields_and_composed_config() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/launch.py", "--fields", "trainer"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "trainer.max_staleness = 2  (int)\n    Maximum policy lag" in out.stdout
    assert "actors.count" not in out.stdout  # only the prefix asked for
    job = subprocess.run(
        [sys.executable, "scripts/launch.py", "--cfg", "job", "preset=gpu_one"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert job.returncode == 0, job.stderr
    assert "backend: nccl" in job.stdout and "max_model_len: 4096" in job.stdout
