"""The broker's metric catalogue: every number it reports, with its kind, labels and HELP line.

Every process reports counters and gauges to the broker (`Stats` messages, agentstream/wire/messages.py); the
broker turns them into one snapshot (schema in broker/dashboard.py), which goes to /metrics in Prometheus text
format (broker/prometheus.py) and, once a second, as one flat point to the dashboard's history and to the metric
sinks (broker/sinks.py). The names below are the Prometheus ones; a point's keys are the same without prefix
and suffix (`reward_mean/<env>` for a labelled series).

Prometheus metric names (all prefixed `agentstream_`; counters end in `_total`):

- transitions_ingested_total (counter): per-step transitions accepted by the broker
- transitions_trained_total (counter): transitions served to the learner
- transitions_dropped_<reason>_total (counter): transitions dropped, by reason (stale, actor_died, ...)
- groups_admitted/completed/trained_total (counter): groups granted to actors / completed / served
- malformed_messages_total (counter): messages the broker rejected
- env_steps_total, episodes_total, successes_total, invalid_actions_total, tokens_generated_total,
  transitions_sent_total, episode_return_sum_total, engine_errors_total (counter): actor totals over all actors and
  incarnations
- env_steps_per_s, tokens_per_s, transitions_per_s (gauge): rates over the last 10 s
- learner_samples_per_s, learner_steps_per_s (gauge): transitions trained / optimizer steps per second (10 s)
- learner_version, learner_step_time_s, learner_loss, learner_publish_s (gauge): from the learner's last VersionUpdate
- learner_mismatch_logp_abs_mean, learner_mismatch_logp_abs_max, learner_mismatch_kl, learner_mismatch_version,
  learner_mismatch_tokens (gauge): train-inference mismatch: the engine's log-probs against the learner's on the same
  weights (tokens sampled at the learner's version), as last measured, at learner version mismatch_version; tokens: how
  many the last step had
- buffered_transitions, groups_ready, groups_open, group_waiters (gauge): broker buffer depth and queues
- staleness_mean, staleness_max (gauge): policy lag of the last trained batch
- staleness_count (gauge; label lag): trained transitions per policy lag (histogram)
- reward_mean, success_rate, invalid_action_ratio (gauge): over episodes/steps of the last 60 s, all envs
- env_reward_mean, env_success_rate, env_invalid_action_ratio (gauge; label env): the same per environment
- env_episodes_total (counter; label env): episodes finished per environment
- actors_alive, engines_alive (gauge): processes that reported within 10 s
- weight_sync_s (gauge): slowest engine's last weight update (write to resume)
- judge_requests_total, judge_parsed_total, judge_parse_failures_total, judge_errors_total (counter): LLM judges
  (actors/judge.py): episodes judged = parsed + parse failures + errors (timeouts included)
- judge_latency_s_sum_total, judge_latency_count_total, judge_score_sum_total (counter): answered judge requests'
  seconds and count; the scores given (defaults included)
- judge_latency_s (gauge): mean seconds of the judge requests answered in the last 60 s
- distill_steps_total, distill_tokens_total, distill_kl_sum_total, distill_latency_s_sum_total, distill_errors_total,
  distill_retries_total, distill_dropped_total (counter): on-policy distillation (actors/teacher.py): steps and tokens
  given a teacher's signal, the sum of log pi_student - log pi_teacher over them, answered requests' seconds, failed
  requests, retries, groups dropped for want of a signal
- distill_kl (gauge): mean reverse KL per token to the teacher over the last 60 s
- token_reward_steps_total, token_reward_sum_total, token_reward_failures_total, token_reward_failures_CAUSE_total
  (counter): rewards on tokens (actors/token_rewards.py): steps given them, their sum; steps without them because the
  function failed, in all and by cause (raised, not_numbers, wrong_length, non_finite)
- gateway_requests_total, gateway_calls_total, gateway_episodes_opened_total, gateway_episodes_finished_total,
  gateway_prompt_tokens_total, gateway_tool_calls_total (counter): the OpenAI-compatible gateway (gateway/server.py; an
  actor to the broker, whose episodes and calls also count in episodes_total and env_steps_total): HTTP requests, model
  calls, episodes, prompt tokens, tool calls returned
- gateway_rejected_total, gateway_rejected_CODE_total, gateway_tool_parse_failures_total,
  gateway_tool_parse_REASON_total, gateway_prompts_rendered_anew_total, gateway_prompts_extended_total,
  gateway_internal_errors_total (counter): its refusals (4xx) in all and by code (docs/gateway.md), tool calls that did
  not parse in all and by reason, prompts rendered whole again vs extended token-exactly, 500s
- engine_failovers_total, engine_stalls_total, episode_retries_total, infra_failures_total, infra_failures_CAUSE_total,
  episodes_cut_total (counter): faults outside the model (actors/actor.py, docs/reliability.md): requests moved off a
  failed or stalled engine; episodes played again on their seed; episode attempts failed by their env or engines, in all
  and by cause (timeout, raised, engine); episodes stopped because their group was given up
- actor_alive, actor_episodes_in_flight, actor_requests_in_flight, actor_policy_version, actor_env_steps_hung (gauge;
  label actor): per actor (env_steps_hung: env calls left running after env.step_timeout_s)
- engine_alive, engine_version, engine_requests_in_flight, engine_weight_sync_s (gauge; label engine): per engine
  (requests: vLLM running+waiting, -1 unknown)
- run_wall_s, run_total_steps (gauge): seconds since the broker started; configured steps
- wal_failing (gauge): 1 while the write-ahead log cannot be written (full disk)
- wal_stalled_s, wal_pending_bytes (gauge): seconds stalled on it in all; bytes waiting to be written
- wal_write_errors_total (counter): failed writes of the write-ahead log (and compactions)

Any other counter or gauge a process reports still appears, under its sanitized name, with a generic HELP.
"""

from __future__ import annotations

from broker.stats import GATEWAY_REJECT_CODES

MISMATCH_KEYS = (
    "mismatch_logp_abs_mean",
    "mismatch_logp_abs_max",
    "mismatch_kl",
    "mismatch_tokens",
    "mismatch_version",
)
"""The learner's train-inference mismatch metrics (learner/step.py `mismatch_metrics`), shown as learner_<key>; the
last measurement stays until the next (mismatch_version: the learner version it was measured on)."""
VALIDATION_GAUGES = ("val_success_rate", "val_return", "val_version", "val_teacher_success", "val_warm_model_success")
"""The evaluator's gauges the dashboard shows (actors/evaluate.py): the latest validation on held-out seeds, and what
the warm start measured on the same seeds (its teacher's and the warm model's success; absent without a teacher)."""

PREFIX = "agentstream_"
"""What every Prometheus name starts with."""

# The gateway's counters (broker.stats.GATEWAY_COUNTERS), one HELP line each.
GATEWAY_HELP: dict[str, str] = {
    "gateway_requests": "HTTP requests the OpenAI-compatible gateway handled (answered or refused).",
    "gateway_calls": "Model calls the gateway answered (each one transition; also counted in env_steps).",
    "gateway_episodes_opened": "Episodes opened at the gateway.",
    "gateway_episodes_finished": "Episodes finished at the gateway (also counted in episodes).",
    "gateway_episodes_abandoned": "Gateway episodes given up, their group dropped: no request for "
    "gateway.episode_idle_timeout_s, or the agent gave up (POST /episodes/<id>/abandon).",
    "gateway_prompt_tokens": "Prompt tokens of the gateway's model calls.",
    "gateway_tool_calls": "Tool calls the gateway parsed from answers and returned as OpenAI tool_calls.",
    "gateway_tool_parse_failures": "Answers whose tool calls did not parse (returned as text; the step is invalid).",
    "gateway_prompts_extended": "Gateway calls whose prompt extended the previous prompt and answer token-exactly.",
    "gateway_prompts_rendered_anew": "Gateway calls rendered whole again (history edited, tools changed).",
    "gateway_internal_errors": "Gateway requests that failed inside it (500, logged with the trace).",
    "gateway_rejected": "Gateway requests refused with a 4xx (all codes).",
    **{
        f"gateway_tool_parse_{r}": f"Gateway answers whose tool calls did not parse: {r}."
        for r in ("truncated", "bad_json", "bad_call", "unknown_tool")
    },
    **{
        f"gateway_rejected_{c}": f"Gateway requests refused with code {c} (docs/gateway.md, Bad input)."
        for c in GATEWAY_REJECT_CODES
    },
}

# HELP text per name (without prefix and without `_total`); an unknown name gets a generic line.
HELP: dict[str, str] = {
    "transitions_ingested": "Per-step transitions accepted by the broker.",
    "transitions_trained": "Transitions served to the learner in batches.",
    "transitions_dropped_stale": "Transitions dropped because their policy lag exceeded the bound.",
    "groups_admitted": "Groups granted to actors.",
    "groups_completed": "Groups whose G trajectories all finished.",
    "groups_trained": "Complete groups served to the learner.",
    "env_steps": "Environment steps taken by all actors.",
    "tokens_generated": "Response tokens generated by the engines.",
    "transitions_sent": "Transitions sent by actors.",
    "episodes": "Episodes finished.",
    "successes": "Episodes that ended in success.",
    "episode_return_sum": "Sum of episode returns (divide by episodes for the mean).",
    "invalid_actions": "Steps whose response did not parse as an action.",
    "engine_errors": "Engine requests that failed.",
    "judge_requests": "Episodes an LLM judge scored (parsed + parse failures + errors).",
    "judge_parsed": "Judge answers whose score parsed.",
    "judge_parse_failures": "Judge answers without a score (judges.default_score was used).",
    "judge_errors": "Judge requests that failed or timed out (judges.default_score was used).",
    "judge_score_sum": "Sum of the judge scores given (defaults included; divide by judge_requests).",
    "judge_latency_s_sum": "Seconds of the answered judge requests (divide by judge_latency_count).",
    "judge_latency_count": "Answered judge requests.",
    "token_reward_steps": "Steps given rewards on their response tokens (trainer.token_reward).",
    "token_reward_sum": "Sum of the rewards placed on response tokens.",
    "token_reward_failures": "Steps without token rewards because the token reward function failed.",
    "token_reward_failures_raised": "Token reward function calls that raised.",
    "token_reward_failures_not_numbers": "Token reward function calls that returned no sequence of numbers.",
    "token_reward_failures_wrong_length": "Token reward function calls that returned more or fewer values than tokens.",
    "token_reward_failures_non_finite": "Token reward function calls that returned nan, inf or values beyond float32.",
    **GATEWAY_HELP,
    "judge_latency_s": "Mean seconds of the judge requests answered in the last 60 s.",
    "distill_steps": "Steps given a distillation teacher's per-token signal (distill.count).",
    "distill_tokens": "Response tokens given a teacher's log-prob.",
    "distill_kl_sum": "Sum over those tokens of log pi_student - log pi_teacher (divide by distill_tokens).",
    "distill_latency_s_sum": "Seconds of the answered teacher requests (divide by distill_steps).",
    "distill_errors": "Teacher requests that failed or timed out (asked again up to distill.retries times).",
    "distill_retries": "Teacher requests asked again after a failure.",
    "distill_dropped": "Groups dropped because a step of theirs got no teacher signal within the retries.",
    "distill_kl": "Mean reverse KL per token to the teacher (log pi_student - log pi_teacher) over the last 60 s.",
    "infra_failures_teacher": "Episode attempts failed because no teacher answered within distill.retries retries.",
    "engine_failovers": "Engine requests moved to another engine after a failure or a stall.",
    "engine_stalls": "Engine requests unanswered for engines.stall_timeout_s whose engine then missed a probe too.",
    "episode_retries": "Episodes played again on their seed after an infrastructure failure.",
    "infra_failures": "Episode attempts failed by the env or the engines (not the model), in all.",
    "infra_failures_timeout": "Episode attempts failed because an env step outlasted env.step_timeout_s.",
    "infra_failures_raised": "Episode attempts failed because an env step raised.",
    "infra_failures_engine": "Episode attempts failed because no engine answered within engines.request_timeout_s.",
    "episodes_cut": "Episodes stopped early because another episode of their group gave up (the group is dropped).",
    "frozen_steps": "Steps of a frozen seat (env.kwargs.opponent=frozen), sampled from the frozen copy, never sent.",
    "frozen_invalid_actions": "Steps of a frozen seat whose response did not parse as an action.",
    "malformed_messages": "Messages the broker could not decode.",
    "buffered_transitions": "Transitions held by the broker, not yet trained on.",
    "groups_ready": "Complete groups waiting to be served.",
    "groups_open": "Groups still being played.",
    "group_waiters": "Actor group requests waiting for admission.",
    "staleness_mean": "Mean policy lag (learner version - producing version) of the last trained batch.",
    "staleness_max": "Largest policy lag of the last trained batch.",
    "reward_mean": "Mean episode return over the last 60 s.",
    "success_rate": "Fraction of the last 60 s's episodes that succeeded.",
    "invalid_action_ratio": "Fraction of the last 60 s's steps with an invalid action.",
    "actors_alive": "Actor processes that reported within 10 s.",
    "engines_alive": "Engines that reported within 10 s.",
    "weight_sync_s": "Seconds the slowest engine's last weight update took (write to resume).",
    "env_steps_per_s": "Environment steps per second (10 s window).",
    "tokens_per_s": "Generated tokens per second (10 s window).",
    "transitions_per_s": "Transitions ingested per second (10 s window).",
    "learner_samples_per_s": "Transitions trained per second (10 s window).",
    "learner_steps_per_s": "Learner optimizer steps per second (10 s window).",
    "learner_version": "Learner policy version (one per optimizer step).",
    "learner_step_time_s": "Seconds taken by the last learner step.",
    "learner_loss": "Loss of the last learner step.",
    "learner_publish_s": "Seconds the learner took to publish the last weights.",
    "learner_mismatch_logp_abs_mean": "Mean |engine log-prob - learner log-prob| of the last step's tokens sampled on "
    "the learner's weights (train-inference mismatch; ~1e-6 in fp32).",
    "learner_mismatch_logp_abs_max": "Largest |engine log-prob - learner log-prob| of those tokens.",
    "learner_mismatch_kl": "Mean per-token KL(engine || learner) of those tokens (k3 estimator).",
    "learner_mismatch_tokens": "Tokens of the last step sampled on the learner's current weights "
    "(the mismatch's sample).",
    "learner_mismatch_version": "Learner version the mismatch figures were last measured on.",
    "run_wall_s": "Seconds since the broker started.",
    "run_total_steps": "Learner steps the run is configured to take.",
    "wal_failing": "1 while the broker's write-ahead log cannot be written (a full disk): nothing is acknowledged.",
    "wal_stalled_s": "Seconds the broker has stalled on an unwritable write-ahead log, in all.",
    "wal_pending_bytes": "Bytes of write-ahead log records waiting to be written.",
    "wal_write_errors": "Failed writes of the write-ahead log (and failed compactions).",
    "engine_version": "Policy version an engine is serving.",
    "engine_alive": "1 if the engine reported within 10 s.",
    "engine_requests_in_flight": "Requests the engine's vLLM server is running or queueing (-1: unknown).",
    "engine_weight_sync_s": "Seconds the engine's last weight update took.",
    "actor_alive": "1 if the actor reported within 10 s and has not said goodbye.",
    "actor_episodes_in_flight": "Episodes an actor is running now.",
    "actor_requests_in_flight": "Engine requests an actor is waiting on now.",
    "actor_env_steps_hung": "Env calls of an actor still running after env.step_timeout_s.",
    "actor_policy_version": "Newest policy version an actor's responses came from.",
    "staleness_count": "Trained transitions per policy lag (label lag).",
    "env_reward_mean": "Mean episode return over the last 60 s, per environment.",
    "env_success_rate": "Success rate over the last 60 s, per environment.",
    "env_invalid_action_ratio": "Invalid-action ratio over the last 60 s, per environment.",
    "env_episodes": "Episodes finished, per environment.",
}


def help_text(name: str) -> str:
    """The HELP line of `name` (without prefix and without `_total`); an unknown name gets a generic line."""
    return HELP.get(name, f"{name.replace('_', ' ')} (as reported to the broker).")
