"""Generated text-to-SQL tasks: a small company database in SQLite, a question and its gold query.

Everything is a pure function of the seed: the rows, the question template and its parameters. The file
goes where skyrl-gym's `text2sql` env looks for Spider databases: `<root>/spider/database/<db_id>/<db_id>.sqlite`.
"""

from __future__ import annotations

import os
import random
import sqlite3
from dataclasses import dataclass

SCHEMA = (
    "CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, budget INTEGER NOT NULL);\n"
    "CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, "
    "department_id INTEGER NOT NULL REFERENCES departments(id), city TEXT NOT NULL, salary INTEGER NOT NULL, "
    "hire_year INTEGER NOT NULL);"
)

DEPARTMENTS = ["Sales", "Engineering", "Support", "Finance", "Legal", "Research", "Marketing"]
CITIES = ["Oslo", "Lima", "Kyoto", "Austin", "Porto", "Accra", "Perth"]
FIRST = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lu", "Mo", "Ned", "Ola", "Pia"]
LAST = ["Stone", "Reed", "Marsh", "Vale", "Frost", "Hale", "Quill", "Birch", "Crane", "Dunn"]


@dataclass(frozen=True)
class SQLTask:
    db_id: str
    question: str
    gold_sql: str


def _rows(rng: random.Random) -> tuple[list[tuple], list[tuple]]:
    depts = [(i + 1, name, rng.randrange(100, 900) * 1000) for i, name in enumerate(rng.sample(DEPARTMENTS, 4))]
    salaries = rng.sample(range(30, 200), 24)  # distinct, so "the highest paid" is unique
    employees = []
    for i, salary in enumerate(salaries):
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        employees.append(
            (i + 1, name, rng.randint(1, len(depts)), rng.choice(CITIES[:4]), salary * 1000, rng.randint(2010, 2024))
        )
    return depts, employees


def _question(rng: random.Random, depts: list[tuple], employees: list[tuple]) -> tuple[str, str]:
    dept = rng.choice(depts)[1]
    city = rng.choice(employees)[3]
    year = rng.randint(2012, 2022)
    pay = rng.randrange(60, 160) * 1000
    templates = [
        (
            f"How many employees work in the {dept} department?",
            f"SELECT COUNT(*) FROM employees e JOIN departments d ON e.department_id = d.id WHERE d.name = '{dept}'",
        ),
        (
            f"What is the name of the highest-paid employee based in {city}?",
            f"SELECT name FROM employees WHERE city = '{city}' ORDER BY salary DESC LIMIT 1",
        ),
        (
            f"List the names of the employees hired after {year} who earn more than {pay}.",
            f"SELECT name FROM employees WHERE hire_year > {year} AND salary > {pay}",
        ),
        (
            "Which department has the largest total salary of its employees?",
            "SELECT d.name FROM employees e JOIN departments d ON e.department_id = d.id GROUP BY d.id "
            "ORDER BY SUM(e.salary) DESC LIMIT 1",
        ),
        (
            f"What is the average salary in the {dept} department, rounded to the nearest whole number?",
            f"SELECT ROUND(AVG(e.salary)) FROM employees e JOIN departments d ON e.department_id = d.id "
            f"WHERE d.name = '{dept}'",
        ),
        (
            f"How many employees based in {city} were hired in or before {year}?",
            f"SELECT COUNT(*) FROM employees WHERE city = '{city}' AND hire_year <= {year}",
        ),
    ]
    return rng.choice(templates)


def make_task(seed: int, root: str) -> SQLTask:
    """Write the database for `seed` under `root` (Spider layout) and return its question and gold query."""
    rng = random.Random(f"text2sql-{seed}")
    depts, employees = _rows(rng)
    question, gold = _question(rng, depts, employees)
    db_id = f"company_{seed}"
    folder = os.path.join(root, "spider", "database", db_id)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{db_id}.sqlite")
    if os.path.exists(path):
        os.remove(path)
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode=OFF")  # a throwaway file: no journal, no fsync
        conn.execute("PRAGMA synchronous=OFF")
        conn.executescript(SCHEMA)
        conn.executemany("INSERT INTO departments VALUES (?, ?, ?)", depts)
        conn.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?, ?)", employees)
        conn.commit()
    finally:
        conn.close()
    return SQLTask(db_id, question, gold)
