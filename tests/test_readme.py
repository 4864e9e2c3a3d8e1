"""The README and docs/*.md are exact: their commands parse with the real CLI, the config keys they name exist
in the schema with the defaults they state. Docs that drift from the code fail here, not in a new user's
terminal."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT
from pydantic import BaseModel

from dtrain.cli import build_parser
from dtrain.config.schema import ExperimentConfig

README = (ROOT / "README.md").read_text()
# Every page a user reads: the README first, then docs/ by name.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The config keys' table, with their defaults.
CONFIG_PAGE = ROOT / "docs" / "config.md"
# Pages whose YAML is Determined's own (keys dtrain reads and translates, or names and ignores): not the schema's.
DETERMINED_YAML = {"from-determined-config.md"}
# Placeholders the docs use in commands, and real values that stand for them.
PLACEHOLDERS = {"CONFIG": "examples/digits/experiment.yaml", "RUN_DIR": "runs/r", "SEARCH_DIR": "runs/s",
                "DIR": "runs/d", "RUN": "runs/r", "N": "2", "ID": "job-1", "IMAGE": "registry/dtrain:1",
                "KEY": "seed", "VALUE": "1", "ARGS": ""}
_PLACEHOLDER = re.compile(r"\b(" + "|".join(PLACEHOLDERS) + r")\b")
# Where a shell line stops being dtrain's arguments: a redirection, a pipe, the next command.
_SHELL_END = re.compile(r"\s(?:>|\||&&|;)\s.*$")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _code_blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def _shell_commands(text: str = README) -> list[str]:
    """Every line of a code block that starts with `dtrain ` or `make `, continuations joined, comments and what
    follows a redirection, a pipe or `&&` cut."""
    lines = []
    for _, body in _code_blocks(text):
        for line in body.replace("\\\n", " ").splitlines():
            if line.startswith(("dtrain ", "make ")):
                lines.append(_SHELL_END.sub("", re.sub(r"\s+#.*$", "", line)).strip())
    return lines


def _page_commands(prefix: str) -> list[Any]:
    return [pytest.param(page, c, id=f"{page.name}: {c[:60]}") for page in PAGES
            for c in _shell_commands(page.read_text()) if c.startswith(prefix)]


def _argv(command: str) -> list[str]:
    """The command as argv, optional ``[...]`` parts included and placeholders replaced by real values."""
    text = command.replace("[", " ").replace("]", " ")
    text = _PLACEHOLDER.sub(lambda m: PLACEHOLDERS[m.group(1)], text)
    return shlex.split(text)


def _parse(argv: list[str]) -> Any:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"dtrain {' '.join(argv)}: {err.getvalue().strip()}")


def test_the_readme_has_commands_to_check():
    commands = _shell_commands()
    assert len(commands) >= 10 and any(c.startswith("make ") for c in commands)
    assert {"run", "report", "doctor", "bench", "compare", "search"} <= {c.split()[1] for c in commands}


@pytest.mark.parametrize(("page", "command"), _page_commands("dtrain "))
def test_every_dtrain_command_in_the_docs_parses(page, command):
    args = _parse(_argv(command)[1:])
    config = getattr(args, "config", None)
    # A bare file name is the page's own example (a user's experiment.yaml); a path is this repository's.
    if config is not None and "/" in str(config) and not _PLACEHOLDER.search(command.split("#")[0]):
        assert (ROOT / config).is_file(), f"{_name(page)}: {command}: {config} does not exist"


@pytest.mark.parametrize(("page", "command"), _page_commands("make "))
def test_every_make_command_in_the_docs_is_a_target(page, command):
    makefile = (ROOT / "Makefile").read_text()
    for word in _argv(command)[1:]:
        if "=" in word:  # a variable, e.g. SLOTS=1
            assert re.search(rf"^{re.escape(word.split('=')[0])} \??=", makefile, re.M), command
        else:
            assert re.search(rf"^{re.escape(word)}:", makefile, re.M), f"{_name(page)}: {command}: no target {word!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_inline_dtrain_mentions_name_real_commands_and_options(page):
    """`dtrain CMD --flag ...` in running text: the command exists and every --flag belongs to it."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    top = {s for a in parser._actions for s in a.option_strings}
    checked = 0
    for span in re.findall(r"`(dtrain [^`]+)`", page.read_text()):
        words = [w for w in span.split()[1:] if w != "..."]
        while words and words[0] in top:
            words.pop(0)
        if not words:
            continue
        assert words[0] in sub.choices, f"{_name(page)}: `{span}`: no command {words[0]!r}"
        options = {s for a in sub.choices[words[0]]._actions for s in a.option_strings}
        if words[0] == "launch":  # what follows the script belongs to the script
            words = words[: next((i for i, w in enumerate(words) if w.endswith(".py")), len(words))]
        for word in words[1:]:
            flag = word.strip("[]").split("=")[0]
            if flag.startswith("--"):
                assert flag in options, f"{_name(page)}: `{span}`: dtrain {words[0]} has no {flag}"
        checked += 1
    if page.name == "README.md":
        assert checked >= 5


# ------------------------------------------------------------------------------------------ config keys


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [m for m in map(_model_of, typing.get_args(annotation)) if m is not None]
        return models[0] if models else None
    return None


def _field(path: str) -> Any:
    model: type[BaseModel] | None = ExperimentConfig
    field = None
    for part in path.split("."):
        assert model is not None, f"{path}: {part!r} is below a value, not a section"
        assert part in model.model_fields, f"docs key {path}: {model.__name__} has no field {part!r}"
        field = model.model_fields[part]
        model = _model_of(field.annotation)
    return field


def _keys(cell: str) -> list[str]:
    """`a.b`, `.c` (sibling), `a.{x,y}`, `a.b` (+ `c`, `d`): the dotted keys a table cell names."""
    keys: list[str] = []
    for name in re.findall(r"`([^`]+)`", cell):
        braced = re.fullmatch(r"(.*)\{(.*)\}", name)
        names = [braced.group(1) + n.strip() for n in braced.group(2).split(",")] if braced else [name]
        for n in names:
            parent = keys[-1].rsplit(".", 1)[0] + "." if keys and "." in keys[-1] else ""
            keys.append(parent + n[1:] if n.startswith(".") else (parent + n if keys and "." not in n else n))
    return keys


def _key_table() -> list[tuple[list[str], str]]:
    text = CONFIG_PAGE.read_text()
    section = text[text.index("## Config keys"):]
    rows = []
    for line in section.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and cells[0] not in ("key", "---"):
            rows.append((_keys(cells[0]), cells[-1]))
    return rows


def _defaults(cell: str) -> list[Any]:
    """The default column: `x`, 2 / 2, 10, true / [1, 4], 2 / required / none / free text."""
    text = cell.replace("`", "")
    parts = [p.strip() for p in re.split(r",\s*(?![^\[]*\])", text)]
    return [yaml.safe_load(p) if p not in ("required", "none") else p for p in parts]


def test_every_key_in_the_readme_table_is_in_the_schema_with_its_default():
    rows = _key_table()
    assert len(rows) >= 25
    checked = 0
    for keys, default_cell in rows:
        fields = [_field(k) for k in keys]
        defaults = _defaults(default_cell)
        if len(defaults) == 1:  # one default for every key of the row
            defaults *= len(keys)
        if len(defaults) != len(keys):
            continue  # a default explained in words
        for key, field, stated in zip(keys, fields, defaults, strict=True):
            if field.is_required():
                assert stated == "required", f"{key}: config.md says default {stated!r}, the schema requires it"
                continue
            actual = field.get_default(call_default_factory=True)
            if actual is None:
                assert stated in ("none", "auto"), f"{key}: config.md says {stated!r}, the schema's default is None"
            elif isinstance(actual, BaseModel) or actual == {}:
                continue  # a whole section (its keys have their own rows)
            else:
                assert stated == actual, f"{key}: config.md says default {stated!r}, the schema has {actual!r}"
            checked += 1
    assert checked >= 30


def test_the_key_table_covers_every_section_of_the_schema():
    named = {k.split(".")[0] for keys, _ in _key_table() for k in keys}
    # code_dir is set from the config file's location; searcher has its own section and YAML example.
    assert set(ExperimentConfig.model_fields) - named == {"code_dir", "searcher"}


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in DETERMINED_YAML], ids=lambda p: p.name)
def test_yaml_examples_use_real_keys(page):
    for lang, body in _code_blocks(page.read_text()):
        if lang != "yaml":
            continue
        doc = yaml.safe_load(body)
        for section, values in doc.items():
            _field(section)
            if section != "hyperparameters" and isinstance(values, dict):
                for key in values:
                    _field(f"{section}.{key}")


def test_the_key_parser_reads_every_form():
    assert _keys("`a.b`, `.c`") == ["a.b", "a.c"]
    assert _keys("`a.{x, y}`") == ["a.x", "a.y"]
    assert _keys("`a.b` (+ `c`, `d`)") == ["a.b", "a.c", "a.d"]
    assert _keys("`x`, `y`") == ["x", "y"]
    assert _defaults("false, [1, 4, 16, 64], 2, 5") == [False, [1, 4, 16, 64], 2, 5]
