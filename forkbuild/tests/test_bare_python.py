"""The README's commands start from a bare python3: the bootstrap needs only the
standard library until the tool environment exists, gets uv without pip, and a step
makes only what it uses. The help says what each step does and which options it has."""

import json
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from forkbuild.core import pins
from forkbuild.core.errors import ForkError
from forkbuild.gpu.bundle.build import RUNNER_MODULES
from forkbuild.setup import bootstrap, uv


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python with the standard library alone: no pip, no packaging."""
    home = tmp_path_factory.mktemp("bare") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", home], check=True)
    python = home / "bin" / "python"
    for module in ("packaging", "pip"):
        probe = _run([python, "-c", f"import {module}"])
        assert probe.returncode != 0, f"{module} is importable in {home}"
    return python


def _run(argv: list, env: dict | None = None, cwd=pins.REPO_ROOT, check=False):
    """ARGV run to its end (5 minutes at most), its output captured."""
    env = {**os.environ, **(env or {})}
    argv = [str(a) for a in argv]
    options = {"capture_output": True, "text": True, "timeout": 300, "check": check}
    return subprocess.run(argv, cwd=cwd, env=env, **options)


def _forkbuild(python: Path, *args: str, env: dict[str, str] | None = None):
    return _run([python, "-m", "forkbuild", *args], env)


def _head(tree: Path) -> str:
    return _run(["git", "rev-parse", "HEAD"], cwd=tree, check=True).stdout.strip()


SYSTEM_PYTHON, HERE = Path("/usr/bin/python3"), Path(sys.executable)
# Stands in for os.execv: prints what the bootstrap imported and where it would go.
PROBE = """
import json, os, runpy, sys
before = set(sys.modules)  # what python's own start-up loaded (site, sitecustomize)
sys.path.insert(0, sys.argv.pop(1))
def execv(path, argv):
    names = sorted(
        n for n in set(sys.modules) - before
        if "." not in n or n.startswith("forkbuild")
    )
    stdlib = sorted(sys.stdlib_module_names)  # the probed python's own, not pytest's
    seen = {"to": [str(path), *argv[1:]], "modules": names, "stdlib": stdlib}
    print(json.dumps(seen), flush=True)
    os._exit(0)
os.execv = execv
runpy.run_module("forkbuild", run_name="__main__")
"""


def _fresh_tools(tmp_path: Path) -> dict[str, str]:
    return {"VLLM_FORK_BUILD": str(tmp_path / "build"), "VLLM_FORK_TOOLS": ""}


def test_the_bootstrap_runs_on_the_system_python_on_the_stdlib_alone(tmp_path):
    """`python3 -I -m forkbuild` makes the tool environment and re-executes there having
    imported only the standard library and forkbuild's bootstrap and runner modules."""
    python = SYSTEM_PYTHON if SYSTEM_PYTHON.exists() else Path(sys.executable)
    argv = [python, "-I", "-c", PROBE, pins.REPO_ROOT, "tree", "--force"]
    done = _run(argv, _fresh_tools(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    tools = tmp_path / "build" / "tools"
    python_there = str(tools / "bin" / "python")
    assert seen["to"] == [python_there, "-m", "forkbuild", "tree", "--force"]
    allowed = {
        "forkbuild." + m.replace("/", ".").removesuffix(".__init__")
        for m in (*bootstrap.MODULES, *RUNNER_MODULES)
    } | {"forkbuild", "forkbuild.__init__"}
    ours = {m for m in seen["modules"] if m.startswith("forkbuild.")}
    assert ours - allowed == set(), "imported outside the bootstrap's closure"
    assert "forkbuild.setup.bootstrap" in ours
    others = {m for m in seen["modules"] if not m.startswith("forkbuild")}
    assert others - set(seen["stdlib"]) - {"__main__"} == set()
    assert (tools / uv.STAMP).is_file()


def test_the_tool_environment_is_reused_and_made_again_when_damaged(tmp_path):
    env = _fresh_tools(tmp_path)
    tools = tmp_path / "build" / "tools"
    made = f"creating {tools}"
    runs = [_forkbuild(HERE, "--help", env=env) for _ in range(2)]
    gone = next((tools / "lib").glob("python3*/site-packages/rich/__init__.py"))
    gone.unlink()
    runs.append(_forkbuild(HERE, "--help", env=env))
    (tools / uv.STAMP).write_text("another lock\n")
    runs.append(_forkbuild(HERE, "--help", env=env))
    assert [r.returncode for r in runs] == [0] * 4, runs[-1].stderr[-2000:]
    assert [made in r.stderr for r in runs] == [True, False, True, True]
    assert f"lacks {gone}; making it again" in runs[2].stderr
    assert gone.exists() and not tools.with_name("tools.partial").exists()


def test_fetch_and_tree_run_on_a_bare_python_and_make_no_venv(bare_python, tmp_path):
    """With the files cached, they need only the tool environment: no vLLM venv."""
    build = tmp_path / "build"
    for step in (["fetch", "--route", "cpu"], ["tree"]):
        result = _forkbuild(bare_python, *step, env=_fresh_tools(tmp_path))
        assert result.returncode == 0, result.stderr[-2000:]
    assert (build / f"vllm-{pins.load().upstream_version}" / "vllm").is_dir()
    assert not (build / "venv").exists() and not (build / "venv.partial").exists()
    assert (build / "tools" / uv.STAMP).is_file()


def other_interpreters() -> list[Path]:
    """The other supported Pythons here, each minor version's oldest (3.11.2 Debian)."""
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.1*/bin/python3"))
    oldest: dict[tuple[int, ...], tuple[tuple[int, ...], Path]] = {}
    for candidate in [SYSTEM_PYTHON, *pyenv]:
        if not candidate.exists() or candidate.resolve() == HERE.resolve():
            continue
        said = _run([candidate, "-c", "import sys; print(*sys.version_info[:3])"])
        version = tuple(map(int, said.stdout.split()))
        minor = version[:2]  # one per minor version: its oldest patch release
        if ".".join(map(str, minor)) in pins.load().pythons and (
            minor not in oldest or version < oldest[minor][0]
        ):
            oldest[minor] = (version, candidate)
    return [candidate for _, candidate in sorted(oldest.values())]


def test_tree_is_the_same_on_every_interpreter_here(tmp_path):
    """`make tree PYTHON=...` on other Pythons (3.11.2: no data filter): same tree."""
    interpreters = other_interpreters()
    if not interpreters:
        pytest.skip("no other supported Python on this machine")
    builds = {python: tmp_path / f"build-{i}" for i, python in enumerate(interpreters)}
    # `make fetch` (the cached files verified) then `make tree`, as the README says.
    steps = "{0} -m forkbuild fetch --route cpu && {0} -m forkbuild tree"
    out = {"text": True, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    running = {}
    for python, build in builds.items():
        argv = ["sh", "-c", steps.format(shlex.quote(str(python)))]
        env = {**os.environ, "VLLM_FORK_BUILD": str(build), "VLLM_FORK_TOOLS": ""}
        running[python] = subprocess.Popen(argv, cwd=pins.REPO_ROOT, env=env, **out)
    heads = {}
    for python, process in running.items():
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, f"{python}: {output[-2000:]}"
        heads[python] = _head(builds[python] / f"vllm-{pins.load().upstream_version}")
    # The running interpreter's tree: the build's own when made from the same inputs.
    made_here = pins.build_dir() / f"vllm-{pins.load().upstream_version}"
    inputs = made_here / ".git" / "forkbuild-inputs"
    theirs = next(iter(builds.values())) / made_here.name / ".git" / "forkbuild-inputs"
    if inputs.exists() and inputs.read_text() == theirs.read_text():
        heads[HERE] = _head(made_here)
    assert len(set(heads.values())) == 1, heads


def test_uv_bootstraps_without_pip_from_ensurepips_wheel(bare_python, tmp_path):
    """No cache, no pip: uv comes via ensurepip's wheel (needs the package index)."""
    code = "from forkbuild.core import pins\nfrom forkbuild.setup import uv\n"
    code += "print(uv.bootstrap_pip()[-1])\nprint(uv.binary(pins.load()))\n"
    env = {"VLLM_FORK_CACHE": str(tmp_path / "cache")}
    result = _run([bare_python, "-c", code], env)
    assert result.returncode == 0, result.stderr[-2000:]
    via, binary = result.stdout.strip().splitlines()[-2:]
    # ensurepip's own wheel: bundled with it, or where Debian keeps it
    kept = sysconfig.get_config_var("WHEEL_PKG_DIR")
    wheel = Path(via).parent  # .../pip-X-py3-none-any.whl/pip
    assert wheel.name.startswith("pip-"), via
    assert wheel.parent.name == "_bundled" or (kept and wheel.parent == Path(kept)), via
    assert Path(binary).is_relative_to(tmp_path / "cache")
    uv_version = pins.load().uv.requirement.split("==")[1]
    said = _run([binary, "--version"], check=True).stdout.split()[:2]
    assert said == ["uv", uv_version]


def test_a_python_without_pip_or_ensurepip_is_told_the_package(monkeypatch):
    monkeypatch.setattr(uv.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ForkError) as err:
        uv.bootstrap_pip()
    assert "\n" not in str(err.value)
    assert "neither pip nor ensurepip" in err.value.cause
    assert "python3-venv" in err.value.hint


def test_help_lists_every_target_variable_and_what_test_runs():
    text = _run(["make", "-s", "help", f"PYTHON={HERE}"], check=True).stdout
    words = "PORT HOST PRESET MODEL ROUTE VERSION VERSIONS ACCEPT ARGS CPU_BYTES PYTHON"
    for word in ["make clean", "lock", *words.split()]:
        assert word in text, word
    test_help = " ".join(_forkbuild(HERE, "test", "--help").stdout.split())
    assert "GPU tests' clean skip" in test_help and "patch-status" in test_help
    assert "CUDA route without a GPU" in test_help and "--route" in test_help
    steps = ("tree", "wheel", "lock", "matrix", "patch-status", "upstream", "nightly")
    for step in steps:
        assert "--route" not in _forkbuild(HERE, step, "--help").stdout, step
    makefile = (pins.REPO_ROOT / "Makefile").read_text()
    readme = (pins.REPO_ROOT / "README.md").read_text()
    assert "~11 min" in makefile and "11 min for all five releases" in readme
