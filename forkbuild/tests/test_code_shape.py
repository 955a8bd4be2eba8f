"""forkbuild's shape: no import circle among its modules (imports inside functions
count), no program handed to an interpreter as text (`python -c`): every probe is a
module run with `-m`, linted and tested like the rest; and the fork's own code passes
ruff as vLLM configures it (ruff.toml)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from forkbuild.pins import REPO_ROOT

MODULES = {p.stem: p for p in (REPO_ROOT / "forkbuild").glob("*.py")}


def imports(path: Path) -> set[str]:
    """The forkbuild modules PATH imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("forkbuild")
        ):
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[1]
                for a in node.names
                if a.name.startswith("forkbuild.") and "." in a.name
            )
    return found & MODULES.keys()


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of GRAPH finds, as the path that closes it."""
    found, stack, seen = [], [], set()

    def walk(node: str) -> None:
        stack.append(node)
        seen.add(node)
        for target in sorted(graph[node]):
            if target in stack:
                found.append(stack[stack.index(target) :] + [target])
            elif target not in seen:
                walk(target)
        stack.pop()

    for node in sorted(graph):
        if node not in seen:
            walk(node)
    return found


def test_forkbuild_has_no_import_circle():
    graph = {name: imports(path) - {name} for name, path in MODULES.items()}
    assert circles(graph) == []


def test_the_circle_finder_finds_one_hidden_in_a_function(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from forkbuild import b\n")
    b.write_text("def f():\n    from forkbuild.a import x\n")
    MODULES.update(a=a, b=b)
    try:
        assert circles({"a": imports(a), "b": imports(b)}) == [["a", "b", "a"]]
    finally:
        del MODULES["a"], MODULES["b"]


def program_arguments(path: Path) -> list[int]:
    """Lines of PATH where a list of arguments holds "-c" right after the program it
    runs and before something that is not an option: a program passed as text (nvcc's
    `-c` is followed by options)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.List) and len(node.elts) > 2:
            flag, following = node.elts[1], node.elts[2]
            option = isinstance(following, ast.Constant) and str(
                following.value
            ).startswith("-")
            if isinstance(flag, ast.Constant) and flag.value == "-c" and not option:
                lines.append(node.lineno)
    return lines


def test_no_program_is_passed_as_text():
    found = {name: program_arguments(path) for name, path in MODULES.items()}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_program_finder_finds_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        'import subprocess\nsubprocess.run([python, "-c", PROBE, "x"])\n'
        'subprocess.run([nvcc, "-c", "-Xcompiler", "-fPIC", source])\n'
    )
    assert program_arguments(path) == [2]


def test_the_forks_code_passes_ruff():
    """`ruff check` and `ruff format --check` over ruff.toml's files, with the ruff of
    fork.toml's test tools."""
    for args in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
