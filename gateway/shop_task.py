"""The example agents' task: a question about a small shop, answered with two tools, and its checker.

    from gateway.shop_task import SYSTEM, TASKS, TOOLS, check, run_tool

`lookup` reads a price from TABLE, `calculator` does arithmetic; `check` compares the number in the final answer
with the task's. TOOLS are the tools' OpenAI JSON schemas (the engine writes calls under them with
`tool_choice="required"`); `run_tool` runs a call the model wrote and returns the text it reads next. The agents of
examples/ play it (the plain `openai` loop, the OpenAI Agents SDK, LangGraph) and so does bench/ecosystem.py's
verifiers ToolEnv. Standard library only: it runs wherever agent code does (the verifiers venv included).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass

# ------------------------------------------------------------------------------------------------ the tools
TABLE = {"apple": 3, "bread": 4, "cheese": 12, "milk": 2, "coffee": 9, "tea": 5}
"""The shop's prices: what `lookup` reads."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The price of one item in the shop.",
            "parameters": {
                "type": "object",
                "properties": {"item": {"type": "string", "enum": sorted(TABLE)}},
                "required": ["item"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/(). -]{1,30}$"}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
]
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> float:
    """+ - * / on numbers, nothing else (no names, no calls: safe on a model's text)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    return ev(ast.parse(expression[:200], mode="eval").body)


def run_tool(name: str, arguments: str) -> str:
    """A tool call's result as the text the model reads next; a bad call gets an error text, never an exception."""
    try:
        args = json.loads(arguments)
        if name == "lookup":
            item = str(args.get("item", "")).lower()
            return f"{item} costs {TABLE[item]}" if item in TABLE else f"error: no item {item!r} (see {sorted(TABLE)})"
        if name == "calculator":
            return str(calculate(str(args.get("expression", ""))))
        return f"error: no tool {name!r}"
    except (ValueError, TypeError, SyntaxError, ZeroDivisionError, RecursionError, AttributeError) as exc:
        return f"error: {exc}"


# ------------------------------------------------------------------------------------------------ the tasks
@dataclass(frozen=True)
class Task:
    id: str
    question: str
    answer: float


TASKS = [
    Task("apples", "How much do 3 apples cost?", 3 * TABLE["apple"]),
    Task("breakfast", "How much do 1 coffee and 2 bread cost together?", TABLE["coffee"] + 2 * TABLE["bread"]),
    Task("cheese", "How much do 2 cheese cost?", 2 * TABLE["cheese"]),
    Task("tea-milk", "How much do 4 tea and 1 milk cost?", 4 * TABLE["tea"] + TABLE["milk"]),
    Task("change", "I pay 50 for 3 cheese. How much change do I get?", 50 - 3 * TABLE["cheese"]),
    Task("difference", "How much more does coffee cost than milk?", TABLE["coffee"] - TABLE["milk"]),
    Task(
        "picnic",
        "How much do 2 apples, 1 bread and 1 cheese cost?",
        2 * TABLE["apple"] + TABLE["bread"] + TABLE["cheese"],
    ),
    Task("split", "Two friends split the cost of 4 coffee equally. How much does each pay?", 4 * TABLE["coffee"] / 2),
]
SYSTEM = "Find prices with lookup, compute with calculator, then reply: ANSWER: <number>"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def check(task: Task, answer: str) -> float:
    """1.0 if the last number in the final answer is the task's, else 0.0."""
    numbers = _NUMBER.findall(answer or "")
    return 1.0 if numbers and abs(float(numbers[-1]) - task.answer) < 1e-6 else 0.0
