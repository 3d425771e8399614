"""Generated ALFWorld households: a pure function of (seed, task types) -> the PDDL problem ALFWorld runs.

The official ALFWorld game files (PDDL problems exported from AI2-THOR scenes) cannot be downloaded here,
so this module writes its own: one room of a scene type (kitchen, living room, bedroom, bathroom), its
receptacles, objects placed where ALFRED allows them (`alfworld.gen.constants.VAL_RECEPTACLE_OBJECTS`),
and a goal from ALFWorld's own goal library (`alfworld.gen.goal_library`), so that the engine, the text and
the commands are exactly ALFWorld's. Ids follow ALFRED's mangling (`Apple_bar_03`, `Sink_bar_01_bar_
SinkBasin`) so ALFWorld's demangler names them `apple 1`, `sinkbasin 1`, as in the real game.

    hh = generate(seed=7, task_types=TASK_TYPES)
    hh.pddl_problem(), hh.task_text, expert_plan(hh)
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from alfworld.gen import constants, goal_library

# ALFWorld's six task types, by the names its game files and goal library use.
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
SHORT_NAMES = {  # the names the brief and verl-agent use -> ALFWorld's task type
    "pick_and_place": "pick_and_place_simple",
    "look_at_obj_in_light": "look_at_obj_in_light",
    "pick_clean_then_place": "pick_clean_then_place_in_recep",
    "pick_heat_then_place": "pick_heat_then_place_in_recep",
    "pick_cool_then_place": "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place": "pick_two_obj_and_place",
}

# Per scene type: (receptacle type, min count, max count). Shaped after AI2-THOR's floor plans.
SCENES: dict[str, tuple[tuple[str, int, int], ...]] = {
    "Kitchen": (
        ("CounterTop", 1, 3),
        ("Cabinet", 2, 6),
        ("Drawer", 1, 4),
        ("Fridge", 1, 1),
        ("Microwave", 1, 1),
        ("SinkBasin", 1, 1),
        ("StoveBurner", 2, 4),
        ("DiningTable", 0, 1),
        ("GarbageCan", 1, 1),
        ("Shelf", 0, 2),
        ("CoffeeMachine", 1, 1),
        ("Toaster", 0, 1),
    ),
    "LivingRoom": (
        ("Sofa", 1, 1),
        ("ArmChair", 0, 2),
        ("CoffeeTable", 1, 1),
        ("SideTable", 1, 2),
        ("TVStand", 0, 1),
        ("Shelf", 1, 3),
        ("Drawer", 0, 3),
        ("Cabinet", 0, 3),
        ("GarbageCan", 1, 1),
        ("Dresser", 0, 1),
        ("Safe", 0, 1),
    ),
    "Bedroom": (
        ("Bed", 1, 1),
        ("Desk", 0, 1),
        ("Dresser", 0, 1),
        ("SideTable", 1, 2),
        ("Drawer", 1, 4),
        ("Shelf", 1, 4),
        ("GarbageCan", 1, 1),
        ("LaundryHamper", 0, 1),
        ("Safe", 0, 1),
        ("ArmChair", 0, 1),
    ),
    "Bathroom": (
        ("Toilet", 1, 1),
        ("SinkBasin", 1, 2),
        ("BathtubBasin", 0, 1),
        ("Cabinet", 1, 4),
        ("CounterTop", 1, 1),
        ("Drawer", 0, 3),
        ("GarbageCan", 1, 1),
        ("HandTowelHolder", 1, 1),
        ("TowelHolder", 1, 1),
        ("ToiletPaperHanger", 1, 1),
        ("Shelf", 0, 2),
    ),
}
SCENE_OBJECTS: dict[str, tuple[str, ...]] = {
    "Kitchen": (
        "Apple",
        "Bread",
        "Bowl",
        "ButterKnife",
        "Cup",
        "DishSponge",
        "Egg",
        "Fork",
        "Kettle",
        "Knife",
        "Ladle",
        "Lettuce",
        "Mug",
        "Pan",
        "Plate",
        "Pot",
        "Potato",
        "PepperShaker",
        "SaltShaker",
        "SoapBottle",
        "Spatula",
        "Spoon",
        "Tomato",
        "WineBottle",
    ),
    "LivingRoom": (
        "Book",
        "Box",
        "CellPhone",
        "CreditCard",
        "KeyChain",
        "Laptop",
        "Newspaper",
        "Pillow",
        "RemoteControl",
        "Statue",
        "Vase",
        "Watch",
        "TissueBox",
        "Candle",
    ),
    "Bedroom": (
        "AlarmClock",
        "BaseballBat",
        "BasketBall",
        "Book",
        "CD",
        "CellPhone",
        "CreditCard",
        "KeyChain",
        "Laptop",
        "Mug",
        "Pen",
        "Pencil",
        "Pillow",
        "TennisRacket",
        "Watch",
    ),
    "Bathroom": (
        "Candle",
        "Cloth",
        "DishSponge",
        "HandTowel",
        "SoapBar",
        "SoapBottle",
        "SprayBottle",
        "TissueBox",
        "ToiletPaper",
        "Towel",
    ),
}
# Which scenes can host each task: the appliance it needs must be there (ALFRED's GOALS_VALID, narrowed).
TASK_SCENES = {
    "pick_and_place_simple": ("Kitchen", "LivingRoom", "Bedroom", "Bathroom"),
    "look_at_obj_in_light": ("LivingRoom", "Bedroom"),
    "pick_clean_then_place_in_recep": ("Kitchen", "Bathroom"),
    "pick_heat_then_place_in_recep": ("Kitchen",),
    "pick_cool_then_place_in_recep": ("Kitchen",),
    "pick_two_obj_and_place": ("Kitchen", "LivingRoom", "Bedroom", "Bathroom"),
}
LAMP_HOLDERS = ("SideTable", "Desk", "Dresser")
RECEPTACLE_OBJECTS = ("Bowl", "Cup", "Mug", "Pan", "Plate", "Pot")  # ALFRED's objects that hold others
CAN_CONTAIN = constants.VAL_RECEPTACLE_OBJECTS
OPENABLE = set(constants.OPENABLE_CLASS_LIST)


@dataclass(frozen=True)
class Thing:
    """A receptacle or an object: its PDDL id, its ALFRED type and the name the game shows."""

    id: str
    type: str
    name: str = ""


@dataclass
class Household:
    """One generated task: the room, where everything is, and the goal."""

    seed: int
    task_type: str
    scene: str
    receptacles: list[Thing]
    objects: list[Thing]
    location_of: dict[str, str]  # object id -> receptacle id
    target_type: str  # the object type the goal is about
    recep_type: str  # the goal's receptacle type ("" for look_at_obj_in_light)
    toggle_type: str  # "DeskLamp" for look_at_obj_in_light, else ""
    task_text: str
    names: dict[str, str] = field(default_factory=dict)  # PDDL id -> displayed name

    def name(self, thing_id: str) -> str:
        return self.names[thing_id]

    def pddl_problem(self) -> str:
        """The PDDL problem, in the layout of ALFWorld's `initial_state.pddl` files."""
        return _pddl_problem(self)


def _mangle(type_name: str, index: int) -> str:
    if type_name in ("SinkBasin", "BathtubBasin"):  # ALFRED names basins after their sink/bathtub
        return f"{type_name[:-5]}_bar_{index:02d}_bar_{type_name}"
    return f"{type_name}_bar_{index:02d}"


def _display_names(things: list[Thing]) -> dict[str, str]:
    """ALFWorld's demangler numbering: per name, ids sorted (lowercase, as the PDDL parser keeps them),
    numbered from the count down (`Demangler` pops the highest number first)."""
    by_name: dict[str, list[str]] = {}
    for t in things:
        by_name.setdefault(t.id.split("_bar_", 1)[0].lower() + ("basin" if "basin" in t.id.lower() else ""), []).append(
            t.id
        )
    names = {}
    for name, ids in by_name.items():
        for i, thing_id in enumerate(sorted(ids, key=str.lower)):
            names[thing_id] = f"{name} {len(ids) - i}"
    return names


def generate(seed: int, task_types: tuple[str, ...] = TASK_TYPES) -> Household:
    """The household for `seed`: same seed and task types -> same household, same text."""
    rng = random.Random(f"alfworld-household-{seed}")
    task_type = task_types[rng.randrange(len(task_types))]
    scene = rng.choice(TASK_SCENES[task_type])
    for _ in range(100):  # a few layouts cannot host the sampled goal; draw again from the same stream
        hh = _try_generate(rng, seed, task_type, scene)
        if hh is not None:
            return hh
    raise RuntimeError(f"no household for seed {seed} and task {task_type} after 100 draws")


def _try_generate(rng: random.Random, seed: int, task_type: str, scene: str) -> Household | None:
    counts = Counter()
    receptacles = []
    for rtype, lo, hi in SCENES[scene]:
        for _ in range(rng.randint(lo, hi)):
            counts[rtype] += 1
            receptacles.append(Thing(_mangle(rtype, counts[rtype]), rtype))
    rtypes = {r.type for r in receptacles}
    holders = lambda otype: [r for r in receptacles if otype in CAN_CONTAIN.get(r.type, ())]  # noqa: E731

    # The target object type and the goal receptacle type.
    candidates = [o for o in SCENE_OBJECTS[scene] if holders(o)]
    if task_type == "pick_clean_then_place_in_recep":
        candidates = [o for o in candidates if o in CAN_CONTAIN["SinkBasin"]]
    elif task_type == "pick_heat_then_place_in_recep":
        candidates = [o for o in candidates if o in CAN_CONTAIN["Microwave"]]
    elif task_type == "pick_cool_then_place_in_recep":
        candidates = [o for o in candidates if o in CAN_CONTAIN["Fridge"]]
    target = rng.choice(sorted(candidates))
    excluded = {
        "pick_clean_then_place_in_recep": "SinkBasin",
        "pick_heat_then_place_in_recep": "Microwave",
        "pick_cool_then_place_in_recep": "Fridge",
    }.get(task_type)
    goal_rtypes = sorted({r.type for r in holders(target)} - {excluded})
    recep_type = toggle_type = ""
    if task_type == "look_at_obj_in_light":
        toggle_type = "DeskLamp"
        if not rtypes & set(LAMP_HOLDERS):
            return None
    else:
        if not goal_rtypes:
            return None
        recep_type = rng.choice(goal_rtypes)

    # Where the targets start: never already in a goal receptacle (the task would be done at reset).
    sources = [r for r in holders(target) if r.type != recep_type]
    if not sources:
        return None
    n_targets = rng.randint(2, 3) if task_type == "pick_two_obj_and_place" else rng.randint(1, 2)
    objects, location_of = [], {}
    ocounts = Counter()

    def place(otype: str, where: list[Thing]) -> None:
        ocounts[otype] += 1
        obj = Thing(_mangle(otype, ocounts[otype]), otype)
        objects.append(obj)
        location_of[obj.id] = rng.choice(where).id

    for _ in range(n_targets):
        place(target, sources)
    if toggle_type:
        place(toggle_type, [r for r in receptacles if r.type in LAMP_HOLDERS])
    distractors = [o for o in SCENE_OBJECTS[scene] if o != target and holders(o)]
    for otype in rng.sample(distractors, k=min(len(distractors), rng.randint(3, 6))):
        for _ in range(rng.randint(1, 2)):
            # Distractors of other types may sit anywhere they fit, goal receptacles included.
            place(otype, holders(otype))

    template = rng.choice(goal_library.gdict[task_type]["templates"])
    task_text = template.format(obj=target.lower(), recep=recep_type.lower(), toggle=toggle_type.lower(), mrecep="")
    hh = Household(
        seed, task_type, scene, receptacles, objects, location_of, target, recep_type, toggle_type, task_text
    )
    hh.names = _display_names(receptacles + objects)
    return hh


def _pddl_problem(hh: Household) -> str:
    otypes = sorted({o.type for o in hh.objects})
    rtypes = sorted({r.type for r in hh.receptacles})
    loc = {r.id: f"loc_bar_{i + 1:02d}" for i, r in enumerate(hh.receptacles)}
    decl = ["agent1 - agent"] + [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in rtypes]
    decl += [f"{o.id} - object" for o in hh.objects] + [f"{r.id} - receptacle" for r in hh.receptacles]
    decl += ["loc_bar_00 - location"] + [f"{v} - location" for v in loc.values()]
    init = ["(atLocation agent1 loc_bar_00)"]  # the agent starts in the middle of the room
    for r in hh.receptacles:
        init.append(f"(receptacleType {r.id} {r.type}Type)")
        init.append(f"(receptacleAtLocation {r.id} {loc[r.id]})")
        if r.type in OPENABLE:
            init.append(f"(openable {r.id})")
    for rt in rtypes:
        init += [f"(canContain {rt}Type {ot}Type)" for ot in otypes if ot in CAN_CONTAIN.get(rt, ())]
    for o in hh.objects:
        where = hh.location_of[o.id]
        init += [
            f"(objectType {o.id} {o.type}Type)",
            f"(inReceptacle {o.id} {where})",
            f"(objectAtLocation {o.id} {loc[where]})",
        ]
        if o.type == "DeskLamp":
            init.append(f"(toggleable {o.id})")
            continue
        init.append(f"(pickupable {o.id})")
        for prop, appliance in (("cleanable", "SinkBasin"), ("heatable", "Microwave"), ("coolable", "Fridge")):
            if o.type in CAN_CONTAIN[appliance]:
                init.append(f"({prop} {o.id})")
        if o.type in RECEPTACLE_OBJECTS:
            init.append(f"(isReceptacleObject {o.id})")
    goal = (
        goal_library.gdict[hh.task_type]["pddl"]
        .format(obj=hh.target_type, recep=hh.recep_type, toggle=hh.toggle_type, mrecep="")
        .replace("#", "-")
    )  # the library writes `?o # object` where PDDL wants `?o - object`
    lines = [f"(define (problem plan_generated_{hh.seed})", "    (:domain alfred)", "    (:objects"]
    lines += [f"        {d}" for d in decl] + ["    )", "    (:init"] + [f"        {f}" for f in init] + ["    )"]
    return "\n".join(lines) + "\n" + goal.strip() + "\n"  # the library's goal closes `(define` itself


def expert_plan(hh: Household) -> list[str]:
    """A shortest-enough command list that solves `hh`, from the generator's own knowledge of the room."""
    plan: list[str] = []
    here = ""
    opened: set[str] = set()

    def go(recep_id: str) -> None:
        nonlocal here
        if here != recep_id:
            plan.append(f"go to {hh.name(recep_id)}")
            here = recep_id
        if any(r.id == recep_id and r.type in OPENABLE for r in hh.receptacles) and recep_id not in opened:
            plan.append(f"open {hh.name(recep_id)}")
            opened.add(recep_id)

    def first(rtype: str) -> str:
        return min((r for r in hh.receptacles if r.type == rtype), key=lambda r: hh.name(r.id)).id

    targets = sorted((o for o in hh.objects if o.type == hh.target_type), key=lambda o: hh.name(o.id))
    n = 2 if hh.task_type == "pick_two_obj_and_place" else 1
    goal_recep = first(hh.recep_type) if hh.recep_type else ""
    for obj in targets[:n]:
        src = hh.location_of[obj.id]
        go(src)
        plan.append(f"take {hh.name(obj.id)} from {hh.name(src)}")
        for verb, appliance in (("clean", "SinkBasin"), ("heat", "Microwave"), ("cool", "Fridge")):
            if hh.task_type == f"pick_{verb}_then_place_in_recep":
                app = first(appliance)
                if here != app:
                    plan.append(f"go to {hh.name(app)}")
                    here = app
                plan.append(f"{verb} {hh.name(obj.id)} with {hh.name(app)}")
        if hh.task_type == "look_at_obj_in_light":
            lamp = next(o for o in hh.objects if o.type == hh.toggle_type)
            if here != hh.location_of[lamp.id]:
                plan.append(f"go to {hh.name(hh.location_of[lamp.id])}")
            plan.append(f"use {hh.name(lamp.id)}")
            return plan
        go(goal_recep)
        plan.append(f"move {hh.name(obj.id)} to {hh.name(goal_recep)}")
    return plan
