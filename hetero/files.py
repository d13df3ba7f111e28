"""The one YAML boundary: profile.yaml and plan.yaml in and out.

Reading composes the YAML into nodes (which keep line and column) with a loader whose only booleans are
`true`/`false` and whose numbers are plain decimals, then walks the nodes against the schema dataclasses. Every
problem is collected with its `file:line:col` before anything is reported. Writing renders the dataclasses
back with units, a flow-style line per list entry, and each `why` as a `# why:` comment, which reading recovers.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import tempfile
import typing
from pathlib import Path
from typing import Any

import yaml

from hetero.errors import FileProblems, Problem
from hetero.fields import FieldSpec, choices, is_optional, is_schema, specs, strip_optional
from hetero.plan.schema import Plan
from hetero.profile.schema import Profile
from hetero.report.schema import Run
from hetero.units import _DIGITS, LIMIT, _cut

API_VERSION = "hetero/v1"
KINDS: dict[str, type] = {"Profile": Profile, "Plan": Plan, "Run": Run}
_STR, _INT, _FLOAT, _BOOL, _NULL, _SEQ, _MAP = (
    f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map"))
_BAD = object()  # a value that failed validation; its problem is already recorded
MAX_BYTES = 16 << 20  # a profile of a 10,000-layer model is ~3 MiB
MAX_DEPTH = 32  # hetero's files nest 5 levels deep


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser when built in: 4-5x faster
    """YAML 1.1 without its surprises: `yes`/`on`/`off` are words, `1:20` is not 80, `0x1f` is text."""

    yaml_implicit_resolvers: dict = {}


for _tag, _pattern, _first in [
    (_BOOL, r"^(?:true|false)$", "tf"),
    (_NULL, r"^(?:~|null|)$", ["~", "n", ""]),
    (_INT, r"^[-+]?[0-9]+$", "-+0123456789"),
    (_FLOAT, r"^[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?[0-9]+[eE][-+]?[0-9]+$", "-+.0123456789"),
]:
    _Loader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))


# -- reading ---------------------------------------------------------------------------------------------------


def load(path: str | os.PathLike, expect: type | None = None) -> Any:
    """The Profile or Plan in `path`; FileProblems listing every problem if it is not a valid one."""
    name = str(path)
    return loads(_read_text(Path(path), name), name=name, expect=expect)


def loads(text: str, name: str = "<string>", expect: type | None = None) -> Any:
    root = _compose(text, name)
    cls = _header(root, name, expect)
    reader = _Reader(name, text)
    obj = reader.dataclass(root, cls, "", skip=("apiVersion", "kind"))
    if reader.problems:
        raise FileProblems(reader.problems)
    return obj


def _read_text(path: Path, name: str) -> str:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)  # never more: a file's size may lie (a pipe, /dev/zero)
    except FileNotFoundError:
        raise FileProblems([Problem(name, "no such file")]) from None
    except IsADirectoryError:
        raise FileProblems([Problem(name, "is a directory, not a profile or plan file")]) from None
    except OSError as e:
        raise FileProblems([Problem(name, f"cannot read: {e.strerror}")]) from None
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


def _compose(text: str, name: str) -> yaml.Node:
    try:
        _guard(text, name)
        docs = list(yaml.compose_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise FileProblems([_problem(name, mark, f"YAML syntax error: {e.problem or e.context}")]) from None
    except yaml.reader.ReaderError as e:
        message = f"not a text file (character U+{e.character:04X} at offset {e.position})"
        raise FileProblems([Problem(name, message)]) from None
    docs = [d for d in docs if not (isinstance(d, yaml.ScalarNode) and d.tag == _NULL)]
    if not docs:
        raise FileProblems([Problem(name, f"empty file (expected a Profile or Plan starting with "
                                          f"'apiVersion: {API_VERSION}')", 1, 1)])
    if len(docs) > 1:
        raise FileProblems([_problem(name, docs[1].start_mark, f"expected one YAML document, found {len(docs)}")])
    return docs[0]


_OPEN = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
         yaml.FlowSequenceStartToken)
_CLOSE = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)


def _guard(text: str, name: str) -> None:
    """Refuse, from the token stream alone (flat, no recursion, no expansion), what the parser or the reader must
    never see: a text over MAX_BYTES, nesting deeper than MAX_DEPTH (the parser recurses: 50,000 levels crash it)
    and anchors or aliases (an alias bomb expands to gigabytes; hetero's files never use them)."""
    if len(text) > MAX_BYTES:
        raise FileProblems([Problem(name, f"larger than {MAX_BYTES >> 20} MiB: not a profile or plan hetero wrote")])
    depth = 0
    for token in yaml.scan(text, Loader=_Loader):
        if isinstance(token, (yaml.AnchorToken, yaml.AliasToken)):
            what = "anchor" if isinstance(token, yaml.AnchorToken) else "alias"
            message = f"YAML {what} {_cut(token.value)}: hetero files take no anchors or aliases (write values out)"
            raise FileProblems([_problem(name, token.start_mark, message)])
        if isinstance(token, _OPEN):
            depth += 1
            if depth > MAX_DEPTH:
                raise FileProblems([_problem(name, token.start_mark, f"nested more than {MAX_DEPTH} levels deep")])
        elif isinstance(token, _CLOSE):
            depth -= 1


def kind_of(path: str | os.PathLike) -> str | None:
    """The `kind` the file at `path` declares at its top; None when it is not a readable YAML mapping with one."""
    try:
        root = _compose(_read_text(Path(path), str(path)), str(path))
    except FileProblems:
        return None
    top = {k.value: v for k, v in root.value} if isinstance(root, yaml.MappingNode) else {}
    kind = top.get("kind")
    return kind.value if isinstance(kind, yaml.ScalarNode) else None


def line_of(path: str | os.PathLike, key: str) -> int | None:
    """The 1-based line of the value at `key` (`optimizer.nvme.path`, `layers[3].name`) in the file at `path`; None
    when the file cannot be read or has no such key (a default the file left out)."""
    try:
        node = _compose(_read_text(Path(path), str(path)), str(path))
    except FileProblems:
        return None
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        if part.startswith("[") and isinstance(node, yaml.SequenceNode):
            index = int(part[1:-1])
            node = node.value[index] if index < len(node.value) else None
        elif isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
        else:
            return None
        if node is None:
            return None
    return node.start_mark.line + 1


def _header(root: yaml.Node, name: str, expect: type | None) -> type:
    if not isinstance(root, yaml.MappingNode):
        raise FileProblems([_problem(name, root.start_mark, "expected a mapping with apiVersion and kind at the top")])
    top = {k.value: v for k, v in root.value if isinstance(k, yaml.ScalarNode)}
    wanted = [expect.__name__] if expect else list(KINDS)
    problems = []
    version, kind = top.get("apiVersion"), top.get("kind")
    if version is None:
        problems.append(_problem(name, root.start_mark,
                                 f"missing key 'apiVersion' (expected 'apiVersion: {API_VERSION}')"))
    elif version.value != API_VERSION:
        shown = _cut(version.value) if isinstance(version.value, str) else "a collection"
        problems.append(_problem(name, version.start_mark,
                                 f"apiVersion: unsupported {shown} (this hetero reads {API_VERSION})"))
    if kind is None:
        problems.append(_problem(name, root.start_mark, f"missing key 'kind' (expected {_or(wanted)})"))
    elif not isinstance(kind.value, str):  # a list or mapping node: its value is a list of nodes
        problems.append(_problem(name, kind.start_mark, f"kind: expected one of {_or(wanted)}, not a collection"))
    elif kind.value not in wanted:
        found = f"kind {kind.value!r}" if kind.value in KINDS else f"unknown kind {_cut(kind.value)}"
        problems.append(_problem(name, kind.start_mark, f"kind: {found}, expected {_or(wanted)}"
                                 + _did_you_mean(kind.value, wanted)))
    if problems:
        raise FileProblems(problems)
    return KINDS[kind.value]


class _Reader:
    """Walks composed nodes against a schema type, recording a Problem for each bad value and going on."""

    def __init__(self, name: str, text: str):
        self.name = name
        self.lines = text.splitlines()
        self.problems: list[Problem] = []
        self.nodes: dict[str, yaml.Node] = {}

    def problem(self, node: yaml.Node, path: str, message: str) -> object:
        self.problems.append(_problem(self.name, node.start_mark, f"{path}: {message}" if path else message))
        return _BAD

    def dataclass(self, node: yaml.Node, cls: type, path: str, skip: tuple[str, ...] = (),
                  anchor_line: int | None = None) -> Any:
        if not isinstance(node, yaml.MappingNode):
            return self.problem(node, path, f"expected a mapping of {cls.__name__} keys, got {_shape(node)}")
        by_key = {s.key: s for s in specs(cls) if not s.comment}
        values: dict[str, Any] = {}
        misspelt: set[str] = set()  # keys an unknown key was taken for: reported once, not also as missing
        for key_node, value_node in self._pairs(node, path):
            key = key_node.value
            if key in skip:
                continue
            spec = by_key.get(key)
            if spec is None:
                misspelt.add(self._unknown(key_node, list(by_key), path))
                continue
            child = f"{path}.{key}" if path else key
            values[spec.name] = self.value(value_node, spec.type, spec, child, key_node.start_mark.line)
        missing = [s for s in by_key.values() if s.required and s.name not in values]
        for spec in missing:
            if spec.key not in misspelt:
                self.problem(node, path, f"missing key {spec.key!r}")
        if misspelt or missing or any(v is _BAD for v in values.values()):
            return _BAD
        for spec in specs(cls):
            if spec.comment:
                values[spec.name] = self._why(node.start_mark.line if anchor_line is None else anchor_line)
        return self._checked(cls(**values), node, path)

    def _unknown(self, key_node: yaml.Node, keys: list[str], path: str) -> str:
        """Record an unknown key; the key it was probably meant to be, or ''."""
        where = f" in {path}" if path else ""
        message = f"unknown key {_cut(key_node.value)}{where}" + _did_you_mean(key_node.value, keys)
        self.problems.append(_problem(self.name, key_node.start_mark, message))
        return _closest(key_node.value, keys) or ""

    def _pairs(self, node: yaml.MappingNode, path: str):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.problem(key_node, path, "keys must be plain words")
            elif key_node.value in seen:
                self.problem(key_node, path, f"duplicate key {_cut(key_node.value)}")
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
            return self.problem(node, path, f"unsupported YAML tag {_cut(node.tag)}")
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
            return self.problem(node, path, f"expected a list, got {_shape(node)}")
        out = [self.value(n, item, spec, f"{path}[{i}]", n.start_mark.line) for i, n in enumerate(node.value)]
        return _BAD if any(v is _BAD for v in out) else out

    def _dict(self, node: yaml.Node, item: Any, spec: FieldSpec, path: str) -> Any:
        if not isinstance(node, yaml.MappingNode):
            return self.problem(node, path, f"expected a mapping, got {_shape(node)}")
        out = {k.value: self.value(v, item, spec, f"{path}.{k.value}", k.start_mark.line)
               for k, v in self._pairs(node, path)}
        return _BAD if any(v is _BAD for v in out.values()) else out

    def scalar(self, node: yaml.Node, tp: Any, spec: FieldSpec, path: str) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return self.problem(node, path, f"expected a single value, got {_shape(node)}")
        try:
            value = _convert(node, tp, spec)
        except ValueError as e:
            return self.problem(node, path, str(e))
        if spec.ge is not None and value < spec.ge or spec.le is not None and value > spec.le:
            return self.problem(node, path, f"{_cut(node.value)[1:-1]} is out of range ({_range(spec)})")
        return value

    def _why(self, line: int) -> str:
        match = re.search(r"\s#\s*why:\s?(.*)$", self.lines[line]) if line < len(self.lines) else None
        return match.group(1).strip() if match else ""


def _convert(node: yaml.ScalarNode, tp: Any, spec: FieldSpec) -> Any:
    text, tag = node.value, node.tag
    if spec.unit is not None:
        raw = {_INT: lambda t: _number(t, int), _FLOAT: lambda t: _number(t, float),
               _BOOL: lambda t: t == "true"}.get(tag, str)(text)
        return spec.unit.parse(raw)
    if (words := choices(tp)) is not None:
        if text not in words:
            raise ValueError(f"{_cut(text)} is not one of {_or(words)}" + _did_you_mean(text, words))
        return text
    if tp is bool:
        if tag != _BOOL:
            raise ValueError(f"expected true or false, got {_cut(text)}")
        return text == "true"
    if tp is int:
        if tag != _INT:
            raise ValueError(f"expected a whole number, got {_cut(text)}")
        return _number(text, int)
    if tp is float:
        if tag not in (_INT, _FLOAT):
            raise ValueError(f"expected a number, got {_cut(text)}")
        return _number(text, float)
    assert tp is str, f"unsupported schema type {tp}"
    return text


def _number(text: str, tp: type) -> int | float:
    """`text` (a YAML int or float) as `tp`: finite and within +-LIMIT; its length is checked before converting
    (Python refuses to convert ints of over 4300 digits with a message about its own settings)."""
    value = tp(text) if len(text) <= _DIGITS + 8 else math.inf
    if not math.isfinite(value) or abs(value) > LIMIT:
        raise ValueError(f"{_cut(text)} is out of range (at most {float(LIMIT):.3e})")
    return value


# -- writing ---------------------------------------------------------------------------------------------------


def dumps(obj: Any, header: tuple[str, ...] = ()) -> str:
    """`obj` as YAML text that `loads` reads back to an equal object."""
    kind = type(obj).__name__
    assert KINDS.get(kind) is type(obj), f"not a file kind: {kind}"
    lines = [f"# {h}" for h in header] + [f"apiVersion: {API_VERSION}", f"kind: {kind}"]
    _block_map(_tree(obj, None, type(obj)), 0, lines)
    return "\n".join(lines) + "\n"


def save(obj: Any, path: str | os.PathLike, header: tuple[str, ...] = ()) -> None:
    """Write atomically: a crash or a full disk leaves the old file, never half a file."""
    write_text(path, dumps(obj, header))


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` into `path` atomically (a temporary file beside it, then renamed)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a plan is a normal, shareable file
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@dataclasses.dataclass(slots=True)
class _Map:
    items: list[tuple[str, Any]]  # (key text, str | _Map | _Seq)
    why: str = ""


@dataclasses.dataclass(slots=True)
class _Seq:
    items: list[Any]


def _tree(value: Any, spec: FieldSpec | None, tp: Any) -> Any:
    """The text of a scalar, or a _Map/_Seq of texts, with the `why` comments attached."""
    tp = strip_optional(tp)
    if value is None:
        return "null"
    if is_schema(type(value)):
        fields = [s for s in specs(type(value)) if not s.comment]
        why = next((getattr(value, s.name) for s in specs(type(value)) if s.comment), "")
        return _Map([(s.key, _tree(getattr(value, s.name), s, s.type)) for s in fields], why)
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
    if any(p is None for _, p in parts):
        return None
    return "{" + ", ".join(f"{k}: {v}" for k, v in parts) + "}"


def _comment(line: str, why: str) -> str:
    return f"{line}  # why: {' '.join(why.split())}" if why else line


def _block_map(node: _Map, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    for key, value in node.items:
        flow = _flow(value)
        why = value.why if isinstance(value, _Map) else ""
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


# -- content -----------------------------------------------------------------------------------------------------


def to_data(obj: Any) -> Any:
    """`obj` as JSON-ready data keyed by field names, quantities in base units (what `--json` prints)."""
    if is_schema(type(obj)):
        return {s.name: to_data(getattr(obj, s.name)) for s in specs(type(obj)) if not s.comment}
    if isinstance(obj, list):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    return obj


def content_sha256(obj: Any) -> str:
    """Hash of what a file says, not how it is formatted: reformatting or comments never make a plan stale."""
    data = json.dumps(to_data(obj), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()


# -- messages ----------------------------------------------------------------------------------------------------


def _problem(name: str, mark: Any, message: str) -> Problem:
    return Problem(name, message, mark.line + 1, mark.column + 1) if mark else Problem(name, message)


def _closest(word: str, options: typing.Sequence[str]) -> str | None:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return close[0] if close else None


def _did_you_mean(word: str, options: typing.Sequence[str]) -> str:
    close = _closest(word, options)
    return f" (did you mean {close!r}?)" if close else ""


def _or(words: typing.Sequence[str]) -> str:
    words = list(words)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" or {words[-1]}"


def _shape(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return _cut(node.value)


def _range(spec: FieldSpec) -> str:
    if spec.ge is not None and spec.le is not None:
        return f"{spec.ge:g} to {spec.le:g}"
    return f">= {spec.ge:g}" if spec.ge is not None else f"<= {spec.le:g}"
