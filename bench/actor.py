"""Actor overhead: generated tokens/s the actors reach versus the same engine driven directly (its ceiling).

    .venv/bin/python -m bench.actor [--episodes 32] [--seconds 20] [--engine-url URL]

One vLLM server (started here, or `--engine-url`). Actors: a real broker (`python -m broker.server`) and a
real actor process (`python -m actors.actor`) running K episodes (no env latency), with everything an actor
does per step: memory, chat template, engine request and version reads, env step, transition to the broker;
measured by the engine itself (the difference of vLLM's `vllm:generation_tokens_total`) over a window after a
warm-up. Ceiling: the same prompts, read back from the broker's log in the order the actor sent them, each
sent once by K coroutines one request after another (the body `engines.client.EngineClient` sends: token-id
prompts, same sampling, log-probs), after emptying vLLM's prefix cache, so that both paths meet the cache
alike; the rate is the engine's generated tokens over the replay. `EngineClient.generate` replays add the
client's version reads and parsing. The last line is actor / ceiling (target >= 0.90).

Replaying the actor's own prompts matters: every prompt of an episode is new to the engine (a new
observation), while a small fixed pool of prompts is all prefix-cache hits after its first round; measured
here, the fixed pool ran ~5x faster than the actor's own prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from agentstream import config as config_mod
from agentstream.config import Config
from agentstream.wire.addresses import free_port
from bench import harness
from bench.harness import generated_tokens


def window_rate(url: str, warmup_s: float, seconds: float) -> float:
    """Tokens/s the engine generated during `seconds`, after `warmup_s` (blocking; run in a thread)."""
    time.sleep(warmup_s)
    n0, t0 = generated_tokens(url), time.time()
    time.sleep(seconds)
    return (generated_tokens(url) - n0) / (time.time() - t0)


def bench_config(args: argparse.Namespace, model: str, folder: Path) -> Config:
    cfg = Config()
    cfg.run.output_dir = str(folder)
    cfg.model.path = model
    cfg.env.name, cfg.env.group_size, cfg.env.max_steps = args.env, 4, args.max_steps
    cfg.actors.episodes_per_actor = args.episodes
    cfg.sampling.max_tokens = args.max_tokens
    cfg.trainer.max_staleness = 10**6  # nothing trains: admission must never wait for a learner
    cfg.trainer.total_steps = 10**6
    cfg.learner.world_size = 1
    cfg.trainer.groups_per_step = 1
    return cfg


def logged_prompts(run_dir: Path) -> list[list[int]]:
    """Every prompt the actor's transitions carry, in the order the broker logged them (its write-ahead log)."""
    from broker.state import logged_transitions

    return [t.prompt_ids.tolist() for t in logged_transitions(run_dir / "broker-wal")]


async def replay(url: str, cfg: Config, prompts: list[list[int]], concurrency: int, with_client: bool = False) -> float:
    """The ceiling: `concurrency` request loops that send every prompt once, in order, and nothing else
    (`with_client`: through `EngineClient.generate`, the actors' route and parsing). Tokens/s
    generated over the whole replay."""
    import aiohttp

    from engines.client import EngineClient

    await asyncio.to_thread(harness.reset_prefix_cache, url)
    todo = iter(prompts)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        client = EngineClient(url, session, cfg.engines.request_timeout_s)

        async def loop() -> None:
            for prompt in todo:  # shared: each prompt goes out once
                if with_client:
                    await client.generate(prompt, cfg.sampling)
                    continue
                body = client._completion_body(prompt, cfg.sampling, None, client.model)
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    await resp.json()

        n0, t0 = await asyncio.to_thread(generated_tokens, url), time.time()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return (await asyncio.to_thread(generated_tokens, url) - n0) / (time.time() - t0)


def drive_with_actor(url: str, cfg: Config, folder: Path, warmup_s: float, seconds: float) -> float:
    """The real broker and one real actor process with `episodes_per_actor` episodes."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    config_mod.save(cfg, path)
    port = free_port()
    actor_argv = [
        sys.executable,
        "-m",
        "actors.actor",
        "--config",
        str(path),
        "--name",
        "actor-0",
        "--broker",
        f"tcp://127.0.0.1:{port}",
        "--engine",
        url,
    ]
    with (
        harness.started(harness.broker_argv(path, port), folder / "broker.log"),
        harness.started(actor_argv, folder / "actor.log") as actor,
    ):
        n0 = generated_tokens(url)
        deadline = time.monotonic() + 120
        while generated_tokens(url) == n0:  # the actor imports and connects first
            if actor.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the actor did not start generating; see {folder / 'actor.log'}:\n"
                    f"{(folder / 'actor.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)
        return window_rate(url, warmup_s, seconds)


def main() -> None:
    parser = harness.arguments(__doc__, model=True, engine_url=True)
    parser.add_argument("--episodes", type=int, default=32, help="K: concurrent episodes = concurrent requests")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window of the actor path")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before the actor window")
    parser.add_argument("--repeats", type=int, default=1, help="measurements of each path (median reported)")
    parser.add_argument("--max-tokens", type=int, default=32, help="sampling.max_tokens")
    parser.add_argument("--max-steps", type=int, default=8, help="env.max_steps")
    parser.add_argument("--env", default="agentstream/FrozenLake-v0")
    args = parser.parse_args()
    model, folder = harness.begin(
        args.model,
        "bench-actor-",
        about=(
            f"{args.episodes} concurrent episodes/requests, {args.max_tokens} tokens/response, "
            f"{args.seconds:.0f} s actor windows; the ceiling replays the actor's own prompts"
        ),
    )
    cfg = bench_config(args, model, folder)
    print(f"{'path':<28} {'tokens/s':>10}", flush=True)
    direct, actor = [], []
    with harness.vllm_server(model, folder, args.engine_url) as url:
        for i in range(args.repeats):
            run_dir = folder / f"actor-{i}"
            cfg.run.output_dir = str(run_dir)  # the broker's log goes here: the ceiling replays its prompts
            actor.append(drive_with_actor(url, cfg, run_dir, args.warmup, args.seconds))
            print(f"{'actor (+ broker)':<28} {actor[-1]:>10.0f}", flush=True)
            prompts = logged_prompts(run_dir)
            direct.append(asyncio.run(replay(url, cfg, prompts, args.episodes)))
            print(
                f"{'engine driven directly':<28} {direct[-1]:>10.0f}   ({len(prompts)} prompts, "
                f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens)",
                flush=True,
            )
            rate = asyncio.run(replay(url, cfg, prompts, args.episodes, with_client=True))
            print(f"{'EngineClient.generate loops':<28} {rate:>10.0f}", flush=True)
    print(
        harness.ratio_line(
            "actor/ceiling", statistics.median(actor), statistics.median(direct), "tokens/s", target=0.90
        )
    )


if __name__ == "__main__":
    main()
