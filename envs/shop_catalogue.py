"""A generated WebShop-like catalogue and shopping goals, and WebShop's reward.

Products have a category path, a type ("t-shirt"), attributes ("cotton", "machine wash"), options
({"color": [...], "size": [...]}), a price, a title, bullet points and a description. A goal names a
product type, 1-3 of its attributes, one value per option and a price ceiling, phrased like WebShop's
synthetic instructions. The reward follows WebShop's `get_reward` (Yao et al. 2022, sec. 3.2 and
`web_agent_site/engine/goal.py`): (matched attributes + matched options + [price ok]) /
(|attributes| + |options| + 1), times a type factor from query/category/title-noun overlap. spaCy noun
parsing and fuzzy string ratios are replaced by each product's declared type words and token-set equality.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Any

from envs.tools.bm25 import BM25, tokenize

EXACT_MATCH_OPTS = ("size",)  # WebShop matches these options exactly, the rest fuzzily
PRICE_RANGE = [10.0 * i for i in range(1, 100)]

# category -> (category path, [(type, query)], attributes, options)
_CATEGORIES: dict[str, tuple[str, list[str], list[str], dict[str, list[str]]]] = {
    "clothing": (
        "clothing › men › tops",
        ["t-shirt", "hoodie", "polo shirt", "tank top"],
        ["cotton", "machine wash", "slim fit", "short sleeve", "long sleeve", "polyester", "quick dry"],
        {
            "color": ["red", "navy blue", "black", "white", "heather grey"],
            "size": ["small", "medium", "large", "x-large"],
        },
    ),
    "footwear": (
        "clothing › shoes › athletic",
        ["running shoes", "hiking boots", "sandals", "sneakers"],
        ["rubber sole", "non slip", "waterproof", "lightweight", "memory foam", "lace up"],
        {"color": ["black", "white", "olive green", "brown"], "size": ["7", "8", "9", "10", "11"]},
    ),
    "beauty": (
        "beauty › personal care › hair",
        ["shampoo", "conditioner", "hair oil", "face serum"],
        ["sulfate free", "paraben free", "natural ingredients", "long lasting", "travel size", "vegan"],
        {"scent": ["lavender", "coconut", "unscented", "citrus"], "size": ["8 ounce", "16 ounce"]},
    ),
    "grocery": (
        "grocery › snacks › bars",
        ["protein bars", "granola", "trail mix", "dark chocolate"],
        ["gluten free", "low sugar", "high protein", "keto friendly", "non gmo", "individually wrapped"],
        {"flavor": ["peanut butter", "sea salt", "almond", "berry"], "size": ["pack of 6", "pack of 12"]},
    ),
    "electronics": (
        "electronics › audio › headphones",
        ["headphones", "earbuds", "bluetooth speaker"],
        ["wireless", "noise cancelling", "bluetooth", "long battery life", "water resistant", "usb c"],
        {"color": ["black", "silver", "rose gold"]},
    ),
}
_BRANDS = ["Acme", "Northwind", "Zephyr", "Kestrel", "Lumo", "Orbit", "Pinecrest", "Valea", "Brisk", "Solace"]


@dataclass(frozen=True)
class Product:
    asin: str
    category: str
    product_category: str
    query: str
    product_type: str
    title: str
    attributes: tuple[str, ...]
    options: dict[str, list[str]]
    price: float
    bullets: tuple[str, ...]
    description: str

    @property
    def search_text(self) -> str:
        return " ".join([self.title, self.product_type, self.category, *self.attributes, *self.bullets])


@dataclass(frozen=True)
class Goal:
    asin: str
    query: str
    product_category: str
    product_type: str
    attributes: tuple[str, ...]
    goal_options: dict[str, str]
    price_upper: float
    instruction_text: str


@dataclass
class Catalogue:
    products: list[Product]
    index: BM25
    by_asin: dict[str, Product] = field(default_factory=dict)

    def search(self, query: str, k: int = 50) -> list[Product]:
        return [self.products[i] for i, _ in self.index.top_k(query, k)]


def _product(rng: random.Random, i: int) -> Product:
    category = rng.choice(sorted(_CATEGORIES))
    path, types, attrs, options = _CATEGORIES[category]
    ptype = rng.choice(types)
    chosen = sorted(rng.sample(attrs, rng.randint(2, 4)))
    opts = {name: sorted(rng.sample(values, rng.randint(2, len(values)))) for name, values in options.items()}
    brand = rng.choice(_BRANDS)
    title = f"{brand} {' '.join(a.title() for a in chosen[:2])} {ptype.title()}"
    bullets = tuple(f"{a.capitalize()} design for everyday use" for a in chosen[2:]) + (f"By {brand}",)
    return Product(
        asin=f"b{rng.randrange(16**6):06x}{i:03d}",
        category=category,
        product_category=path,
        query=ptype,
        product_type=ptype,
        title=title,
        attributes=tuple(chosen),
        options=opts,
        price=round(rng.uniform(5, 95), 2),
        bullets=bullets,
        description=f"The {brand} {ptype} is {', '.join(chosen)}.",
    )


@functools.lru_cache(maxsize=8)
def make_catalogue(catalogue_seed: int = 0, n_products: int = 300) -> Catalogue:
    """The catalogue for `catalogue_seed` (cached per process: every episode of a run shares it)."""
    rng = random.Random(f"shop-{catalogue_seed}")
    products = [_product(rng, i) for i in range(n_products)]
    return Catalogue(products, BM25([p.search_text for p in products]), {p.asin: p for p in products})


def make_goal(seed: int, catalogue: Catalogue) -> Goal:
    """A goal for a product of the catalogue: a pure function of the seed and the catalogue."""
    rng = random.Random(f"shop-goal-{seed}")
    product = rng.choice(catalogue.products)
    attrs = tuple(rng.sample(product.attributes, rng.randint(1, min(3, len(product.attributes)))))
    goal_options = {name: rng.choice(values) for name, values in sorted(product.options.items())}
    ceilings = [p for p in PRICE_RANGE if p > product.price][:4]  # WebShop: 2 of the next 4 tens, the higher
    price_upper = sorted(rng.sample(ceilings, 2))[1] if len(ceilings) >= 2 else 1_000_000.0
    text = f"i am looking for a {' and '.join(attrs)} {product.product_type}"
    option_text = ", and ".join(f"{k}: {v}" for k, v in goal_options.items())
    text += f" with {option_text}" if option_text else ""
    text += f", and price lower than {price_upper:.2f} dollars" if price_upper < 1_000_000 else ""
    return Goal(
        product.asin,
        product.query,
        product.product_category,
        product.product_type,
        attrs,
        goal_options,
        price_upper,
        text,
    )


def _token_set_match(a: str, b: str) -> bool:
    # Stands in for fuzz.token_set_ratio(a, b) > 85: equal token sets, or one contained in the other.
    ta, tb = set(tokenize(a)), set(tokenize(b))
    return bool(ta) and bool(tb) and (ta <= tb or tb <= ta)


def _in_text(value: str, product: Product) -> bool:
    value = value.lower()
    return (
        value in product.title.lower()
        or value in " ".join(product.bullets).lower()
        or value in product.description.lower()
    )


def type_reward(product: Product, goal: Goal) -> float:
    """WebShop's r_type: 1 if query, category (>= 2 shared path parts) or type words (> 0.2) agree."""
    query_match = product.query == goal.query
    category_match = (
        len(
            {x.strip() for x in product.product_category.split("›")}
            & {x.strip() for x in goal.product_category.split("›")}
        )
        >= 2
    )
    desired = set(tokenize(goal.product_type))
    title_score = len(set(tokenize(product.product_type)) & desired) / len(desired) if desired else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type


def attribute_matches(product: Product, goal: Goal) -> int:
    return sum(
        1 for g in goal.attributes if any(_token_set_match(p, g) for p in product.attributes) or _in_text(g, product)
    )


def option_matches(product: Product, goal: Goal, chosen: dict[str, str]) -> int:
    goal_values = list(goal.goal_options.values())
    n = 0
    for name, value in chosen.items():
        if name.lower() in EXACT_MATCH_OPTS:
            matched = value in goal_values
        else:
            matched = any(_token_set_match(g, value) for g in goal_values)
        n += int(matched or _in_text(value, product))
    return n


def reward(product: Product, goal: Goal, chosen: dict[str, str]) -> tuple[float, dict[str, Any]]:
    """WebShop's total reward for buying `product` with options `chosen`, and its parts."""
    r_type = type_reward(product, goal)
    n_attr, n_opt = attribute_matches(product, goal), option_matches(product, goal, chosen)
    r_price = product.price <= goal.price_upper
    total = (n_attr + n_opt + int(r_price)) / (len(goal.attributes) + len(goal.goal_options) + 1) * r_type
    return total, {"r_type": r_type, "attribute_matches": n_attr, "option_matches": n_opt, "r_price": r_price}
