"""The house's shape, drawn from its imports and checked against the one table docs/architecture.md shows: floors
from the CLI down to the schemas, every import running down a floor or within one, no import circle, each row's
Imports column what its packages import, and planning importable without torch."""

import ast
import functools
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"


@dataclass(frozen=True)
class Row:
    """One row of the doc's floor table."""

    floor: int
    packages: frozenset[str]  # top-level names under hetero/: `cli` for cli/, `units` for units.py, `hetero` itself
    imports: frozenset[str] | None  # packages outside the row it imports; None: `everything below`


def _name(cell: str) -> str:
    """`cli/` -> cli, `units.py` -> units, `__init__.py` -> hetero (the package's own module)."""
    name = cell.strip().strip("`").removesuffix("/").removesuffix(".py")
    return "hetero" if name == "__init__" else name


def floor_table(text: str) -> list[Row]:
    """The table under `## The floors`: Floor | Package | Owns | Imports. In Imports, what a parenthesis says is a
    comment; `everything below` and `nothing` are words, not names."""
    section = text.split("## The floors", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        floor, packages, _, imports = cells
        names = frozenset(_name(n) for n in re.findall(r"`[^`]+`", packages))
        listed = re.sub(r"\([^)]*\)", "", imports).strip()
        if listed == "everything below":
            rows.append(Row(int(floor), names, None))
            continue
        rows.append(Row(int(floor), names, frozenset() if listed == "nothing" else
                        frozenset(_name(n) for n in listed.split(",") if n.strip())))
    return rows


ROWS = floor_table(ARCHITECTURE.read_text())
FLOOR = {name: row.floor for row in ROWS for name in row.packages}


def modules() -> dict[str, Path]:
    out = {}
    for path in (REPO / "hetero").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The hetero modules `name` imports, at the top or inside a function alike."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name and target.startswith("hetero"):
                found.add(target)
    return found


@functools.cache  # parsing every module takes seconds; the tests only read it
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_doc_shows_a_table_of_floors():
    assert len(ROWS) >= 8 and all(row.packages for row in ROWS)
    assert len(FLOOR) == sum(len(r.packages) for r in ROWS), "a package in two rows"
    assert [r.floor for r in ROWS] == sorted(r.floor for r in ROWS)


def test_every_package_has_a_floor():
    """Every package and top-level module of hetero/ is in the doc's table, and every name there exists."""
    assert {package(m) for m in graph()} == set(FLOOR)


def disagreements(rows: list[Row], edges: dict[str, set[str]]) -> list[str]:
    """Where a row's Imports column is not what its packages import from outside the row."""
    # not `package`: Python 3.12 inlines comprehensions (PEP 709), and a loop variable of that name made the
    # function `package` an unbound local in the next comprehension (UnboundLocalError on the GPU image's 3.12.3)
    floor = {name: row.floor for row in rows for name in row.packages}
    wrong = []
    for row in rows:
        actual = {package(b) for a, bs in edges.items() if package(a) in row.packages for b in bs} - row.packages
        if row.imports is None:  # everything below
            wrong += [f"{sorted(row.packages)} imports {p}, not below it" for p in actual if floor[p] <= row.floor]
            continue
        wrong += [f"{sorted(row.packages)} imports {p}, which its Imports column leaves out"
                  for p in sorted(actual - row.imports)]
        wrong += [f"{sorted(row.packages)} lists {p} in its Imports column but imports nothing of it"
                  for p in sorted(row.imports - actual)]
    return wrong


def test_each_rows_imports_are_what_the_doc_says():
    """A row's Imports column is what its packages import from outside the row: nothing more, nothing less."""
    assert disagreements(ROWS, graph()) == []


def test_a_doc_that_disagrees_with_the_imports_fails():
    text, edges = ARCHITECTURE.read_text(), graph()
    plan_row = next(line for line in text.splitlines() if line.startswith("| 4 | `plan/`"))
    imports = plan_row.rsplit("|", 2)[1]
    fewer = floor_table(text.replace(plan_row, plan_row.replace(imports, " units, errors ")))
    assert "['plan'] imports schema, which its Imports column leaves out" in disagreements(fewer, edges)
    more = floor_table(text.replace(plan_row, plan_row.replace(imports, imports.rstrip() + ", report ")))
    assert "['plan'] lists report in its Imports column but imports nothing of it" in disagreements(more, edges)
    up = floor_table(text.replace("| 5 | `schema/` |", "| 1 | `schema/` |"))
    assert any(e.startswith("hetero.plan.") and " -> hetero.schema." in e
               for e in upward({p: r.floor for r in up for p in r.packages}, edges))


def upward(floor: dict[str, int], edges: dict[str, set[str]]) -> list[str]:
    return [f"{a} -> {b}" for a, targets in edges.items() for b in targets if floor[package(a)] > floor[package(b)]]


def test_imports_run_down_the_floors():
    assert upward(FLOOR, graph()) == []


def test_no_import_circle():
    edges, state, circles = graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_run_never_imports_profile_and_plan_never_imports_run():
    edges = graph()
    assert not [(a, b) for a, bs in edges.items() for b in bs if package(a) == "run" and package(b) == "profile"]
    assert not [(a, b) for a, bs in edges.items() for b in bs if package(a) == "plan" and package(b) in ("run", "profile")]


def test_planning_imports_without_torch():
    """`hetero plan`, `check` and `show` stay fast and work where torch is absent: no planning module needs it."""
    plan_modules = sorted(m for m in graph() if package(m) == "plan")
    code = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
            + "".join(f"import {m}\n" for m in plan_modules)
            + "import hetero.schema.files\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(plan_modules) > 10
