"""The research repository's layout: studies and benchmarks are modules (no ``sys.path`` edits), their imports
form no cycle (function-level imports included, which the import contracts of ``lightning_sp`` do not see), and
``scripts/`` holds only thin entry points."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("experiments", "benchmarks")
ENTRY_POINTS = {"bench_gpu.py", "demo.py", "run.py", "figures.py", "hf_support_table.py", "cluster_train.py",
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


def test_run_by_name_finds_every_study_and_benchmark_and_names_the_choices(tmp_path):
    import os
    import subprocess
    import sys

    script = str(ROOT / "scripts" / "run.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # from anywhere, nothing on the path
    listed = subprocess.run([sys.executable, script, "--list"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    names = {line.split()[0] for line in listed.stdout.splitlines()}
    studies = {p.parent.name for package in PACKAGES for p in (ROOT / package).glob("*/run.py")}
    assert listed.returncode == 0 and studies <= names and len(studies) >= 18, listed.stdout
    wrong = subprocess.run([sys.executable, script, "longest_sequnce"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60)
    assert wrong.returncode != 0 and "longest_sequence" in wrong.stderr, wrong.stderr
    # a module runs with its arguments, from a folder outside the repository
    helped = subprocess.run([sys.executable, script, "peers.cell", "--help"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "--pair" in helped.stdout, helped.stderr[-2000:]


def test_sources_compile_without_warnings():
    """An invalid escape in a docstring is a SyntaxWarning on every import under Python 3.12 (it flooded the first
    GPU run's log); it must fail here instead, whatever Python runs the suite."""
    import warnings

    offenders = []
    for package in ("lightning_sp", "tests", *PACKAGES, "scripts"):
        for path in (ROOT / package).rglob("*.py"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                try:
                    compile(path.read_text(), str(path), "exec")
                except SyntaxError as err:
                    offenders.append(f"{path.relative_to(ROOT)}: {err.msg}")
    assert offenders == []
    with warnings.catch_warnings():  # control: the docstring this test was written for, unescaped, is caught
        warnings.simplefilter("error")
        try:
            compile('"""c_r  \\ \\   (one CAUSAL square)"""', "control", "exec")
        except SyntaxError:
            pass
        else:
            raise AssertionError("an invalid escape sequence compiled without a warning")


def test_bench_gpu_old_address_serves_the_outside_check():
    """The ready GPU check loads ``scripts/bench_gpu.py`` by path (not as a module) and calls these names."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("Results", "parse_args", "_meta", "kernels_section", "schedule_section", "main"):
        assert callable(getattr(mod, name)), name
    assert mod.parse_args(["--smoke"]).kernel_causal == [True]
