"""One registry style for every family of named things (advantage estimators, losses, envs, memories, ...).

    ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")

    @ADVANTAGES.register("grpo")
    def grpo(inp: AdvantageInput, *, eps: float) -> ...: ...

    fn = ADVANTAGES.get(name)   # KeyError: unknown advantage estimator 'x'; known: gigpo, grpo, ...

An entry may carry traits (a frozen dataclass of the family's own: what an estimator needs, what an env
declares); `traits(name)` returns them. `lookup` gives the same error for a plain mapping that is not a
Registry (a table of constants). This module imports nothing of the project, so every layer may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")
V = TypeVar("V")
Traits = TypeVar("Traits")


def unknown_name(what: str, name: object, known: Iterable[object]) -> str:
    """The one message for a name that is not registered: "unknown <what> 'x'; known: a, b, c"."""
    return f"unknown {what} {name!r}; known: {', '.join(sorted(str(k) for k in known))}"


def lookup(table: Mapping[str, V], name: str, what: str) -> V:
    """`table[name]`, or a KeyError that lists the known names."""
    try:
        return table[name]
    except KeyError:
        raise KeyError(unknown_name(what, name, table)) from None


class Registry(Generic[T]):
    """Named entries of one family, each with optional traits; registering a name twice is an error."""

    def __init__(self, what: str):
        self.what = what  # how the error names an entry: "advantage estimator", "env", ...
        self._entries: dict[str, T] = {}
        self._traits: dict[str, object] = {}

    def register(self, name: str, traits: object = None) -> Callable[[T], T]:
        """Decorator: register the decorated object under `name` (with `traits`, if the family has any)."""

        def wrap(entry: T) -> T:
            self.add(name, entry, traits)
            return entry

        return wrap

    def add(self, name: str, entry: T, traits: object = None) -> None:
        """Register `entry` under `name`, as the decorator does."""
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._entries[name] = entry
        self._traits[name] = traits

    def get(self, name: str) -> T:
        """The entry registered under `name`; an unknown name lists the known ones."""
        return lookup(self._entries, name, self.what)

    def traits(self, name: str) -> object:
        """The traits registered with `name` (None if it was registered without); unknown names raise as `get`."""
        self.get(name)
        return self._traits[name]

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(self._entries.items())

    def values(self) -> Iterator[T]:
        return iter(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))
