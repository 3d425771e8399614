"""The layout holds: no import circle between modules, no import that crosses a layer the wrong way, and every
example runs alone.

The layers (pyproject.toml, `[tool.importlinter]`), bottom to top: `agentstream` (the config schema and the
wire library) -> `envs` | `memory` -> `engines` -> `actors` | `broker` | `learner` | `gateway` -> `launcher`; and the
learner imports nothing of `engines` (the weight pipe's two ends share only `agentstream.weights`).
Every import counts, also those inside functions and under `if TYPE_CHECKING:`. Both checks are shown to fail on a
small package made here that breaks them. An example (examples/*.py, run as a script, not a package) imports of the
project only gateway/'s agent side, as installed modules, and never another example (it would need examples/ on
`sys.path`: a copy of the file would not run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agentstream", "envs", "memory", "engines", "actors", "broker", "learner", "gateway", "launcher", "bench")
AGENT_SIDE = ("gateway.episode_client", "gateway.agent_runner", "gateway.shop_task")
"""What of the project an example may import (standard library and `openai` only: the verifiers venv has them)."""
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every set of modules that import each other in a circle (Tarjan's strongly connected components of
    size > 1, and modules that import themselves), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(root: str) -> None:  # iterative: a deep chain must not hit Python's recursion limit
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.find_modules_directly_imported_by(node):
                    cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    assert len(graph.modules) > 80  # every package was found (a typo in PACKAGES would find nothing)
    cycles = import_cycles(graph)
    assert cycles == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for m in ("p.a", "p.b", "p.c", "p.d"):
        graph.add_module(m)
    # a -> b -> c -> a is a circle; d -> a is not part of it.
    for importer, imported in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.a")]:
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


def lint_imports(cwd: Path, config: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=cwd,
        text=True,
        capture_output=True,
        env={"PYTHONPATH": str(pythonpath), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


def test_every_import_goes_down_the_layers() -> None:
    proc = lint_imports(ROOT, ROOT / "pyproject.toml", ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 kept, 0 broken" in proc.stdout


def test_an_import_up_the_layers_is_caught(tmp_path: Path) -> None:
    # `low` is the lower layer; a function-level import of `high` inside it breaks the contract.
    for package, body in [("high", "import low\n"), ("low", "def f():\n    import high\n")]:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(body)
    config = tmp_path / "layers.toml"
    config.write_text(
        textwrap.dedent("""
        [tool.importlinter]
        root_packages = ["high", "low"]
        [[tool.importlinter.contracts]]
        name = "high over low"
        type = "layers"
        layers = ["high", "low"]
    """)
    )
    proc = lint_imports(tmp_path, config, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "low -> high" in proc.stdout


def imports_of(path: Path) -> set[str]:
    """The modules a file imports (relative ones with their leading dots)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
    return out


def examples_that_lean_on_others(folder: Path) -> dict[str, list[str]]:
    """Per example in `folder`, what it imports of the project other than AGENT_SIDE, or of the other examples."""
    examples = sorted(folder.glob("*.py"))
    ours = set(PACKAGES) | {p.stem for p in examples}
    found = {}
    for path in examples:
        wrong = sorted(
            m for m in imports_of(path) if m.startswith(".") or (m.split(".")[0] in ours and m not in AGENT_SIDE)
        )
        if wrong:
            found[path.name] = wrong
    return found


def test_each_example_runs_alone() -> None:
    assert len(list((ROOT / "examples").glob("*.py"))) >= 4
    assert examples_that_lean_on_others(ROOT / "examples") == {}


def test_an_example_that_imports_a_sibling_is_caught(tmp_path: Path) -> None:
    (tmp_path / "helper.py").write_text("X = 1\n")
    (tmp_path / "agent.py").write_text(
        "from helper import X\nfrom gateway.episode_client import open_episode\n"
        "from gateway import server\nimport launcher.run\n"
    )
    assert examples_that_lean_on_others(tmp_path) == {"agent.py": ["gateway", "helper", "launcher.run"]}
