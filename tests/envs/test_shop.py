"""Shop env: a scripted shopper buying the goal product with its options gets WebShop's reward 1."""

import random
import string

import envs
from envs.base import Action, ParseFailure
from envs.shop import SEARCH_PLACEHOLDER, parse_action
from envs.shop_catalogue import Goal, reward


def _buy(env, seed: int, options: bool = True, asin: str | None = None) -> tuple[float, dict]:
    obs, info = env.reset(seed=seed)
    goal = env.goal
    assert info["admissible_actions"] == [SEARCH_PLACEHOLDER]
    query = goal.instruction_text.split(" with ")[0].removeprefix("i am looking for a ")
    obs, _, _, _, info = env.step(f"<action>search[{query}]</action>")
    target = asin or goal.asin
    while f"click[{target}]" not in info["admissible_actions"]:
        assert "click[next >]" in info["admissible_actions"], "target not in the search results"
        obs, _, _, _, info = env.step("<action>click[next >]</action>")
    obs, _, _, _, info = env.step(f"<action>click[{target}]</action>")
    assert info["valid"] and "[Buy Now]" in obs
    if options:
        for value in goal.goal_options.values():
            _, _, _, _, info = env.step(f"<action>click[{value}]</action>")
            assert info["valid"]
    _, r, term, _, info = env.step("<action>click[buy now]</action>")
    assert term
    return r, info


def test_gold_shopper_gets_reward_one_on_several_seeds() -> None:
    env = envs.make("agentstream/Shop-v0", max_steps=30)
    for seed in range(8):
        r, info = _buy(env, seed)
        assert r == 1.0 and info["success"], (seed, info["reward_parts"])


def test_buying_without_the_options_scores_lower() -> None:
    env = envs.make("agentstream/Shop-v0", max_steps=30)
    r, info = _buy(env, 0, options=False)
    goal = env.goal
    # Worked by hand: no option chosen matches nothing, so (|attrs| + 0 + 1) / (|attrs| + |options| + 1) < 1.
    n_a, n_o = len(goal.attributes), len(goal.goal_options)
    assert r == (n_a + 1) / (n_a + n_o + 1) and not info["success"]


def test_reward_by_hand() -> None:
    env = envs.make("agentstream/Shop-v0")
    env.reset(seed=0)
    product = env.catalogue.by_asin[env.goal.asin]
    goal = Goal(
        product.asin,
        product.query,
        product.product_category,
        product.product_type,
        (product.attributes[0], "definitely-not-an-attribute"),
        {"size": "no-such-size"},
        price_upper=product.price - 0.01,
        instruction_text="",
    )
    # attributes 1 of 2, option 0 of 1 (size matches exactly or not at all), price over -> (1+0+0)/(2+1+1) = 0.25
    total, parts = reward(product, goal, {"size": "zzz"})
    assert total == 0.25 and parts["r_type"] == 1.0
    other_type = next(p for p in env.catalogue.products if p.category != product.category)
    # a product of another category shares no type word: r_type 0, total 0
    assert reward(other_type, goal, {})[0] == 0.0


def test_same_seed_same_instruction_invalid_click_does_not_move() -> None:
    a, b = envs.make("agentstream/Shop-v0"), envs.make("agentstream/Shop-v0")
    obs_a, _ = a.reset(seed=5)
    assert obs_a == b.reset(seed=5)[0] and obs_a != a.reset(seed=6)[0]
    obs, r, term, _, info = a.step("<action>click[buy now]</action>")  # no such button on the search page
    assert not info["valid"] and "not available" in info["parse_error"] and not term and r == 0.0


def test_parser() -> None:
    assert parse_action("<action>search[ Red  Shirt ]</action>") == Action(("search", "red shirt"))
    assert parse_action("ok <action>click[Buy Now]</action>") == Action(("click", "buy now"))
    assert isinstance(parse_action("click[buy now]"), ParseFailure)
    assert isinstance(parse_action("<action>jump[x]</action>"), ParseFailure)
    assert isinstance(parse_action("<action>click[]</action>"), ParseFailure)
    rng = random.Random(0)
    pieces = ["<action>", "</action>", "click[", "search[", "]", "["]
    for _ in range(3000):
        text = "".join(
            rng.choice(pieces) if rng.random() < 0.3 else rng.choice(string.printable)
            for _ in range(rng.randint(0, 40))
        )
        assert isinstance(parse_action(text), (Action, ParseFailure))
