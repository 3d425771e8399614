"""Actor overhead: generated tokens/s the actors reach versus the same engine driven directly (its ceiling).

    .venv/bin/python scripts/bench_actor.py [--episodes 32] [--seconds 20] [--engine-url URL]

One vLLM server (started here, or `--engine-url`). Ceiling: K coroutines, each sending the engine one
`/v1/completions` request after another (the body `engines.client.EngineClient` sends: token-id prompts,
same sampling, log-probs), with prompts the actor's own memory and chat template build for the env. Actors:
a real broker (`python -m broker.server`) and a real actor process (`python -m actors.actor`) running K
episodes (no env latency), with everything an actor does per step: memory, chat template, engine request
and version reads, env step, transition to the broker. Both are measured by the engine itself: the
difference of vLLM's `vllm:generation_tokens_total` over the same wall time, after a warm-up. The paths
run one after the other, alternating (`--repeats`). The last line is actor / ceiling (target >= 0.90).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentstream import config as config_mod
from agentstream.config import Config
from agentstream.procs import free_port, start, stop
from scripts.bench_async import vllm_server


def generated_tokens(url: str) -> float:
    """The engine's own count of generated tokens so far (Prometheus counter)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=60).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


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


def actor_prompts(cfg: Config, n: int) -> list[list[int]]:
    """Prompts as the actor builds them (memory + chat template) for the first steps of `n` episodes."""
    from transformers import AutoTokenizer

    import envs
    import memory

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    rng = random.Random(0)
    out = []
    for seed in range(n):
        env = envs.make(cfg.env.name, max_steps=cfg.env.max_steps, **cfg.env.kwargs)
        mem = memory.make(cfg.memory.kind, k=cfg.memory.k, max_events=cfg.memory.max_events, tokenizer=tok,
                          max_prompt_tokens=cfg.engines.max_model_len - cfg.sampling.max_tokens)
        obs, info = env.reset(seed=seed)
        mem.reset(env.instructions)
        for _ in range(rng.randint(0, 3)):  # some prompts carry history, as later steps' do
            answer = f"<action>{rng.choice(info.get('admissible_actions') or ['noop'])}</action>"
            nxt, reward, term, trunc, info = env.step(answer)
            mem.record(obs, answer, reward=float(reward), info=info)
            obs = nxt
            if term or trunc:
                break
        out.append(list(tok.apply_chat_template(mem.messages(obs), add_generation_prompt=True, tokenize=True,
                                                return_dict=False)))
        env.close()
    return out


async def drive_directly(url: str, cfg: Config, prompts: list[list[int]], concurrency: int, warmup_s: float,
                         seconds: float, with_client: bool = False) -> float:
    """The ceiling: `concurrency` request loops on the engine, nothing else. `with_client`: each loop calls
    `EngineClient.generate` instead (adds its version reads and parsing): the client's share of the overhead."""
    import aiohttp

    from engines.client import EngineClient

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        client = EngineClient(url, session, cfg.engines.request_timeout_s)

        async def loop(i: int) -> None:
            k = i
            while with_client:
                await client.generate(prompts[k % len(prompts)], cfg.sampling)
                k += concurrency
            while True:
                body = client._completion_body(prompts[k % len(prompts)], cfg.sampling, None, client.model)
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    await resp.json()
                k += concurrency

        tasks = [asyncio.create_task(loop(i)) for i in range(concurrency)]
        try:
            return await asyncio.to_thread(window_rate, url, warmup_s, seconds)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def drive_with_actor(url: str, cfg: Config, folder: Path, warmup_s: float, seconds: float) -> float:
    """The real broker and one real actor process with `episodes_per_actor` episodes."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    config_mod.save(cfg, path)
    port = free_port()
    broker = start([sys.executable, "-m", "broker.server", "--config", str(path), "--port", str(port),
                    "--dashboard-port", str(free_port())], folder / "broker.log", cwd=ROOT)
    actor = start([sys.executable, "-m", "actors.actor", "--config", str(path), "--name", "actor-0",
                   "--broker", f"tcp://127.0.0.1:{port}", "--engine", url], folder / "actor.log", cwd=ROOT)
    try:
        n0 = generated_tokens(url)
        deadline = time.monotonic() + 120
        while generated_tokens(url) == n0:  # the actor imports and connects first
            if actor.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the actor did not start generating; see {folder / 'actor.log'}:\n"
                                   f"{(folder / 'actor.log').read_text()[-2000:]}")
            time.sleep(0.5)
        return window_rate(url, warmup_s, seconds)
    finally:
        stop(actor, 10)
        stop(broker, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=32, help="K: concurrent episodes = concurrent requests")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window of each path")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before each window")
    parser.add_argument("--repeats", type=int, default=1, help="measurements of each path (median reported)")
    parser.add_argument("--max-tokens", type=int, default=32, help="sampling.max_tokens")
    parser.add_argument("--max-steps", type=int, default=8, help="env.max_steps")
    parser.add_argument("--env", default="agentstream/FrozenLake-v0")
    parser.add_argument("--model", default="", help="model directory (default: the tiny local model)")
    parser.add_argument("--engine-url", default="", help="use this running vLLM server instead of starting one")
    args = parser.parse_args()
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the servers this script started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from agentstream.config import TINY_MODEL_DIR
    from agentstream.tiny_model import ensure_tiny_model

    model = args.model or str(ensure_tiny_model(TINY_MODEL_DIR))
    folder = Path(tempfile.mkdtemp(prefix="bench-actor-"))
    cfg = bench_config(args, model, folder)
    prompts = actor_prompts(cfg, 64)
    print(f"# load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other work on the machine slows every path; compare ratios within one run)", flush=True)
    print(f"# {args.episodes} concurrent episodes/requests, {args.max_tokens} tokens/response, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.seconds:.0f} s windows", flush=True)
    print(f"{'path':<28} {'tokens/s':>10}", flush=True)
    direct, actor = [], []
    with vllm_server(model, folder, args.engine_url or None) as url:
        for i in range(args.repeats):
            direct.append(asyncio.run(drive_directly(url, cfg, prompts, args.episodes, args.warmup, args.seconds)))
            print(f"{'engine driven directly':<28} {direct[-1]:>10.0f}", flush=True)
            rate = asyncio.run(drive_directly(url, cfg, prompts, args.episodes, args.warmup, args.seconds, True))
            print(f"{'EngineClient.generate loops':<28} {rate:>10.0f}", flush=True)
            actor.append(drive_with_actor(url, cfg, folder / f"actor-{i}", args.warmup, args.seconds))
            print(f"{'actor (+ broker)':<28} {actor[-1]:>10.0f}", flush=True)
    ratio = statistics.median(actor) / statistics.median(direct)
    print(f"actor/ceiling: {ratio:.2f} ({statistics.median(actor):.0f} / {statistics.median(direct):.0f} tokens/s; "
          f"target >= 0.90)")


if __name__ == "__main__":
    main()
