"""The shape of the code: no import cycle among eagle_fx's modules and passes (imports inside
functions count: a deferred import hides a cycle, it does not remove it), each module imports on
its own in a fresh interpreter, and no module is over MAX_LINES lines."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450
PACKAGES = {"eagle_fx": ROOT / "eagle_fx", "eagle_fx.passes": ROOT / "passes"}  # package -> folder (pyproject)


def project_modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of eagle_fx (passes/ as eagle_fx.passes)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package] + parts)] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (top level, functions, branches)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_cycle_finder_sees_a_deferred_import(tmp_path):
    """The checker itself: a cycle closed only by an import inside a function is found."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert cycles(graph) == [["a", "b"]]


def test_no_import_cycles():
    modules = project_modules()
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert cycles(graph) == []


@pytest.mark.parametrize("module", ["eagle_fx.drafts", "eagle_fx.multimodal", "eagle_fx.model_inputs"])
def test_imports_alone_in_a_fresh_interpreter(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT)


def test_no_module_over_the_line_limit():
    long = {str(path.relative_to(ROOT)): n for path in project_modules().values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_every_package_folder_is_in_the_wheel():
    """pyproject's [tool.setuptools] packages names each package folder (a folder left out is missing
    from a built wheel, though an editable install still finds it: eagle_fx.runtime was)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = set()
    for package, folder in PACKAGES.items():
        for init in folder.rglob("__init__.py"):
            folders.add(".".join([package, *init.parent.relative_to(folder).parts]))
    assert folders - listed == set()
