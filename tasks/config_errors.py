"""Config mistakes as one line each: ``<dotted.field>: <what is wrong>``, with a did-you-mean for unknown keys.

pydantic reports a ``ValidationError`` as a multi-line block per error (location, message, input, a URL);
a user needs the field, the problem and, for a typo, the key they meant. The rules:

1. The location is printed as the dotted key ``--set`` takes (``trainer.learning_rate``), list items as
   ``[i]`` (``rewards.components[0].weight``); pydantic's union-member tags (``list[str]``) are dropped,
   and the alternatives of one union field are joined into one line ("... or ...").
2. An unknown key gets the closest field name of its own section (``difflib``, cutoff 0.6); failing that,
   the closest field anywhere in the config by its last name (``learning_rate`` at the top level ->
   ``trainer.learning_rate``). A dotted YAML key that names a real field is told to nest.
3. A value error quotes the input (shortened to 60 characters), never more.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

MAX_INPUT_CHARS = 60


class ConfigError(ValueError):
    """The config cannot be built; ``problems`` holds one line per mistake (the message joins them)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def _members(annotation: Any) -> list[Any]:
    """The types a field may hold: the members of a union (Optional included), else the annotation itself."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    return next((m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)), None)


def _container_item(annotation: Any, kinds: tuple[type, ...]) -> Any:
    """The item type (list, tuple) or value type (dict) of a union member of `kinds` in `annotation`, else None."""
    for member in _members(annotation):
        origin, args = typing.get_origin(member), typing.get_args(member)
        if origin in kinds and args:
            return args[-1] if origin is dict else args[0]
    return None


def _resolve(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, type[BaseModel] | None]:
    """(the dotted path of `loc`, the model whose field or unknown key it ends at), union tags dropped."""
    path, annotation, holder = "", root, root
    for part in loc:
        model = _model_of(annotation)
        if isinstance(part, int):
            path += f"[{part}]"
            annotation, holder = _container_item(annotation, (list, tuple)), None
            continue
        if model is not None:  # a field, or an unknown key of this model
            holder = model
            field = model.model_fields.get(part)
            annotation = field.annotation if field is not None else None
        elif _container_item(annotation, (dict,)) is not None:  # a key of a dict field
            annotation, holder = _container_item(annotation, (dict,)), None
        else:  # a union member's tag such as "list[str]": not part of the key
            continue
        path = f"{path}.{part}" if path else str(part)
    return path, holder


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of `model` and of its nested models, as dotted paths."""
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        nested = _model_of(field.annotation)
        if nested is not None:
            out += field_paths(nested, f"{path}.")
    return out


def suggest(root: type[BaseModel], holder: type[BaseModel] | None, parent: str, key: str) -> str | None:
    """The field a mistyped `key` (under `parent`, a field of `holder`) most likely meant, as a dotted path."""
    if holder is not None:
        close = difflib.get_close_matches(key, list(holder.model_fields), n=1, cutoff=0.6)
        if close:
            return f"{parent}.{close[0]}" if parent else close[0]
    paths = field_paths(root)
    by_leaf: dict[str, str] = {}
    for path in paths:
        by_leaf.setdefault(path.rsplit(".", 1)[-1], path)
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_leaf), n=1, cutoff=0.8)
    return by_leaf[close[0]] if close else None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_INPUT_CHARS else text[: MAX_INPUT_CHARS - 3] + "..."


def _problem(root: type[BaseModel], error: dict[str, Any]) -> tuple[str, str]:
    """(dotted path, what is wrong) for one pydantic error."""
    path, holder = _resolve(root, tuple(error["loc"]))
    if error["type"] == "extra_forbidden":
        key = str(error["loc"][-1])
        parent = path[: -len(key)].rstrip(".")
        if "." in key:
            path = f"{parent}.{key!r}" if parent else repr(key)
            if f"{parent}.{key}".lstrip(".") in field_paths(root):
                nested = key.replace(".", ": {", 1)
                return path, f"unknown key; in YAML nest it ({nested}: ...}}), dotted keys are for --set"
        hint = suggest(root, holder, parent, key)
        return path, "unknown key" + (f"; did you mean {hint}?" if hint else "")
    message = error["msg"]
    if message.startswith("Value error, "):
        return path, message[len("Value error, "):]
    if error["type"] == "missing":
        return path, "required"
    message = message[0].lower() + message[1:]
    return path, f"{message}, got {_shown(error.get('input'))}"


def describe(root: type[BaseModel], exc: ValidationError) -> list[str]:
    """One line per problem of `exc` (raised validating `root`), in pydantic's order."""
    merged: dict[str, list[str]] = {}
    for error in exc.errors():
        path, what = _problem(root, error)
        if what not in merged.setdefault(path, []):
            merged[path].append(what)
    lines = []
    for path, whats in merged.items():
        got = {w.rsplit(", got ", 1)[1] for w in whats if ", got " in w}
        if len(whats) > 1 and len(got) == 1:  # a union's alternatives for one input
            whats = [" or ".join(w.rsplit(", got ", 1)[0] for w in whats) + f", got {got.pop()}"]
        lines += [f"{path}: {what}" if path else what for what in whats]
    return lines
