"""The one YAML boundary: profile.yaml, plan.yaml and run.yaml in and out, and a file's content hash. `load` returns
a valid Profile, Plan or Run or raises FileProblems; `save` writes atomically what `load` reads back equal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml

from hetero.errors import FileProblems
from hetero.schema import yaml_write
from hetero.schema.fields import is_schema
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from hetero.schema.run import Run
from hetero.schema.yaml_read import API_VERSION, Reader, compose, did_you_mean, one_of, problem_at, read_text
from hetero.units import quoted_cut

KINDS: dict[str, type] = {"Profile": Profile, "Plan": Plan, "Run": Run}


def load(path: str | os.PathLike, expect: type | None = None) -> Any:
    """The Profile or Plan in `path`; FileProblems listing every problem if it is not a valid one."""
    return loads(read_text(Path(path), str(path)), name=str(path), expect=expect)


def loads(text: str, name: str = "<string>", expect: type | None = None) -> Any:
    root = compose(text, name)
    cls = _header(root, name, expect)
    reader = Reader(name, text)
    obj = reader.dataclass(root, cls, "", skip=("apiVersion", "kind"))
    if reader.problems:
        raise FileProblems(reader.problems)
    return obj


def kind_of(path: str | os.PathLike) -> str | None:
    """The `kind` the file at `path` declares at its top; None when it is not a readable YAML mapping with one."""
    root = _root(path)
    top = {k.value: v for k, v in root.value} if isinstance(root, yaml.MappingNode) else {}
    kind = top.get("kind")
    return kind.value if isinstance(kind, yaml.ScalarNode) else None


def line_of(path: str | os.PathLike, key: str) -> int | None:
    """The 1-based line of the value at `key` (`optimizer.nvme.path`, `layers[3].name`) in the file at `path`; None
    when the file cannot be read or has no such key (a default the file left out)."""
    node = _root(path)
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
    return None if node is None else node.start_mark.line + 1


def _root(path: str | os.PathLike) -> yaml.Node | None:
    """The file's composed YAML; None when it cannot be read as YAML."""
    try:
        return compose(read_text(Path(path), str(path)), str(path))
    except FileProblems:
        return None


def _header(root: yaml.Node, name: str, expect: type | None) -> type:
    if not isinstance(root, yaml.MappingNode):
        raise FileProblems([problem_at(name, root.start_mark,
                                       "expected a mapping with apiVersion and kind at the top")])
    top = {k.value: v for k, v in root.value if isinstance(k, yaml.ScalarNode)}
    wanted = [expect.__name__] if expect else list(KINDS)
    problems = []
    version, kind = top.get("apiVersion"), top.get("kind")
    if version is None:
        problems.append(problem_at(name, root.start_mark,
                                 f"missing key 'apiVersion' (expected 'apiVersion: {API_VERSION}')"))
    elif version.value != API_VERSION:
        shown = quoted_cut(version.value) if isinstance(version.value, str) else "a collection"
        problems.append(problem_at(name, version.start_mark,
                                 f"apiVersion: unsupported {shown} (this hetero reads {API_VERSION})"))
    if kind is None:
        problems.append(problem_at(name, root.start_mark, f"missing key 'kind' (expected {one_of(wanted)})"))
    elif not isinstance(kind.value, str):  # a list or mapping node: its value is a list of nodes
        problems.append(problem_at(name, kind.start_mark, f"kind: expected one of {one_of(wanted)}, not a collection"))
    elif kind.value not in wanted:
        found = f"kind {kind.value!r}" if kind.value in KINDS else f"unknown kind {quoted_cut(kind.value)}"
        problems.append(problem_at(name, kind.start_mark, f"kind: {found}, expected {one_of(wanted)}"
                                 + did_you_mean(kind.value, wanted)))
    if problems:
        raise FileProblems(problems)
    return KINDS[kind.value]


def dumps(obj: Any, header: tuple[str, ...] = ()) -> str:
    """`obj` as YAML text that `loads` reads back to an equal object."""
    kind = type(obj).__name__
    assert KINDS.get(kind) is type(obj), f"not a file kind: {kind}"
    lines = [f"# {h}" for h in header] + [f"apiVersion: {API_VERSION}", f"kind: {kind}"]
    yaml_write.render(obj, lines)
    return "\n".join(lines) + "\n"


def save(obj: Any, path: str | os.PathLike, header: tuple[str, ...] = ()) -> None:
    """Write atomically: a crash or a full disk leaves the old file, never half a file."""
    write_text(path, dumps(obj, header))


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` into `path` atomically and durably (a temporary file beside it, fsynced, renamed over `path`, then the
    directory fsynced): after a crash at any moment `path` holds the old text or the new one, whole."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        umask = os.umask(0o022)  # read by setting it: mkstemp makes 0600, and a plan is a normal, shareable file
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    # A directory we may write in but not open (rare), or a file system that cannot sync one: the file is on disk.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def to_data(obj: Any, defaults: bool = True) -> Any:
    """`obj` as JSON-ready data keyed by field names, quantities in base units (what `--json` prints); without the
    fields that hold their declared default unless `defaults`."""
    if is_schema(type(obj)):
        return {f.name: to_data(getattr(obj, f.name), defaults) for f in dataclasses.fields(obj)
                if not f.metadata.get("comment") and (defaults or not _is_default(f, getattr(obj, f.name)))}
    if isinstance(obj, list):
        return [to_data(v, defaults) for v in obj]
    if isinstance(obj, dict):
        return {k: to_data(v, defaults) for k, v in obj.items()}
    return obj


def content_sha256(obj: Any) -> str:
    """Hash of what a file says, not how it is formatted: reformatting or comments never make a plan stale, and
    neither does a field a later hetero added, while it holds its default (what an older file without it means)."""
    data = to_data(obj, defaults=False)
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _is_default(f: dataclasses.Field, value: Any) -> bool:
    if f.default is not dataclasses.MISSING:
        return value == f.default
    return f.default_factory is not dataclasses.MISSING and value == f.default_factory()
