"""The key reference of docs/plan-format.md, generated from the schema so the docs cannot drift from the code.

`python -m hetero.docs docs/plan-format.md` rewrites the part of that file between the two markers; a test fails
when it is out of date.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from hetero.schema.fields import describe, is_schema, specs, strip_optional
from hetero.schema.files import KINDS

BEGIN = "<!-- BEGIN GENERATED: python -m hetero.docs docs/plan-format.md -->"
END = "<!-- END GENERATED -->"


def reference() -> str:
    """Markdown tables, one per schema class, in the order a reader meets them in each file."""
    out: list[str] = []
    seen: set[type] = set()
    for kind, cls in KINDS.items():
        out.append(f"### kind: {kind}\n")
        _classes(cls, kind, out, seen)
    return "\n".join(out).rstrip() + "\n"


def _classes(cls: type, where: str, out: list[str], seen: set[type]) -> None:
    if cls in seen:
        return
    seen.add(cls)
    out += [f"#### `{where}` ({cls.__name__})\n", f"{(cls.__doc__ or '').strip()}\n", "| key | value | meaning |",
            "| --- | --- | --- |"]
    nested = []
    for spec in specs(cls):
        key = "`# why:` comment" if spec.comment else f"`{spec.key}`"
        value = describe(spec) + ("" if spec.required or spec.comment else " (optional)")
        out.append(f"| {key} | {value} | {spec.doc.replace('|', '/')} |")
        if (inner := _schema_of(spec.type)) is not None:
            nested.append((inner, f"{where}.{spec.key}"))
    out.append("")
    for inner, path in nested:
        _classes(inner, path, out, seen)


def _schema_of(tp: typing.Any) -> type | None:
    tp = strip_optional(tp)
    if typing.get_origin(tp) in (list, dict):
        tp = typing.get_args(tp)[-1]
    return tp if is_schema(tp) else None


def update(path: Path) -> bool:
    """Rewrite the generated part of `path`; True if it changed."""
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{reference()}{END}{tail}"
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    print("updated" if update(Path(sys.argv[1])) else "up to date", sys.argv[1])
