"""Environments by name: every env registers a gymnasium id under the `agentstream/` namespace.

    import envs.registry as reg
    env = reg.make("agentstream/FrozenLake-v0", map_size=4, max_steps=8)
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

NAMESPACE = "agentstream"
_ENTRY_POINTS = {
    f"{NAMESPACE}/FrozenLake-v0": "envs.frozenlake:FrozenLakeText",
    f"{NAMESPACE}/Sokoban-v0": "envs.sokoban:SokobanText",
    f"{NAMESPACE}/Taxi-v0": "envs.taxi:TaxiText",
    f"{NAMESPACE}/EZPoints-v0": "envs.cards:EZPointsText",
    f"{NAMESPACE}/Points24-v0": "envs.cards:Points24Text",
    f"{NAMESPACE}/NumberLine-v0": "envs.cards:NumberLineText",
    f"{NAMESPACE}/Blackjack-v0": "envs.cards:BlackjackText",
    f"{NAMESPACE}/Reasoning-v0": "envs.reasoning:ReasoningEnv",
    f"{NAMESPACE}/SkyRL-v0": "envs.skyrl:SkyRLGymEnv",
    f"{NAMESPACE}/Shop-v0": "envs.shop:ShopEnv",
    f"{NAMESPACE}/ALFWorld-v0": "envs.alfworld.game:AlfWorldText",
    f"{NAMESPACE}/TWX-TWC-v0": "envs.textworld_express:TWCText",
    f"{NAMESPACE}/TWX-CookingWorld-v0": "envs.textworld_express:CookingWorldText",
    f"{NAMESPACE}/TextArena-v0": "envs.arena:TextArenaEnv",
}


def _register_all() -> None:
    for env_id, entry_point in _ENTRY_POINTS.items():
        if env_id not in gym.registry:
            # The episode limit is the env's own (`max_steps`), so gymnasium's TimeLimit and the
            # passive checker (which insists on Box/Discrete spaces) stay out of the way.
            gym.register(id=env_id, entry_point=entry_point, disable_env_checker=True, order_enforce=False)


def known_envs() -> list[str]:
    """Every registered agentstream env id."""
    return sorted(_ENTRY_POINTS)


def make(name: str, **kwargs: Any) -> gym.Env:
    """Build a registered env; an unknown name lists the known ones."""
    if name not in _ENTRY_POINTS:
        raise KeyError(f"unknown env {name!r}; known: {', '.join(known_envs())}")
    return gym.make(name, **kwargs).unwrapped


_register_all()
