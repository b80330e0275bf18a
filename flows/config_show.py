"""`trajflow config show [CONFIG] [--set ...]`: the effective RunConfig as YAML, each field's description as a comment.

The output is a config file in its own right (loading it gives the same RunConfig), so it doubles as a
starting point: ``trajflow config show > my.yaml``. Sections (nested models) keep the config's order; a
field's description is the comment above it, wrapped at 100 columns; values are YAML flow style on one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

import yaml
from pydantic import BaseModel

from flows.preflight import load_for_command, run_guarded

WIDTH = 100


def _value(value: Any) -> str:
    """One JSON-mode value as a one-line YAML scalar or flow collection."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True, sort_keys=False)
    text = text.removesuffix("\n...\n").strip()
    return json.dumps(value) if "\n" in text else text  # a multi-line string: JSON's escapes keep it on one line


def commented_yaml(model: BaseModel, indent: int = 0) -> list[str]:
    """`model` as YAML lines: a nested model becomes an indented section, every field gets its description above it."""
    pad = " " * indent
    dumped = model.model_dump(mode="json")
    lines: list[str] = []
    for name, field in type(model).model_fields.items():
        if field.description:
            lines += textwrap.wrap(" ".join(field.description.split()), WIDTH - indent - 2,
                                   initial_indent=f"{pad}# ", subsequent_indent=f"{pad}# ", break_on_hyphens=False)
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            lines += commented_yaml(value, indent + 2)
        else:
            lines.append(f"{pad}{name}: {_value(dumped[name])}")
    return lines


def run_command(args: argparse.Namespace) -> int:
    """Print the config that `trajflow train CONFIG --set ...` would run with."""

    def show() -> int:
        config = load_for_command(args)
        sys.stdout.write("\n".join(commented_yaml(config)) + "\n")
        return 0

    return run_guarded("trajflow config show", show)
