"""A YAML reader for input nobody vetted: bounded before anything else looks at it.

PyYAML's ``safe_load`` never runs code, but it happily spends unbounded time and memory: a 20 MB file
parses for a minute, an anchor/alias "billion laughs" expands to gigabytes once something walks it, and
lists nested 10,000 deep overflow the recursion limit. Duplicate keys silently keep the last value.

:func:`load_text` therefore works in stages, each bounded by the previous one:

1. size: at most :data:`MAX_BYTES` (checked on the file size, before reading);
2. events: the parser's event stream (libyaml when present, no recursion) is counted and its nesting
   depth tracked, so composing the node graph afterwards cannot recurse deeply or take long;
3. aliases: the composed graph is measured as if every alias were expanded (memoized, so a bomb costs
   time proportional to the *file*), and refused beyond :data:`MAX_NODES` nodes, :data:`MAX_DEPTH`
   levels, or when an alias contains itself;
4. construction, with duplicate keys and non-JSON types (``!!binary``, ``!!set``...) refused.

Every failure is a :class:`~dtrain.errors.ConfigError` with one line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from dtrain.errors import ConfigError

# A real experiment config is a few hundred bytes; these bounds are orders of magnitude above that and
# keep the worst case (pure-Python construction of MAX_NODES nodes) well under a second.
MAX_BYTES = 256 * 1024
MAX_NODES = 10_000
MAX_DEPTH = 32

_BaseLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_BaseDumper: type = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

# YAML 1.1 (PyYAML) reads `1e-3` as a *string*; YAML 1.2 and every other tool read a number. Configs
# write learning rates and timeouts that way, so both the loader and the dumper use the 1.2 rule (the
# dumper must, or a string such as "1e5" would be written bare and read back as a float).
_FLOAT_12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_FLOAT_FIRST = list("-+0123456789")
_REFUSED_TAGS = {
    "tag:yaml.org,2002:binary": "binary data",
    "tag:yaml.org,2002:set": "a set",
    "tag:yaml.org,2002:omap": "an ordered map",
    "tag:yaml.org,2002:pairs": "a list of pairs",
}
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class _Loader(_BaseLoader):  # type: ignore[misc, valid-type]
    """SafeLoader that refuses duplicate and complex keys and keeps dates as the strings written."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` may be overridden by the keys beside it: that is its purpose
            if not isinstance(key_node, yaml.ScalarNode):
                raise _error(key_node, "a key is a list or mapping; keys must be plain names")
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                first = seen[key].start_mark.line + 1
                raise _error(key_node, f"duplicate key {show(key)} (first set at line {first}); keep one")
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-any-return]

    def construct_refused(self, node: yaml.Node) -> Any:
        raise _error(node, f"!!{node.tag.rsplit(':', 1)[-1]} ({_REFUSED_TAGS[node.tag]}) is not allowed in a "
                           "config; use strings, numbers, lists and mappings")


class _Dumper(_BaseDumper):  # type: ignore[misc, valid-type]
    """SafeDumper that quotes every string the loader above would read as something else."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, _FLOAT_FIRST)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", _Loader.construct_yaml_str)
for _tag in _REFUSED_TAGS:
    _Loader.add_constructor(_tag, _Loader.construct_refused)


class _NodeError(Exception):
    def __init__(self, line: int | None, message: str) -> None:
        super().__init__(message)
        self.line = line


def _error(node: yaml.Node | None, message: str) -> _NodeError:
    return _NodeError(node.start_mark.line + 1 if node is not None and node.start_mark else None, message)


def show(value: Any, limit: int = 60) -> str:
    """A value for a one-line message: repr (control characters escaped), cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plain(text: str, limit: int = 200) -> str:
    """Text for a one-line message, unquoted: control characters escaped, cut to ``limit`` characters."""
    shown = repr(str(text))[1:-1]
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


class MalformedYaml(ConfigError):
    """The text is not YAML at all (as opposed to YAML that breaks a bound or a rule)."""


def read_file(path: Path, what: str = "config") -> Any:
    """Load a YAML file within the bounds above; raise :class:`ConfigError` with one line."""
    try:
        if not path.is_file():
            raise ConfigError(f"{what} file {show(str(path))} does not exist; pass the path of an experiment YAML "
                              "file")
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ConfigError(f"{plain(str(path))}: {size:,} bytes; a {what} file may be at most {MAX_BYTES:,} "
                              "bytes: is this the right file?")
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)  # the file may grow after stat: never read more than the bound
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ConfigError(f"cannot read {what} {show(str(path))}: {getattr(exc, 'strerror', None) or exc}; "
                          "pass a readable YAML file") from None
    return load_bytes(raw, source=str(path))


def load_bytes(raw: bytes, source: str) -> Any:
    """Decode UTF-8 text and :func:`load_text` it."""
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{plain(source)}: more than {MAX_BYTES:,} bytes; a config may be at most that")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{plain(source)}: byte {exc.start} is not UTF-8 text; save the file as UTF-8") from None
    return load_text(text, source)


def load_text(text: str, source: str) -> Any:
    """Parse one YAML document from ``text`` within :data:`MAX_BYTES`, :data:`MAX_NODES` and
    :data:`MAX_DEPTH`; ``source`` names it in errors (a file name, ``--set KEY``)."""
    where = plain(source)
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{where}: more than {MAX_BYTES:,} characters; a config may be at most that")
    bad = _CONTROL.search(text)
    if bad is not None:
        line = text.count("\n", 0, bad.start()) + 1
        raise ConfigError(f"{where}: line {line}: control character U+{ord(bad.group()):04X} is not allowed; "
                          "remove it (write it as an escape inside double quotes if it is meant)")
    try:
        _check_events(text)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_graph(node)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except _NodeError as exc:
        at = f" at line {exc.line}" if exc.line else ""
        raise ConfigError(f"{where}{at}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise MalformedYaml(f"{where}: malformed YAML{at}: {plain(problem)}; fix the syntax") from None
    except (ValueError, OverflowError, TypeError, RecursionError, MemoryError) as exc:
        # Scalars the constructor cannot turn into values, e.g. an integer of 5,000 digits (ValueError).
        detail = plain(str(exc).split("\n", 1)[0] or type(exc).__name__, 120)
        raise ConfigError(f"{where}: unreadable value ({detail}); fix the value") from None


def _check_events(text: str) -> None:
    """Count the parse events and track nesting, without building anything."""
    depth = 0
    for events, event in enumerate(yaml.parse(text, Loader=_BaseLoader), start=1):
        if events > 2 * MAX_NODES + 8:  # a node is one event, a collection two; plus stream/document events
            raise _NodeError(event.start_mark.line + 1, f"more than {MAX_NODES:,} values; a config may hold at "
                                                        "most that many")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _NodeError(event.start_mark.line + 1, f"lists/mappings nested more than {MAX_DEPTH} deep; "
                                                            "flatten the structure")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_graph(root: yaml.Node) -> None:
    """Refuse a node graph whose alias-expanded tree is too big or too deep, or that contains itself.

    Aliases make the graph a DAG (or a cycle) whose expansion can be exponential in its size; measuring
    every shared node once keeps this linear. Iterative, because the graph may be deep before expansion.
    """
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, expanded depth)
    path: set[int] = set()  # nodes being measured: meeting one again means an alias inside itself
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        kids = _children(node)
        if finished:
            path.discard(key)
            size = 1 + sum(measured[id(k)][0] for k in kids)
            depth = 1 + max((measured[id(k)][1] for k in kids), default=0)
            if size > MAX_NODES:
                raise _error(node, f"more than {MAX_NODES:,} values (aliases expanded); a config may hold at most "
                                   "that many: is this the right file?")
            if depth > MAX_DEPTH:
                raise _error(node, f"lists/mappings nested more than {MAX_DEPTH} deep (aliases expanded); flatten "
                                   "the structure")
            measured[key] = (size, depth)
            continue
        if key in measured:
            continue
        path.add(key)
        stack.append((node, True))
        for kid in kids:
            if id(kid) in path:
                raise _error(kid, "an alias refers to a list/mapping that contains it (endless); remove the alias")
            if id(kid) not in measured:
                stack.append((kid, False))


def dump(data: Any) -> str:
    """YAML text that :func:`load_text` reads back as ``data`` (JSON-like values only)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True)  # type: ignore[no-any-return]
