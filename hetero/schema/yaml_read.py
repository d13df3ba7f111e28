"""Reading hetero's YAML files safely: bounded text in, composed nodes walked against a schema dataclass, every
problem collected at its `file:line:col`. Booleans are only `true`/`false`, numbers plain decimals; anchors, aliases
and deep nesting are refused from the token stream before the parser sees them.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import stat
import typing
from pathlib import Path
from typing import Any

import yaml

from hetero.errors import FileProblems, Problem
from hetero.schema.fields import FieldSpec, choices, is_optional, is_schema, specs, strip_optional
from hetero.units import LIMIT, MAX_DIGITS, quoted_cut

_STR, _INT, _FLOAT, _BOOL, _NULL, _SEQ, _MAP = (
    f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map"))
API_VERSION = "hetero/v1"
BAD = object()  # a value that failed validation; its problem is already recorded
MAX_BYTES = 16 << 20  # a profile of a 10,000-layer model is ~3 MiB
MAX_DEPTH = 32  # hetero's files nest 5 levels deep


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser when built in: several times faster
    """YAML 1.1 without its surprises: `yes`/`on`/`off` are words, `1:20` is not 80, `0x1f` is text."""

    yaml_implicit_resolvers: dict = {}


for _tag, _pattern, _first in [
    (_BOOL, r"^(?:true|false)$", "tf"),
    (_NULL, r"^(?:~|null|)$", ["~", "n", ""]),
    (_INT, r"^[-+]?[0-9]+$", "-+0123456789"),
    (_FLOAT, r"^[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?[0-9]+[eE][-+]?[0-9]+$", "-+.0123456789"),
]:
    _Loader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))


def read_text(path: Path, name: str) -> str:
    fd = None
    try:
        # Opened without waiting (a FIFO would block until someone writes to it), then refused unless a regular file.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise FileProblems([Problem(name, "is a directory, not a profile or plan file")])
        if not stat.S_ISREG(mode):
            raise FileProblems([Problem(name, "not a regular file (a pipe or a device): give the path of a profile or "
                                              "plan file")])
        data = os.read(fd, MAX_BYTES + 1)  # never more: a file's size may lie
        while len(data) <= MAX_BYTES and (more := os.read(fd, MAX_BYTES + 1 - len(data))):
            data += more
    except FileNotFoundError:
        raise FileProblems([Problem(name, "no such file")]) from None
    except OSError as e:
        raise FileProblems([Problem(name, f"cannot read: {e.strerror}")]) from None
    finally:
        if fd is not None:
            os.close(fd)
    if len(data) > MAX_BYTES:
        raise FileProblems([Problem(name, f"larger than {MAX_BYTES >> 20} MiB: not a profile or plan hetero wrote")])
    nul = data.find(b"\0")
    try:
        text = data.decode("utf-8")
        bad = nul if nul >= 0 else None
    except UnicodeDecodeError as e:
        bad = e.start if nul < 0 else min(e.start, nul)
    if bad is not None:
        message = f"not a text file (byte 0x{data[bad]:02x} at offset {bad}); expected a YAML profile or plan"
        raise FileProblems([Problem(name, message)])
    return text


def compose(text: str, name: str) -> yaml.Node:
    try:
        guard(text, name)
        docs = list(yaml.compose_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise FileProblems([problem_at(name, mark, f"YAML syntax error: {e.problem or e.context}")]) from None
    except yaml.reader.ReaderError as e:
        message = f"not a text file (character U+{e.character:04X} at offset {e.position})"
        raise FileProblems([Problem(name, message)]) from None
    docs = [d for d in docs if not (isinstance(d, yaml.ScalarNode) and d.tag == _NULL)]
    if not docs:
        raise FileProblems([Problem(name, f"empty file (expected a Profile or Plan starting with "
                                          f"'apiVersion: {API_VERSION}')", 1, 1)])
    if len(docs) > 1:
        raise FileProblems([problem_at(name, docs[1].start_mark, f"expected one YAML document, found {len(docs)}")])
    return docs[0]


_OPEN = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
         yaml.FlowSequenceStartToken)
_CLOSE = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)


def guard(text: str, name: str) -> None:
    """Refuse from the token stream (flat: no recursion, no expansion) a text over MAX_BYTES, nesting deeper than
    MAX_DEPTH (the parser recurses) and anchors or aliases (an alias bomb expands to gigabytes)."""
    if len(text) > MAX_BYTES:
        raise FileProblems([Problem(name, f"larger than {MAX_BYTES >> 20} MiB: not a profile or plan hetero wrote")])
    depth = 0
    for token in yaml.scan(text, Loader=_Loader):
        if isinstance(token, (yaml.AnchorToken, yaml.AliasToken)):
            what = "anchor" if isinstance(token, yaml.AnchorToken) else "alias"
            message = (f"YAML {what} {quoted_cut(token.value)}: hetero files take no anchors or aliases "
                       "(write values out)")
            raise FileProblems([problem_at(name, token.start_mark, message)])
        if isinstance(token, _OPEN):
            depth += 1
            if depth > MAX_DEPTH:
                raise FileProblems([problem_at(name, token.start_mark, f"nested more than {MAX_DEPTH} levels deep")])
        elif isinstance(token, _CLOSE):
            depth -= 1


class Reader:
    """Walks composed nodes against a schema type, recording a Problem for each bad value and going on."""

    def __init__(self, name: str, text: str):
        self.name = name
        self.lines = text.splitlines()
        self.problems: list[Problem] = []
        self.nodes: dict[str, yaml.Node] = {}

    def problem(self, node: yaml.Node, path: str, message: str) -> object:
        self.problems.append(problem_at(self.name, node.start_mark, f"{path}: {message}" if path else message))
        return BAD

    def dataclass(self, node: yaml.Node, cls: type, path: str, skip: tuple[str, ...] = (),
                  anchor_line: int | None = None) -> Any:
        if not isinstance(node, yaml.MappingNode):
            return self.problem(node, path, f"expected a mapping of {cls.__name__} keys, got {shape(node)}")
        by_key = {s.key: s for s in specs(cls) if not s.comment}
        values: dict[str, Any] = {}
        misspelt: set[str] = set()  # keys an unknown key was taken for: reported once, not also as missing
        for key_node, value_node in self._pairs(node, path):
            key = key_node.value
            if key in skip:
                continue
            if (spec := by_key.get(key)) is None:
                misspelt.add(self._unknown(key_node, list(by_key), path))
                continue
            child = f"{path}.{key}" if path else key
            values[spec.name] = self.value(value_node, spec.type, spec, child, key_node.start_mark.line)
        missing = [s for s in by_key.values() if s.required and s.name not in values]
        for spec in missing:
            if spec.key not in misspelt:
                self.problem(node, path, f"missing key {spec.key!r}")
        if misspelt or missing or any(v is BAD for v in values.values()):
            return BAD
        for spec in specs(cls):
            if spec.comment:
                values[spec.name] = self._why(node.start_mark.line if anchor_line is None else anchor_line)
        return self._checked(cls(**values), node, path)

    def _unknown(self, key_node: yaml.Node, keys: list[str], path: str) -> str:
        """Record an unknown key; the key it was probably meant to be, or ''."""
        where = f" in {path}" if path else ""
        message = f"unknown key {quoted_cut(key_node.value)}{where}" + did_you_mean(key_node.value, keys)
        self.problems.append(problem_at(self.name, key_node.start_mark, message))
        return closest(key_node.value, keys) or ""

    def _pairs(self, node: yaml.MappingNode, path: str):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.problem(key_node, path, "keys must be plain words")
            elif key_node.value in seen:
                self.problem(key_node, path, f"duplicate key {quoted_cut(key_node.value)}")
            else:
                seen.add(key_node.value)
                yield key_node, value_node

    def _checked(self, obj: Any, node: yaml.Node, path: str) -> Any:
        check = getattr(obj, "problems", None)
        for rel, message in check() if check else ():
            full = f"{path}.{rel}" if path else rel
            self.problem(self.nodes.get(full, node), full, message)
        return obj

    def value(self, node: yaml.Node, tp: Any, spec: FieldSpec, path: str, anchor_line: int) -> Any:
        self.nodes[path] = node
        if node.tag not in (_STR, _INT, _FLOAT, _BOOL, _NULL, _SEQ, _MAP):
            return self.problem(node, path, f"unsupported YAML tag {quoted_cut(node.tag)}")
        if isinstance(node, yaml.ScalarNode) and node.tag == _NULL:
            return None if is_optional(tp) else self.problem(node, path, "must not be null")
        tp = strip_optional(tp)
        origin = typing.get_origin(tp)
        if origin is list:
            return self._list(node, typing.get_args(tp)[0], spec, path)
        if origin is dict:
            return self._dict(node, typing.get_args(tp)[1], spec, path)
        if is_schema(tp):
            return self.dataclass(node, tp, path, anchor_line=anchor_line)
        return self.scalar(node, tp, spec, path)

    def _list(self, node: yaml.Node, item: Any, spec: FieldSpec, path: str) -> Any:
        if not isinstance(node, yaml.SequenceNode):
            return self.problem(node, path, f"expected a list, got {shape(node)}")
        out = [self.value(n, item, spec, f"{path}[{i}]", n.start_mark.line) for i, n in enumerate(node.value)]
        return BAD if any(v is BAD for v in out) else out

    def _dict(self, node: yaml.Node, item: Any, spec: FieldSpec, path: str) -> Any:
        if not isinstance(node, yaml.MappingNode):
            return self.problem(node, path, f"expected a mapping, got {shape(node)}")
        out = {k.value: self.value(v, item, spec, f"{path}.{k.value}", k.start_mark.line)
               for k, v in self._pairs(node, path)}
        return BAD if any(v is BAD for v in out.values()) else out

    def scalar(self, node: yaml.Node, tp: Any, spec: FieldSpec, path: str) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return self.problem(node, path, f"expected a single value, got {shape(node)}")
        try:
            value = convert(node, tp, spec)
        except ValueError as e:
            return self.problem(node, path, str(e))
        if spec.ge is not None and value < spec.ge or spec.le is not None and value > spec.le:
            return self.problem(node, path, f"{quoted_cut(node.value)[1:-1]} is out of range ({value_range(spec)})")
        return value

    def _why(self, line: int) -> str:
        match = re.search(r"\s#\s*why:\s?(.*)$", self.lines[line]) if line < len(self.lines) else None
        return match.group(1).strip() if match else ""


def convert(node: yaml.ScalarNode, tp: Any, spec: FieldSpec) -> Any:
    text, tag = node.value, node.tag
    if spec.unit is not None:
        raw = {_INT: lambda t: number(t, int), _FLOAT: lambda t: number(t, float),
               _BOOL: lambda t: t == "true"}.get(tag, str)(text)
        return spec.unit.parse(raw)
    if (words := choices(tp)) is not None:
        if text not in words:
            raise ValueError(f"{quoted_cut(text)} is not one of {one_of(words)}" + did_you_mean(text, words))
        return text
    if tp is str:
        return text
    tags, expected = {bool: ((_BOOL,), "true or false"), int: ((_INT,), "a whole number"),
                      float: ((_INT, _FLOAT), "a number")}[tp]
    if tag not in tags:
        raise ValueError(f"expected {expected}, got {quoted_cut(text)}")
    return text == "true" if tp is bool else number(text, tp)


def number(text: str, tp: type) -> int | float:
    """`text` (a YAML int or float) as `tp`: finite and within +-LIMIT; its length is checked before converting
    (Python refuses to convert ints of over 4300 digits with a message about its own settings)."""
    value = tp(text) if len(text) <= MAX_DIGITS + 8 else math.inf
    if not math.isfinite(value) or abs(value) > LIMIT:
        raise ValueError(f"{quoted_cut(text)} is out of range (at most {float(LIMIT):.3e})")
    return value


def problem_at(name: str, mark: Any, message: str) -> Problem:
    return Problem(name, message, mark.line + 1, mark.column + 1) if mark else Problem(name, message)


def closest(word: str, options: typing.Sequence[str]) -> str | None:
    return next(iter(difflib.get_close_matches(word, options, n=1, cutoff=0.6)), None)


def did_you_mean(word: str, options: typing.Sequence[str]) -> str:
    close = closest(word, options)
    return f" (did you mean {close!r}?)" if close else ""


def one_of(words: typing.Sequence[str]) -> str:
    words = list(words)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" or {words[-1]}"


def shape(node: yaml.Node) -> str:
    return "a mapping" if isinstance(node, yaml.MappingNode) else \
        "a list" if isinstance(node, yaml.SequenceNode) else quoted_cut(node.value)


def value_range(spec: FieldSpec) -> str:
    if spec.ge is not None and spec.le is not None:
        return f"{spec.ge:g} to {spec.le:g}"
    return f">= {spec.ge:g}" if spec.ge is not None else f"<= {spec.le:g}"
