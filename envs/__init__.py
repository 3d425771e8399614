"""Text environments (gymnasium), each split into game, action parser and prompt."""

from envs.base import Action, EnvTraits, ParseFailure, ParseResult, TextEnv
from envs.registry import known_envs, make, traits

__all__ = ["Action", "EnvTraits", "ParseFailure", "ParseResult", "TextEnv", "known_envs", "make", "traits"]
