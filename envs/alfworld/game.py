"""ALFWorld as a gymnasium text env: ALFWorld's own TextWorld/PDDL engine on locally generated households.

Each reset generates the household for the seed (`household.generate`), hands ALFWorld's domain
(`alfworld/data/alfred.pddl`), its grammar (`alfred.twl2`, with the task text filled in, as ALFWorld's
`add_task_to_grammar` does) and the generated problem to TextWorld's `PddlEnv`, and names entities with
ALFWorld's demangler. Text and commands are therefore exactly ALFWorld's ("You arrive at fridge 1. The
fridge 1 is closed.", "move apple 1 to countertop 2"). Success is ALFWorld's `won`: the PDDL goal holds.

    env = envs.make("agentstream/ALFWorld-v0", max_steps=50, task_types=["pick_heat_then_place"])
    obs, info = env.reset(seed=3)
    obs, reward, terminated, truncated, info = env.step("<action>go to fridge 1</action>")

Steps call into Fast Downward's C library and the TextWorld grammar (tens of ms): `blocking = True` tells
the actor to run them in a thread. Every env loads its own copy of the library (fast_downward.load_lib),
so envs in threads do not share planner state; the PDDL translation at reset is pure Python with
module-level state, so resets are serialised by a lock.
"""

from __future__ import annotations

import copy
import importlib.resources
import threading
from typing import Any

from agentstream.registry import unknown_name
from envs.alfworld.household import SHORT_NAMES, TASK_TYPES, Household, generate
from envs.alfworld.parser import parse_action
from envs.alfworld.prompt import instructions
from envs.base import ParseResult, StepResult, TextGame, text_space

try:
    import textworld
    from alfworld.agents.utils.misc import Demangler
    from textworld.envs.pddl import PddlEnv

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # the env module stays importable; making the env says how to install
    _IMPORT_ERROR = exc

INSTALL_HINT = "pip install alfworld==0.4.2 (builds fast-downward-textworld from source: ~2-4 min, needs cmake/g++)"
_TRANSLATE_LOCK = threading.Lock()
_PARSE_CACHE_SIZE = 8192
# State that changes during play; static facts (types, what fits where) say nothing about progress.
_DYNAMIC = ("atlocation", "inreceptacle", "holds", "opened", "isclean", "ishot", "iscool", "istoggled")


def _cache_grammar_parses() -> None:
    """Memoise TextWorld's two string parsers (grammar templates and logic conditions).

    The engine re-parses the same few strings with tatsu for every admissible command on every step
    (~7 ms a parse, >80% of a step; ~8 -> ~25 steps/s on this contended box). Each parse is a pure function of its
    arguments; callers mutate what they get (they set `.context`), so each call gets a deep copy.
    """
    import textworld.logic
    from textworld.envs.pddl import textgen

    for module in (textgen, textworld.logic):
        parse = module._parse_and_convert
        if getattr(parse, "_agentstream_cached", False):
            continue
        module._parse_and_convert = _memoised(parse)


def _memoised(parse: Any) -> Any:
    cache: dict[Any, Any] = {}

    def cached(*args: Any, **kwargs: Any) -> Any:
        key = (args, tuple(sorted(kwargs.items())))
        if key not in cache:
            if len(cache) >= _PARSE_CACHE_SIZE:  # keys are templates and task texts: a bounded set
                return parse(*args, **kwargs)
            cache[key] = parse(*args, **kwargs)
        return copy.deepcopy(cache[key])

    cached._agentstream_cached = True
    return cached


def _game_logic() -> tuple[str, str]:
    data = importlib.resources.files("alfworld") / "data"
    return (data / "alfred.pddl").read_text(), (data / "alfred.twl2").read_text()


def _resolve_task_types(task_types: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if not task_types:
        return TASK_TYPES
    resolved = []
    for name in task_types:
        full = SHORT_NAMES.get(name, name)
        if full not in TASK_TYPES:
            raise ValueError(unknown_name("ALFWorld task type", name, set(SHORT_NAMES) | set(TASK_TYPES)))
        resolved.append(full)
    return tuple(resolved)


def _make_engine():
    class _Demangled(textworld.core.Wrapper):  # ALFWorld's AlfredDemangler, without its other imports
        def load(self, *args: Any, **kwargs: Any) -> None:
            super().load(*args, **kwargs)
            demangler = Demangler(game_infos=self._entity_infos, shuffle=False)
            for info in self._entity_infos.values():
                info.name = demangler.demangle_alfred_name(info.id)

    return _Demangled(PddlEnv(textworld.EnvInfos(won=True, admissible_commands=True)))


class AlfWorldText(TextGame):
    """ALFWorld household tasks with text observations and text actions (see the module docstring)."""

    metadata = {"render_modes": []}
    blocking = True  # steps are CPU-bound library calls: the actor runs them in a thread
    instructions = instructions("solve the household task")

    def __init__(self, max_steps: int = 50, task_types: list[str] | tuple[str, ...] | None = None):
        if _IMPORT_ERROR is not None:
            raise ImportError(f"ALFWorld env needs the alfworld package: {INSTALL_HINT}") from _IMPORT_ERROR
        _cache_grammar_parses()
        self.max_steps = max_steps
        self.task_types = _resolve_task_types(task_types)
        self.observation_space = text_space()
        self.action_space = text_space()
        self._domain, self._grammar = _game_logic()
        self._engine = None
        self.household: Household | None = None
        self._state = None
        self._obs = ""
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        task_seed = int(self.np_random.integers(2**31)) if seed is None else seed
        self.household = generate(task_seed, self.task_types)
        game = {
            "pddl_domain": self._domain,
            "grammar": self._grammar.replace("UNKNOWN GOAL", self.household.task_text),
            "pddl_problem": self.household.pddl_problem(),
        }
        with _TRANSLATE_LOCK:
            if self._engine is None:
                self._engine = _make_engine()
            self._engine.load(game)
            self._state = self._engine.reset()
        self.instructions = instructions(self.household.task_text)
        self._steps = 0
        self._obs = self._state.feedback
        return self._obs, self._info(valid=True)

    def _started(self) -> bool:
        return self._state is not None

    def _parse(self, action: str) -> ParseResult:
        return parse_action(action, self.admissible_actions())

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        return self._obs, self._info(valid=False)

    def _step(self, command: str) -> StepResult:
        self._state, _, _ = self._engine.step(command)
        self._obs = self._state.feedback
        won = bool(self._state["won"])
        return self._obs, float(won), won, False, self._info(valid=True)

    def admissible_actions(self) -> list[str]:
        """ALFWorld's admissible commands now, less `help` (it shows a manual, it does not act)."""
        return [c for c in self._state["admissible_commands"] if c != "help"]

    def anchor(self) -> str:
        """The state as text: the facts that change during play, with the names the game shows."""
        infos = self._state["_entity_infos"]
        facts = []
        for fact in self._state["_facts"]:
            if fact.name in _DYNAMIC:
                facts.append(f"{fact.name}({', '.join(infos[v.name].name.strip() for v in fact.arguments)})")
        return "; ".join(sorted(facts))

    def _info(self, valid: bool) -> dict[str, Any]:
        return {
            "valid": valid,
            "success": bool(self._state["won"]),
            "anchor": self.anchor(),
            "admissible_actions": self.admissible_actions(),
            "task_type": self.household.task_type,
        }

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        self._state = None
