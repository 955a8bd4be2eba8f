"""forkbuild.mutants: each mutant is applied alone, tested, and undone; a survivor or a
mutant that no longer matches the release's code stops the step."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from forkbuild import fetch, mutants, tree
from forkbuild.errors import ForkError

VIEWS = """\
def page_view(raw, offset, stride):
    return raw[offset::stride]
"""
TEST = """\
from pkg.views import page_view

def test_second_page():
    assert page_view(list(range(8)), 1, 2) == [1, 3, 5, 7]
"""
KILLED = mutants.Mutant("offset ignored", "pkg/views.py", "raw[offset::stride]", "raw[::stride]")
# Equivalent for the one case the test has: it survives.
SURVIVES = mutants.Mutant("copy instead of view", "pkg/views.py", "return raw[offset::stride]",
                          "return list(raw[offset::stride])")


@pytest.fixture
def worktree(tmp_path: Path) -> Path:
    work = tmp_path / "release"
    (work / "pkg").mkdir(parents=True)
    (work / "pkg" / "__init__.py").write_text("")
    (work / "pkg" / "views.py").write_text(VIEWS)
    (work / "tests").mkdir()
    (work / "tests" / "test_views.py").write_text(TEST)
    env = {**os.environ, **tree.IDENTITY}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "release"]):
        tree._git_ok(args, work, env, "make the fake release")
    return work


def _clean(work: Path) -> bool:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=work,
                          capture_output=True, text=True, check=True).stdout == ""


def test_a_killed_mutant_names_its_killers_and_the_file_is_restored(worktree, tmp_path):
    (verdict,) = mutants.kill(Path(sys.executable), worktree, (KILLED,), ["tests/test_views.py"],
                              tmp_path)
    assert verdict.killers == ["tests/test_views.py::test_second_page"]
    assert _clean(worktree)
    assert "| offset ignored | `pkg/views.py` | 1 of 1 | `test_views.py` (1) |" in mutants.table([verdict])


def test_a_survivor_stops_the_step_with_its_name(worktree, tmp_path):
    with pytest.raises(ForkError, match="1 of 2 mutant.*survived.*copy instead of view"):
        mutants.kill(Path(sys.executable), worktree, (KILLED, SURVIVES), ["tests/test_views.py"],
                     tmp_path)
    assert _clean(worktree)


def test_a_mutant_that_no_longer_matches_is_refused_untouched(worktree, tmp_path):
    stale = mutants.Mutant("stride ignored", "pkg/views.py", "raw[offset::step]", "raw[offset:]")
    with pytest.raises(ForkError, match="matches 0 times in pkg/views.py.*") as refused:
        mutants.kill(Path(sys.executable), worktree, (stale,), ["tests/test_views.py"], tmp_path)
    assert "rewrite the mutant" in str(refused.value)
    assert _clean(worktree)
    with pytest.raises(ForkError, match="no mutants of vLLM 9.9.9"):
        mutants.for_release("9.9.9")


def test_the_newest_release_has_mutants_that_match_its_code_once(fork_pins):
    release = fork_pins.releases[-1]
    wanted = mutants.for_release(release.version)
    sdist = fetch.artifacts_dir() / release.sdist.filename
    if not sdist.exists():
        pytest.skip(f"{sdist.name} is not cached yet: run `make matrix` or `make upstream`")
    with tarfile.open(sdist) as tar:
        top = tar.getmembers()[0].name.split("/", 1)[0]
        for mutant in wanted:
            text = tar.extractfile(f"{top}/{mutant.path}").read().decode()
            assert text.count(mutant.original) == 1, mutant.name
    # The breakages the issue names are all there.
    names = " ".join(m.name for m in wanted)
    for kind in ("offset", "layer stride", "block stride", "order", "copied", "connector"):
        assert kind in names
