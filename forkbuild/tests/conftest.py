"""Fixtures: a throw-away build folder and cache, with the real, checked sdist in it."""

import os
import shutil
from pathlib import Path

import pytest

from forkbuild.core import pins
from forkbuild.setup import bootstrap, fetch

# forkbuild started by a test in its own build folder re-executes in this tool
# environment rather than making one there (test_bare_python makes fresh ones).
os.environ.setdefault("VLLM_FORK_TOOLS", str(bootstrap.tools_dir()))


@pytest.fixture(scope="session")
def fork_pins() -> pins.Pins:
    return pins.load()


@pytest.fixture(scope="session")
def real_sdist(fork_pins: pins.Pins) -> Path:
    path = fetch.artifacts_dir() / fork_pins.sdist.filename
    if not path.exists():
        pytest.skip("the sdist is not cached yet: run `make install` first")
    return path


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point forkbuild's cache and build folders at TMP_PATH."""
    monkeypatch.setenv("VLLM_FORK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_FORK_BUILD", str(tmp_path / "build"))
    (tmp_path / "cache" / "artifacts").mkdir(parents=True)
    return tmp_path


@pytest.fixture
def scratch_sdist(scratch: Path, real_sdist: Path) -> Path:
    copy = scratch / "cache" / "artifacts" / real_sdist.name
    shutil.copy2(real_sdist, copy)
    return copy
