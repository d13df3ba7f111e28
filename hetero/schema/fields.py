"""How schema dataclasses declare their fields, and how the YAML boundary reads those declarations: `doc(...)`
gives a field's documentation, unit and bounds, from which validation, the YAML key and the docs are derived.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass
from functools import cache
from typing import Any, Literal, Union

from hetero.units import Unit

# Bounds on counts, checked at load: far above any real machine or run, low enough that a typo (or a hostile
# file) cannot make hetero allocate gigabytes or plan for minutes.
MAX_CHANNELS = 32  # AXDIMM channels: each emulated one is a worker thread and its buffers
MAX_RANK = 65535  # data-parallel ranks
MAX_MICRO_BATCHES = 4096  # gradient accumulation
MAX_STEPS = 1_000_000  # steps profiled or recorded
MAX_CORES = 65536  # cores, NUMA nodes
MAX_LINK = 64  # PCIe generation and lanes
MAX_LAYERS = 20_000  # layers in a profile (a 175B GPT has ~1,000 modules); `hetero plan` stays far from minutes there


def doc(text: str, *, unit: Unit | None = None, default: Any = MISSING, default_factory: Any = MISSING,
        ge: float | None = None, le: float | None = None, comment: bool = False, added: bool = False) -> Any:
    """A documented schema field. `comment=True`: written as a `# why:` comment, not a key; `added=True`: added after
    files were written without it, so left out of files and hashes while at its default (`left_out`)."""
    meta = {"doc": text, "unit": unit, "ge": ge, "le": le, "comment": comment, "added": added}
    if comment:
        return dataclasses.field(default=default, metadata=meta, compare=False)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field of a schema class as the YAML boundary sees it."""

    name: str  # the dataclass attribute, with its unit suffix: "fp_s"
    key: str  # the YAML key, without it: "fp"
    type: Any  # the resolved annotation
    doc: str
    unit: Unit | None
    ge: float | None
    le: float | None
    comment: bool
    required: bool
    added: bool = False  # added after files were written without it: left out of them while at its default

    @property
    def optional(self) -> bool:
        return is_optional(self.type)


@cache
def specs(cls: type) -> tuple[FieldSpec, ...]:
    """The fields of a schema dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        assert "doc" in meta, f"{cls.__name__}.{f.name} is not declared with doc()"
        unit = meta["unit"]
        key = f.name.removesuffix(unit.suffix) if unit is not None and unit.suffix else f.name
        required = f.default is MISSING and f.default_factory is MISSING
        out.append(FieldSpec(f.name, key, hints[f.name], meta["doc"], unit, meta["ge"], meta["le"],
                             meta["comment"], required, meta.get("added", False)))
    keys = [s.key for s in out]
    assert len(set(keys)) == len(keys), f"{cls.__name__}: two fields share a YAML key in {keys}"
    return tuple(out)


def left_out(obj: Any, spec: FieldSpec) -> bool:
    """Whether `obj`'s field is one added later (`doc(added=True)`) that holds its default: files and hashes leave it
    out, so older files keep their hash and newer ones stay readable by older hetero."""
    if not spec.added:
        return False
    field = next(f for f in dataclasses.fields(obj) if f.name == spec.name)
    default = field.default_factory() if field.default_factory is not MISSING else field.default
    return getattr(obj, spec.name) == default


def is_schema(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def strip_optional(tp: Any) -> Any:
    if not is_optional(tp):
        return tp
    rest = [a for a in typing.get_args(tp) if a is not type(None)]
    assert len(rest) == 1, f"only `X | None` unions are supported, got {tp}"
    return rest[0]


def choices(tp: Any) -> tuple[str, ...] | None:
    """The allowed words of a `Literal[...]` enumeration, or None."""
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def describe(spec: FieldSpec) -> str:
    """A short type description for docs: `size`, `one of gfgb, dha, dfgb`, `integer >= 1`, `list of Layer`."""
    text = _describe_type(strip_optional(spec.type), spec.unit)
    if spec.ge is not None and spec.le is not None:
        text += f" from {spec.ge:g} to {spec.le:g}"
    elif spec.ge is not None:
        text += f" >= {spec.ge:g}"
    return f"{text} or null" if spec.optional else text


def _describe_type(tp: Any, unit: Unit | None) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        return f"list of {_describe_type(typing.get_args(tp)[0], unit)}"
    if origin is dict:
        return f"mapping of name to {_describe_type(typing.get_args(tp)[1], unit)}"
    if unit is not None:
        return unit.name
    if (words := choices(tp)) is not None:
        return "one of " + ", ".join(words)
    if is_schema(tp):
        return tp.__name__
    return {str: "text", int: "integer", float: "number", bool: "true or false"}[tp]


def unique_names(items: list, path: str, attr: str = "name") -> list[tuple[str, str]]:
    """(YAML path, message) for every entry whose `attr` repeats an earlier one; for `problems()` methods."""
    seen: dict[str, int] = {}
    out = []
    for i, item in enumerate(items):
        value = getattr(item, attr)
        if value in seen:
            out.append((f"{path}[{i}].{attr}", f"duplicate {attr} {value!r} (first at {path}[{seen[value]}])"))
        seen.setdefault(value, i)
    return out
