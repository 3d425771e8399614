"""Gateway overhead: generated tokens/s through the gateway with the real `openai` client at K concurrent episodes,
versus the same engine driven directly with the same prompts at the same concurrency (its ceiling).

    .venv/bin/python -m bench.gateway [--episodes 32] [--rounds 4] [--turns 3] [--engine-url URL]

One vLLM server (started here, or `--engine-url`), a real broker (`python -m broker.server`) and a real gateway
(`python -m gateway`). Gateway path: K episodes at once (one `openai.AsyncOpenAI` client on one event loop,
each episode's calls under its own key; open and finish as the two POSTs of gateway/episode_client.py), each a
chat of --turns calls (the answer goes back, then a new user message: every later prompt extends the previous one
token-exactly); --rounds episodes per lane, G per task id (one group). Ceiling: the same `openai` client on the
engine's own /v1/completions, every prompt the gateway sent (token ids, read back from the broker's log in its
order) sent once by K request loops, asking what the gateway asks of the engine; then, for reference, the same
prompts as raw HTTP bodies (`EngineClient`'s, aiohttp), without the openai client, and through
`EngineClient.generate` (adding the version reads before and after, as the gateway's calls do). vLLM's prefix cache
is emptied before each path. Rates are the engine's own count of generated tokens (`vllm:generation_tokens_total`)
over the path's wall time. The CPU seconds the gateway, the broker and the agent side used meanwhile are printed
beside the gateway's rate: where the engine is CPU-bound (this machine), they are what the path takes from it. The
last line is gateway / ceiling, medians of --repeats alternating measurements (target >= 0.85).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from agentstream import config as config_mod
from agentstream.config import Config
from agentstream.wire.addresses import free_port
from bench import harness
from bench.actor import logged_prompts, replay
from bench.harness import cpu_s, generated_tokens, reset_prefix_cache

G = 4  # episodes per task id: one group


def bench_config(args: argparse.Namespace, model: str, folder: Path) -> Config:
    cfg = Config()
    cfg.run.output_dir = str(folder)  # the broker's log goes here: the ceiling replays its prompts
    cfg.model.path = model
    cfg.env.group_size = G
    cfg.sampling.max_tokens, cfg.sampling.temperature = args.max_tokens, 1.0
    cfg.trainer.max_staleness = 10**6  # nothing trains: admission must never wait for a learner
    cfg.trainer.total_steps = 10**6
    cfg.learner.world_size, cfg.trainer.groups_per_step = 1, 1
    return cfg


async def play(http, client, gateway: str, task_id: str, turns: int, max_tokens: int) -> None:
    """One episode: open it, `turns` chat calls (each answer sent back with a new user message), finish it. As
    agent code that reuses its clients does: one `openai.AsyncOpenAI` for every episode, this one's key per call
    (the gateway's `/v1` route names the episode by its bearer key); open and finish are the two plain POSTs
    gateway/episode_client.py makes, here on an async HTTP client."""
    resp = await http.post(f"{gateway}/episodes", json={"task_id": task_id})
    resp.raise_for_status()
    ep = resp.json()
    episode = client.with_options(api_key=ep["api_key"])
    messages = [{"role": "user", "content": f"Task {task_id}: describe the next move in a few words."}]
    for turn in range(turns):
        r = await episode.chat.completions.create(
            model="policy", messages=messages, max_tokens=max_tokens, temperature=1.0
        )
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content or ""},
            {"role": "user", "content": f"Step {turn + 1} done. And then?"},
        ]
    (await http.post(f"{gateway}/episodes/{ep['id']}/finish", json={"reward": 0.0})).raise_for_status()


async def drive_gateway(
    gateway: str, engine: str, episodes: int, rounds: int, turns: int, max_tokens: int, pids: dict[str, int]
) -> tuple[float, dict[str, float]]:
    """K = `episodes` lanes, each playing `rounds` episodes one after another; G lanes share each task id.
    Returns tokens/s and the CPU seconds each process of the path used meanwhile (this one: the agent side)."""
    import httpx
    import openai

    async def lane(i: int) -> None:
        for r in range(rounds):
            await play(http, client, gateway, f"r{r}-t{i // G}", turns, max_tokens)

    limits = httpx.Limits(max_connections=4 * episodes, max_keepalive_connections=4 * episodes)
    async with (
        httpx.AsyncClient(timeout=600, limits=limits) as http,
        openai.AsyncOpenAI(
            base_url=f"{gateway}/v1",
            api_key="-",
            max_retries=0,
            http_client=httpx.AsyncClient(timeout=600, limits=limits),
        ) as client,
    ):
        await asyncio.to_thread(reset_prefix_cache, engine)
        pids = {**pids, "agent (openai client)": os.getpid()}
        c0 = {name: cpu_s(pid) for name, pid in pids.items()}
        n0, t0 = await asyncio.to_thread(generated_tokens, engine), time.time()
        await asyncio.gather(*(lane(i) for i in range(episodes)))
        rate = (await asyncio.to_thread(generated_tokens, engine) - n0) / (time.time() - t0)
        return rate, {name: cpu_s(pid) - c0[name] for name, pid in pids.items()}


async def replay_openai(engine: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> float:
    """The ceiling with the agent's own client: `concurrency` loops of `openai.AsyncOpenAI` on the engine's
    /v1/completions, each prompt (token ids) sent once, in order, with what the gateway asks of the engine (the
    same sampling, the sampled tokens' log-probs, their ids). Tokens/s generated over the whole replay."""
    import httpx
    import openai

    await asyncio.to_thread(reset_prefix_cache, engine)
    todo = iter(prompts)
    limits = httpx.Limits(max_connections=2 * concurrency, max_keepalive_connections=2 * concurrency)
    async with openai.AsyncOpenAI(
        base_url=f"{engine}/v1", api_key="-", max_retries=0, http_client=httpx.AsyncClient(timeout=600, limits=limits)
    ) as client:

        async def loop() -> None:
            for prompt in todo:  # shared: each prompt goes out once
                await client.completions.create(
                    model="policy",
                    prompt=prompt,
                    max_tokens=max_tokens,
                    temperature=1.0,
                    top_p=1.0,
                    logprobs=0,
                    extra_body={"return_token_ids": True},
                )

        n0, t0 = await asyncio.to_thread(generated_tokens, engine), time.time()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return (await asyncio.to_thread(generated_tokens, engine) - n0) / (time.time() - t0)


def main() -> None:
    parser = harness.arguments(__doc__, model=True, engine_url=True)
    parser.add_argument("--episodes", type=int, default=32, help="K: concurrent episodes = concurrent requests")
    parser.add_argument("--rounds", type=int, default=4, help="episodes each lane plays, one after another")
    parser.add_argument("--turns", type=int, default=3, help="chat calls per episode")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every call")
    parser.add_argument("--repeats", type=int, default=5, help="measurements of each path, alternating (medians)")
    args = parser.parse_args()
    if args.episodes % G:
        parser.error(f"--episodes must be a multiple of {G} (whole groups)")
    model, folder = harness.begin(
        args.model,
        "bench-gateway-",
        about=(
            f"{args.episodes} concurrent episodes/requests, {args.rounds} rounds x {args.turns} calls, "
            f"{args.max_tokens} tokens/response; the ceiling replays the gateway's own prompts"
        ),
    )
    cfg = bench_config(args, model, folder)
    print(f"{'path':<32} {'tokens/s':>10}", flush=True)
    through, direct = [], []
    with harness.vllm_server(model, folder, args.engine_url) as engine:
        # A fresh vLLM server's first batches are slower: warm it at this concurrency and these prompt lengths
        # first, or the first path measured (the gateway's) pays for it.
        warm = [[3 + i % 200 for i in range(n)] for n in range(40, 152, 4)] * max(1, args.episodes // 8)
        asyncio.run(replay_openai(engine, warm, args.episodes, args.max_tokens))
        for i in range(args.repeats):  # the paths alternate: a change of load on the machine hits both
            run_dir = folder / f"gateway-{i}"  # its broker's log: the prompts the ceiling replays
            through.append(gateway_path(args, cfg, run_dir, engine))
            prompts = logged_prompts(run_dir)
            direct.append(asyncio.run(replay_openai(engine, prompts, args.episodes, args.max_tokens)))
            print(
                f"{'engine driven directly':<32} {direct[-1]:>10.0f}   ({len(prompts)} prompts, "
                f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens; the same openai client)",
                flush=True,
            )
        raw = asyncio.run(replay(engine, cfg, prompts, args.episodes))
        print(f"{'engine, raw HTTP (aiohttp)':<32} {raw:>10.0f}   (the same prompts; no openai client)", flush=True)
        versioned = asyncio.run(replay(engine, cfg, prompts, args.episodes, with_client=True))
        print(
            f"{'EngineClient.generate loops':<32} {versioned:>10.0f}   (the gateway's engine client and route: "
            f"/inference/v1/generate)",
            flush=True,
        )
    print(
        harness.ratio_line(
            "gateway/ceiling",
            statistics.median(through),
            statistics.median(direct),
            "tokens/s",
            target=0.85,
            note=f"medians of {args.repeats}",
        )
    )


def gateway_path(args: argparse.Namespace, cfg: Config, run_dir: Path, engine: str) -> float:
    """A real broker and gateway process for this run; the K lanes through them. Prints and returns tokens/s."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run.output_dir = str(run_dir)
    path = run_dir / "config.yaml"
    config_mod.save(cfg, path)
    port, gw_port = free_port(), free_port()
    gw_argv = [
        sys.executable,
        "-m",
        "gateway",
        "--config",
        str(path),
        "--name",
        "gateway-0",
        "--broker",
        f"tcp://127.0.0.1:{port}",
        "--engine",
        engine,
        "--port",
        str(gw_port),
    ]
    # leaving the block stops the gateway first: it drains, every transition is in the broker's log before it stops
    with (
        harness.started(harness.broker_argv(path, port), run_dir / "broker.log") as broker,
        harness.started(gw_argv, run_dir / "gateway.log") as gw,
    ):
        url = f"http://127.0.0.1:{gw_port}"
        harness.wait_healthy(f"{url}/health", gw, run_dir / "gateway.log", "the gateway")
        # the gateway answers /health whether or not its broker is up: without one, the first episode gets 429
        harness.wait_listening(port, "the broker", proc=broker, log=run_dir / "broker.log")
        rate, cpu = asyncio.run(
            drive_gateway(
                url,
                engine,
                args.episodes,
                args.rounds,
                args.turns,
                args.max_tokens,
                {"gateway": gw.pid, "broker": broker.pid},
            )
        )
        print(
            f"{'gateway (openai client)':<32} {rate:>10.0f}   (CPU s meanwhile: "
            f"{', '.join(f'{k} {v:.1f}' for k, v in cpu.items())})",
            flush=True,
        )
        return rate


if __name__ == "__main__":
    main()
