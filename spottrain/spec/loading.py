"""Reading a spec: the file's size cap, one YAML parse (its depth and alias-expansion caps,
the line of every key), then the model and the checks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from spottrain.catalog import Catalog, bundled

from .checks import check_catalog, check_files
from .errors import SpecError, describe_error, yaml_problem
from .job import JobSpec

# Bounds of the spec file itself (see the README's "Job spec"): a job spec is a few hundred
# values, so anything past these is a mistake or an attack on the parser (a billion-laughs
# alias bomb, a binary file, a stream that never ends), refused before it costs memory.
MAX_SPEC_BYTES = 1 << 20
MAX_SPEC_VALUES = 100_000
MAX_SPEC_DEPTH = 32


@dataclass(frozen=True)
class LoadedSpec:
    """A spec, where it came from (relative paths in it are relative to ``base_dir``), and
    the exact text it was parsed from (what a run records, so it never re-reads the file)."""

    spec: JobSpec
    source: str
    base_dir: Path
    text: str = ""


# libyaml's parser when PyYAML has it (the pure-Python one is ten times slower).
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_spec(
    text: str, source: str = "<spec>", base_dir: Path | None = None, catalog: Catalog | None = None
) -> LoadedSpec:
    """Parse and validate a spec given as YAML text. The text is parsed once: the values and
    the line of every key come from the same YAML node tree.

    Raises:
        SpecError: malformed YAML, too large or too deeply nested, aliases that expand past
            ``MAX_SPEC_VALUES``, or one line per bad key (path, line, what is allowed).
    """
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(source, [_too_large(f"{len(text):,} characters")])
    data, node = _load_yaml(text, source)
    if not isinstance(data, dict):
        raise SpecError(source, ["the spec must be a YAML mapping (key: value lines)"])
    lines = dict(_key_lines(node))
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(source, [describe_error(err, lines) for err in e.errors()]) from None
    base = base_dir or Path.cwd()
    problems = check_catalog(spec, catalog or bundled()) + check_files(spec, base)
    if problems:
        raise SpecError(source, problems)
    return LoadedSpec(spec, source, base, text)


def load_spec(path: str | Path, catalog: Catalog | None = None) -> LoadedSpec:
    """Read, parse and validate the spec file at ``path``.

    Raises:
        SpecError: the file cannot be read, is larger than ``MAX_SPEC_BYTES``, is not UTF-8
            text, or the spec is not valid.
    """
    p = Path(path)
    return parse_spec(_read_spec_file(p), str(p), p.resolve().parent, catalog)


def _read_spec_file(p: Path) -> str:
    # Read no more than the cap (plus one byte to see it is past it): the path may name a
    # huge file, a device or a pipe that never ends.
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise SpecError(str(p), [f"cannot read the file: {e.strerror or e}"]) from None
    if len(raw) > MAX_SPEC_BYTES:
        # A device or a pipe has no size: say only that it went past the cap.
        what = f"{size:,} bytes" if size > MAX_SPEC_BYTES else f"over {MAX_SPEC_BYTES:,} bytes"
        raise SpecError(str(p), [_too_large(what)])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            str(p),
            [
                f"not a text file: byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8; "
                "give the job spec's YAML file"
            ],
        ) from None


def _too_large(what: str) -> str:
    return (
        f"the spec is {what}; a job spec may be at most 1 MiB ({MAX_SPEC_BYTES:,} bytes): "
        "is this the right file?"
    )


def _load_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """The values of a YAML document and its node tree, from one parse. Refuses, before
    building any value, a tree too deep or one whose aliases expand past
    ``MAX_SPEC_VALUES`` values."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_tree(node, source)
        return loader.construct_document(node), node
    except SpecError:
        raise
    except yaml.YAMLError as e:
        raise SpecError(source, [f"not valid YAML: {yaml_problem(e)}"]) from None
    except (ValueError, TypeError, AttributeError, OverflowError):
        # PyYAML's constructors raise these for a scalar that matches a type's pattern but
        # is not one (2020-13-45) or an explicit tag on the wrong text (!!int abc); their
        # words quote the value, so they are not repeated.
        raise SpecError(
            source,
            [
                "not valid YAML: a value cannot be read as its type: a date that does not "
                "exist (2020-13-45), or a !!int, !!float or !!timestamp tag on other text; "
                "quote the value or fix it"
            ],
        ) from None
    except RecursionError:
        raise SpecError(source, [_too_deep()]) from None
    finally:
        loader.dispose()


def _check_tree(root: yaml.Node, source: str) -> None:
    """Refuse a node tree nested deeper than ``MAX_SPEC_DEPTH``, holding an alias to a node
    that contains it, or counting more than ``MAX_SPEC_VALUES`` values once its aliases are
    expanded (the billion-laughs bomb: 500 bytes that expand to 10^9 values). The count
    visits each distinct node once, so the check costs what the file does."""
    # per node: (values it expands to, its height)
    seen: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()

    def visit(node: yaml.Node, depth: int) -> tuple[int, int]:
        if depth > MAX_SPEC_DEPTH:
            raise SpecError(source, [_too_deep()])
        known = seen.get(id(node))
        if known is not None:
            if depth + known[1] > MAX_SPEC_DEPTH:
                raise SpecError(source, [_too_deep()])
            return known
        if id(node) in open_:
            raise SpecError(
                source,
                [
                    f"not valid YAML for a job spec: an alias (*name) at line {_line(node)} "
                    "refers to a node that contains it"
                ],
            )
        open_.add(id(node))
        children: list[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        count, height = 1, 0
        for child in children:
            n, h = visit(child, depth + 1)
            count, height = count + n, max(height, h + 1)
            if count > MAX_SPEC_VALUES:
                raise SpecError(
                    source,
                    [
                        f"the spec holds more than {MAX_SPEC_VALUES:,} values once its YAML "
                        "aliases (*name) are expanded; a job spec needs a few hundred: write the "
                        "values out, or drop the aliases"
                    ],
                )
        open_.discard(id(node))
        seen[id(node)] = (count, height)
        return count, height

    visit(root, 1)


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _too_deep() -> str:
    return (
        f"the spec is nested more than {MAX_SPEC_DEPTH} levels deep; a job spec needs a few "
        "(see the README's job spec reference)"
    )


def _key_lines(node: yaml.Node | None, path: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    """(dotted key path, 1-based line) for every key of a composed YAML document."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            sub = (*path, str(key.value))
            yield ".".join(sub), key.start_mark.line + 1
            yield from _key_lines(value, sub)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            sub = (*path, str(i))
            yield ".".join(sub), item.start_mark.line + 1
            yield from _key_lines(item, sub)
