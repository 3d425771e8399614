"""Environments by name: every env registers a gymnasium id under the `agentstream/` namespace, with its traits.

    import envs.registry as reg
    env = reg.make("agentstream/FrozenLake-v0", map_size=4, max_steps=8)
    reg.traits("agentstream/TextArena-v0", {"opponent": "self"}).seats     # 2, and nothing is built
    env = reg.make("examples.my_env.guess:GuessEnv", max_steps=8)         # a user's env (envs/user.py)

A name that is not built in is a user's env: a gymnasium id or an import path `package.module:Class`
(`envs.user.resolve`), wrapped as the actor plays it (`envs.user.UserEnv`); its traits are one seat's.

The traits (`envs.base.EnvTraits`: seats, a frozen seat, the answer parser) are what the actor and the launcher
read of an env, so that a new game declares them here instead of being special-cased there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import gymnasium as gym

from agentstream.registry import Registry
from envs import arena, openenv, user
from envs.base import EnvTraits

NAMESPACE = "agentstream"
TraitsOf = Callable[[Mapping[str, Any]], EnvTraits]
"""An env's traits given its kwargs (most envs' are the same whatever the kwargs)."""


def _fixed(parser: str = "") -> TraitsOf:
    """Traits that do not depend on the kwargs: one seat, and the env's answer parser (`module:function`)."""
    declared = EnvTraits(parser=parser)
    return lambda kwargs: declared


ENVS: Registry[str] = Registry("env")
"""Env id -> its gymnasium entry point; each with its traits function (`TraitsOf`)."""
for _name, _entry_point, _traits in [
    ("FrozenLake-v0", "envs.frozenlake:FrozenLakeText", _fixed("envs.frozenlake:parse_action")),
    ("Sokoban-v0", "envs.sokoban:SokobanText", _fixed("envs.sokoban:parse_action")),
    ("Taxi-v0", "envs.taxi:TaxiText", _fixed("envs.taxi:parse_action")),
    ("EZPoints-v0", "envs.cards:EZPointsText", _fixed()),  # (its parser takes the hand's choices)
    ("Points24-v0", "envs.cards:Points24Text", _fixed()),
    ("NumberLine-v0", "envs.cards:NumberLineText", _fixed("envs.cards.numberline:parse_action")),
    ("Blackjack-v0", "envs.cards:BlackjackText", _fixed("envs.cards.blackjack:parse_action")),
    ("Reasoning-v0", "envs.reasoning:ReasoningEnv", _fixed("envs.reasoning:parse_answer")),
    ("SkyRL-v0", "envs.skyrl:SkyRLGymEnv", _fixed()),  # (its parser is the task family's)
    ("Shop-v0", "envs.shop:ShopEnv", _fixed("envs.shop:parse_action")),
    ("ALFWorld-v0", "envs.alfworld.game:AlfWorldText", _fixed()),  # (its parser takes the admissible commands)
    ("TWX-TWC-v0", "envs.textworld_express:TWCText", _fixed()),
    ("TWX-CookingWorld-v0", "envs.textworld_express:CookingWorldText", _fixed()),
    ("TextArena-v0", "envs.arena:TextArenaEnv", arena.traits),
    ("OpenEnv-v0", "envs.openenv:OpenEnvText", openenv.traits),  # an OpenEnv server's game (env.kwargs names it)
]:
    ENVS.add(f"{NAMESPACE}/{_name}", _entry_point, _traits)


def _register_all() -> None:
    for env_id, entry_point in ENVS.items():
        if env_id not in gym.registry:
            # The episode limit is the env's own (`max_steps`), so gymnasium's TimeLimit and the
            # passive checker (which insists on Box/Discrete spaces) stay out of the way.
            gym.register(id=env_id, entry_point=entry_point, disable_env_checker=True, order_enforce=False)


def known_envs() -> list[str]:
    """Every registered agentstream env id."""
    return ENVS.names()


def make(name: str, **kwargs: Any) -> gym.Env:
    """Build an env: a built-in one by its id, else a user's (a gymnasium id or `package.module:Class`,
    `envs.user.make`); a name that resolves to nothing raises `envs.user.EnvSourceError`."""
    if name in ENVS:
        return gym.make(name, **kwargs).unwrapped
    return user.make(name, **kwargs)


def traits(name: str, kwargs: Mapping[str, Any] | None = None) -> EnvTraits:
    """What env `name` declares with `kwargs` (its env.kwargs), without building it. A user's env (which must
    resolve: `envs.user.resolve`) declares one seat and no answer parser."""
    if name not in ENVS:
        user.resolve(name)
        return EnvTraits()
    traits_of = cast(TraitsOf, ENVS.traits(name))  # (every entry above registers a TraitsOf)
    return traits_of(kwargs or {})


_register_all()
