"""The config's checks: every value that cannot work, found before any process starts and said with what to
change; `check_config` raises them together as one ConfigError. They live with the launcher because they read
the registries of the envs, memories and the learner's algorithms, which the config schema must not import."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from actors.judge import COMBINE_RULES, pattern_errors, template_errors
from actors.token_rewards import token_reward_errors
from agentstream.config import (
    REPO_ROOT,
    SMOLLM2_DIR,
    TINY_MODEL_DIR,
    TINY_VL_MODEL_DIR,
    TINY_WARM_MODEL_DIR,
    AlgorithmConfig,
    Config,
    ConfigError,
    LearnerConfig,
    ValidationConfig,
)
from agentstream.models import is_vision_language
from agentstream.wire.addresses import read_record
from agentstream.wire.curve import KEYGEN_COMMAND, is_loopback, keys_dir_errors
from broker.sinks import logger_errors
from broker.wal import FOLDER as WAL_FOLDER
from envs.check import env_errors as user_env_errors
from envs.openenv import kwargs_errors as openenv_kwargs_errors
from envs.registry import ENVS
from envs.registry import traits as env_traits
from envs.toolcalls import TOOL_PARSERS
from gateway.spec import read_key
from launcher.placement import PlacementError, host_gpus, host_plan
from learner.advantages import ADVANTAGES, GROUP_OF_ONE, advantage_traits
from learner.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, VALUE_LOSS_AGGREGATIONS
from learner.offpolicy import LEVELS, OFF_POLICY
from memory import MEMORIES
from memory.prompt import IMAGE_MODES


def _env_kwargs_errors(name: str, kwargs: dict[str, Any]) -> list[str]:
    """Keyword arguments the env's constructor does not take (read from its signature, nothing is built)."""
    import importlib
    import inspect

    import gymnasium as gym

    module, _, cls_name = str(gym.registry[name].entry_point).partition(":")
    try:
        params = inspect.signature(getattr(importlib.import_module(module), cls_name)).parameters
    except ImportError as exc:
        return [
            f"env.name={name!r} needs a package that is not installed ({exc}); the main job's set-up leaves out "
            "the envs beyond the toy-text and reasoning ones: run bash scripts/setup.sh full."
        ]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    unknown = sorted(set(kwargs) - set(params))
    if not unknown:
        return []
    known = sorted(p for p in params if p not in ("self", "render_mode"))
    return [f"env.kwargs has {unknown}, which {name} does not take; it takes {known}."]


def _unknown(setting: str, value: object, known: Iterable[object], verb: str = "is unknown") -> str:
    """ "<setting>=<value> is unknown; known: a, b, c." for a name its registry lacks, the known names sorted as
    `agentstream.registry.unknown_name` lists them."""
    return f"{setting}={value!r} {verb}; known: {', '.join(sorted(str(k) for k in known))}."


TINY_DIRS = (TINY_MODEL_DIR.resolve(), TINY_VL_MODEL_DIR.resolve(), TINY_WARM_MODEL_DIR.resolve())
"""The tiny local models' directories: made on first use (launcher.run), so they need not exist yet."""
TEACHER_MADE_DIRS = (SMOLLM2_DIR.resolve(),)
"""Teachers the launcher makes on first use (launcher.run): SmolLM2-135M-Instruct from its PyPI package."""


def check_config(cfg: Config) -> None:
    """Raise one ConfigError listing every value of `cfg` that cannot work."""
    errors = config_errors(cfg)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def config_errors(cfg: Config) -> list[str]:
    """Every value of `cfg` that cannot work, each said with what to change (empty: the config is fine)."""
    errors = _episode_errors(cfg) + _model_errors(cfg) + _scale_errors(cfg) + _engine_errors(cfg) + _learner_errors(cfg)
    errors += logger_errors(cfg.broker.logger)
    errors += _lora_and_checkpoint_errors(cfg)
    errors += algorithm_errors(cfg.algorithm) + reference_errors(cfg)
    errors += _validation_errors(cfg.validation)
    errors += judges_errors(cfg)
    errors += distill_errors(cfg)
    errors += gateway_errors(cfg)
    errors += _role_errors(cfg)
    errors += backend_errors(cfg)
    errors += network_errors(cfg)  # off loopback only with CURVE keys or an explicit opt-in
    errors += placement_errors(cfg)
    return errors


def placement_errors(cfg: Config) -> list[str]:
    """Whether this host's GPUs hold the engines and learner ranks it starts (none on CPU; Ray places its own)."""
    if cfg.launcher.backend == "ray":
        return []
    try:
        host_plan(cfg, len(host_gpus()))
    except PlacementError as exc:
        return [str(exc)]
    return []


def _episode_errors(cfg: Config) -> list[str]:
    """The env, its groups and the memory that builds each prompt."""
    errors: list[str] = []
    g, k = cfg.env.group_size, cfg.actors.episodes_per_actor
    if g < 1:
        errors.append(f"env.group_size={g}: must be at least 1.")
    elif k < g or k % g:
        errors.append(
            f"actors.episodes_per_actor={k} must be a positive multiple of env.group_size={g} "
            f"(each actor runs whole groups); set actors.episodes_per_actor={max(g, k - k % g)} "
            f"or lower env.group_size."
        )
    if cfg.env.name in ENVS:
        errors += _env_kwargs_errors(cfg.env.name, cfg.env.kwargs)
    else:  # a user's env (a gymnasium id or package.module:Class): built and played a few steps here
        errors += user_env_errors(cfg.env.name, cfg.env.kwargs, cfg.env.max_steps)
    errors += remote_env_errors(cfg)
    errors += frozen_seat_errors(cfg)
    if cfg.env.step_latency_mean_s < 0 or cfg.env.step_latency_sigma < 0:
        errors.append(
            f"env.step_latency_mean_s={cfg.env.step_latency_mean_s} and env.step_latency_sigma="
            f"{cfg.env.step_latency_sigma}: both must be >= 0 (0 = no simulated latency)."
        )
    errors += token_reward_errors(cfg.trainer.token_reward, cfg.trainer.token_reward_kwargs)
    if cfg.memory.kind not in MEMORIES:
        errors.append(_unknown("memory.kind", cfg.memory.kind, MEMORIES))
    mem, room = cfg.memory, cfg.engines.max_model_len - cfg.sampling.max_tokens
    if min(mem.k, mem.max_events, mem.max_prompt_tokens) < 0:
        errors.append(
            f"memory.k={mem.k}, memory.max_events={mem.max_events}, "
            f"memory.max_prompt_tokens={mem.max_prompt_tokens}: must all be >= 0."
        )
    elif mem.max_prompt_tokens > room or room < 1:
        errors.append(
            f"memory.max_prompt_tokens={mem.max_prompt_tokens or room} + sampling.max_tokens="
            f"{cfg.sampling.max_tokens} must fit engines.max_model_len={cfg.engines.max_model_len} (the engine "
            f"refuses longer requests): lower memory.max_prompt_tokens or raise engines.max_model_len."
        )
    if mem.images not in IMAGE_MODES or mem.image_tokens < 0:
        errors.append(
            f"memory.images={mem.images!r}, memory.image_tokens={mem.image_tokens}: use one of "
            f"{', '.join(IMAGE_MODES)}, and image_tokens >= 0 (0: measured with the model's processor)."
        )
    elif mem.images != "none":
        errors += _image_errors(cfg)
    return errors


def remote_env_errors(cfg: Config) -> list[str]:
    """An env played on a server (`EnvTraits.remote`: OpenEnv's): a server is named, the app this launch serves
    imports, or the server at env.kwargs.base_url answers (envs/openenv.py); the launcher serves an app on this
    host only."""
    if cfg.env.name not in ENVS or not env_traits(cfg.env.name, cfg.env.kwargs).remote:
        return []
    serving = cfg.run.role == "all"  # the main launch serves env.kwargs.app; a joining one plays on base_url
    errors = openenv_kwargs_errors(cfg.env.kwargs, serving=serving)
    if serving and cfg.env.kwargs.get("app") and cfg.launcher.backend == "ray":
        errors.append(
            "launcher.backend=ray does not place an env's server: serve it yourself (python -m uvicorn MODULE:app "
            "--host HOST --port PORT) and give env.kwargs.base_url=http://HOST:PORT instead of env.kwargs.app."
        )
    return errors


def frozen_seat_errors(cfg: Config) -> list[str]:
    """A seat played by a frozen copy of the policy (`EnvTraits.frozen_seat`: TextArena's env.kwargs.opponent=frozen):
    LoRA, and a refresh period."""
    if cfg.env.name not in ENVS or not env_traits(cfg.env.name, cfg.env.kwargs).frozen_seat:
        return []
    errors = []
    if cfg.model.lora_rank < 1:
        errors.append(
            "env.kwargs.opponent=frozen needs model.lora_rank > 0 (e.g. model.lora_rank=8): the frozen copy "
            "is a second LoRA adapter on the same engines, and without LoRA a vLLM server serves one "
            "model only. Set model.lora_rank, or use opponent=self (both seats trained)."
        )
    if cfg.engines.frozen_every < 1:
        errors.append(
            f"engines.frozen_every={cfg.engines.frozen_every}: must be at least 1 (the frozen copy is "
            f"refreshed every this many policy versions)."
        )
    return errors


def _image_errors(cfg: Config) -> list[str]:
    """A run whose prompts show images: a vision-language model, room for the images, what trains them."""
    mem, errors = cfg.memory, []
    if not is_vision_language(cfg.model.path) and Path(cfg.model.path).resolve() != TINY_VL_MODEL_DIR.resolve():
        errors.append(
            f"memory.images={mem.images} needs a vision-language model (a config.json with a "
            f"vision_config); model.path={cfg.model.path} is not one: use memory.images=none, or a VL "
            f"model directory (the tiny one: model.path={TINY_VL_MODEL_DIR}, made on first use)."
        )
    most = 1 if mem.images == "current" else mem.k + 1 if mem.kind == "last_k" else None
    if most is None:
        errors.append(
            f"memory.images=last_k with memory.kind={mem.kind}: that memory may show any number of "
            f"history pictures; use memory.kind=last_k (at most k + 1 pictures) or memory.images=current."
        )
    elif most > cfg.engines.max_images_per_prompt:
        errors.append(
            f"memory.images={mem.images} shows up to {most} pictures per prompt, more than "
            f"engines.max_images_per_prompt={cfg.engines.max_images_per_prompt}: raise it or lower memory.k."
        )
    if cfg.algorithm.advantage in ADVANTAGES and advantage_traits(cfg.algorithm.advantage).needs_values:
        errors.append(
            f"memory.images={mem.images}: a vision-language policy trains without a critic for now "
            f"(algorithm.advantage={cfg.algorithm.advantage} needs one): use a critic-free advantage "
            f"(grpo, gigpo, rloo, ...)."
        )
    if cfg.model.lora_rank and cfg.model.train_vision:
        errors.append(
            f"model.lora_rank={cfg.model.lora_rank} with model.train_vision=true: LoRA adapts the language "
            f"model only and the engine serves the vision tower it loaded; train the tower with full "
            f"weights (model.lora_rank=0), or keep it frozen (model.train_vision=false)."
        )
    return errors


def _model_errors(cfg: Config) -> list[str]:
    """The model directory and dtype."""
    errors: list[str] = []
    model = Path(cfg.model.path)
    if model.resolve() not in TINY_DIRS and not (model / "config.json").is_file():
        errors.append(
            f"model.path={cfg.model.path!r} is not a Hugging Face model directory (no config.json). "
            f"Point it at a local model directory, or leave it unset for the tiny local model."
        )
    if cfg.model.dtype not in ("float32", "bfloat16"):
        errors.append(f"model.dtype={cfg.model.dtype!r}: use float32 or bfloat16.")
    return errors


def _scale_errors(cfg: Config) -> list[str]:
    """Process counts, batch sizes, staleness, reuse and delivery."""
    errors: list[str] = []
    if cfg.actors.count < (0 if cfg.gateway.enabled else 1):  # with the gateway, agent code alone may play
        errors.append(
            f"actors.count={cfg.actors.count}: must be at least 1 (or 0 with gateway.enabled=true, when "
            f"agent code plays every episode through the gateway)."
        )
    if cfg.learner.torch_threads < 0:
        errors.append(
            f"learner.torch_threads={cfg.learner.torch_threads}: must be >= 0 (0: chosen by the launcher, "
            f"every core when synchronous, else 1)."
        )
    for name, value in [
        ("learner.world_size", cfg.learner.world_size),
        ("trainer.total_steps", cfg.trainer.total_steps),
    ]:
        if value < 1:
            errors.append(f"{name}={value}: must be at least 1.")
    if cfg.engines.external_urls and len(cfg.engines.external_urls) != cfg.engines.count:
        errors.append(
            f"engines.external_urls lists {len(cfg.engines.external_urls)} servers but engines.count="
            f"{cfg.engines.count}; set engines.count={len(cfg.engines.external_urls)}."
        )
    if cfg.trainer.groups_per_step < cfg.learner.world_size:
        errors.append(
            f"trainer.groups_per_step={cfg.trainer.groups_per_step} is smaller than "
            f"learner.world_size={cfg.learner.world_size}: every rank needs at least one whole group."
        )
    t = cfg.trainer
    if t.max_samples_per_group < 1 or not (t.samples_per_insert == 0 or t.samples_per_insert >= 1):
        errors.append(
            f"trainer.max_samples_per_group={t.max_samples_per_group} (>= 1; 1 = no reuse) and "
            f"trainer.samples_per_insert={t.samples_per_insert} (0 = no limit, or >= 1: every fresh group "
            f"is one sample already, a ratio below 1 would stop training)."
        )
    if cfg.trainer.max_staleness < 0:
        errors.append(f"trainer.max_staleness={cfg.trainer.max_staleness}: must be >= 0 (0 = synchronous).")
    if cfg.broker.dead_actor_groups not in ("drop", "serve"):
        errors.append(
            f"broker.dead_actor_groups={cfg.broker.dead_actor_groups!r}: use drop (a dead actor's unfinished "
            f"groups are dropped) or serve (their finished trajectories are trained as a smaller group)."
        )
    if cfg.actors.max_unacked < 1 or cfg.actors.ack_timeout_s <= 0:
        errors.append(
            f"actors.max_unacked={cfg.actors.max_unacked}, actors.ack_timeout_s={cfg.actors.ack_timeout_s}: "
            f"both must be positive."
        )
    if cfg.actors.episode_retries < 0 or cfg.actors.max_hung_steps < 0 or cfg.env.step_timeout_s < 0:
        errors.append(
            f"actors.episode_retries={cfg.actors.episode_retries}, actors.max_hung_steps="
            f"{cfg.actors.max_hung_steps}, env.step_timeout_s={cfg.env.step_timeout_s}: none may be "
            f"negative."
        )
    if not 0 < cfg.engines.stall_timeout_s < cfg.engines.request_timeout_s:
        errors.append(
            f"engines.stall_timeout_s={cfg.engines.stall_timeout_s} must be positive and below "
            f"engines.request_timeout_s={cfg.engines.request_timeout_s} (a stalled engine is left after it)."
        )
    return errors


def _engine_errors(cfg: Config) -> list[str]:
    """How the vLLM servers run."""
    errors: list[str] = []
    e = cfg.engines
    if e.cpu_executor not in ("uni", "mp"):
        errors.append(
            f"engines.cpu_executor={e.cpu_executor!r}: use uni (the model runs in vLLM's engine process) "
            f"or mp (a worker process of its own, vLLM's CPU default)."
        )
    elif e.cpu_threads < 0:
        errors.append(f"engines.cpu_threads={e.cpu_threads}: must be >= 0 (0: one per core).")
    elif e.cpu_threads_bind and e.cpu_executor != "mp":
        errors.append(
            f"engines.cpu_threads_bind={e.cpu_threads_bind!r} needs engines.cpu_executor=mp (vLLM binds the "
            f"threads of its mp worker only); add engines.cpu_executor=mp or drop the binding."
        )
    if e.weight_sync not in ("stream", "file"):
        errors.append(
            f"engines.weight_sync={e.weight_sync!r}: use stream (buckets over a process group with the "
            f"engine workers) or file (a safetensors file through each weight sidecar)."
        )
    if e.weight_bucket_mb < 1 or e.weight_sync_timeout_s <= 0:
        errors.append(
            f"engines.weight_bucket_mb={e.weight_bucket_mb} must be >= 1 and engines.weight_sync_timeout_s="
            f"{e.weight_sync_timeout_s} positive."
        )
    if cfg.engines.count < (1 if cfg.run.role == "engines" else 0):
        errors.append(
            f"engines.count={cfg.engines.count}: must be at least {1 if cfg.run.role == 'engines' else 0} "
            f"(0: no engine on this host; engines join with role=engines)."
        )
    return errors


def _learner_errors(cfg: Config) -> list[str]:
    """How the learner ranks compute."""
    errors: list[str] = []
    if cfg.learner.backend not in ("auto", "gloo", "nccl"):
        errors.append(f"learner.backend={cfg.learner.backend!r}: use auto, gloo or nccl.")
    for name in ("ppo_epochs", "mini_batches"):
        if getattr(cfg.learner, name) < 1:
            errors.append(
                f"learner.{name}={getattr(cfg.learner, name)}: must be at least 1 (1: one optimizer step per batch)."
            )
    if cfg.learner.logprob_chunk_tokens < 0:
        errors.append(
            f"learner.logprob_chunk_tokens={cfg.learner.logprob_chunk_tokens}: must be >= 0 (0: no chunking; "
            f"e.g. 1024 for a large vocabulary)."
        )
    betas = list(cfg.learner.betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        errors.append(f"learner.betas={betas}: give two numbers in [0, 1), e.g. [0.9,0.999] (AdamW's default).")
    if not cfg.learner.eps > 0:
        errors.append(f"learner.eps={cfg.learner.eps}: must be > 0 (AdamW's default 1e-8).")
    return errors


def judges_errors(cfg: Config) -> list[str]:
    """What is wrong with `judges.*` (empty: nothing, or no judge), each saying what to change."""
    j = cfg.judges
    if j.count < 0:
        return [f"judges.count={j.count}: must be >= 0 (0 = no LLM judge)."]
    if j.count == 0:
        return []
    errors = template_errors(j.template) + pattern_errors(j.score_pattern)
    if (
        j.model
        and Path(j.model).resolve() != TINY_MODEL_DIR.resolve()
        and not (Path(j.model) / "config.json").is_file()
    ):
        errors.append(
            f"judges.model={j.model!r} is not a Hugging Face model directory (no config.json): point it at a "
            f"local model directory, or leave it empty to judge with model.path's initial weights."
        )
    if j.combine not in COMBINE_RULES:
        errors.append(
            f"judges.combine={j.combine!r} is unknown; use one of {', '.join(COMBINE_RULES)} "
            f"(add: env + weight*score, replace: weight*score, multiply: env * weight*score)."
        )
    if not all(math.isfinite(v) for v in (j.default_score, j.weight)):
        errors.append(f"judges.default_score={j.default_score}, judges.weight={j.weight}: both must be finite numbers.")
    if not 1 <= j.max_tokens < cfg.engines.max_model_len:
        errors.append(
            f"judges.max_tokens={j.max_tokens}: must be at least 1 and leave room for the prompt within "
            f"engines.max_model_len={cfg.engines.max_model_len} (the judges' context)."
        )
    if j.temperature < 0 or j.timeout_s <= 0 or j.max_restarts < 0:
        errors.append(
            f"judges.temperature={j.temperature} (>= 0; 0 = greedy), judges.timeout_s={j.timeout_s} (> 0), "
            f"judges.max_restarts={j.max_restarts} (>= 0): one of them is out of range."
        )
    return errors


def distill_errors(cfg: Config) -> list[str]:
    """What is wrong with `distill.*` (empty: nothing, or no distillation), each saying what to change. Whether the
    teacher shares the student's tokenizer needs both directories made: `tokenizer_errors`, at launch."""
    d = cfg.distill
    if d.count < 0:
        return [f"distill.count={d.count}: must be >= 0 (0 = no distillation teacher)."]
    if d.count == 0:
        return []
    errors = []
    if not d.model:
        errors.append("distill.count > 0 needs distill.model: the teacher's Hugging Face model directory.")
    elif Path(d.model).resolve() not in TEACHER_MADE_DIRS and not (Path(d.model) / "config.json").is_file():
        errors.append(
            f"distill.model={d.model!r} is not a Hugging Face model directory (no config.json): point it at a local "
            f"model directory that shares the student's tokenizer."
        )
    if d.task_reward not in ("keep", "drop"):
        errors.append(
            f"distill.task_reward={d.task_reward!r} is unknown; use keep (the env's reward beside the teacher's "
            f"signal) or drop (the teacher's signal alone)."
        )
    if not math.isfinite(d.coef) or d.coef <= 0:
        errors.append(f"distill.coef={d.coef}: must be a finite number > 0 (the weight of the reverse KL).")
    if cfg.gateway.enabled or cfg.run.role == "gateway":
        errors.append(
            "distill.count > 0 with the gateway: the gateway's episodes would be trained without a teacher's signal "
            "(only actors ask the teachers); set gateway.enabled=false, or distill.count=0."
        )
    if d.timeout_s <= 0 or d.retries < 0 or d.max_restarts < 0:
        errors.append(
            f"distill.timeout_s={d.timeout_s} (> 0), distill.retries={d.retries} (>= 0), distill.max_restarts="
            f"{d.max_restarts} (>= 0): one of them is out of range."
        )
    return errors


def tokenizer_errors(student: str, teacher: str) -> list[str]:
    """Whether the student (model.path) and the teacher (distill.model) share a tokenizer: the same token for every
    id, so that the teacher's log-prob of a token id is of the token the student sampled (empty: they do). Both
    directories must exist (the launcher makes its own models first)."""
    from transformers import AutoTokenizer

    if Path(student).resolve() == Path(teacher).resolve():
        return []
    vocab_s = AutoTokenizer.from_pretrained(student).get_vocab()
    vocab_t = AutoTokenizer.from_pretrained(teacher).get_vocab()
    if vocab_s == vocab_t:
        return []
    differ = len(set(vocab_s.items()) ^ set(vocab_t.items())) // 2
    return [
        f"distill.model={teacher!r} does not share the student's tokenizer (model.path={student!r}): vocabularies of "
        f"{len(vocab_t)} and {len(vocab_s)} tokens, about {differ} of them different, so the teacher's log-prob of a "
        f"token id would be of another token. Use a student made with the teacher's tokenizer (python "
        f"scripts/make_tiny_model.py --tokenizer-from {teacher} --out DIR, then model.path=DIR), or a teacher of the "
        f"student's family."
    ]


def gateway_errors(cfg: Config) -> list[str]:
    """What is wrong with `gateway.*`, each saying what to change."""
    g = cfg.gateway
    errors: list[str] = []
    if g.key_file:
        try:
            key = read_key(g.key_file)
        except OSError as exc:
            errors.append(f"gateway.key_file={g.key_file!r} cannot be read ({exc.strerror}).")
        else:
            if len(key) < 32:
                errors.append(
                    f"gateway.key_file={g.key_file!r}: its first line must be a key of 32 or more "
                    f'characters; make one: python -c "import secrets; print(secrets.token_urlsafe(32))"'
                    f" > {g.key_file}"
                )
    if not is_loopback(g.host) and not g.key_file:
        errors.append(
            f"gateway.host={g.host!r} is not a loopback address and gateway.key_file is empty: anyone who "
            f"reaches it could open episodes and write training data; give the run a key (gateway.key_file) "
            f"or keep the gateway on 127.0.0.1."
        )
    if not 0 <= g.port <= 65535:
        errors.append(f"gateway.port={g.port}: must be a TCP port (0 picks a free one).")
    if g.max_body_bytes < 1024 or g.max_episodes < 1:
        errors.append(
            f"gateway.max_body_bytes={g.max_body_bytes} (>= 1024), gateway.max_episodes={g.max_episodes} "
            f"(>= 1): one of them is too small to serve a chat request."
        )
    if g.admission_timeout_s <= 0 or g.retry_after_s < 1 or g.episode_idle_timeout_s <= 0:
        errors.append(
            f"gateway.admission_timeout_s={g.admission_timeout_s} (> 0), gateway.retry_after_s="
            f"{g.retry_after_s} (>= 1), gateway.episode_idle_timeout_s={g.episode_idle_timeout_s} (> 0): "
            f"one of them is out of range."
        )
    if g.tool_parser not in TOOL_PARSERS:
        errors.append(
            f"gateway.tool_parser={g.tool_parser!r} is unknown; use one of {', '.join(sorted(TOOL_PARSERS))}."
        )
    if g.chat_template and not (REPO_ROOT / g.chat_template).is_file():  # relative: to the repository
        errors.append(
            f"gateway.chat_template={g.chat_template!r} is not a file: give a Jinja chat template's path "
            f"(e.g. gateway/templates/chatml_tools.jinja), or leave it empty for the model's own."
        )
    return errors


ROLES = ("all", "actors", "engines", "learner", "gateway")
"""What one launch starts: the whole run, or more actors / engines / learner ranks / a gateway for a running one."""


def _role_errors(cfg: Config) -> list[str]:
    role, address = cfg.run.role, cfg.broker.address
    if role not in ROLES:
        return [f"run.role={role!r} is unknown; use one of {', '.join(ROLES)}."]
    if role != "all" and not (address.startswith("tcp://") or read_record(address)):
        return [
            f"run.role={role} joins a running run: set broker.address=tcp://HOST:PORT (the main launch prints "
            f"it as `broker:`), or the run's record RUN/broker.json on storage this host reads (followed if the "
            f"broker moves); got broker.address={address!r}."
        ]
    if role == "all" and address:
        return [
            f"broker.address={address!r} is only for role=actors, engines, learner or gateway; role=all starts its "
            f"own broker (set broker.host/broker.port to choose where it listens)."
        ]
    return _learner_node_errors(cfg.learner, role)


def backend_errors(cfg: Config) -> list[str]:
    """launcher.backend: local, or ray with Ray installed and the parts the Ray backend places."""
    b = cfg.launcher.backend
    if b not in ("local", "ray"):
        return [f"launcher.backend={b!r} is unknown; use local (this host) or ray (a Ray cluster)."]
    if b == "local":
        return []
    try:
        import ray  # noqa: F401
    except ImportError:
        return ["launcher.backend=ray needs Ray: run bash scripts/setup.sh (it installs the project's [ray] extra)."]
    errors = []
    if cfg.run.role not in ("all", "actors", "engines"):
        errors.append(
            f"launcher.backend=ray places a whole run (role=all), more actors or more engines (role=actors|"
            f"engines); role={cfg.run.role} joins a run from one host: use launcher.backend=local there."
        )
    if cfg.judges.count:
        errors.append(
            "launcher.backend=ray does not place LLM judges yet: set judges.count=0, or use launcher.backend=local."
        )
    if cfg.distill.count:
        errors.append(
            "launcher.backend=ray does not place distillation teachers yet: set distill.count=0, or use "
            "launcher.backend=local."
        )
    unknown = sorted(set(cfg.launcher.resources) - {"broker", "engine", "learner", "actor"})
    if unknown:
        errors.append(f"launcher.resources has {unknown}: its roles are broker, engine, learner and actor.")
    bad = {f"{role}.{k}": v for role, res in cfg.launcher.resources.items() for k, v in res.items() if v < 0}
    if bad:
        errors.append(f"launcher.resources asks negative amounts {bad}: every amount is >= 0.")
    return errors


def _learner_node_errors(c: LearnerConfig, role: str) -> list[str]:
    """Multi-node learner: whole hosts of ranks, and each launch in its own node's place."""
    if c.nnodes < 1 or c.world_size % c.nnodes:
        return [
            f"learner.world_size={c.world_size} over learner.nnodes={c.nnodes} hosts: every host runs the same "
            f"number of ranks, so world_size must be a multiple of nnodes (>= 1)."
        ]
    # (a role=learner launch is checked again with the run's nnodes, from the broker, once it joined)
    if role == "learner" and not (1 <= c.node_rank and (c.nnodes == 1 or c.node_rank < c.nnodes)):
        return [
            f"role=learner joins as node learner.node_rank={c.node_rank} of the run's learner.nnodes={c.nnodes}: "
            f"set learner.node_rank to 1..nnodes-1 (node 0 is the main launch's)."
        ]
    if role == "all" and c.node_rank != 0:
        return [f"learner.node_rank={c.node_rank}: the main launch runs node 0; other nodes join with role=learner."]
    return []


def _validation_errors(v: ValidationConfig) -> list[str]:
    if v.every < 0 or v.episodes < 1 or v.temperature < 0 or v.final_timeout_s <= 0:
        return [
            (
                f"validation.every={v.every} (>= 0; 0 = off), validation.episodes={v.episodes} (>= 1), "
                f"validation.temperature={v.temperature} (>= 0; 0 = greedy), validation.final_timeout_s="
                f"{v.final_timeout_s} (> 0): one of them is out of range."
            )
        ]
    return []


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's `--max-lora-rank` accepts (vllm.config.lora.MaxLoRARanks)."""


def _lora_and_checkpoint_errors(cfg: Config) -> list[str]:
    errors = []
    m, ck = cfg.model, cfg.checkpoint
    if m.lora_rank < 0:
        errors.append(f"model.lora_rank={m.lora_rank}: must be >= 0 (0 = full fine-tuning).")
    elif m.lora_rank and m.lora_rank not in VLLM_LORA_RANKS:
        errors.append(f"model.lora_rank={m.lora_rank}: vLLM serves only ranks {VLLM_LORA_RANKS}; pick one of them.")
    if m.lora_rank and not m.lora_target_modules:
        errors.append("model.lora_target_modules is empty: name the linear layers to adapt (e.g. q_proj, v_proj).")
    if m.lora_rank and m.lora_alpha <= 0:
        errors.append(f"model.lora_alpha={m.lora_alpha}: must be > 0.")
    if not 0.0 <= m.lora_dropout < 1.0:
        errors.append(f"model.lora_dropout={m.lora_dropout}: must be in [0, 1).")
    if ck.every_steps < 0:
        errors.append(f"checkpoint.every_steps={ck.every_steps}: must be >= 0 (0 = never save).")
    if ck.resume_from and ck.resume_from != "latest" and not Path(ck.resume_from).is_dir():
        errors.append(
            f"checkpoint.resume_from={ck.resume_from!r} is not a folder; give a step_XXXXXXXX folder or `latest`."
        )
    wal = Path(cfg.run.output_dir) / WAL_FOLDER
    if cfg.run.role == "all" and cfg.broker.wal and not ck.resume_from and wal.is_dir() and any(wal.iterdir()):
        # its broker would recover the old buffer and learner version while a fresh learner starts at version 0
        errors.append(
            f"run.output_dir={cfg.run.output_dir} holds an earlier run (its broker's log {wal}): give a new "
            "run.output_dir, or continue that run with checkpoint.resume_from=latest."
        )
    return errors


def algorithm_errors(a: AlgorithmConfig) -> list[str]:
    """What is wrong with `algorithm.*` (empty: nothing), each saying what to change."""
    errors = []
    for name, value, known in [
        ("advantage", a.advantage, ADVANTAGES),
        ("policy_loss", a.policy_loss, POLICY_LOSSES),
        ("loss_agg", a.loss_agg, LOSS_AGGREGATIONS),
        ("kl_estimator", a.kl_estimator, KL_ESTIMATORS),
        ("off_policy", a.off_policy, OFF_POLICY),
        ("is_level", a.is_level, LEVELS),
        ("reference", a.reference, ("none", "frozen_copy")),
        ("value_loss_agg", a.value_loss_agg, VALUE_LOSS_AGGREGATIONS),
        ("group_of_one", a.group_of_one, GROUP_OF_ONE),
    ]:
        if value not in known:
            errors.append(_unknown(f"algorithm.{name}", value, known))
    if not 0.0 <= a.gamma <= 1.0 or not 0.0 <= a.lam <= 1.0:
        errors.append(f"algorithm.gamma={a.gamma}, algorithm.lam={a.lam}: both must be in [0, 1].")
    if not 0.0 <= a.clip_low < 1.0 or a.clip_high < 0.0:
        errors.append(f"algorithm.clip_low={a.clip_low} must be in [0, 1) and clip_high={a.clip_high} >= 0.")
    if a.dual_clip != 0.0 and a.dual_clip <= 1.0:
        errors.append(f"algorithm.dual_clip={a.dual_clip}: use a constant > 1 (e.g. 3.0), or 0 to turn it off.")
    if a.is_cap <= 1.0 and a.off_policy in ("tis", "mis"):
        errors.append(f"algorithm.is_cap={a.is_cap}: the cap C must be > 1 (e.g. 2.0).")
    for name, value in [("norm_length", a.norm_length), ("critic_lr", a.critic_lr)]:
        if value <= 0:
            errors.append(f"algorithm.{name}={value}: must be > 0.")
    for name, value in [
        ("entropy_coef", a.entropy_coef),
        ("kl_coef", a.kl_coef),
        ("step_weight", a.step_weight),
        ("value_clip", a.value_clip),
    ]:
        if value < 0:
            errors.append(f"algorithm.{name}={value}: must be >= 0.")
    return errors


def reference_errors(cfg: Config) -> list[str]:
    """Online DPO and SPIN: a reference to compare with, the pair mean carried by the advantages."""
    a, errors = cfg.algorithm, []
    if a.dpo_beta <= 0:
        errors.append(f"algorithm.dpo_beta={a.dpo_beta}: must be > 0 (e.g. 0.1).")
    if a.ref_update_every < 0:
        errors.append(
            f"algorithm.ref_update_every={a.ref_update_every}: must be >= 0 (0 = never refresh the reference)."
        )
    if a.advantage not in ADVANTAGES or not advantage_traits(a.advantage).needs_logprobs:
        return errors
    if a.reference != "frozen_copy" and not cfg.model.lora_rank:
        errors.append(
            f"algorithm.advantage={a.advantage} compares the policy with a reference: set "
            f"algorithm.reference=frozen_copy (or train LoRA, whose base model is the reference)."
        )
    if a.ref_update_every > 0 and a.reference != "frozen_copy":
        errors.append(
            f"algorithm.ref_update_every={a.ref_update_every} refreshes a frozen copy: set "
            f"algorithm.reference=frozen_copy, or ref_update_every=0."
        )
    if a.loss_agg != "token-sum":
        errors.append(
            f"algorithm.advantage={a.advantage} carries DPO's mean over pairs in its advantages: set "
            f"algorithm.loss_agg=token-sum (got {a.loss_agg!r}; `algorithm=online_dpo` sets it)."
        )
    return errors


def network_errors(cfg: Config) -> list[str]:
    """Leaving loopback: ZeroMQ sockets need CURVE keys, vLLM's unauthenticated HTTP an explicit opt-in."""
    b, role = cfg.broker, cfg.run.role
    fix = (
        f"generate keys with `{KEYGEN_COMMAND}` and set broker.curve_keys_dir=KEYS, or set "
        f"broker.allow_insecure_bind=true if every machine on that network is trusted."
    )
    errors: list[str] = []
    if b.curve_keys_dir:
        errors += keys_dir_errors(b.curve_keys_dir, server=role == "all")
    elif not b.allow_insecure_bind:
        binds = [("broker.host", b.host), ("learner.weight_host", cfg.learner.weight_host)] if role == "all" else []
        address = b.address if b.address.startswith("tcp://") else (read_record(b.address) or {}).get("address", "")
        joins = [("broker.address", address.removeprefix("tcp://").rsplit(":", 1)[0])] if role != "all" else []
        for name, host in binds + joins:
            if host and not is_loopback(host):
                errors.append(
                    f"{name} uses {host!r}, which is not a loopback address: without CURVE anyone who "
                    f"reaches it can send messages, and all traffic is in the clear; {fix}"
                )
    if role in ("all", "engines") and not is_loopback(cfg.engines.host) and not b.allow_insecure_bind:
        errors.append(
            f"engines.host={cfg.engines.host!r} is not a loopback address, and vLLM's HTTP server (with the "
            f"weight-reload endpoints) has no authentication: keep it on 127.0.0.1, or set "
            f"broker.allow_insecure_bind=true if every machine on that network is trusted."
        )
    return errors
