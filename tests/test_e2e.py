"""End-to-end: the real launcher runs broker, a vLLM engine, a 2-rank FSDP2 learner and 2 actors.

Asserts from summary.json and the broker's final /metrics that the loop went all the way round:
env -> memory -> engine -> actor -> broker -> learner -> weights -> engine; and that the run's metrics reach
every logger (JSONL, TensorBoard, W&B offline, MLflow file store), read back with each tracker's own reader.

The same run (one run for all: the suite's time) also rewards with an LLM judge and trains with SPIN:
- judge-0, a vLLM server of the tiny model's initial weights (frozen), scores every finished episode. Its
  answers are the untrained model's random text and the score pattern asks for `JUDGED=<n>`, which that text
  never holds: every verdict is a parse failure, so with combine=replace and default_score=-0.5 every
  episode's last step gets -0.5 (plus the invalid-action penalty) and the other steps only their penalties.
- `algorithm=spin` with the reference refreshed every version: online DPO's pairs on two learner ranks.
- A reward on every response token (`trainer.token_reward=actors.token_rewards:per_token_cost`, COST each): it
  travels with each transition, one per token, and its sum joins the step's reward.
A dead actor's restart under a new incarnation is tested in tests/test_chaos.py (kill -9, three times), and
Ctrl-C of a run (exit code 130, nothing left running) in tests/test_roles.py.
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_testing import processes_mentioning, read_mlflow, read_tensorboard, read_wandb

from agentstream.wire.addresses import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
STEPS, GROUPS, G = 3, 4, 4
DEFAULT, PENALTY = -0.5, -0.1  # the judge's default score (every verdict here), the invalid-action penalty
COST = -0.0078125  # the reward on each response token (2^-7: exact in float32)


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} missing from /metrics"
    return float(match.group(1))


def routes(log: Path) -> set[str]:
    """The paths of a vLLM server's access-log lines (`"POST /v1/completions HTTP/1.1" 200`), without queries."""
    return {m.group(1) for m in re.finditer(r'"(?:GET|POST) ([^ ?"]+)\S* HTTP/', log.read_text())}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str, float]:
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    argv = [
        sys.executable,
        "scripts/launch.py",
        f"run.output_dir={run_dir}",
        "actors.count=2",
        "actors.episodes_per_actor=8",
        f"env.group_size={G}",
        "engines.count=1",
        "learner.world_size=2",
        f"trainer.total_steps={STEPS}",
        f"trainer.groups_per_step={GROUPS}",
        "trainer.max_staleness=1",
        f"trainer.invalid_action_penalty={PENALTY}",
        f"broker.dashboard_port={free_port()}",
        "logger=[jsonl,tensorboard,wandb,mlflow]",
        "algorithm=spin",
        "algorithm.ref_update_every=1",
        "judges.count=1",
        "judges.combine=replace",
        f"judges.default_score={DEFAULT}",
        "judges.max_tokens=8",
        "judges.score_pattern='JUDGED=([0-9]+)'",
        "trainer.token_reward=actors.token_rewards:per_token_cost",
        f"+trainer.token_reward_kwargs.cost={COST}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI")}
    started = time.time()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    wall = time.time() - started
    assert proc.returncode == 0, f"launcher failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "dashboard:" in proc.stdout and "summary:" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir, summary, (run_dir / "metrics.txt").read_text(), wall


def test_learner_and_every_engine_reach_the_final_version(run) -> None:
    _, s, metrics, wall = run
    print(
        f"e2e wall {wall:.1f}s; {s['env_steps_per_s']:.1f} env steps/s; {s['tokens_per_s']:.0f} tokens/s; "
        f"step time {s['learner_metrics'].get('step_time_s')}"
    )
    assert s["status"] == "finished", s["reason"]
    assert s["learner_version"] == STEPS
    assert s["engine_versions"] == {"engine-0": STEPS}
    assert metric(metrics, "agentstream_learner_version") == STEPS
    assert metric(metrics, "agentstream_engine_version", '{engine="engine-0"}') == STEPS


def test_every_trained_group_had_g_complete_trajectories(run) -> None:
    _, s, _, _ = run
    assert s["groups_trained"] == STEPS * GROUPS
    assert s["trained_group_shapes"] == {f"{G}/{G}": STEPS * GROUPS}


def test_no_transition_is_lost_or_invented(run) -> None:
    _, s, metrics, _ = run
    dropped = sum(s["transitions_dropped"].values())
    assert s["transitions_sent"] > 0
    assert s["transitions_sent_reported"] == s["transitions_sent"] == s["transitions_ingested"]
    assert s["transitions_ingested"] == s["transitions_trained"] + s["transitions_buffered"] + dropped
    assert s["transitions_trained"] > 0
    assert metric(metrics, "agentstream_transitions_ingested_total") == s["transitions_ingested"]
    assert metric(metrics, "agentstream_transitions_trained_total") == s["transitions_trained"]
    # staleness of trained tokens never exceeds the bound (1)
    assert set(s["staleness_hist"]) <= {"0", "1"}


def test_each_transition_holds_the_prompt_and_anchor_of_the_state_it_acted_in(run) -> None:
    """What the broker logged: every transition's prompt ends with the observation it was generated from, and
    its anchor (GiGPO's step-group key) is that same state, not the state the action led to."""
    from transformers import AutoTokenizer

    from agentstream.config import TINY_MODEL_DIR
    from broker.state import logged_transitions

    run_dir, _, _, _ = run
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    seen = 0
    for t in logged_transitions(run_dir / "broker-wal"):
        prompt = tok.decode(t.prompt_ids)
        assert t.anchor and prompt.endswith(f"{t.anchor}<|im_end|>\n<|im_start|>assistant\n"), (t.anchor, prompt[-300:])
        seen += 1
    assert seen > 0


def test_every_logger_ends_at_the_summarys_learner_version_and_loss(run) -> None:
    """The broker logs a last point when it stops: each tracker's last learner_version and learner_loss are
    summary.json's (TensorBoard keeps float32)."""
    run_dir, s, _, _ = run
    want = {"learner_version": float(s["learner_version"]), "learner_loss": s["learner_metrics"]["loss"]}
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tb = read_tensorboard(run_dir / "tensorboard")
    wandb_run, wandb_history = read_wandb(run_dir / "wandb")
    mlflow_run, mlflow_history = read_mlflow((run_dir / "mlruns").as_uri(), "agentstream")
    assert wandb_run["display_name"] == mlflow_run.info.run_name == run_dir.name
    for key, value in want.items():
        assert jsonl[-1][key] == value, key
        assert tb[key][-1][1] == pytest.approx(value, rel=1e-6), key
        assert wandb_history[key][-1][1] == value, key
        assert mlflow_history[key][-1][1] == value, key
    # One entry per point in each: W&B and MLflow step through the points 0, 1, 2, ...
    assert [step for step, _ in wandb_history["learner_version"]] == list(range(len(jsonl)))
    assert [step for step, _ in mlflow_history["learner_version"]] == list(range(len(jsonl)))
    assert len(tb["learner_version"]) == len(jsonl)


def test_no_process_is_left_running(run) -> None:
    run_dir, s, _, _ = run
    assert s["processes_left"] == []
    assert processes_mentioning(str(run_dir)) == []


def test_every_finished_episode_was_judged_once(run) -> None:
    _, s, metrics, _ = run
    assert s["status"] == "finished", s["reason"]
    j = s["judges"]
    assert j["requests"] == s["episodes"] > 0
    assert j["parsed"] + j["parse_failures"] + j["errors"] == j["requests"]
    assert j["errors"] == 0 and j["parse_failures"] == j["requests"]  # the random text never says JUDGED=<n>
    assert j["score_mean"] == DEFAULT and j["latency_mean_s"] > 0
    assert metric(metrics, "agentstream_judge_requests_total") == j["requests"]
    assert metric(metrics, "agentstream_judge_parse_failures_total") == j["parse_failures"]
    assert metric(metrics, "agentstream_judge_latency_count_total") == j["requests"]  # each one answered


def test_every_logged_last_step_carries_the_judged_reward_and_no_other_step_does(run) -> None:
    from broker.state import logged_transitions

    run_dir, s, _, _ = run
    last = other = 0
    for t in logged_transitions(run_dir / "broker-wal"):
        assert t.token_rewards.tolist() == [COST] * t.response_ids.size  # one per response token
        penalty = (0.0 if t.valid else PENALTY) + COST * t.response_ids.size  # and their sum in the step's reward
        if t.done or t.truncated:
            assert t.info["judge_outcome"] == "parse_failure" and t.info["judge_score"] == DEFAULT
            assert t.reward == pytest.approx(DEFAULT + penalty)  # replace: weight 1 x the default, env reward gone
            last += 1
        else:
            assert "judge_score" not in t.info and t.reward == pytest.approx(penalty)  # FrozenLake pays at the end only
            other += 1
    assert 0 < last <= s["judges"]["requests"] and other > 0


def test_every_step_got_its_token_rewards(run) -> None:
    _, _, metrics, _ = run
    steps = metric(metrics, "agentstream_env_steps_total")
    assert steps > 0 and metric(metrics, "agentstream_token_reward_steps_total") == steps
    assert metric(metrics, "agentstream_token_reward_failures_total") == 0
    assert metric(metrics, "agentstream_token_reward_sum_total") == COST * metric(
        metrics, "agentstream_tokens_generated_total"
    )


def test_the_learner_trained_on_the_judged_rewards(run) -> None:
    """Each step trains GROUPS groups of G whole trajectories, each with one judged last step: its rewards sum to
    GROUPS * G * DEFAULT plus the penalty of each invalid step and COST for each response token."""
    run_dir, _, _, _ = run
    steps = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward_mean" in m]
    assert len(steps) == STEPS
    for m in steps:
        n = m["transitions"]
        want = GROUPS * G * DEFAULT + PENALTY * m["invalid_frac"] * n + COST * m["tokens"]
        assert m["reward_mean"] * n == pytest.approx(want, rel=1e-6), m


def test_the_judge_is_a_server_of_its_own_that_never_gets_weights(run) -> None:
    run_dir, s, _, _ = run
    logs = run_dir / "logs"
    assert s["engine_versions"] == {"engine-0": STEPS}  # the judge is not one of the engines
    assert sorted(p.name for p in logs.glob("sidecar-*.log")) == ["sidecar-0.log"]  # no sidecar for the judge
    # What each server was asked (its HTTP access log): the judge only its health and completions, never a weight
    # route (sleep, the streamed update's, update_weight_version, ...) nor even its version; the engine all of them.
    assert routes(logs / "judge-0.log") == {"/health", "/v1/completions"}
    assert {
        "/sleep",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/inference/v1/generate",
    } <= routes(logs / "engine-0.log")
    actor_log = (logs / "actor-0.log").read_text()
    assert "Traceback" not in actor_log


def test_the_judge_metrics_reach_the_metrics_file_and_nothing_is_left_running(run) -> None:
    run_dir, s, _, _ = run
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["judge_requests"] == s["judges"]["requests"] and last["judge_errors"] == 0
    assert last["judge_parse_failures"] == s["judges"]["parse_failures"] and "judge_latency_s" in last
    assert s["processes_left"] == [] and processes_mentioning(str(run_dir)) == []


def test_spin_pairs_each_group_once_and_refreshes_the_reference_every_version(run) -> None:
    """Each step's GROUPS groups are each a pair, a tie or alone (counted), and the reference follows the policy:
    refreshed after every version, it equals the policy the next step starts from, so every z is 0 and the DPO loss
    of a step with pairs is -log sigmoid(0) = log 2 exactly."""
    run_dir, _, _, _ = run
    steps = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "version" in m]
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:
        assert m["adv_dpo_pair_count"] + m["adv_dpo_tie_count"] + m["adv_dpo_lone_count"] == GROUPS, m
        assert m["reference_version"] == m["version"] and m["reference_refreshes"] == m["version"]
        if m["adv_dpo_pair_count"]:
            assert m["adv_dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
        else:
            assert m["adv_dpo_loss"] == 0.0 and m["grad_norm"] == 0.0  # no pair, no gradient


def test_bad_config_stops_the_launch_at_once_with_what_to_change(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/launch.py",
            f"run.output_dir={tmp_path}",
            "env.group_size=16",
            "model.path=/nonexistent",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "set actors.episodes_per_actor=16 or lower env.group_size" in proc.stderr
    assert "model.path='/nonexistent' is not a Hugging Face model directory" in proc.stderr


def test_a_dead_learner_stops_the_run_with_the_reason(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # No engine (engines.count=0: none on this host): the learner dies before one would be needed.
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/launch.py",
            f"run.output_dir={run_dir}",
            "learner.backend=nccl",
            "run.shutdown_timeout_s=5",
            "engines.count=0",
            f"broker.dashboard_port={free_port()}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "learner exited" in summary["reason"] or "learner died" in summary["reason"]
    assert "CUDA is not available" in summary["reason"]  # the learner's own message, from its log
    assert summary["processes_left"] == [] and processes_mentioning(str(run_dir)) == []


def test_a_lora_run_sends_adapters_that_the_engine_keeps_serving(tmp_path: Path) -> None:
    # Regression: vLLM re-reads an adapter's folder when it re-activates it for a request; deleting an older
    # version's folder killed the engine's worker at the second update.
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/launch.py",
            f"run.output_dir={run_dir}",
            "model.lora_rank=8",
            "learner.world_size=1",
            "trainer.groups_per_step=2",
            "trainer.total_steps=4",
            f"broker.dashboard_port={free_port()}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert proc.returncode == 0, summary.get("reason")
    assert summary["learner_version"] == 4 and summary["engine_versions"] == {"engine-0": 4}
    assert "LoRA adapter 'policy-lora' added" in (run_dir / "logs" / "sidecar-0.log").read_text()
