"""Name rules: what a project, a run or a stored file may be called, so nothing escapes the root.

Project and run names match ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` and contain no ``..``; they are a
single path component, never a slash, never absolute. File paths inside a run are relative, use
``/`` only, and have no empty, ``.`` or ``..`` component.
"""

from __future__ import annotations

import re

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_NAME_RE = re.compile(NAME_PATTERN)
_TEMP_RE = re.compile(r"^\..*\.tmp-[0-9a-f]{32}$")
MAX_RELPATH = 1024


class InvalidNameError(ValueError):
    """A project/run name or a relative path that breaks the naming rules (the message says which)."""


def validate_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid ``kind`` name (e.g. ``"run"``), else raise InvalidNameError."""
    rule = f"{kind} names must match {NAME_PATTERN} (letters, digits, '.', '_', '-'; at most 128 characters; no '..')"
    if not isinstance(value, str):
        raise InvalidNameError(f"invalid {kind} name {value!r}: not a string; {rule}")
    if not _NAME_RE.fullmatch(value) or ".." in value:
        raise InvalidNameError(f"invalid {kind} name {value!r}: {rule}")
    return value


def is_temp_name(name: str) -> bool:
    """True for the temporary files of atomic writes (``.<name>.tmp-<32 hex>``); readers ignore them."""
    return bool(_TEMP_RE.match(name))


def safe_relpath(relpath: str) -> str:
    """Return ``relpath`` if it is a safe relative file path inside a step or run, else raise InvalidNameError."""
    rule = "a relative path uses '/' only, with no leading '/', no '\\', no empty, '.' or '..' component"
    if not isinstance(relpath, str) or not relpath:
        raise InvalidNameError(f"invalid relative path {relpath!r}: must be a non-empty string; {rule}")
    if len(relpath) > MAX_RELPATH:
        raise InvalidNameError(f"invalid relative path {relpath[:80]!r}...: longer than {MAX_RELPATH} characters")
    if relpath.startswith("/"):
        raise InvalidNameError(f"invalid relative path {relpath!r}: absolute paths are not allowed; {rule}")
    if "\\" in relpath:
        raise InvalidNameError(f"invalid relative path {relpath!r}: backslashes are not allowed; {rule}")
    if any(ord(c) < 32 or ord(c) == 127 for c in relpath):
        raise InvalidNameError(f"invalid relative path {relpath!r}: control characters are not allowed")
    for part in relpath.split("/"):
        if part in ("", ".", ".."):
            raise InvalidNameError(f"invalid relative path {relpath!r}: component {part!r} is not allowed; {rule}")
        if is_temp_name(part):
            raise InvalidNameError(f"invalid relative path {relpath!r}: {part!r} is reserved for temporary files")
    return relpath


def safe_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a safe relative path optionally ending with '/'."""
    if prefix == "":
        return prefix
    if not isinstance(prefix, str):
        raise InvalidNameError(f"invalid prefix {prefix!r}: must be a string")
    safe_relpath(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix
