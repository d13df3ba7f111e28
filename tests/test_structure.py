"""The house's shape, drawn from its imports (docs/architecture.md): floors from the CLI down to the schemas, every
import running down a floor or within one, no import circle, and planning importable without torch."""

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

# Top to bottom. Packages on one floor may import each other, as long as no circle forms.
FLOORS = [
    {"cli", "docs", "__main__"},
    {"launch"},
    {"profile"},
    {"run"},
    {"harness", "plan", "report", "kernels"},
    {"schema"},
    {"units", "errors", "interrupts", "hetero"},
]
FLOOR = {package: k for k, floor in enumerate(FLOORS) for package in floor}


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


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_package_has_a_floor():
    assert {package(m) for m in graph()} <= set(FLOOR)


def test_imports_run_down_the_floors():
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in targets
              if FLOOR[package(a)] > FLOOR[package(b)]]
    assert upward == []


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
