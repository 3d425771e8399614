"""Key-events memory, and what makes a step key, checked on the hand-made episode in memory_testing."""

from memory_testing import EPISODE, NOW, played

from memory.history import action_name, key_event_reason


def test_key_events_of_a_hand_made_episode() -> None:
    user = played("key_events", k=2).messages(NOW)[1]["content"]
    # Steps 1-4 are older than the last 2. Key among them: step 2 (invalid answer) and step 4 (reward 0 -> 0.5);
    # steps 1 and 3 (valid, reward unchanged at 0) are not. Steps 5-6 are the recent ones: step 5 was marked by
    # the env ("found the key"), step 6 is plain (reward 0 after 0: unchanged).
    assert user == (
        "Key events:\n"
        f"Step 2 (invalid answer):\n{EPISODE[1][0]}\nYou answered: I think up\n"
        f"Step 4 (reward 0 -> 0.5):\n{EPISODE[3][0]}\nYou answered: <action>right</action>\n"
        "\n"
        "Recent steps:\n"
        f"Step 5 (found the key):\n{EPISODE[4][0]}\nYou answered: <action>right</action>\n"
        f"Step 6:\n{EPISODE[5][0]}\nYou answered: <action>down</action>\n"
        "\n"
        f"Now (step 7):\n{NOW}"
    )


def test_max_events_keeps_the_newest_key_steps() -> None:
    user = played("key_events", k=2, max_events=1).messages(NOW)[1]["content"]
    assert "Step 2 (" not in user and "Step 4 (reward 0 -> 0.5):" in user


def test_key_events_under_a_budget_drop_the_oldest_event_first(count, tokenizer) -> None:
    whole = played("key_events", k=2).messages(NOW)
    mem = played("key_events", k=2, tokenizer=tokenizer, max_prompt_tokens=count(whole) - 1)
    user = mem.messages(NOW)[1]["content"]
    assert "Step 2 (" not in user and "Step 4 (" in user and "Step 5 (" in user and "Step 6:" in user
    assert mem.dropped_steps == 1


def test_what_makes_a_step_key() -> None:
    assert key_event_reason(0.0, 0.0, {"valid": True}) == ""
    assert key_event_reason(-0.1, -0.1, {"valid": True}) == ""  # a constant step penalty is not news
    assert key_event_reason(1.0, 0.0, {"valid": True, "success": True}) == "success"
    assert key_event_reason(0.0, 0.0, {"valid": False}) == "invalid answer"
    assert key_event_reason(0.9, -0.1, {}) == "reward -0.1 -> 0.9"
    assert key_event_reason(0.0, 0.0, {"key_event": "door opened", "success": True}) == "door opened"
    assert key_event_reason(0.0, 0.0, {"key_event": True}) == "key event"


def test_action_names() -> None:
    assert action_name("I go <action> left </action> now") == "left"
    assert action_name("no tag   at\nall") == "no tag at all"
    assert action_name("x" * 40) == "x" * 21 + "..."
