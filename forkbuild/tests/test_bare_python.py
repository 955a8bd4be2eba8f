"""The README's commands start from a bare python3: the bootstrap needs nothing but the
standard library until the tool environment exists, bootstraps uv without pip, and a
step makes only what it uses. The help says what each step does and which options it
takes."""

from __future__ import annotations

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
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(home)], check=True
    )
    python = home / "bin" / "python"
    for module in ("packaging", "pip"):
        probe = subprocess.run(
            [str(python), "-c", f"import {module}"], capture_output=True, check=False
        )
        assert probe.returncode != 0, f"{module} is importable in {home}"
    return python


def _forkbuild(
    python: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 300
):
    return subprocess.run(
        [str(python), "-m", "forkbuild", *args],
        cwd=pins.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


SYSTEM_PYTHON = Path("/usr/bin/python3")
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
    print(json.dumps({"to": [str(path), *argv[1:]], "modules": names}), flush=True)
    os._exit(0)
os.execv = execv
runpy.run_module("forkbuild", run_name="__main__")
"""


def _fresh_tools(tmp_path: Path) -> dict[str, str]:
    return {"VLLM_FORK_BUILD": str(tmp_path / "build"), "VLLM_FORK_TOOLS": ""}


def test_the_bootstrap_runs_on_the_system_python_with_the_standard_library_alone(
    tmp_path,
):
    """`python3 -I -m forkbuild` (no site-packages, no PYTHONPATH) makes the tool
    environment and re-executes there having imported only the standard library and
    forkbuild's bootstrap and runner modules (forkbuild/setup/bootstrap.py MODULES,
    forkbuild/gpu/bundle/build.py RUNNER_MODULES)."""
    python = SYSTEM_PYTHON if SYSTEM_PYTHON.exists() else Path(sys.executable)
    done = subprocess.run(
        [str(python), "-I", "-c", PROBE, str(pins.REPO_ROOT), "tree", "--force"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **_fresh_tools(tmp_path)},
    )
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
    assert others - set(sys.stdlib_module_names) - {"__main__"} == set()
    assert (tools / uv.STAMP).is_file()


def test_the_tool_environment_is_reused_and_made_again_when_damaged(tmp_path):
    env = _fresh_tools(tmp_path)
    tools = tmp_path / "build" / "tools"
    made = f"creating {tools}"
    runs = [_forkbuild(Path(sys.executable), "--help", env=env)]
    runs.append(_forkbuild(Path(sys.executable), "--help", env=env))
    gone = next((tools / "lib").glob("python3*/site-packages/rich/__init__.py"))
    gone.unlink()
    runs.append(_forkbuild(Path(sys.executable), "--help", env=env))
    (tools / uv.STAMP).write_text("another lock\n")
    runs.append(_forkbuild(Path(sys.executable), "--help", env=env))
    assert [r.returncode for r in runs] == [0] * 4, runs[-1].stderr[-2000:]
    assert [made in r.stderr for r in runs] == [True, False, True, True]
    assert f"lacks {gone}; making it again" in runs[2].stderr
    assert gone.exists() and not tools.with_name("tools.partial").exists()


def test_fetch_and_tree_run_on_a_bare_python_and_make_no_venv(bare_python, tmp_path):
    """With the files cached, `make fetch` and `make tree` need no venv of vLLM's, only
    the tool environment, made by the bootstrap from a python without pip."""
    env = _fresh_tools(tmp_path)
    build = tmp_path / "build"
    for step in (["fetch", "--route", "cpu"], ["tree"]):
        result = _forkbuild(bare_python, *step, env=env)
        assert result.returncode == 0, result.stderr[-2000:]
    assert (build / f"vllm-{pins.load().upstream_version}" / "vllm").is_dir()
    assert not (build / "venv").exists() and not (build / "venv.partial").exists()
    assert (build / "tools" / uv.STAMP).is_file()


def other_interpreters() -> list[Path]:
    """The other Pythons of the supported versions on this machine (CI's has the same):
    Debian 12's /usr/bin/python3 (3.11.2, the oldest 3.11 patch release in use), and the
    pyenv builds of the other minor versions, oldest patch release first."""
    supported = pins.load().pythons
    found = []
    for candidate in [
        Path("/usr/bin/python3"),
        *sorted(Path.home().glob(".pyenv/versions/3.1*/bin/python3")),
    ]:
        if (
            not candidate.exists()
            or candidate.resolve() == Path(sys.executable).resolve()
        ):
            continue
        version = subprocess.run(
            [str(candidate), "-c", "import sys; print(*sys.version_info[:3])"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        minor = ".".join(version[:2])
        if minor in supported:
            found.append((tuple(map(int, version)), candidate))
    oldest: dict[tuple[int, int], tuple[tuple[int, ...], Path]] = {}
    for version, candidate in found:  # one per minor version: its oldest patch release
        if version[:2] not in oldest or version < oldest[version[:2]][0]:
            oldest[version[:2]] = (version, candidate)
    return [candidate for _, candidate in sorted(oldest.values())]


def test_tree_is_the_same_on_every_interpreter_here(tmp_path):
    """`make fetch` and `make tree PYTHON=...` with each other supported interpreter of
    this machine (the standard library alone; tarfile's data filter is missing before
    3.11.4) make the very commits the running one makes: same inputs, same tree."""
    interpreters = other_interpreters()
    if not interpreters:
        pytest.skip("no other supported Python on this machine")
    builds = {python: tmp_path / f"build-{i}" for i, python in enumerate(interpreters)}
    # `make fetch` (the cached files verified) then `make tree`, as the README runs
    # them.
    steps = "{0} -m forkbuild fetch --route cpu && {0} -m forkbuild tree"
    running = {
        python: subprocess.Popen(
            ["sh", "-c", steps.format(shlex.quote(str(python)))],
            cwd=pins.REPO_ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_FORK_BUILD": str(build), "VLLM_FORK_TOOLS": ""},
        )
        for python, build in builds.items()
    }
    heads = {}
    for python, process in running.items():
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, f"{python}: {output[-2000:]}"
        tree = builds[python] / f"vllm-{pins.load().upstream_version}"
        heads[python] = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=tree,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    # The running interpreter's tree: the build's own when made from the same inputs.
    made_here = pins.build_dir() / f"vllm-{pins.load().upstream_version}"
    inputs = made_here / ".git" / "forkbuild-inputs"
    theirs = next(iter(builds.values())) / made_here.name / ".git" / "forkbuild-inputs"
    if inputs.exists() and inputs.read_text() == theirs.read_text():
        heads[Path(sys.executable)] = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=made_here,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    assert len(set(heads.values())) == 1, heads


def test_uv_bootstraps_without_pip_from_ensurepips_wheel(bare_python, tmp_path):
    """An empty cache and a Python without pip: uv arrives through the pip wheel that
    ensurepip bundles, verified (needs the package index, as a cold `make` does)."""
    code = (
        "from forkbuild.core import pins\nfrom forkbuild.setup import uv\n"
        "print(uv.bootstrap_pip()[-1])\n"
        "print(uv.binary(pins.load()))\n"
    )
    result = subprocess.run(
        [str(bare_python), "-c", code],
        cwd=pins.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "VLLM_FORK_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    via, binary = result.stdout.strip().splitlines()[-2:]
    # ensurepip's own wheel: bundled with it, or where the distribution keeps it
    # (Debian)
    kept = sysconfig.get_config_var("WHEEL_PKG_DIR")
    wheel = Path(via).parent  # .../pip-X-py3-none-any.whl/pip
    assert wheel.name.startswith("pip-"), via
    assert wheel.parent.name == "_bundled" or (kept and wheel.parent == Path(kept)), via
    assert Path(binary).is_relative_to(tmp_path / "cache")
    version = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.split()[:2] == [
        "uv",
        pins.load().uv.requirement.split("==")[1],
    ]


def test_a_python_without_pip_or_ensurepip_gets_one_line_naming_the_package(
    monkeypatch,
):
    monkeypatch.setattr(uv.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ForkError) as err:
        uv.bootstrap_pip()
    assert "\n" not in str(err.value)
    assert "neither pip nor ensurepip" in err.value.cause
    assert "python3-venv" in err.value.hint


def test_help_lists_every_target_variable_and_what_test_runs():
    text = subprocess.run(
        ["make", "-s", "help", f"PYTHON={sys.executable}"],
        cwd=pins.REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for word in (
        "make clean",
        "PORT",
        "HOST",
        "PRESET",
        "MODEL",
        "ROUTE",
        "VERSION",
        "VERSIONS",
        "ACCEPT",
        "ARGS",
        "CPU_BYTES",
        "PYTHON",
        "lock",
    ):
        assert word in text, word
    test_help = " ".join(
        _forkbuild(Path(sys.executable), "test", "--help").stdout.split()
    )
    assert "GPU tests' clean skip" in test_help and "patch-status" in test_help
    assert "CUDA route without a GPU" in test_help
    assert "--route" in test_help
    for step in (
        "tree",
        "wheel",
        "lock",
        "matrix",
        "patch-status",
        "upstream",
        "nightly",
    ):
        assert (
            "--route" not in _forkbuild(Path(sys.executable), step, "--help").stdout
        ), step
    makefile = (pins.REPO_ROOT / "Makefile").read_text()
    readme = (pins.REPO_ROOT / "README.md").read_text()
    assert "~11 min" in makefile and "11 min for all five releases" in readme
