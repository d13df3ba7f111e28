"""Writing hetero's YAML files: dataclasses rendered back with units, a flow-style line per list entry, and each
`why` as a `# why:` comment (which reading recovers)."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any

from hetero.schema.fields import FieldSpec, is_schema, left_out, specs, strip_optional


def render(obj: Any, lines: list[str]) -> None:
    """Append the block-style YAML lines of the schema object `obj` to `lines`."""
    _block_map(_tree(obj, None, type(obj)), 0, lines)


@dataclasses.dataclass(slots=True)
class _Map:
    items: list[tuple[str, Any]]  # (key text, str | _Map | _Seq)
    why: str = ""


@dataclasses.dataclass(slots=True)
class _Seq:
    items: list[Any]
    why: str = ""


class _Null(str):
    """`null`, with the reason the section is absent (a plan's `omitted`) as its `# why:`."""

    def __new__(cls, why: str):
        out = super().__new__(cls, "null")
        out.why = why
        return out


def _tree(value: Any, spec: FieldSpec | None, tp: Any) -> Any:
    """The text of a scalar, or a _Map/_Seq of texts, with the `why` comments attached."""
    tp = strip_optional(tp)
    if value is None:
        return "null"
    if is_schema(type(value)):
        fields = [s for s in specs(type(value)) if not s.comment and not left_out(value, s)]
        why = next((getattr(value, s.name) for s in specs(type(value)) if s.comment), "")
        return _Map([(s.key, _said_why(_tree(getattr(value, s.name), s, s.type), s.key, value)) for s in fields], why)
    if isinstance(value, list):
        return _Seq([_tree(v, spec, typing.get_args(tp)[0]) for v in value])
    if isinstance(value, dict):
        return _Map([(_text(k), _tree(v, spec, typing.get_args(tp)[1])) for k, v in value.items()])
    if spec is not None and spec.unit is not None:
        return spec.unit.format_exact(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return _text(value)


def _said_why(node: Any, key: str, owner: Any) -> Any:
    """An absent section (null, or an empty list) of an object that says why in `omitted`, with that reason."""
    omitted = getattr(owner, "omitted", None)
    why = omitted.get(key) if isinstance(omitted, dict) else None
    if why and node == "null":
        return _Null(why)
    return _Seq([], why) if why and isinstance(node, _Seq) and not node.items else node


_PLAIN = re.compile(r"^[A-Za-z0-9_/][A-Za-z0-9_./:@+\- ]*$")
_IMPLICIT = re.compile(r"^(?:true|false|null|~|[-+]?[0-9.][0-9.eE+-]*)$")


def _text(s: str) -> str:
    """`s` plain where YAML reads it back as the same string, double-quoted otherwise."""
    if _PLAIN.match(s) and not _IMPLICIT.match(s) and ": " not in s and not s.endswith((" ", ":")):
        return s
    return json.dumps(s, ensure_ascii=False)


def _flow(node: Any) -> str | None:
    """`node` on one line, or None when it holds a list of mappings (kept as a block, one entry per line)."""
    if isinstance(node, str):
        return node
    if isinstance(node, _Seq):
        if any(isinstance(i, _Map) for i in node.items):
            return None
        parts = [_flow(i) for i in node.items]
        return None if None in parts else "[" + ", ".join(parts) + "]"
    parts = [(k, _flow(v)) for k, v in node.items]
    return None if any(p is None for _, p in parts) else "{" + ", ".join(f"{k}: {v}" for k, v in parts) + "}"


def _comment(line: str, why: str) -> str:
    return f"{line}  # why: {' '.join(why.split())}" if why else line


def _block_map(node: _Map, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    for key, value in node.items:
        flow = _flow(value)
        why = getattr(value, "why", "")
        if flow is not None and (len(pad) + len(key) + len(flow) <= 110 or isinstance(value, str)):
            lines.append(_comment(f"{pad}{key}: {flow}", why))
        elif isinstance(value, _Map):
            lines.append(_comment(f"{pad}{key}:", why))
            _block_map(value, indent + 2, lines)
        else:
            lines.append(f"{pad}{key}:")
            _block_seq(value, indent + 2, lines)


def _block_seq(node: _Seq, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    for item in node.items:
        flow = _flow(item)
        why = item.why if isinstance(item, _Map) else ""
        if flow is not None:
            lines.append(_comment(f"{pad}- {flow}", why))
            continue
        start = len(lines)
        _block_map(item, indent + 2, lines) if isinstance(item, _Map) else _block_seq(item, indent + 2, lines)
        lines[start] = _comment(f"{pad}- {lines[start][indent + 2:]}", why)
