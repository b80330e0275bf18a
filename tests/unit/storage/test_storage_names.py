"""Project/run names and relative paths: nothing can escape the storage root."""

from __future__ import annotations

import pytest

from storage import InvalidNameError, RunStore, safe_relpath, validate_name
from storage.names import safe_prefix

VALID_NAMES = ["a", "run-1", "Run_2.final", "0", "x" * 128, "a.b"]
INVALID_NAMES = ["", "..", "/x", "a/b", ".", ".hidden", "-x", "a..b", "x" * 129, "a b", "a\\b", "ü", "a\n", "~", "C:"]


@pytest.mark.parametrize("name", VALID_NAMES)
def test_valid_names(name):
    assert validate_name("run", name) == name


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_invalid_names_are_refused_with_the_rule(name):
    with pytest.raises(InvalidNameError) as info:
        validate_name("run", name)
    assert repr(name) in str(info.value) and "run names must match" in str(info.value)


@pytest.mark.parametrize("name", ["..", "/x", "a/b", "", "../../etc"])
def test_run_store_refuses_escaping_names(name, store_root):
    with pytest.raises(InvalidNameError, match="invalid project name"):
        RunStore(store_root, name, "run")
    with pytest.raises(InvalidNameError, match="invalid run name"):
        RunStore(store_root, "proj", name)


def test_non_string_name():
    with pytest.raises(InvalidNameError, match="not a string"):
        validate_name("project", None)
    assert issubclass(InvalidNameError, ValueError)


@pytest.mark.parametrize("rel", ["a.txt", "adapter/adapter_model.safetensors", "a/b/c..d", ".hidden", "judge-cache/ab.json"])
def test_safe_relpaths(rel):
    assert safe_relpath(rel) == rel


@pytest.mark.parametrize(
    "rel, why",
    [
        ("", "non-empty"),
        ("/etc/passwd", "absolute"),
        ("../x", "'..'"),
        ("a/../../x", "'..'"),
        ("a\\b", "backslash"),
        ("a//b", "''"),
        ("a/./b", "'.'"),
        ("a/", "''"),
        ("a\x00b", "control"),
        (".x.tmp-" + "0" * 32, "reserved for temporary files"),
        ("a" * 1025, "longer than"),
    ],
)
def test_unsafe_relpaths(rel, why):
    with pytest.raises(InvalidNameError, match=why.replace(".", r"\.")):
        safe_relpath(rel)


def test_prefixes():
    assert safe_prefix("") == ""
    assert safe_prefix("adapter/") == "adapter/"
    assert safe_prefix("traj") == "traj"
    with pytest.raises(InvalidNameError):
        safe_prefix("../")
