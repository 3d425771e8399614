"""TextWorldExpress games (`textworld-express`, a Java simulator driven over py4j) as text envs.

Two games are registered: TextWorld Commonsense (`twc`: put things where they belong) and CookingWorld
(`cookingworld`: find the ingredients, prepare them as the cookbook says, eat the meal). Game parameters
go straight to TWX (`game_params={"numLocations": 1, "includeDoors": 0}` or the string form
"numLocations=1,includeDoors=0"). The seed picks the game: `envs.base.TRAIN_SEEDS` map onto TWX's `train`
fold and `VALIDATION_SEEDS` onto its `dev` fold (seed modulo the fold's size), so validation games were
never trained on. TWX's valid actions become `info["admissible_actions"]`; with `gold_path=True` the reset
info carries TWX's gold action sequence (reset takes ~2x longer).

    env = envs.make("agentstream/TWX-CookingWorld-v0", max_steps=50, game_params={"numLocations": 1})
    obs, info = env.reset(seed=4)
    obs, reward, terminated, truncated, info = env.step("<action>take cookbook</action>")

Each env starts its own JVM on first reset (~0.5 s, ~150 MB) and stops it in `close()`. Steps are
blocking calls into the JVM (a few ms): `blocking = True` lets the actor run them in a thread.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from envs.alfworld.parser import normalize
from envs.base import TRAIN_SEEDS, Action, ParseFailure, ParseResult, StepResult, TextGame, seed_split, text_space

INSTALL_HINT = "pip install textworld-express==1.1.0 (and Java 17: apt-get install openjdk-17-jre-headless)"
_FOLDS = {"train": "train", "validation": "dev"}
_TAG = "action"

INSTRUCTIONS = {
    "twc": (
        "You are in a house. {task} Each step you see what happened and the valid actions. Think inside "
        "<think> </think> tags, then give exactly one valid action inside <action> </action> tags, for "
        "example <action>take dirty towel</action>."
    ),
    "cookingworld": (
        "You are in a house. {task} Read the cookbook, gather and prepare the ingredients it lists, then "
        "prepare and eat the meal. Each step you see what happened and the valid actions. Think inside "
        "<think> </think> tags, then give exactly one valid action inside <action> </action> tags, for "
        "example <action>take cookbook</action>."
    ),
}


def parse_action(text: object, admissible: Collection[str] | None = None) -> ParseResult:
    """The first `<action>COMMAND</action>` -> Action(command), matched case-insensitively against
    `admissible` when given (TWX's commands keep capitals, e.g. 'take dirty green T-shirt'). Never raises."""
    if not isinstance(text, str):
        return ParseFailure(f"expected text, got {type(text).__name__}")
    lower = text.lower()
    start = lower.find(f"<{_TAG}>")
    end = lower.find(f"</{_TAG}>", start + 1) if start >= 0 else -1
    if start < 0 or end < 0:
        return ParseFailure("no <action>...</action> tag found")
    command = normalize(text[start + len(_TAG) + 2 : end])
    if not command:
        return ParseFailure("the <action> tag is empty")
    if admissible is None:
        return Action(command)
    for candidate in admissible:
        if normalize(candidate) == command:
            return Action(candidate)
    shown = command if len(command) <= 60 else command[:60] + "..."
    return ParseFailure(f"{shown!r} is not a valid action here; choose one from the list")


def _params_text(game_params: Mapping[str, Any] | str | None) -> str:
    if game_params is None:
        return ""
    if isinstance(game_params, str):
        return game_params
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in game_params.items())


class TextWorldExpressText(TextGame):
    """A TextWorldExpress game with text observations and text actions (see the module docstring)."""

    metadata = {"render_modes": []}
    blocking = True
    game = "twc"

    def __init__(
        self,
        max_steps: int = 50,
        game_params: Mapping[str, Any] | str | None = None,
        gold_path: bool = False,
        game: str | None = None,
    ):
        try:
            import textworld_express  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"TextWorldExpress env needs: {INSTALL_HINT}") from exc
        self.game = game or self.game
        self.max_steps = max_steps
        self.game_params = _params_text(game_params)
        self.gold_path = gold_path
        self.instructions = INSTRUCTIONS.get(self.game, INSTRUCTIONS["twc"]).format(task="")
        self.observation_space = text_space()
        self.action_space = text_space()
        self._twx = None
        self._fold_seeds: dict[str, list[int]] = {}
        self._infos: dict[str, Any] = {}
        self._obs = ""
        self._steps = 0

    def _start(self) -> None:
        from textworld_express import TextWorldExpressEnv

        # TWX's own step limit stays out of the way: the episode limit is ours (`max_steps`).
        self._twx = TextWorldExpressEnv(envStepLimit=10**6)
        self._twx.load(self.game, self.game_params)  # raises ValueError naming a bad parameter
        self._fold_seeds = {"train": self._twx.getValidSeedsTrain(), "dev": self._twx.getValidSeedsDev()}

    def game_seed(self, seed: int) -> tuple[str, int]:
        """(TWX fold, TWX seed) for an env seed."""
        fold = _FOLDS[seed_split(seed)]
        seeds = self._fold_seeds[fold]
        return fold, seeds[seed % len(seeds)]

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if self._twx is None:
            self._start()
        # Unseeded: a training game (any int up to 2**31 could fall past VALIDATION_SEEDS, which raised).
        env_seed = int(self.np_random.integers(TRAIN_SEEDS.start, TRAIN_SEEDS.stop)) if seed is None else seed
        fold, game_seed = self.game_seed(env_seed)
        self._obs, self._infos = self._twx.reset(
            seed=game_seed,
            gameFold=fold,
            gameName=self.game,
            gameParams=self.game_params,
            generateGoldPath=self.gold_path,
        )
        task = self._infos["taskDescription"]
        self.instructions = INSTRUCTIONS.get(self.game, INSTRUCTIONS["twc"]).format(task=task)
        self._steps = 0
        info = self._info(valid=True)
        if self.gold_path:
            # TWX's gold sequence starts with the 'look around' that produced the first observation.
            gold = self._twx.getGoldActionSequence()
            info["gold_path"] = gold[1:] if gold and gold[0] == "look around" else gold
        return self._obs, info

    def _started(self) -> bool:
        return self._twx is not None and bool(self._infos)

    def _parse(self, action: str) -> ParseResult:
        return parse_action(action, self._infos["validActions"])

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        return self._obs, self._info(valid=False)

    def _step(self, command: str) -> StepResult:
        assert self._twx is not None
        self._obs, reward, _, self._infos = self._twx.step(command)
        terminated = bool(self._infos["tasksuccess"] or self._infos["taskfailure"])
        return self._obs, float(reward), terminated, False, self._info(valid=True)

    def _info(self, valid: bool) -> dict[str, Any]:
        infos = self._infos
        return {
            "valid": valid,
            "success": bool(infos["tasksuccess"]),
            "anchor": f"{infos['look'].strip()}\n{infos['inventory'].strip()}",
            "admissible_actions": sorted(infos["validActions"]),
            "score": float(infos["score"]),
        }

    def close(self) -> None:
        if self._twx is not None:
            proc = self._twx._gateway.java_process
            self._twx.close()  # shuts the gateway and asks the JVM to exit (a newline on its stdin)
            proc.stdin.close()
            proc.wait(timeout=10)
            self._twx.close = lambda: None  # its __del__ closes again: nothing is left to close
        self._twx = None

    def __del__(self) -> None:  # an env dropped without close() still stops its JVM
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down py4j already
            pass


class TWCText(TextWorldExpressText):
    """TextWorld Commonsense: pick up the misplaced things and put them where they belong."""

    game = "twc"


class CookingWorldText(TextWorldExpressText):
    """CookingWorld: read the recipe, gather and prepare the ingredients, prepare and eat the meal."""

    game = "cookingworld"
