"""Last-k memory keeps exactly the last k steps and the instructions."""

import re

import memory


def test_last_k_keeps_the_last_k_steps() -> None:
    mem = memory.make("last_k", k=2)
    mem.reset("RULES")
    for i in range(5):
        mem.record(f"obs{i}", f"act{i}")
    msgs = mem.messages("obs5")
    assert msgs[0] == {"role": "system", "content": "RULES"}
    user = msgs[1]["content"]
    # steps 1..5 recorded obs0..obs4; the last two are steps 4 and 5 (obs3, obs4); step 6 is asked for
    assert user == (
        "Recent steps:\nStep 4:\nobs3\nYou answered: act3\nStep 5:\nobs4\nYou answered: act4\n\nNow (step 6):\nobs5"
    )


def test_k_zero_shows_only_the_current_observation() -> None:
    mem = memory.make("last_k", k=0)
    mem.reset("R")
    mem.record("old", "a")
    assert mem.messages("new")[1]["content"] == "Now (step 2):\nnew"


def test_last_k_over_a_50_step_episode_shows_exactly_the_previous_k_steps(play) -> None:
    for step, (msgs, obs) in enumerate(play(memory.make("last_k", k=3), seed=1), start=1):
        shown = [int(n) for n in re.findall(r"^Step (\d+):$", msgs[1]["content"], re.M)]
        assert shown == list(range(max(1, step - 3), step)), f"step {step}"
        assert msgs[1]["content"].endswith(f"Now (step {step}):\n{obs}")


def test_unknown_memory_lists_known_ones() -> None:
    try:
        memory.make("nope")
    except KeyError as exc:
        assert all(kind in str(exc) for kind in ("full", "key_events", "last_k", "summary"))
    else:
        raise AssertionError("expected KeyError")
