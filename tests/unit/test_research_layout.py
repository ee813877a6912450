"""The research repository's layout: studies and benchmarks are modules (no ``sys.path`` edits), their imports
form no cycle (function-level imports included, which the import contracts of ``lightning_sp`` do not see), and
``scripts/`` holds only thin entry points."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("experiments", "benchmarks")
ENTRY_POINTS = {"demo.py", "run.py", "figures.py", "hf_support_table.py", "cluster_train.py",
                "torchrun_multinode.sh", "slurm_train.sbatch"}


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every module of ``known`` that ``path`` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in known}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
            if nxt not in state and (found := visit(nxt, stack + [nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_import_cycle_in_the_research_code():
    modules = _modules()
    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}
    # a package imports its own modules to re-export them: not a cycle of code
    graph = {name: {m for m in deps if not (m.startswith(name + ".") and modules[name].name == "__init__.py")}
             for name, deps in graph.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    # control: the cycle this layout broke (calibrate imported split, which imports calibrate) is found
    broken = {**graph, "experiments.cost_model.calibrate": graph["experiments.cost_model.calibrate"]
              | {"experiments.cost_model.split"}}
    assert _cycle(broken) is not None


def test_no_sys_path_edits():
    offenders = [str(p.relative_to(ROOT)) for package in (*PACKAGES, "scripts") for p in (ROOT / package).rglob("*.py")
                 if "sys.path" in p.read_text() and p.name != "cluster_train.py"]
    assert offenders == [], "run these as modules (python -m ...) instead of editing sys.path"


def test_scripts_holds_only_entry_points():
    assert {p.name for p in (ROOT / "scripts").iterdir() if p.is_file()} <= ENTRY_POINTS
