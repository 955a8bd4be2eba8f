"""The hash-locked environments: locks current, the venv equal to its lock, a bad hash
refused with both hashes and no half venv, xfails counted as xfails."""

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from forkbuild.core import pins
from forkbuild.core.errors import ForkError
from forkbuild.core.pytest_runner import read_junit
from forkbuild.setup import bootstrap, install, lock, uv

SIX = "six==1.17.0"  # a requirement added to the inputs


@pytest.fixture(scope="module")
def fork_tree(fork_pins: pins.Pins) -> Path:
    path = pins.build_dir() / f"vllm-{fork_pins.upstream_version}"
    if not (path / "requirements").is_dir():
        pytest.skip("the tree is not built yet: run `make install` first")
    return path


def _pins_with_hashes(lock_file: Path, requirements) -> dict[str, str]:
    """LOCK_FILE pins each of REQUIREMENTS, and every package with its sha256."""
    locked = lock.pinned(lock_file)
    for requirement in map(Requirement, requirements):
        assert locked[lock.normalize(requirement.name)] in requirement.specifier
    assert lock_file.read_text().count("--hash=sha256:") >= len(locked)
    return locked


def test_every_lock_matches_the_requirements_it_was_made_from(fork_pins, fork_tree):
    assert lock.stale(fork_pins, fork_tree) == []  # the tools locks' digests too
    lock.check(fork_pins, fork_tree)
    wanted = fork_pins.forkbuild + fork_pins.tools + fork_pins.test
    for python in fork_pins.pythons:
        _pins_with_hashes(lock.path("tools", python), fork_pins.forkbuild)
        for route in fork_pins.routes.values():
            lock_file = lock.path(route.name, python)
            locked = _pins_with_hashes(lock_file, wanted + route.extra)
            assert locked["torch"] == fork_pins.torch


def test_a_changed_tool_list_makes_the_tools_locks_stale(fork_pins, fork_tree):
    """Every lock is stale; only `make lock` runs on the old tools lock."""
    bumped = dataclasses.replace(fork_pins, forkbuild=(*fork_pins.forkbuild, SIX))
    stale = lock.stale(bumped, fork_tree)
    assert len(stale) == (len(fork_pins.routes) + 1) * len(fork_pins.pythons)
    tools = lock.path("tools", lock.running_python())
    assert f"{tools.name} (its inputs changed)" in stale
    with pytest.raises(ForkError, match="forkbuild as it is now") as err:
        bootstrap.ensure(bumped, "tree")
    assert "make lock" in err.value.hint
    python, _ = bootstrap.ensure(bumped, "lock")
    assert python.exists()


def test_a_changed_input_makes_the_locks_stale(fork_pins, fork_tree, tmp_path):
    copy = tmp_path / "tree"
    shutil.copytree(fork_tree / "requirements", copy / "requirements")
    assert lock.stale(fork_pins, copy) == []
    common = copy / "requirements" / "common.txt"
    common.write_text(f"{common.read_text()}{SIX}\n")
    stale = lock.stale(fork_pins, copy)
    # requirements/cuda.txt includes common.txt: both routes' locks are stale
    assert len(stale) == len(fork_pins.routes) * len(fork_pins.pythons)
    with pytest.raises(ForkError, match="no longer match the requirements") as err:
        lock.check(fork_pins, copy)
    assert "make lock" in err.value.hint
    bumped = dataclasses.replace(fork_pins, test=(*fork_pins.test, SIX))
    assert len(lock.stale(bumped, fork_tree)) == len(stale)


def test_a_changed_exclusion_makes_the_route_locks_stale(fork_pins, fork_tree):
    """A dependency left out of a route's lock (fork.toml `exclude`) is an input too."""
    cpu = fork_pins.routes["cpu"]
    assert "nvidia-cutlass-dsl" in cpu.exclude  # FlashInfer's CUDA compiler
    locked = lock.pinned(lock.path("cpu", fork_pins.pythons[0]))
    assert "flashinfer-python" in locked
    assert not {lock.normalize(n) for n in cpu.exclude} & set(locked)
    fewer = dataclasses.replace(cpu, exclude=cpu.exclude[1:])
    changed = dataclasses.replace(fork_pins, routes={**fork_pins.routes, "cpu": fewer})
    said = [
        f"{lock.path('cpu', v).name} (its inputs changed)" for v in fork_pins.pythons
    ]
    assert sorted(lock.stale(changed, fork_tree)) == sorted(said)


@pytest.fixture
def scratch_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A throw-away build folder; the download cache stays shared."""
    monkeypatch.setenv("VLLM_FORK_BUILD", str(tmp_path / "build"))
    return tmp_path / "build"


def test_a_bad_or_missing_lock_stops_the_install_and_leaves_no_venv(
    fork_pins, scratch_build, monkeypatch
):
    """A hash mismatch says both hashes; a missing lock what to do."""
    tblib = lock.pinned(lock.path("cpu", lock.running_python()))["tblib"]
    bad, wrong = scratch_build.parent / "locks" / "cpu-py311.txt", "0" * 64
    bad.parent.mkdir()
    bad.write_text(f"tblib=={tblib} \\\n    --hash=sha256:{wrong}\n")
    monkeypatch.setattr(lock, "path", lambda *_: bad)
    with pytest.raises(ForkError) as err:
        install.ensure_toolchain(fork_pins, "cpu")
    message = str(err.value)
    assert "\n" not in message and f"sha256 mismatch for tblib=={tblib}" in message
    assert f"cpu-py311.txt pins {wrong}" in message and "the download has " in message
    computed = message.split("the download has ", 1)[1][:64]
    assert len(computed) == 64 and computed != wrong
    assert not (scratch_build / "venv").exists()
    assert not (scratch_build / "venv.partial").exists()
    bad.unlink()
    with pytest.raises(ForkError, match="cpu-py311.txt is missing") as err:
        install.ensure_toolchain(fork_pins, "cpu")
    assert "make lock" in err.value.hint
    monkeypatch.setattr(bootstrap, "tools_lock", lambda python: bad)
    with pytest.raises(ForkError, match="no tool environment locked for") as err:
        bootstrap.ensure(fork_pins, "tree")
    assert ", ".join(fork_pins.pythons) in err.value.hint


def test_xfails_are_counted_as_xfails(tmp_path):
    junit = tmp_path / "r.xml"
    skipped = '<testcase classname="tests.t" name="{}"><skipped type="pytest.{}" '
    skipped += 'message="{}"/></testcase>'
    cases = skipped.format("b", "skip", "no GPU")
    cases += "".join(skipped.format(name, "xfail", "known") for name in "cd")
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.t" name="a"/>'
        f"{cases}</testsuite></testsuites>"
    )
    outcome = read_junit(junit)
    assert (outcome.passed, outcome.skipped, outcome.xfailed) == (1, 1, 2)
    assert str(outcome) == "1 passed, 0 failed, 0 errors, 1 skipped, 2 xfailed"
    assert outcome.reasons["tests/t.py::c"] == "xfail: known"


@pytest.mark.parametrize("route", ["cpu", "cuda", "tools"])
def test_each_lock_of_this_python_installs_on_its_platform(fork_pins, route, tmp_path):
    """A dry run for the lock's platform: a GPU host's install, checked without one."""
    lock_file, venv = lock.path(route, lock.running_python()), tmp_path / "venv"
    create = ["venv", "--quiet", "--python", sys.executable, str(venv)]
    uv.run(fork_pins, create, what="create a venv")
    sync = ["pip", "sync", "--dry-run", "--require-hashes", "--python"]
    sync += [str(venv / "bin" / "python"), "--python-platform", fork_pins.lock_platform]
    what = f"check {lock_file.name}"
    out = uv.run(fork_pins, [*sync, str(lock_file)], what=what, lock=lock_file)
    assert f"Would install {len(lock.pinned(lock_file))} packages" in out


def test_an_environment_holds_exactly_its_lock(tmp_path):
    """Asked of itself; and `pip freeze` of the venv these tests run in is its lock."""
    tools = lock.path("tools", lock.running_python())
    bootstrap.check_holds(bootstrap.tools_dir() / "bin" / "python", tools)
    with pytest.raises(ForkError, match=f"differs from {tools.name} in ") as err:
        bootstrap.check_holds(Path(sys.executable), tools)  # vLLM's venv: far more
    assert "made afresh" in err.value.hint
    record = Path(sys.prefix) / install.LOCK_RECORD
    if not record.is_file():
        pytest.skip(f"{sys.prefix} is not a forkbuild venv")
    freeze = [sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"]
    (tmp_path / "freeze.txt").write_text(subprocess.check_output(freeze, text=True))
    lock_file = pins.REPO_ROOT / record.read_text().strip()
    assert lock.pinned(tmp_path / "freeze.txt") == lock.pinned(lock_file)
    # ensure_toolchain writes the id the install stamp needs
    assert len((Path(sys.prefix) / install.VENV_ID).read_text().strip()) == 32
