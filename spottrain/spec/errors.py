"""The words of a bad spec: :class:`SpecError`, and each pydantic error said as the key's
path, its line in the file and what is allowed, never echoing a secret."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import yaml
from pydantic import BaseModel

from .code import _KINDS
from .fields import _Model
from .job import JobSpec

# user:password@ (or token@) in any URL: shown as ***@ wherever an error quotes a URL.
_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#@\s]*@")


class SpecError(ValueError):
    """A job spec that cannot be used. ``problems`` lists one line per bad key."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{source}: the job spec is not valid:\n{lines}")


def describe_error(err: Any, lines: dict[str, int]) -> str:
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    if loc[:1] == ["code"] and len(loc) > 2 and loc[1] == loc[2]:
        del loc[1]  # the discriminator's tag repeats the key it was chosen by
    secret = _is_secret_place(loc)
    # In a secret place, a key the user chose (a variable name) may be a pasted value too:
    # name the fields down to it and give its line.
    path = ".".join(_field_path(loc) if secret else loc) or "(top level)"
    line = None
    for n in range(len(loc), 0, -1):
        line = lines.get(".".join(loc[:n]))
        if line:
            break
    where = f"{path} (line {line})" if line else path
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = f"; allowed here: {', '.join(allowed)}" if allowed else ""
        return f"{where}: unknown key{hint}"
    if kind == "missing":
        return f"{where}: required, missing"
    msg = str(err["msg"])
    msg = msg.removeprefix("Value error, ")
    if kind == "finite_number":
        msg += _range_of(loc)
    if kind in ("enum", "literal_error"):
        msg = msg.replace("Input should be", "use")
    msg = _redact_userinfo(msg.replace("Input should be", "must be"))
    value = err.get("input")
    if secret:
        # A validator may have quoted the value, or a part of it, in its words: take every
        # quotation and the value itself out of them too.
        msg = _QUOTED_RE.sub("(hidden)", msg)
        for text in sorted(_strings(value), key=len, reverse=True):
            msg = msg.replace(text, "(hidden)")
        return f"{where}: {msg}"
    # Never echo a mapping: the error is about the whole block.
    if isinstance(value, Mapping):
        return f"{where}: {msg}"
    return f"{where}: {msg} (got {_short(value)})"


# Where a value may be, or hold, a secret (a password, a token, a credential in the
# workers' environment): an error there names the key and its line, never what was written.
_SECRET_PLACES = (
    ("redis",),
    ("train", "env"),
    ("train", "secret_env"),
    ("code", "git", "repo"),
)
# A quotation in a message, long enough to hold a secret ('@' is a character, not a value).
_QUOTED_RE = re.compile(r"'[^']{4,}'|\"[^\"]{4,}\"")


def _is_secret_place(loc: list[str]) -> bool:
    return any(tuple(loc[: len(place)]) == place for place in _SECRET_PLACES)


def _field_path(loc: list[str]) -> list[str]:
    """The leading parts of ``loc`` that are fields of the spec, up to the first key the
    user chose (a variable name of ``train.env``, an unknown key)."""
    path: list[str] = []
    for part in loc:
        if part not in _allowed_keys(path):
            break
        path.append(part)
    return path


def _strings(value: Any) -> Iterator[str]:
    """The texts of a value (a mapping's values, not its keys), long enough to replace in a
    message without mangling its words."""
    if isinstance(value, str):
        if len(value) >= 4:
            yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _redact_userinfo(text: str) -> str:
    # A clone or storage URL may carry user:token@: keep the URL, drop the credential.
    return _USERINFO_RE.sub(r"\1***@", text)


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member it tried ("ArchiveCode"); users never wrote that. A
    # user's key (a variable name of train.env) may start with a capital too.
    return isinstance(part, str) and part in _model_names()


def _model_names() -> set[str]:
    names, todo = set(), [_Model]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _range_of(loc: list[str]) -> str:
    """`` from LOW to HIGH``: the bounds of the number field at ``loc``, when it has both."""
    field = getattr(_model_at(loc[:-1]), "model_fields", {}).get(loc[-1]) if loc else None
    bounds = {
        k: getattr(m, k)
        for m in (field.metadata if field else [])
        for k in ("ge", "le")
        if getattr(m, k, None) is not None
    }
    if len(bounds) < 2:
        return ""
    return f" from {bounds['ge']:,} to {bounds['le']:,}"


def _short(value: Any) -> str:
    text = _redact_userinfo(repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _allowed_keys(loc: list[str]) -> list[str]:
    if loc == ["code"]:
        return list(_KINDS)
    return list(getattr(_model_at(loc), "model_fields", {}))


def _model_at(loc: list[str]) -> Any:
    """The model of the block at ``loc``; None where it is no model (a value, a mapping)."""
    model: Any = JobSpec
    if loc[:1] == ["code"]:
        if len(loc) == 1:
            return None
        model = _KINDS.get(loc[1])
        loc = loc[1:]
    mapping_key = False
    for part in loc:
        if mapping_key:  # a user-chosen key of a mapping (a zone name), not a field
            mapping_key = False
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = _model_of(field.annotation)
        mapping_key = getattr(field.annotation, "__origin__", None) is dict
    return model


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def yaml_problem(e: yaml.YAMLError) -> str:
    # What is wrong and where, never the line itself, nor a quoted token of it (an undefined
    # alias, a tag): a password written unquoted may start with * or !.
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        what = ", ".join(p for p in (e.problem, e.context) if p) or "malformed"
        what = _QUOTED_RE.sub("(hidden)", what)
        if mark is None:
            return what
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(e, yaml.reader.ReaderError):
        char = e.character if isinstance(e.character, int) else ord(e.character)
        return f"{e.reason} (character #x{char:04x} at position {e.position})"
    return type(e).__name__
