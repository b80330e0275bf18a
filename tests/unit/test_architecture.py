"""The architecture, checked on the source: which package may import which, no import circles, backends/' layout.

Every ``import`` and ``from ... import`` in agents/, backends/, storage/, tasks/ and flows/ counts, wherever it
stands (module level, inside a function, under ``if TYPE_CHECKING:`` or ``if __name__ == "__main__":``), and so does
``importlib.import_module("literal")``. ``from package import name`` is an edge to ``package.name`` when that is a
module, else to ``package``; relative imports are resolved against the importing module.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.paths import REPO

PACKAGES = ("agents", "backends", "storage", "tasks", "flows")

# The architecture, one row per layer: what its modules may import of trajflow besides their own layer. A module
# belongs to the longest key that is a dotted prefix of its name; an import is allowed when its target belongs to the
# same layer or starts with (or equals) a listed prefix.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "flows": ("tasks", "agents", "backends", "storage"),  # flows/cli.py registers other areas' subcommands
    "tasks": ("agents", "backends", "storage"),
    "storage": ("agents",),  # trajectories as Parquet
    "agents": (),
    "backends": ("backends.art",),  # backends/__init__.py re-exports LocalBackend and RemoteBackend lazily
    "backends.modeling": (),
    "backends.inference": ("backends.modeling", "storage.layout"),  # the adapter folder's file names
    "backends.serving": ("backends.inference", "backends.modeling", "agents"),  # agents: the rollout's seed context
    "backends.training": ("backends.training.kernels", "backends.modeling",
                          "storage.layout",  # the checkpoint folder's names
                          "agents.trajectory"),
    "backends.training.kernels": ("backends.modeling",),
    "backends.policy": ("backends.training", "backends.serving", "backends.modeling", "storage", "agents"),
    "backends.art": ("backends.policy", "backends.training", "backends.serving", "backends.modeling", "storage",
                     "agents"),
}

# Third-party packages a layer never imports: Prefect lives in tasks/ and flows/; agent code runs without torch.
MAY_NOT_IMPORT: dict[str, tuple[str, ...]] = {
    "agents": ("prefect", "torch", "transformers", "peft"),
    "backends": ("prefect",),
    "storage": ("prefect",),
}

BACKENDS_SUBPACKAGES = ("modeling", "inference", "serving", "training", "training/kernels", "policy", "art")
MAX_BACKENDS_TOP_MODULES = 4


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported name: a trajflow module, or a third-party package's dotted name
    file: str  # repository-relative path
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_files(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages (a package's name is its __init__.py)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _literal_import_module(node: ast.AST) -> str | None:
    """The module of ``import_module("x")`` / ``importlib.import_module("x")``, else None."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return node.args[0].value if name == "import_module" else None


def imports_of(module: str, path: Path, modules: dict[str, Path], root: Path = REPO) -> list[Import]:
    """Every import `module` (in `path`) makes, resolved to a trajflow module where it names one."""

    def known(name: str) -> str:
        """`name`, or its longest prefix that is a trajflow module (the module a name inside it belongs to)."""
        parts = name.split(".")
        while len(parts) > 1 and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts)

    is_package = path.name == "__init__.py"
    file = str(path.relative_to(root))
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=file)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        elif (name := _literal_import_module(node)) is not None:
            targets = [name]
        for target in targets:
            resolved = known(target) if target.split(".")[0] in PACKAGES else target
            found.append(Import(module, resolved, file, node.lineno))
    return found


def all_imports(root: Path = REPO) -> list[Import]:
    modules = module_files(root)
    return [imp for module, path in modules.items() for imp in imports_of(module, path, modules, root)]


def _starts_with(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module: str) -> str:
    """The longest MAY_IMPORT key that is a dotted prefix of `module`."""
    return max((key for key in MAY_IMPORT if _starts_with(module, key)), key=len)


def layer_violations(imports: list[Import]) -> list[str]:
    """One line per import that the tables above do not allow, naming its file and line."""
    problems = []
    for imp in imports:
        source_layer = layer_of(imp.source)
        if imp.target.split(".")[0] in PACKAGES:
            allowed = MAY_IMPORT[source_layer]
            if layer_of(imp.target) != source_layer and not any(_starts_with(imp.target, p) for p in allowed):
                problems.append(f"{imp.where()}: {imp.source} imports {imp.target}; {source_layer} may import "
                                f"{', '.join(allowed) or 'nothing'} besides itself")
        else:
            banned = [p for key, names in MAY_NOT_IMPORT.items() if _starts_with(imp.source, key) for p in names]
            if any(_starts_with(imp.target, p) for p in banned):
                problems.append(f"{imp.where()}: {imp.source} imports {imp.target}; "
                                f"{source_layer} never imports {', '.join(banned)}")
    return sorted(problems)


def import_cycles(imports: list[Import]) -> list[str]:
    """Each strongly connected component of more than one module, as its modules and the edges inside it."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if imp.target.split(".")[0] in PACKAGES and imp.target != imp.source:
            graph.setdefault(imp.source, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:
        if len(component) > 1:
            members = set(component)
            edges = [f"{imp.source} -> {imp.target} ({imp.where()})" for source in sorted(members)
                     for target, imp in sorted(graph.get(source, {}).items()) if target in members]
            cycles.append(f"circle {sorted(members)}: " + "; ".join(edges))
    return cycles


def backends_layout_problems(root: Path = REPO) -> list[str]:
    backends = root / "backends"
    top = sorted(p.name for p in backends.glob("*.py") if p.name != "__init__.py")
    problems = []
    if len(top) > MAX_BACKENDS_TOP_MODULES:
        problems.append(f"backends/ has {len(top)} top-level modules besides __init__.py (at most "
                        f"{MAX_BACKENDS_TOP_MODULES}): {', '.join(top)}")
    problems += [f"backends/{sub}/ is missing (or has no __init__.py)" for sub in BACKENDS_SUBPACKAGES
                 if not (backends / sub / "__init__.py").is_file()]
    return problems


def test_imports_follow_the_layers():
    problems = layer_violations(all_imports())
    assert not problems, "imports against the architecture:\n" + "\n".join(problems)


def test_no_import_circles():
    cycles = import_cycles(all_imports())
    assert not cycles, "import circles (lazy imports count):\n" + "\n".join(cycles)


def test_backends_layout():
    problems = backends_layout_problems()
    assert not problems, "\n".join(problems)


# --- the checks themselves fail where they should, on a small tree written here ------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for package in PACKAGES:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    return root


def test_a_back_edge_is_named_with_its_file_and_line(tmp_path):
    root = _tree(tmp_path, {
        "agents/model.py": "import json\n\ndef f():\n    from tasks.run_config import RunConfig\n",
        "backends/training/trainer.py": "from backends.inference import engine\n",
        "backends/inference/engine.py": "import torch\n",
        "backends/serving/app.py": "from ..training import trainer\n",
        "storage/store.py": "import prefect\n",
        "tasks/run_config.py": "import importlib\nimportlib.import_module('flows.train')\n",
        "flows/train.py": "from backends.training.trainer import GRPOTrainer\nimport agents.model\n",
        "agents/client.py": "import torch.nn\n",
    })
    problems = layer_violations(all_imports(root))
    assert problems == [
        "agents/client.py:1: agents.client imports torch.nn; agents never imports prefect, torch, transformers, peft",
        "agents/model.py:4: agents.model imports tasks.run_config; agents may import nothing besides itself",
        "backends/serving/app.py:1: backends.serving.app imports backends.training.trainer; backends.serving may "
        "import backends.inference, backends.modeling, agents besides itself",
        "backends/training/trainer.py:1: backends.training.trainer imports backends.inference.engine; "
        "backends.training may import backends.training.kernels, backends.modeling, storage.layout, "
        "agents.trajectory besides itself",
        "storage/store.py:1: storage.store imports prefect; storage never imports prefect",
        "tasks/run_config.py:2: tasks.run_config imports flows.train; tasks may import agents, backends, storage "
        "besides itself",
    ]


def test_a_lazy_circle_is_found(tmp_path):
    root = _tree(tmp_path, {
        "flows/cli.py": "def run():\n    from flows.train import train\n",
        "flows/train.py": "if __name__ == '__main__':\n    from flows import cli\n",
        "flows/evaluate.py": "import flows.train\n",
    })
    assert import_cycles(all_imports(root)) == [
        "circle ['flows.cli', 'flows.train']: flows.cli -> flows.train (flows/cli.py:2); "
        "flows.train -> flows.cli (flows/train.py:2)"]


def test_a_crowded_or_incomplete_backends_is_refused(tmp_path):
    root = _tree(tmp_path, {f"backends/m{i}.py": "" for i in range(5)})
    (root / "backends" / "modeling").mkdir()
    (root / "backends" / "modeling" / "__init__.py").touch()
    problems = backends_layout_problems(root)
    assert problems[0].startswith("backends/ has 5 top-level modules")
    assert "backends/modeling/ is missing (or has no __init__.py)" not in problems
    assert "backends/training/kernels/ is missing (or has no __init__.py)" in problems
