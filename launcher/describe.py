"""Every config field with its type, default and one-line description, read from `agentstream.config`.

    python scripts/launch.py --fields            # all of them
    python scripts/launch.py --fields trainer    # the fields under `trainer.`

The descriptions are the attribute docstrings of the dataclasses (the string right under each field), read
with `ast` from the source, so that the code and this listing cannot disagree.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from dataclasses import dataclass

from agentstream import config as config_mod


@dataclass(frozen=True)
class FieldDoc:
    """One config field as the user sets it on the command line."""

    name: str  # dotted, e.g. trainer.total_steps
    type: str
    default: str
    doc: str  # the field's docstring, joined into one line; "" if it has none


def attribute_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of a dataclass whose fields are each followed by a string literal."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "(required)"


def field_docs(root: type = config_mod.Config) -> list[FieldDoc]:
    """Every leaf field under `root` (sections are the dataclass-typed fields of `root`), in source order."""
    out: list[FieldDoc] = []
    hints = typing.get_type_hints(root)
    for section in dataclasses.fields(root):
        cls = hints[section.name]
        docs, sub_hints = attribute_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            type_name = getattr(sub_hints[f.name], "__name__", str(sub_hints[f.name]))
            out.append(FieldDoc(f"{section.name}.{f.name}", type_name, _default(f), docs.get(f.name, "")))
    return out


def render(fields: list[FieldDoc], prefix: str = "") -> str:
    """The listing `--fields` prints: one block per field, name = default (type), then its description."""
    lines = []
    for fd in fields:
        if fd.name.startswith(prefix):
            lines.append(f"{fd.name} = {fd.default}  ({fd.type})\n    {fd.doc or '(no description)'}")
    return "\n".join(lines) if lines else f"no config field starts with {prefix!r}"


__all__ = ["FieldDoc", "attribute_docs", "field_docs", "render"]
