"""Has a FrozenLake run learnt to read the holes? From its broker's log: on states where exactly one of right/down
is a hole, the share of the moves that took the safe one, per ten versions.

    .venv/bin/python -m bench.safe_moves RUN_DIR MODEL_DIR [--bucket 10]

RUN_DIR is a finished (or running) run of FrozenLake with the local view (`+env.kwargs.view=local`, whose anchors
name the four neighbours); MODEL_DIR its model (for the tokenizer). Per bucket of versions (the newest version
that may have produced the answer): the decisions counted, the shares of safe, hole and other moves (left, up,
invalid), and safe / (safe + hole): 0.5 is moving right or down at random, near 1 reads the holes. Transitions
compacted out of the log are not counted.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

from bench import harness


def main() -> None:
    p = harness.arguments(__doc__)
    p.add_argument("run_dir")
    p.add_argument("model_dir")
    p.add_argument("--bucket", type=int, default=10, help="versions per line")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from broker.state import logged_transitions
    from broker.wal import FOLDER
    from envs.base import Action
    from envs.frozenlake import ACTIONS, parse_action

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    counts: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for t in logged_transitions(Path(args.run_dir) / FOLDER):
        m = re.search(r"down (\w+), right (\w+)", t.anchor)
        if not m or (m.group(1) == "hole") == (m.group(2) == "hole"):
            continue  # not the local view, or both or neither of right/down a hole
        safe = "right" if m.group(1) == "hole" else "down"
        parsed = parse_action(tok.decode(t.response_ids, skip_special_tokens=True))
        move = ACTIONS[parsed.value] if isinstance(parsed, Action) else ""
        kind = "safe" if move == safe else "hole" if move in ("down", "right") else "other"
        counts[t.version_hi // args.bucket][kind] += 1
    if not counts:
        raise SystemExit(f"no local-view FrozenLake decision with one of right/down a hole in {args.run_dir}'s log")
    for b in sorted(counts):
        c = counts[b]
        n = sum(c.values())
        print(
            f"v{b * args.bucket}-{b * args.bucket + args.bucket - 1}: {n} decisions, safe {c['safe'] / n:.2f}, "
            f"hole {c['hole'] / n:.2f}, other {c['other'] / n:.2f}; "
            f"safe/(safe+hole) {c['safe'] / max(1, c['safe'] + c['hole']):.2f}"
        )


if __name__ == "__main__":
    main()
