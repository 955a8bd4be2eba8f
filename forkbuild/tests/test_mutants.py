"""forkbuild.upstream.mutants: each mutant is applied alone, run against the
release's own tests and the PRs' cases, and undone; a PR is credited only with what the
release's tests miss; a survivor nothing kills, a PR that kills nothing new, or a mutant
that no longer matches the release's code stops the step."""

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from forkbuild.checks import patch_status
from forkbuild.core.errors import ForkError
from forkbuild.core.pytest_runner import Outcome
from forkbuild.setup import fetch, tree
from forkbuild.upstream import mutants

VIEWS = """\
def page_view(raw, offset, stride):
    return raw[offset::stride]
"""
# The first case fails unmutated (as GPU or download cases do here): no kill, no -x stop
TEST = """\
from pkg.views import page_view

def test_needs_what_this_machine_lacks():
    raise RuntimeError("no GPU")

def test_second_page():
    assert page_view(list(range(8)), 1, 2) == [1, 3, 5, 7]
"""


@pytest.fixture
def worktree(tmp_path: Path) -> Path:
    work = tmp_path / "release"
    files = {"pkg/__init__.py": "", "pkg/views.py": VIEWS, "tests/test_views.py": TEST}
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    tree.git_ok(["init", "-q"], work, None, "make the fake release")
    _commit(work, "release")
    return work


def _commit(work: Path, message: str) -> None:
    env = {**os.environ, **tree.IDENTITY}
    # Not the bytecode earlier runs wrote: a release commits none, and a mutant's
    # applying removes it (a tracked .pyc gone reads as a change left behind).
    add = ["add", "-A", "--", ".", ":(exclude,glob)**/__pycache__/**"]
    for args in (add, ["commit", "-qm", message]):
        tree.git_ok(args, work, env, f"commit {message}")


def _clean(work: Path) -> bool:
    return not tree.git(["status", "--porcelain", "--untracked-files=no"], work).stdout


PR_TEST = """\
from pkg.views import page_view

def test_pages_of_a_longer_row():
    assert page_view(list(range(12)), 1, 2) == [1, 3, 5, 7, 9, 11]
"""
PR_CASE = "tests/test_pr.py::test_pages_of_a_longer_row"
KILL = "tests/test_views.py::test_second_page"  # the release's case a kill fails


def _mutant(name: str, line: str, was: str = "    return raw[offset::stride]"):
    """A mutant of the fake release's second line (WAS) into LINE, as a diff file."""
    head = "--- a/pkg/views.py\n+++ b/pkg/views.py\n@@ -1,2 +1,2 @@\n"
    diff = f"{head} def page_view(raw, offset, stride):\n-{was}\n+{line}\n"
    return mutants.Mutant(name, diff, ("tests/test_views.py",))


# Killed by the release's own test: worth nothing to a PR.
CAUGHT = _mutant("offset ignored", "    return raw[::stride]")
# Missed by the release's test (its row has 8 items), killed by the PR's case.
MISSED = _mutant("the row cut at 8 items", "    return raw[offset:8:stride]")
# Missed by both.
NOBODY = _mutant("copy instead of view", "    return list(raw[offset::stride])")


def _with_pr(worktree: Path) -> Path:
    """A second worktree of the release, the PR committed, as `make upstream` has."""
    with_pr = worktree.parent / "with-pr"
    if not with_pr.exists():
        clone = ["clone", "-q", str(worktree), str(with_pr)]
        tree.git_ok(clone, worktree.parent, None, "copy the release")
        (with_pr / "tests" / "test_pr.py").write_text(PR_TEST)
        _commit(with_pr, "pr")
    return with_pr


def _rows(work: Path, tmp: Path, found, stock=None) -> list[mutants.Row]:
    """FOUND's differential: release tests on STOCK (or WORK), the PR's beside."""
    runs = mutants.Runs(Path(sys.executable), tmp / "results", tmp / "runs")
    prs = {"01-pages": (PR_CASE,)}
    return mutants.differential(runs, stock or work, _with_pr(work), found, prs)


# One worktree for both runs (stock is the one with the PR) takes them in turn.
@pytest.mark.parametrize("one_tree", [False, True])
def test_a_pr_earns_only_what_the_release_tests_miss(worktree, tmp_path, one_tree):
    stock = _with_pr(worktree) if one_tree else None
    caught, missed = _rows(worktree, tmp_path, (CAUGHT, MISSED), stock=stock)
    assert caught.upstream_killers == [KILL] and not caught.survivor
    fast = (tmp_path / "results" / "release-tests-1.log").read_text()
    assert "1 failed" in fast and "1 deselected" in fast  # -x, the old failure left out
    assert _clean(_with_pr(worktree))
    assert missed.survivor and missed.by_pr == {"01-pages": [PR_CASE]}
    assert _clean(worktree)
    text = mutants.table([caught, missed], "01-pages")
    row = "| the row cut at 8 items | `pkg/views.py` | no | no | "
    assert row + "`test_pages_of_a_longer_row` |" in text
    assert "offset ignored" not in text.split("Mutants tried")[0]
    assert "Mutants tried on the code these tests cover: 2" in text
    assert "kill 1 of them" in text
    # Each listed mutant as the diff applied, which `git apply` takes; not the caught.
    assert text.count("```diff") == 1
    shown = text.split("```diff\n", 1)[1].split("```", 1)[0]
    assert shown == missed.mutant.diff
    assert shown.startswith("--- a/pkg/views.py\n+++ b/pkg/views.py\n@@ ")
    assert "-    return raw[offset::stride]\n+    return raw[offset:8:stride]" in shown
    (tmp_path / "shown.diff").write_text(shown)
    applied = tree.git(["apply", "--check", str(tmp_path / "shown.diff")], worktree)
    assert applied.returncode == 0, applied.stderr
    with pytest.raises(ForkError, match="only 1 mutant.*survive the release's tests"):
        mutants.check([caught, missed], ["01-pages"])


def test_a_run_never_stops_at_an_old_failure(worktree, tmp_path, monkeypatch):
    # Were the deselection to miss, -x stops at the old failure: a whole run finds it.
    monkeypatch.setattr(mutants, "deselect", lambda baseline: [])
    (again,) = _rows(worktree, tmp_path, (CAUGHT,))
    assert again.upstream_killers == [KILL]
    whole = tmp_path / "results" / "release-tests-1-whole.log"
    assert "2 failed" in whole.read_text()
    assert _clean(worktree)


def test_a_run_made_before_is_read_back_unless_changed(worktree, tmp_path, monkeypatch):
    cache = tmp_path / "runs"
    first = _rows(worktree, tmp_path, (CAUGHT, MISSED))
    made = sorted(cache.glob("*.xml"))
    assert made

    def no_pytest(*args, **kwargs):
        raise AssertionError("a run made before ran again")

    monkeypatch.setattr(mutants, "run_pytest", no_pytest)
    assert _rows(worktree, tmp_path, (CAUGHT, MISSED)) == first
    assert (tmp_path / "results" / "release-tests-1.log").is_file()  # the log too
    monkeypatch.undo()
    # A kept report cut off (a full disk, a kill while copying) is a miss, not an error.
    made[0].write_text(made[0].read_text()[:40])
    assert _rows(worktree, tmp_path, (CAUGHT, MISSED)) == first
    # The release changes: nothing made before stands for it.
    (worktree / "pkg" / "more.py").write_text("MORE = 1\n")
    _commit(worktree, "release 2")
    assert _rows(worktree, tmp_path, (CAUGHT, MISSED)) == first
    assert len(list(cache.glob("*.xml"))) > len(made)
    # A mutant left behind by a stopped run is refused, not measured.
    (worktree / "pkg" / "views.py").write_text(VIEWS.replace("offset::", "::"))
    with pytest.raises(ForkError, match="has changes its commit does not hold"):
        _rows(worktree, tmp_path, (MISSED,))


def test_a_kill_is_a_case_that_passed_unmutated_under_its_id_or_a_new_one():
    case = "tests/test_layouts.py::test_views"
    cases = {f"{case}[BLHNC]": "passed", f"{case}[BLNHC]": "passed"}
    cases |= {"tests/test_layouts.py::test_download": "failed"}
    baseline = Outcome(cases | {"tests/test_layouts.py::test_gpu": "skipped"})
    # BLNHC made an alias of BLHNC: the enum has one member fewer, and its case is
    # renamed (pytest makes ids unique by a suffix); the renamed case failing is a kill.
    mutated = dict(baseline.cases)
    del mutated[f"{case}[BLHNC]"], mutated[f"{case}[BLNHC]"]
    mutated |= {f"{case}[BLHNC0]": "passed", f"{case}[BLHNC1]": "failed"}
    assert mutants.killers(Outcome(mutated), baseline) == [f"{case}[BLHNC1]"]
    # A module that no longer collects is a kill where its cases passed unmutated.
    broken = {"tests/test_layouts.py::(module)": "error"}
    broken["tests/test_other.py::(module)"] = "error"
    killed = mutants.killers(Outcome(broken), baseline)
    assert killed == ["tests/test_layouts.py::(module)"]
    # A case skipped unmutated (a GPU case whose skip condition a mutant changed) that
    # now fails here, or a case of a function nothing of which passed, kills nothing.
    other = {"tests/test_layouts.py::test_gpu": "failed"}
    other["tests/test_layouts.py::test_download[x]"] = "failed"
    assert mutants.killers(Outcome(other), baseline) == []
    assert mutants.killers(baseline, baseline) == []
    assert mutants.killers(baseline) == ["tests/test_layouts.py::test_download"]


def test_a_survivor_an_idle_pr_and_a_mutant_a_gpu_job_catches(worktree, tmp_path):
    """A survivor nothing kills or an idle PR stops the step; a mutant a triggered GPU
    job would likely catch (read) is named beside the table, and measures no PR."""
    on_gpu = dataclasses.replace(MISSED, gpu_job="`gpu-job`")
    nobody, row = _rows(worktree, tmp_path, (NOBODY, on_gpu))
    assert nobody.survivor and nobody.by_pr == {"01-pages": []}
    with pytest.raises(ForkError) as err:
        mutants.check([nobody], ["01-pages"])
    said = str(err.value)
    assert "survive the triggered CI jobs and every PR: copy instead of view" in said
    assert "01-pages kill(s) no mutant the triggered CI jobs miss" in said
    assert _clean(worktree)
    assert row.survivor and row.by_pr["01-pages"] and not row.counts
    text = mutants.table([row], "01-pages")
    assert "| the row cut at 8 items |" not in text and "```diff" not in text
    assert "1 of the rest would likely be caught there" in text
    assert "the row cut at 8 items: `gpu-job`" in text
    said = mutants.summary([row])
    assert "a triggered GPU job would likely catch it: `gpu-job`" in said
    with pytest.raises(ForkError, match="01-pages kill.s. no mutant the triggered"):
        mutants.check([row], ["01-pages"])


def test_a_mutant_that_no_longer_applies_is_refused_untouched(worktree, tmp_path):
    stale = _mutant(
        "stride ignored", "    return raw[offset:]", "    return raw[::step]"
    )
    said = "git apply refused mutant 'stride ignored' on pkg/views.py.*not what the"
    match = f"{said} mutant was written against"
    runs = mutants.Runs(Path(sys.executable), tmp_path, tmp_path / "runs")
    with pytest.raises(ForkError, match=match) as refused:
        runs.run(worktree, ["tests/test_views.py"], "run", stale)
    assert "rewrite the mutant" in refused.value.hint
    assert _clean(worktree)
    with pytest.raises(ForkError, match="no mutants of vLLM 9.9.9"):
        mutants.for_release("9.9.9")
    # A mutant of a file whose release tests are not named is refused when read.
    (tmp_path / "1.0.0").mkdir()
    (tmp_path / "1.0.0" / "01-stale.diff").write_text(stale.diff)
    (tmp_path / "1.0.0" / "mutants.toml").write_text(
        '[tests.other]\nof = ["pkg/other.py"]\nrun = ["tests"]\n'
        '[mutants.01-stale]\nname = "stride ignored"\n'
    )
    with pytest.raises(ForkError, match="names no release tests of pkg/views.py"):
        mutants.for_release("1.0.0", tmp_path)


def test_the_newest_release_has_mutants_that_git_apply_takes(fork_pins, tmp_path):
    release = fork_pins.releases[-1]
    wanted = mutants.for_release(release.version)
    sdist = fetch.artifacts_dir() / release.sdist.filename
    if not sdist.exists():
        why = "is not cached yet: run `make matrix` or `make upstream`"
        pytest.skip(f"{sdist.name} {why}")
    paths = frozenset(m.path for m in wanted)  # the release's files they change
    for path, data in patch_status.sdist_files(sdist, paths).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    for mutant in wanted:
        (tmp_path / "m.diff").write_text(mutant.diff)
        applied = tree.git(["apply", "--check", "m.diff"], tmp_path)
        assert applied.returncode == 0, (mutant.name, applied.stderr)
    # Breakages of each part of the packed path the PRs cover, each with its tests.
    parts = ("kv_cache_interface.py", "worker/utils.py", "kv_cache_planning.py")
    for part in (*parts, "offloading/worker.py", "triton_attn.py"):
        assert any(m.path.endswith(part) for m in wanted), part
    assert all(m.tests for m in wanted)
    assert len(wanted) >= mutants.MIN_SURVIVORS
