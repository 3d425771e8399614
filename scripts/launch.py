"""Start a whole agentstream run (broker, vLLM engines + weight sidecars, FSDP2 learner, actors), or join one.

    .venv/bin/python scripts/launch.py                                  # the default job: tiny model, CPU
    .venv/bin/python scripts/launch.py trainer.total_steps=10 actors.count=4
    .venv/bin/python scripts/launch.py preset=gpu_one model.path=/models/Qwen2.5-0.5B-Instruct
    .venv/bin/python scripts/launch.py role=actors broker.address=tcp://HOST:PORT actors.count=4
    .venv/bin/python scripts/launch.py role=engines broker.address=tcp://HOST:PORT engines.count=1
    .venv/bin/python scripts/launch.py --cfg job                        # print the composed config (values)
    .venv/bin/python scripts/launch.py --fields [PREFIX]                # every field: default, type, meaning

Presets (`conf/preset/`): cpu_tiny (default), gpu_one, multi_node. Algorithms (`conf/algorithm/`): grpo
(default), gigpo, ppo, ... Every field is described in agentstream/config.py; `--fields` lists them.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from agentstream import config as config_mod
from launcher.run import run

config_mod.register_schemas()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    cfg.run.output_dir = str(run_dir)
    try:
        typed = config_mod.to_object(cfg)
    except Exception as exc:  # OmegaConf's validation errors name the key and the expected type
        print(f"[agentstream] invalid config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(run(typed, run_dir))


def print_fields(argv: list[str]) -> None:
    """`--fields [PREFIX]`: Hydra's --cfg shows values only; this shows what each field means."""
    from launcher.describe import field_docs, render

    i = argv.index("--fields")
    prefix = argv[i + 1] if len(argv) > i + 1 and not argv[i + 1].startswith("-") else ""
    print(render(field_docs(), prefix))


def role_shorthand(argv: list[str]) -> list[str]:
    """`argv` with the short keys spelled out: `role=actors` is `run.role=actors` (the field lives in
    RunConfig) and `logger=[jsonl,wandb]` is `broker.logger=[jsonl,wandb]` (verl users know trainer.logger)."""
    fields = {"role=": "run.role=", "logger=": "broker.logger="}
    out = []
    for a in argv:
        short = next((k for k in fields if a.startswith(k)), None)
        out.append(fields[short] + a.removeprefix(short) if short else a)
    return out


if __name__ == "__main__":
    if "--fields" in sys.argv:
        print_fields(sys.argv)
    else:
        sys.argv = role_shorthand(sys.argv)
        main()
