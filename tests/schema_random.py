"""Random instances of any schema dataclass, driven by the same field declarations the loader reads."""

from __future__ import annotations

import dataclasses
import random
import typing
from typing import Any

from hetero.schema.fields import FieldSpec, choices, is_optional, is_schema, specs, strip_optional

# Strings that break naive YAML writers: booleans and numbers in disguise, indicators, quotes, unicode.
TRICKY = ["h.0.attn", "0", "true", "yes", "off", "null", "~", "1e5", "0x1f", "1:20", "a: b", "x # y", "", " lead",
          "-dash", "sha256:ab12", "[x]", "{y}", "a,b", 'quo"te', "it's", "tab\tx", "new\nline", "ünï", "/tmp/x y",
          "trailing:", "*star", "&amp", "!bang", "%pct", "@at", "`tick`", "? q", "| pipe", "> gt"]


def instance(cls: type, rng: random.Random) -> Any:
    values = {s.name: _why(rng) if s.comment else value(s.type, s, rng) for s in specs(cls)}
    return cls(**values)


def value(tp: Any, spec: FieldSpec, rng: random.Random) -> Any:
    if is_optional(tp) and rng.random() < 0.3:
        return None
    tp = strip_optional(tp)
    origin = typing.get_origin(tp)
    if origin is list:
        return [value(typing.get_args(tp)[0], spec, rng) for _ in range(rng.randint(0, 3))]
    if origin is dict:
        return {_name(rng): value(typing.get_args(tp)[1], spec, rng) for _ in range(rng.randint(0, 3))}
    if is_schema(tp):
        return instance(tp, rng)
    if spec.unit is not None:
        return _quantity(spec, rng)
    if (words := choices(tp)) is not None:
        return rng.choice(words)
    if tp is bool:
        return rng.random() < 0.5
    low = int(spec.ge or 0)
    if tp is int:
        return rng.randint(low, low + 8)
    if tp is float:
        return rng.uniform(low, spec.le if spec.le is not None else 1e3)
    return _name(rng)


def _quantity(spec: FieldSpec, rng: random.Random) -> int | float:
    if spec.unit.integral:
        return rng.choice([0, 1, 1023, 1024, rng.randint(0, 2**50)])
    return rng.choice([0.0, 1.0, 10 ** rng.uniform(-10, 6), rng.random()])


def _name(rng: random.Random) -> str:
    return rng.choice(TRICKY) if rng.random() < 0.5 else f"layer.{rng.randint(0, 10**6)}"


def _why(rng: random.Random) -> str:
    return rng.choice(["", "DHA fp 0.21ms < copy 3.1ms + fp 0.05ms"])


def valid(obj: Any) -> bool:
    """True when no `problems()` check anywhere in `obj` objects to it (what the loader would accept)."""
    if isinstance(obj, list):
        return all(valid(v) for v in obj)
    if isinstance(obj, dict):
        return all(valid(v) for v in obj.values())
    if not dataclasses.is_dataclass(obj):
        return True
    check = getattr(obj, "problems", None)
    if check and check():
        return False
    return all(valid(getattr(obj, s.name)) for s in specs(type(obj)))
