"""forkbuild's shape: areas import the core and lower areas, no other module's private
name; no import circle; no `python -c` program; no function over 60 lines; ruff."""

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

from forkbuild.core.pins import REPO_ROOT

PACKAGE = REPO_ROOT / "forkbuild"
# Each area may import the core, its own modules and the areas of a lower rank; areas
# of one rank are siblings and import nothing of each other.
RANK = {"core": 0, "setup": 1, "serve": 2, "gpu": 2, "checks": 3, "upstream": 4}
TOP = {"cli", "__main__", "__init__"}  # the command line sits above every area
LONGEST_FUNCTION = 60


def _dotted(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_dotted(p): p for p in PACKAGE.rglob("*.py") if "tests" not in p.parts}


def imports(path: Path) -> dict[str, set[str]]:
    """The forkbuild modules PATH imports anywhere, each with the names it takes."""
    tree = ast.parse(path.read_text())
    found: dict[str, set[str]] = {}
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "")[:9] == "forkbuild":
            for alias in node.names:
                whole = f"{node.module}.{alias.name}"
                if whole in MODULES:  # `from forkbuild.setup import tree`
                    found.setdefault(whole, set())
                    aliases[alias.asname or alias.name] = whole
                else:
                    found.setdefault(node.module, set()).add(alias.name)
        elif isinstance(node, ast.Import):  # others than forkbuild's are left out below
            for alias in node.names:
                found.setdefault(alias.name, set())
    for node in ast.walk(tree):
        name = getattr(getattr(node, "value", None), "id", None)
        if isinstance(node, ast.Attribute) and name in aliases:
            found[aliases[name]].add(node.attr)
    return {m: names for m, names in found.items() if m in MODULES}


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def crossings(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """Every import of GRAPH the ranks forbid, and every private name taken."""
    bad = []
    for module, targets in sorted(graph.items()):
        mine = area(module)
        for target, names in sorted(targets.items()):
            theirs = area(target)
            private = sorted(n for n in names if n[:1] == "_" and n[-2:] != "__")
            if private and target != module:
                bad.append(f"{module} takes {target}'s private {', '.join(private)}")
            if mine in TOP or mine == theirs or theirs == "core":
                continue
            if theirs in TOP or RANK.get(theirs, 9) >= RANK.get(mine, -1):
                bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A cycle of GRAPH as the path that closes it (graphlib names one), or none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return [exc.args[1]]
    return []


def test_areas_import_only_the_core_and_the_areas_below_them_and_no_circle(tmp_path):
    graph = {m: imports(p) for m, p in MODULES.items()}
    assert crossings(graph) == []
    assert set(RANK) == {area(m) for m in MODULES} - TOP
    assert circles({m: set(targets) - {m} for m, targets in graph.items()}) == []
    # The finder finds a circle hidden in a function.
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from forkbuild import b\n")
    b.write_text("def f():\n    from forkbuild.a import x\n")
    MODULES.update({"forkbuild.a": a, "forkbuild.b": b})
    try:
        graph = {"forkbuild.a": set(imports(a)), "forkbuild.b": set(imports(b))}
        assert circles(graph) == [["forkbuild.a", "forkbuild.b", "forkbuild.a"]]
    finally:
        del MODULES["forkbuild.a"], MODULES["forkbuild.b"]


@pytest.mark.parametrize(
    ("module", "source", "problem"),
    [
        ("forkbuild.core.x", "from forkbuild.setup import tree\n", "imports"),
        ("forkbuild.gpu.x", "from forkbuild.serve import server\n", "imports"),
        ("forkbuild.setup.x", "from forkbuild.checks.matrix import run\n", "imports"),
        ("forkbuild.setup.x", "from forkbuild.cli import main\n", "imports"),
        ("forkbuild.checks.x", "from forkbuild.setup import tree\ntree._x", "private"),
        ("forkbuild.gpu.x", "from forkbuild.setup.tree import _git_ok\n", "private"),
    ],
)
def test_the_area_check_finds_a_forbidden_import(tmp_path, module, source, problem):
    path = tmp_path / "x.py"
    path.write_text(source)
    (found,) = crossings({module: imports(path)})
    assert problem in found


def long_functions(path: Path) -> list[str]:
    """The functions of PATH longer than LONGEST_FUNCTION lines, with their length."""
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]


def program_arguments(path: Path) -> list[int]:
    """Lines of PATH whose argument list has "-c" second, then no option: a program
    passed as text (nvcc's `-c` is followed by options)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        match node:
            case ast.List(elts=[_, ast.Constant(value="-c"), following, *_]):
                value = following.value if isinstance(following, ast.Constant) else ""
                if not str(value).startswith("-"):
                    lines.append(node.lineno)
    return lines


def test_no_function_is_over_60_lines_and_no_program_is_passed_as_text(tmp_path):
    path = tmp_path / "m.py"  # the checks find theirs; the fork's code has none
    path.write_text("def f():\n" + "    x = 1\n" * LONGEST_FUNCTION)
    assert long_functions(path) == [f"f ({LONGEST_FUNCTION + 1} lines)"]
    path.write_text(
        'import subprocess\nsubprocess.run([python, "-c", PROBE, "x"])\n'
        'subprocess.run([nvcc, "-c", "-Xcompiler", "-fPIC", source])\n'
    )
    assert program_arguments(path) == [2]
    tests = sorted((PACKAGE / "tests").glob("*.py"))
    found = {str(p): long_functions(p) for p in [*MODULES.values(), *tests]}
    assert {path: names for path, names in found.items() if names} == {}
    found = {name: program_arguments(path) for name, path in MODULES.items()}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_forks_code_passes_ruff():
    """`ruff check` and `ruff format --check`, with fork.toml's pinned ruff."""
    for args in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        ruff = [sys.executable, "-m", "ruff", *args]
        done = subprocess.run(ruff, cwd=REPO_ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
