"""WebShop-like shopping over a generated catalogue (see `envs.shop_catalogue`), with WebShop's reward.

Pages: search -> results (10 per page) -> item (options, description, features) -> buy. Actions, inside
`<action>...</action>`: `search[query]` (BM25 over the catalogue) on the search page, and `click[X]` for
any button the page lists: a product id, an option value, `buy now`, `back to search`, `next >`, `< prev`,
`description`, `features`. The goal is a pure function of the reset seed; the catalogue of
`catalogue_seed` is shared by every episode. Buying ends the episode with WebShop's reward in [0, 1].

    env = envs.make("agentstream/Shop-v0", max_steps=15)
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("<action>search[red cotton t-shirt]</action>")
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from envs.base import Action, ParseFailure, ParseResult, StepResult, TextGame, text_space
from envs.shop_catalogue import Catalogue, Goal, Product, make_catalogue, make_goal, reward

_ACTION_RE = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)
_COMMAND_RE = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.DOTALL | re.IGNORECASE)
SEARCH_PLACEHOLDER = "search[<your query>]"

INSTRUCTIONS = (
    "You are shopping on a web store for the item the instruction describes. Each turn, answer with one "
    "action inside <action>...</action>: search[your query] on the search page, or click[button] for a "
    "button the page shows in [brackets] (a product id, an option, buy now, back to search, next >, < prev, "
    "description, features). Choose the options the instruction asks for before you click buy now."
)


def parse_action(text: str) -> ParseResult:
    """The first `<action>search[q]</action>` / `<action>click[x]</action>` -> Action((verb, arg)), arg
    stripped and lower-cased. Never raises; whether the page has that button is the game's business."""
    if not isinstance(text, str):
        return ParseFailure(f"expected text, got {type(text).__name__}")
    match = _ACTION_RE.search(text)
    if match is None:
        return ParseFailure("no <action>...</action> tag found")
    command = _COMMAND_RE.match(match.group(1))
    if command is None:
        return ParseFailure("the action must be search[query] or click[button]")
    verb, arg = command.group(1).lower(), " ".join(command.group(2).split()).lower()
    if not arg:
        return ParseFailure(f"{verb}[] is empty")
    return Action((verb, arg))


@dataclass
class Page:
    """Where the shopper is: `kind` in search | results | item | description | features."""

    kind: str = "search"
    query: str = ""
    results: list[Product] = field(default_factory=list)
    page_no: int = 1
    product: Product | None = None
    chosen: dict[str, str] = field(default_factory=dict)


class ShopEnv(TextGame):
    """The shop as a text game (see the module docstring)."""

    metadata = {"render_modes": []}
    instructions = INSTRUCTIONS

    def __init__(
        self,
        max_steps: int = 15,
        catalogue_seed: int = 0,
        n_products: int = 300,
        results_per_page: int = 10,
        max_results: int = 50,
    ):
        self.max_steps, self.results_per_page, self.max_results = max_steps, results_per_page, max_results
        self.catalogue: Catalogue = make_catalogue(catalogue_seed, n_products)
        self.observation_space = text_space(max_length=16384)
        self.action_space = text_space(max_length=16384)
        self.goal: Goal | None = None
        self._page = Page()
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        goal_seed = int(self.np_random.integers(2**31)) if seed is None else seed
        self.goal = make_goal(goal_seed, self.catalogue)
        self._page, self._steps = Page(), 0
        return self._render(), self._info(True, False)

    def _started(self) -> bool:
        return self.goal is not None

    def _parse(self, action: str) -> ParseResult:
        """Also invalid: a well-formed command for a button this page does not have."""
        parsed = parse_action(action)
        if isinstance(parsed, Action) and not self._available(*parsed.value):
            verb, arg = parsed.value
            return ParseFailure(
                f"{verb}[{arg}] is not available on this page; use one of: {', '.join(self.admissible_actions())}"
            )
        return parsed

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        return self._render(), self._info(False, False)

    def _step(self, command: tuple[str, str]) -> StepResult:
        verb, arg = command
        if verb == "click" and arg == "buy now":
            assert self._page.product is not None and self.goal is not None
            value, parts = reward(self._page.product, self.goal, self._page.chosen)
            info = self._info(True, value >= 1.0)
            info.update(reward_parts=parts, purchased=self._page.product.asin)
            return f"Thank you for shopping with us! Your score: {value:.3f}", value, True, False, info
        self._move(verb, arg)
        return self._render(), 0.0, False, False, self._info(True, False)

    # -- the game --------------------------------------------------------------------------------------

    def _clickables(self) -> list[str]:
        page = self._page
        if page.kind == "search":
            return []
        if page.kind == "results":
            shown = self._shown()
            buttons = ["back to search"] + (["< prev"] if page.page_no > 1 else [])
            buttons += ["next >"] if page.page_no * self.results_per_page < len(page.results) else []
            return buttons + [p.asin for p in shown]
        if page.kind == "item":
            assert page.product is not None
            values = [v for vs in page.product.options.values() for v in vs]
            return ["back to search", "< prev", "description", "features", *values, "buy now"]
        return ["back to search", "< prev"]  # description / features

    def _available(self, verb: str, arg: str) -> bool:
        return self._page.kind == "search" if verb == "search" else arg in self._clickables()

    def _move(self, verb: str, arg: str) -> None:
        page = self._page
        if verb == "search":
            self._page = Page("results", arg, self.catalogue.search(arg, self.max_results))
        elif arg == "back to search":
            self._page = Page()
        elif page.kind == "results" and arg in ("next >", "< prev"):
            page.page_no += 1 if arg == "next >" else -1
        elif page.kind == "results":
            page.kind, page.product, page.chosen = "item", self.catalogue.by_asin[arg], {}
        elif page.kind in ("description", "features"):
            page.kind = "item"  # "< prev" from a sub-page
        elif arg == "< prev":
            page.kind, page.product, page.chosen = "results", None, {}
        elif arg in ("description", "features"):
            page.kind = arg
        else:  # an option value
            assert page.product is not None
            name = next(n for n, vs in page.product.options.items() if arg in vs)
            page.chosen[name] = arg

    def _shown(self) -> list[Product]:
        start = (self._page.page_no - 1) * self.results_per_page
        return self._page.results[start : start + self.results_per_page]

    # -- the text ----------------------------------------------------------------------------------------

    def _render(self) -> str:
        assert self.goal is not None
        page = self._page
        head = f"Instruction: {self.goal.instruction_text}\n"
        if page.kind == "search":
            return head + "[Search]"
        if page.kind == "results":
            lines = ["[Back to Search]", f"Page {page.page_no} (Total results: {len(page.results)})"]
            lines += ["[< Prev]"] if page.page_no > 1 else []
            lines += ["[Next >]"] if "next >" in self._clickables() else []
            for p in self._shown():
                lines += [f"[{p.asin}]", p.title, f"${p.price:.2f}"]
            return head + "\n".join(lines)
        product = page.product
        assert product is not None
        if page.kind == "description":
            return head + f"[Back to Search]\n[< Prev]\n{product.description}"
        if page.kind == "features":
            return head + "[Back to Search]\n[< Prev]\n" + "\n".join(product.bullets)
        lines = ["[Back to Search]", "[< Prev]"]
        for name, values in product.options.items():
            lines.append(f"{name}: " + " ".join(f"[{v}]" for v in values))
        lines += [product.title, f"Price: ${product.price:.2f}", "[Description] [Features]", "[Buy Now]"]
        chosen = ", ".join(f"{k}: {v}" for k, v in page.chosen.items()) or "none"
        return head + "\n".join(lines) + f"\nSelected options: {chosen}"

    def admissible_actions(self) -> list[str]:
        """The texts that go inside <action>...</action> on this page."""
        if self._page.kind == "search":
            return [SEARCH_PLACEHOLDER]
        return [f"click[{b}]" for b in self._clickables()]

    def _info(self, valid: bool, success: bool) -> dict[str, Any]:
        return {
            "valid": valid,
            "success": success,
            "anchor": self._render(),
            "admissible_actions": self.admissible_actions(),
        }

    def close(self) -> None:
        self.goal = None
