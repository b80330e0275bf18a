"""The storage layout lives in one place: no file of a run or a step is named outside storage/layout.py.

Every .py file of agents/, backends/, storage/, tasks/ and flows/ (storage/layout.py aside) is
parsed; a string constant, or a literal part of an f-string, is flagged when

1. one of its "/"-separated parts is in FILE_NAMES: ``"scored.parquet"``, ``f"{area}/scored.parquet"``,
   ``"/prefect-results"``;
2. it holds a "/" and one of its parts is in DIR_NAMES: ``"adapter/"``, ``f"logs/{split}.parquet"``;
3. it is exactly a DIR_NAME where a path goes: an operand of ``/`` (pathlib), an argument bound to a
   parameter named like a path (``relpath``, ``prefix``, ``out``, ...) of a function defined in
   these packages, such a parameter's default, or an UPPER_CASE constant of its own.

DIR_NAMES are also plain words ("trainer" is a config section, "groups" a JSON key, "eval" a CLI
command, "logs" a reward detail): as dict keys, subscripts, comparisons and prose they pass.
Docstrings are prose and skipped. FILE_NAMES are distinctive enough to be flagged wherever they are
a whole path part. Tests and benchmarks may spell names: they check the layout from outside.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import storage.layout as layout

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("agents", "backends", "storage", "tasks", "flows")
LAYOUT_FILE = "storage/layout.py"

FILE_NAMES = frozenset({
    "run.json", "lease.json", "manifest.json", "manifest.json.corrupt-", "scenarios.json", "scored.parquet",
    "adapter_config.json", "adapter_model.safetensors",
    "state.pt", "trainer.json", "metrics.json", "training.json", "progress.json", "eval.parquet", "reward_curve.png",
    "judge-cache", "compile-cache", "prefect-results", "recoveries",
})
DIR_NAMES = frozenset({"steps", "groups", "adapter", "trainer", "eval", "logs", "evaluations", "sft-progress"})

# (file, name) -> why the name may be spelled there
ALLOWED: dict[tuple[str, str], str] = {}

_PATH_WORDS = frozenset({"path", "relpath", "rel", "prefix", "dir", "folder", "out", "area"})
_PATH_CALLS = frozenset({"join", "joinpath", "Path", "PurePath", "PurePosixPath"})
_CONSTANT_NAME = re.compile(r"^_?[A-Z][A-Z0-9_]*$")


def _is_path_param(name: str | None) -> bool:
    return name is not None and bool(_PATH_WORDS & set(name.lower().split("_")))


def _str_const(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and _str_const(first.value) is not None:
                ids.add(id(first.value))
    return ids


def _functions(tree: ast.Module) -> list[tuple[str, list[str], bool]]:
    """(name, parameter names in order, is a method) of every function defined in the module."""
    methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
            is_method = id(node) in methods and not static
            out.append((node.name, names[1:] if is_method and names else names, is_method))
    return out


def parameter_index(trees: list[ast.Module]) -> dict[str, list[list[str]]]:
    """Function name -> the positional parameter lists of every function of that name."""
    index: dict[str, list[list[str]]] = {}
    for tree in trees:
        for name, params, _ in _functions(tree):
            index.setdefault(name, []).append(params)
    return index


def _spelled(text: str) -> str | None:
    """The layout name a literal spells as a path (rules 1 and 2), or None."""
    parts = text.split("/")
    for part in parts:
        if part in FILE_NAMES or (len(parts) > 1 and part in DIR_NAMES):
            return part
    return None


def _path_positions(tree: ast.Module, index: dict[str, list[list[str]]]) -> set[int]:
    """ids of the string constants that stand where a path goes (rule 3)."""
    found: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if _str_const(node) is not None:
            found.add(id(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            mark(node.left)
            mark(node.right)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            for i, arg in enumerate(node.args):
                if name in _PATH_CALLS or any(i < len(p) and _is_path_param(p[i]) for p in index.get(name, [])):
                    mark(arg)
            for kw in node.keywords:
                if _is_path_param(kw.arg):
                    mark(kw.value)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
                if _is_path_param(arg.arg):
                    mark(default)
            for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                if _is_path_param(arg.arg):
                    mark(default)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name) and _CONSTANT_NAME.match(targets[0].id):
                mark(node.value)
    return found


def layout_names_in(tree: ast.Module, index: dict[str, list[list[str]]]) -> list[tuple[int, str, str]]:
    """(line, layout name, the literal spelling it) of every place the module spells a layout name as a path."""
    skip = _docstrings(tree)
    at_path = _path_positions(tree, index)
    hits = []
    for node in ast.walk(tree):
        text = _str_const(node)
        if text is None or id(node) in skip:
            continue
        name = _spelled(text)
        if name is None and text in DIR_NAMES and id(node) in at_path:
            name = text
        if name is not None:
            hits.append((node.lineno, name, text))
    return sorted(hits)


def _sources() -> dict[str, ast.Module]:
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(encoding="utf-8"), filename=str(p)) for p in files}


def _findings(sources: dict[str, ast.Module]) -> list[str]:
    index = parameter_index(list(sources.values()))
    return [f"{rel}:{line}: {text!r} spells {name!r}"
            for rel, tree in sources.items() if rel != LAYOUT_FILE
            for line, name, text in layout_names_in(tree, index) if (rel, name) not in ALLOWED]


def test_no_layout_name_is_spelled_outside_storage_layout():
    findings = _findings(_sources())
    assert not findings, ("step/run file names spelled outside storage/layout.py (name them with its constants "
                          "and helpers):\n" + "\n".join(findings))


def test_every_name_of_the_layout_is_checked():
    """A name added to storage/layout.py must be classified here, or the check would not see it spelled."""
    for attr, value in vars(layout).items():
        if attr.isupper() and isinstance(value, str):
            assert all(part in FILE_NAMES | DIR_NAMES for part in value.split("/")), (attr, value)
    for rel, name in ALLOWED:
        assert (ROOT / rel).exists() and name in FILE_NAMES | DIR_NAMES, rel


def _check(source: str) -> list[tuple[int, str, str]]:
    tree = ast.parse(source)
    return layout_names_in(tree, parameter_index([tree]))


@pytest.mark.parametrize("source", [
    'store.put_json(step, "scenarios.json", [])',
    'out = f"{area}/scored.parquet"',
    'url = base.rstrip("/") + "/prefect-results"',
    'path = f"judge-cache/{key}.json"',
    'store.exists(step - 1, "adapter/adapter_model.safetensors")',
    'store.write_groups(step, f"logs/{split}.parquet", groups)',
    'def apply(prune=("adapter/", "trainer/")): ...',
    'weights = folder / "adapter" / "weights.bin"',
    'ADAPTER_DIR = "adapter"',
    'def run_groups(config, step, prefix): ...\nrun_groups(config, 1, "groups")',
    'def score(step, out="eval.parquet"): ...',
    'store.list_files(step, prefix="trainer")',
    'x = f"{run}/evaluations/{stamp}.png"',
])
def test_a_spelled_layout_name_is_caught(source):
    assert _check(source), source


@pytest.mark.parametrize("source", [
    '"""Writes ``scored.parquet`` and ``adapter/`` last."""',
    'def f():\n    """Reads training.json."""',
    'config = {"trainer": {}, "groups": []}',
    'value = record["trainer"]',
    'value = payload.get("groups")',
    'if policy["kind"] == "adapter": pass',
    'subparsers.add_parser("eval", help="evaluate policies")',
    'IDENTITY_FIELDS = ("agent", "trainer")',
    'log.info("trainer ready; groups=%d", n)',
    'metrics = {"train/reward": 1.0, "val/reward": 0.5}',
    'raise ValueError(f"{path}: no training.json there")',
])
def test_plain_words_and_prose_pass(source):
    assert not _check(source), source
