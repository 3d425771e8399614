"""The token budget: every memory kind stays under it, keeps the instructions and the current observation,
and cuts the observation from the front only when those two alone overflow."""

import random

import pytest
from memory_oracles import largest_fitting_reference

import memory
from envs.frozenlake import INSTRUCTIONS
from memory.prompt import CUT_MARK, PromptFitter, largest_fitting

BUDGET = 450  # the 8x8 instructions + observation take about 175 tokens: room for two or three steps


@pytest.mark.parametrize("kind", memory.MEMORIES.names())
def test_every_kind_stays_under_the_budget_over_50_steps(kind, play, count, tokenizer) -> None:
    mem = memory.make(kind, k=4, tokenizer=tokenizer, max_prompt_tokens=BUDGET)
    unbounded = memory.make(kind, k=4)
    seen, seen_unbounded = play(mem, seed=3), play(unbounded, seed=3)
    cut = 0
    for step, ((msgs, obs), (free, _)) in enumerate(zip(seen, seen_unbounded), start=1):
        assert count(msgs) <= BUDGET, f"{kind} step {step}"
        assert msgs[0] == {"role": "system", "content": INSTRUCTIONS}
        assert msgs[1]["content"].endswith(f"Now (step {step}):\n{obs}")
        if count(free) <= BUDGET:  # the budget changes nothing that already fits
            assert msgs == free
        cut += msgs != free
    # k=4 steps of ~95 tokens each do not fit beside ~175: every kind had to cut history, and all but summary
    # dropped some (summary folds recent steps into its summary, which fits)
    assert cut > 0 and mem.truncated_steps == 0
    assert (mem.dropped_steps > 0) == (kind != "summary")


@pytest.mark.parametrize("kind", memory.MEMORIES.names())
def test_an_observation_over_the_budget_is_cut_from_the_front(kind, count, tokenizer) -> None:
    obs = "\n".join(f"line {i} of a long observation" for i in range(60)) + "\nYou are at row 3, column 4."
    floor = count(
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": f"Now (step 2):\n{CUT_MARK}"}]
    )
    budget = floor + 40  # room for the end of the observation only
    mem = memory.make(kind, k=2, tokenizer=tokenizer, max_prompt_tokens=budget)
    mem.reset(INSTRUCTIONS)
    mem.record("previous", "<action>left</action>")
    msgs = mem.messages(obs)
    user = msgs[1]["content"]
    assert msgs[0]["content"] == INSTRUCTIONS and count(msgs) <= budget
    assert user.startswith(f"Now (step 2):\n{CUT_MARK}") and "previous" not in user
    kept = user[len(f"Now (step 2):\n{CUT_MARK}") :]
    assert obs.endswith(kept) and kept.endswith("You are at row 3, column 4.") and len(kept) < len(obs)
    # the cut keeps as much as fits: one more character does not
    longer = [msgs[0], {"role": "user", "content": f"Now (step 2):\n{CUT_MARK}" + obs[-len(kept) - 1 :]}]
    assert count(longer) > budget
    assert (mem.truncated_steps, mem.dropped_steps) == (1, 1)


def test_instructions_that_cannot_fit_fail_at_reset(tokenizer) -> None:
    mem = memory.make("summary", tokenizer=tokenizer, max_prompt_tokens=20)
    with pytest.raises(ValueError, match="max_prompt_tokens=20 is too small"):
        mem.reset(INSTRUCTIONS)


def test_the_reset_check_tokenizes_an_env_s_instructions_once_per_tokenizer_and_budget(tokenizer) -> None:
    calls = []

    class Counting:  # the tokenizer, counting its chat-template calls
        def apply_chat_template(self, conversation, **kwargs):
            calls.append(conversation)
            return tokenizer.apply_chat_template(conversation, **kwargs)

    counting = Counting()
    for _ in range(3):  # three episodes of one env: one tokenization
        memory.make("last_k", tokenizer=counting, max_prompt_tokens=BUDGET).reset(INSTRUCTIONS)
    assert len(calls) == 1
    memory.make("last_k", tokenizer=counting, max_prompt_tokens=BUDGET).reset(INSTRUCTIONS + " More.")
    assert len(calls) == 2  # other instructions: checked
    for _ in range(2):  # a smaller budget is checked anew, and a failed check is not remembered
        with pytest.raises(ValueError, match="max_prompt_tokens=20 is too small"):
            memory.make("last_k", tokenizer=counting, max_prompt_tokens=20).reset(INSTRUCTIONS)
    assert len(calls) == 2 + 2 * 2  # (each failure counts the instructions again for its message)


def test_a_budget_needs_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        memory.make("last_k", max_prompt_tokens=100)


def test_largest_fitting_agrees_with_the_reference() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 70)
        threshold = rng.randint(0, n - 1)  # fits(x) <=> x <= threshold: fits(0), not fits(n)
        probes: list[int] = []

        def fits(x: int) -> bool:  # called only in this iteration: its probes and threshold are this one's
            probes.append(x)  # noqa: B023
            return x <= threshold  # noqa: B023

        assert largest_fitting(n, fits) == threshold
        fast_probes = list(probes)
        assert largest_fitting_reference(n, fits) == threshold
        # galloping from 0: no probe builds a prompt more than twice as long as the answer's
        assert max(fast_probes, default=0) <= max(1, 2 * threshold)


def test_token_ids_are_the_chat_templates_and_the_fitted_prompt_is_tokenized_once() -> None:
    """`token_ids` equals the tokenizer's own chat-template ids for any prompt (changed, repeated, or asked
    twice), and asking for the prompt `fit` just counted does not tokenize it again."""
    calls = []

    class Counting:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
            calls.append(messages)
            text = "|".join(f"{m['role']}:{m['content']}" for m in messages)
            return [ord(c) for c in text]

    tok = Counting()
    fitter = PromptFitter(tok, max_prompt_tokens=10_000)
    rng = random.Random(0)
    for _ in range(50):
        obs = "".join(rng.choice("abc") for _ in range(rng.randint(0, 6)))
        messages = fitter.fit("rules", [], rng.randint(1, 3), obs)
        before = len(calls)
        ids = fitter.token_ids(messages)
        assert len(calls) == before  # the count's tokenization, reused
        assert ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        other = [{"role": "user", "content": obs + "x"}]
        assert fitter.token_ids(other) == [ord(c) for c in f"user:{obs}x"]
        ids.append(-1)  # a caller's copy: changing it changes nothing the fitter keeps
        assert fitter.token_ids(other) == [ord(c) for c in f"user:{obs}x"]
