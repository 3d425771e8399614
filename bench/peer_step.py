"""One optimizer step on the same completions: agentstream's learner (`learner.step.train_step`, the loss, advantages,
clipping and AdamW of a run at the defaults) against TRL's `GRPOTrainer`, to tell a difference in the algorithm's
numbers from one in sampling (issue 38, item 4: at staleness 0 both run GRPO; a per-sample gap between them is
either in these numbers or in the samples).

    .venv/bin/python -m bench.peer_step [--seed 0] [--batch 64] [--lr 1e-3] [--keep DIR] [OVERRIDES...]

The batch: `bench.peer --learn`'s warm start and questions (seed `--seed`), `--batch` / 8 prompts, 8 completions
each sampled here with HF `generate` (temperature 1.0, no top-k, 32 tokens; cut after the first EOS, as TRL cuts
its own), each scored by `bench.peer_trl.score` (the last `<answer>` by reasoning-gym's verifier; the invalid
penalty without one). Then from the same weights:
- TRL (`bench.peer_trl --completions`, in the peer venv): one `trainer.train()` step whose generation is replaced
  by these completions; everything after it (reward, advantages, masks, loss, clipping, AdamW) is TRL's own;
- agentstream: one `train_step` on one gloo rank (FSDP2) on the same tokens and rewards, its behaviour log-probs
  the learner's own (the engine's agree to 3e-7 on the same weights, docs/benchmarks.md), with the config's
  algorithm and learner settings (`OVERRIDES`: `key=value` over them, e.g. `algorithm.loss_agg=seq-mean-token-mean`).

Printed: each side's loss and gradient norm before clipping, the clipped gradients compared (cosine, relative L2
difference, the parameter that differs most) and the two steps' weight updates compared; the relative L2
difference of the gradients last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import torch

from agentstream.config import REPO_ROOT, Config
from bench import harness
from bench.peer_learn import LEARN_KWARGS, warm_model
from bench.peer_run import Workload, invalid_penalty, peer_python, write_prompts
from bench.peer_trl import score


def sample(model: Any, prompts: list[dict[str, Any]], w: Workload, seed: int) -> list[list[list[int]]]:
    """`w.group_size` completions per prompt from HF `generate` on `model` (as TRL samples: temperature, no top-k),
    each cut after its first EOS."""
    torch.manual_seed(seed)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    for row in prompts:
        ids = torch.tensor([row["prompt_ids"]])
        with torch.no_grad():
            seqs = model.generate(
                ids,
                do_sample=True,
                temperature=w.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=w.max_tokens,
                num_return_sequences=w.group_size,
                pad_token_id=next(iter(eos)),
            )
        group = []
        for s in seqs[:, ids.shape[1] :].tolist():
            cut = next((i + 1 for i, t in enumerate(s) if t in eos), len(s))
            group.append(s[:cut])
        out.append(group)
    return out


def make_batch(prompts: list[dict[str, Any]], completions: list[list[list[int]]], rewards: list[list[float]]) -> Any:
    """The learner's columnar batch of single-step trajectories, group by group (behaviour log-probs filled later)."""
    from agentstream.wire.messages import Batch

    p_ids, r_ids, cols = [], [], {k: [] for k in ("group", "traj", "plen", "rlen", "reward")}
    for g, (row, group, rs) in enumerate(zip(prompts, completions, rewards, strict=True)):
        for c, r in zip(group, rs, strict=True):
            p_ids += row["prompt_ids"]
            r_ids += c
            for k, v in (
                ("group", g),
                ("traj", len(cols["traj"])),
                ("plen", len(row["prompt_ids"])),
                ("rlen", len(c)),
                ("reward", r),
            ):
                cols[k].append(v)
    n = len(cols["traj"])
    i32 = lambda k: np.asarray(cols[k], dtype=np.int32)  # noqa: E731
    return Batch(
        step=0,
        rank=0,
        learner_version=0,
        group_size=len(completions[0]),
        group_index=i32("group"),
        traj_index=i32("traj"),
        step_index=np.zeros(n, np.int32),
        prompt_lens=i32("plen"),
        response_lens=i32("rlen"),
        rewards=np.asarray(cols["reward"], np.float32),
        dones=np.ones(n, bool),
        valid=np.ones(n, bool),
        version_lo=np.zeros(n, np.int32),
        version_hi=np.zeros(n, np.int32),
        prompt_ids=np.asarray(p_ids, np.int32),
        response_ids=np.asarray(r_ids, np.int32),
        logprobs=np.zeros(len(r_ids), np.float32),
        anchors=[""] * n,
    )


def agentstream_step(model_dir: str, batch: Any, cfg: Config) -> dict[str, Any]:
    """One `train_step` as a learner rank runs it (one gloo rank, FSDP2, the run's AdamW): the metrics, the gradients
    the optimizer got (after clipping) and the weights after the step."""
    import dataclasses

    import torch.distributed as dist

    from agentstream.wire.addresses import free_port
    from learner.batching import Sequences, make_micro_batches
    from learner.model import init_distributed, load_policy, token_logprobs, trainable_parameters
    from learner.step import StepOptions, train_step

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = init_distributed("gloo")[2]
    try:
        model = load_policy(model_dir, "float32", device, 1)
        seqs = Sequences.from_batch(batch)
        behav = np.zeros(seqs.num_response_tokens, np.float32)
        with torch.no_grad():  # the behaviour log-probs: the learner's own (an engine on the same weights)
            for mb in make_micro_batches(seqs, torch.zeros(seqs.num_transitions), cfg.learner.micro_batch_tokens):
                behav[mb.token_index[mb.mask].numpy()] = token_logprobs(model, mb)[0][mb.mask].numpy()
        grads: dict[str, torch.Tensor] = {}

        class Recording(torch.optim.AdamW):
            def step(self, closure: Any = None) -> Any:
                grads.update({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
                return super().step(closure)

        lcfg = cfg.learner
        optimizer = Recording(
            trainable_parameters(model),
            lr=lcfg.lr,
            betas=tuple(lcfg.betas),
            eps=lcfg.eps,
            weight_decay=lcfg.weight_decay,
        )
        metrics = train_step(
            model,
            optimizer,
            dataclasses.replace(batch, logprobs=behav),
            StepOptions.from_config(lcfg, cfg.algorithm),
            version=0,
            world_size=1,
            device=device,
        )
        return {"metrics": metrics, "grads": grads, "weights": {n: full(p) for n, p in model.named_parameters()}}
    finally:
        dist.destroy_process_group()


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a (possibly FSDP2-sharded) parameter or gradient."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float, str, float]:
    """(cosine, relative L2 difference |a - b| / |b| over all parameters, the parameter with the largest relative
    difference, that difference); fails when the two name different parameters."""
    if set(a) != set(b):
        raise RuntimeError(f"the two sides name different parameters: {sorted(set(a) ^ set(b))[:6]}")
    names = sorted(b)
    va = torch.cat([a[n].double().flatten() for n in names])
    vb = torch.cat([b[n].double().flatten() for n in names])
    worst = max(names, key=lambda n: float((a[n] - b[n]).double().norm() / (b[n].double().norm() + 1e-30)))
    worst_rel = float((a[worst] - b[worst]).double().norm() / (b[worst].double().norm() + 1e-30))
    cos = float(va @ vb / (va.norm() * vb.norm() + 1e-30))
    return cos, float((va - vb).norm() / (vb.norm() + 1e-30)), worst, worst_rel


def main() -> None:
    parser = harness.arguments(__doc__, model=False)
    parser.add_argument("--seed", type=int, default=0, help="the questions' seed (bench.peer --learn's seed)")
    parser.add_argument("--batch", type=int, default=64, help="completions in the step (8 per prompt)")
    parser.add_argument("--lr", type=float, default=Workload.lr)
    parser.add_argument("--keep", default="", help="keep the files here (default: a temporary folder)")
    parser.add_argument("override", nargs="*", help="key=value over agentstream's config (algorithm.*, learner.*)")
    args = parser.parse_args()
    folder = harness.begin("", "bench-peer-step-", args.keep)[1]
    model = str(warm_model(folder / "warm-start.log"))
    w = Workload(model, args.batch, 1, dataset_kwargs=LEARN_KWARGS, seed=args.seed, lr=args.lr)
    write_prompts(w, folder / "prompts.jsonl")
    prompts = [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines()][: w.groups]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}  # the weights both steps start from
    completions = sample(hf, prompts, w, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    kwargs = json.dumps(LEARN_KWARGS, sort_keys=True)
    rewards = [
        [
            score(tokenizer.decode(c, skip_special_tokens=True), row["dataset"], row["seed"], kwargs, invalid_penalty())
            for c in group
        ]
        for row, group in zip(prompts, completions, strict=True)
    ]
    with (folder / "completions.jsonl").open("w") as f:
        for row, group in zip(prompts, completions, strict=True):
            f.write(json.dumps({"prompt_ids": row["prompt_ids"], "completions": group}) + "\n")
    flat = [r for rs in rewards for r in rs]
    lengths = [len(c) for group in completions for c in group]
    group_std = [float(np.std(rs)) for rs in rewards]
    print(
        f"# seed {args.seed}: {w.groups} prompts x {w.group_size} completions from {model}; mean reward "
        f"{np.mean(flat):+.4f}, {np.mean(lengths):.1f} tokens, {sum(s == 0 for s in group_std)} groups with equal "
        f"rewards; lr {args.lr:g}; files in {folder}",
        flush=True,
    )

    with (folder / "peer-venv.log").open("w") as log:
        python, _ = peer_python(log)
    argv = [
        str(python),
        "-m",
        "bench.peer_trl",
        "--prompts",
        str(folder / "prompts.jsonl"),
        "--model",
        model,
        "--out",
        str(folder / "trl-out"),
        "--batch",
        str(w.batch),
        "--steps",
        "1",
        "--group-size",
        str(w.group_size),
        "--max-tokens",
        str(w.max_tokens),
        "--temperature",
        str(w.temperature),
        "--lr",
        str(w.lr),
        "--invalid-penalty",
        str(invalid_penalty()),
        "--seed",
        str(args.seed),
        "--completions",
        str(folder / "completions.jsonl"),
        "--dump",
        str(folder / "trl.pt"),
    ]
    with (folder / "trl.log").open("w") as log:
        if subprocess.run(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(
                f"the TRL step failed; {folder / 'trl.log'} ends:\n{(folder / 'trl.log').read_text()[-3000:]}"
            )
    trl = torch.load(folder / "trl.pt")
    trl_reward = next(
        json.loads(line)["reward_mean"]
        for line in (folder / "trl.log").read_text().splitlines()
        if line.startswith('{"event": "log"')
    )

    from bench.peer_run import compose, workload_overrides

    cfg = compose([*workload_overrides(w), *args.override])
    ours = agentstream_step(model, make_batch(prompts, completions, rewards), cfg)
    torch.save(ours, folder / "agentstream.pt")
    m = ours["metrics"]
    print(f"# mean reward of the step: TRL {trl_reward:+.4f}, agentstream {m.get('reward_mean', np.mean(flat)):+.4f}")
    print(f"# loss: TRL {trl['logs'].get('loss', float('nan')):+.6f}, agentstream {m['loss']:+.6f}")
    print(
        f"# gradient norm before clipping: TRL {trl['logs'].get('grad_norm', float('nan')):.6f}, agentstream "
        f"{m['grad_norm']:.6f}"
    )
    cos, rel, worst, worst_rel = compare(ours["grads"], trl["grads"])
    print(f"# clipped gradients: cosine {cos:.6f}; the parameter that differs most: {worst} ({worst_rel:.2e})")
    ucos, urel, uworst, uworst_rel = compare(
        {n: ours["weights"][n] - before[n] for n in before}, {n: trl["weights"][n] - before[n] for n in before}
    )
    print(
        f"# the step's weight updates: cosine {ucos:.6f}, relative L2 difference {urel:.2e}; most: {uworst} "
        f"({uworst_rel:.2e})"
    )
    print(f"relative L2 difference of the clipped gradients, agentstream vs TRL: {rel:.2e}")


if __name__ == "__main__":
    sys.exit(main())
