"""Summary memory: a rule-based summary of all but the last k steps, checked on a hand-made episode."""

import re

from memory_testing import EPISODE, NOW, played

import memory
from memory.history import History
from memory.summary import summarize


def test_summary_of_a_hand_made_episode() -> None:
    msgs = played("summary", k=2).messages(NOW)
    # Steps 1-4 are summarised, 5-6 shown verbatim. Valid moves in 1-4: right (1), down (3), right (4):
    # right x2 first (most used), then down x1. Step 2 is the one invalid answer. Rewards 0+0+0+0.5.
    # Last lines of observations 1-4: (0,0), (0,1), (0,1) again (merged), (1,1). Key steps among the valid
    # ones: step 4 (reward 0 -> 0.5); step 2 is key too but already counted as invalid.
    assert msgs[0] == {"role": "system", "content": "RULES"}
    assert msgs[1]["content"] == (
        "Summary of steps 1-4:\n"
        "Moves: right x2, down x1.\n"
        "Invalid answers: 1 (last: no <action>...</action> tag found).\n"
        "Reward so far: 0.5.\n"
        "Last states: You are at row 0, column 0. -> You are at row 0, column 1. -> You are at row 1, column 1.\n"
        "Notable: step 4 (reward 0 -> 0.5).\n"
        "\n"
        "Recent steps:\n"
        f"Step 5:\n{EPISODE[4][0]}\nYou answered: <action>right</action>\n"
        f"Step 6:\n{EPISODE[5][0]}\nYou answered: <action>down</action>\n"
        "\n"
        f"Now (step 7):\n{NOW}"
    )


def test_summary_before_k_steps_is_last_k() -> None:
    mem = memory.make("summary", k=2)
    mem.reset("RULES")
    mem.record("obs1", "<action>up</action>")
    assert mem.messages("obs2")[1]["content"] == (
        "Recent steps:\nStep 1:\nobs1\nYou answered: <action>up</action>\n\nNow (step 2):\nobs2"
    )


def test_over_the_budget_recent_steps_fold_into_the_summary_first(count, tokenizer) -> None:
    k2, k1 = played("summary", k=2).messages(NOW), played("summary", k=1).messages(NOW)
    assert count(k1) < count(k2)  # step 5 verbatim costs more than its lines in the summary
    mem = played("summary", k=2, tokenizer=tokenizer, max_prompt_tokens=count(k1))
    # room for k=1 but not k=2: step 5 goes into the summary (steps 1-5), nothing is dropped
    assert mem.messages(NOW) == k1 and mem.dropped_steps == 0
    assert k1[1]["content"].startswith("Summary of steps 1-5:\nMoves: right x3, down x1.\n")
    assert "Notable: step 4 (reward 0 -> 0.5); step 5 (found the key).\n" in k1[1]["content"]


def test_a_summary_that_does_not_fit_is_dropped_last(count, tokenizer) -> None:
    bare = [{"role": "system", "content": "RULES"}, {"role": "user", "content": f"Now (step 7):\n{NOW}"}]
    mem = played("summary", k=2, tokenizer=tokenizer, max_prompt_tokens=count(bare))
    # room for the current step only: k folds to 0, and the summary of all six steps is then dropped
    assert mem.messages(NOW) == bare and mem.dropped_steps == 6


def test_summary_stays_short_over_50_steps(play) -> None:
    msgs, _ = play(memory.make("summary", k=2), seed=4)[-1]
    summary = msgs[1]["content"].split("\n\nRecent steps:")[0]
    assert summary.startswith("Summary of steps 1-47:")
    assert len(summary.splitlines()) <= 6 and len(summary) < 500
    # at most 4 states, and they are the newest positions of steps 1..47
    states = re.search(r"^Last states: (.*)$", summary, re.M).group(1).split(" -> ")
    assert 1 <= len(states) <= 4


def test_summarize_lists_at_most_eight_moves_and_counts_the_rest() -> None:
    history = History()
    for i in range(10):  # ten distinct moves, move i used once
        history.record("s", f"<action>m{i}</action>")
    # all used once: ranked by first use; the two last are "other"
    expected = "Moves: " + ", ".join(f"m{i} x1" for i in range(8)) + ", 2 other."
    assert summarize(history.steps).splitlines()[1] == expected
