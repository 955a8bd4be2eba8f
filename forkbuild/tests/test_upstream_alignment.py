"""patch-status, rebase, upstream: the checks that keep the fork aligned with vLLM."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

from forkbuild.checks import patch_status
from forkbuild.core import pins
from forkbuild.core.errors import ForkError
from forkbuild.setup import fetch, install, tree
from forkbuild.upstream import prs as upstream
from forkbuild.upstream import rebase

MAIL = patch_status.read_series()[0]
FORK = pins.load()
BASE = FORK.upstream_version  # the release the fork is of
NEWEST = upstream.newest(FORK).version
# The matrix releases just before and just after the base (the backport's claim).
OLDER = [r.version for r in FORK.releases if Version(r.version) < Version(BASE)]
NEWER = [r.version for r in FORK.releases if Version(r.version) > Version(BASE)]


def _forkbuild(args: list[str], env=None, timeout=60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "forkbuild", *args]
    kw = {"cwd": pins.REPO_ROOT, "env": env, "capture_output": True, "text": True}
    return subprocess.run(cmd, **kw, timeout=timeout)


@pytest.fixture(scope="module")
def toolchain() -> Path:
    if not install.venv_python().exists():
        pytest.skip("no toolchain venv yet: run `make install` first")
    return install.venv_python()


def test_fix_applies_to_the_bug_and_reverse_applies_to_the_fix(fork_pins, toolchain):
    # its DEP-3 header, read from the mail
    assert str(MAIL.applied_upstream) == NEWER[0]
    assert MAIL.fields["Bug"].endswith("/issues/47054")
    assert MAIL.fields["Origin"].startswith("backport, ")
    assert MAIL.files == ("vllm/v1/worker/gpu/attn_utils.py",)
    expect = {BASE: patch_status.APPLIES, NEWER[0]: patch_status.REVERSED}
    for version, expected in expect.items():
        sdist = fetch.fetch(fork_pins.release(version).sdist, lambda: toolchain)
        assert patch_status.try_apply([MAIL], sdist)[MAIL.name] == expected, version


@pytest.mark.parametrize(
    ("claim", "error"),
    [
        (OLDER[-1], f"not confirmed, e.g. .* on {OLDER[-1]}"),
        ("9.9.9", "not in the version matrix, none newer"),
    ],
)
def test_a_claim_the_releases_contradict_fails(toolchain, tmp_path, claim, error):
    text = MAIL.path.read_text().replace(
        f"Applied-Upstream: v{NEWER[0]}", f"Applied-Upstream: v{claim}"
    )
    (tmp_path / MAIL.name).write_text(text)
    (tmp_path / "series").write_text(MAIL.name + "\n")
    with pytest.raises(ForkError, match=error):
        patch_status.check(FORK, toolchain, patches_dir=tmp_path)


APPLIES, REVERSED, NEITHER = (
    patch_status.APPLIES,
    patch_status.REVERSED,
    patch_status.NEITHER,
)
RECORDS = ("fail", "pass", "no regression case ran", "no matrix record")
# Is a claim confirmed on a release before it, and on one at or after it: per
# (try_apply's verdict, the matrix record). A patch that still applies is not upstream's
# change.
BEFORE_CLAIM = {
    **{(APPLIES, r): True for r in RECORDS},
    **{(v, r): r == "fail" for v in (REVERSED, NEITHER) for r in RECORDS},
}
FROM_CLAIM = {
    **{(APPLIES, r): False for r in RECORDS},
    **{(REVERSED, r): r != "fail" for r in RECORDS},
    **{(NEITHER, r): r == "pass" for r in RECORDS},
}


def test_every_verdict_on_releases_before_at_and_after_the_claim():
    claim = Version("0.27.0")
    for version, table in (
        ("0.26.0", BEFORE_CLAIM),
        ("0.27.0", FROM_CLAIM),
        ("0.33.0", FROM_CLAIM),
    ):
        got = {k: patch_status._judge(claim, version, *k)[0] for k in table}
        assert got == table, version
    # A patch that claims nothing is carried wherever it stands.
    for applied, record in FROM_CLAIM:
        assert patch_status._judge(None, "0.33.0", applied, record)[0]


@pytest.mark.parametrize("record", RECORDS[1:])
def test_a_patch_that_still_applies_says_its_change_is_absent(record: str):
    ok, meaning = patch_status._judge(Version("0.26.0"), "0.26.0", APPLIES, record)
    assert not ok
    assert meaning.startswith("the patch still applies: its own change is absent")
    # A pass there is named as what it is: another change's doing.
    another = meaning.endswith("; the cases pass through another change")
    assert another == (record == "pass")


def _neighbour_fixed(version: str) -> tuple[str, str]:
    """0006's story: (try_apply's verdict, its cases' status) on each release. 0.26.0's
    neighbouring change makes the cases pass while the patch still applies; 0.27.0 makes
    the patch's own change (the code it touches moves: it applies neither way)."""
    if Version(version) < Version("0.26.0"):
        return APPLIES, "failed"
    return (APPLIES if version == "0.26.0" else NEITHER), "passed"


@pytest.fixture
def neighbouring_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Patch 0006 alone in a series folder, on synthetic sdists and matrix record."""
    mail = next(p for p in patch_status.read_series() if p.name.startswith("0006-"))
    modules = FORK.regression_by_patch[mail.name]
    rows = {}
    for release in FORK.releases:
        status = _neighbour_fixed(release.version)[1]
        cases = {f"{m}::test_case": status for m in modules}
        rows[release.version] = {"sdist_sha256": release.sdist.sha256, "cases": cases}
    record = tmp_path / "version-matrix.json"
    record.write_text(json.dumps({"rows": rows}))
    monkeypatch.setattr(patch_status.matrix, "RECORD", record)
    # Each release's sdist stands for its version: try_apply reads the story by name.
    by_name = {r.sdist.filename: r.version for r in FORK.releases}
    monkeypatch.setattr(fetch, "fetch", lambda artifact, pip: Path(artifact.filename))
    verdict = lambda patches, sdist: {
        p.name: _neighbour_fixed(by_name[sdist.name])[0] for p in patches
    }
    monkeypatch.setattr(patch_status, "try_apply", verdict)
    series = tmp_path / "patches"
    series.mkdir()
    (series / mail.name).write_text(mail.path.read_text())
    (series / "series").write_text(mail.name + "\n")
    return series / mail.name


def _claim(mail: Path, version: str) -> None:
    text = re.sub(
        r"(?m)^Applied-Upstream: .*$", f"Applied-Upstream: v{version}", mail.read_text()
    )
    mail.write_text(text)


def test_a_neighbouring_fix_confirms_only_the_release_that_makes_the_patch(
    neighbouring_fix: Path,
):
    # 0.26.0's cases pass, but the patch still applies there: not upstream's change yet.
    _claim(neighbouring_fix, "0.26.0")
    said = (
        "on 0.26.0: the patch still applies: its own change is absent; the cases pass"
    )
    with pytest.raises(ForkError, match=said):
        patch_status.check(FORK, Path("python"), patches_dir=neighbouring_fix.parent)
    # Claimed at 0.27.0 (between matrix releases), 0.26.0 still needs it, 0.33.0 has it.
    _claim(neighbouring_fix, "0.27.0")
    folder = neighbouring_fix.parent
    lines = patch_status.check(FORK, Path("python"), patches_dir=folder)
    assert "(v0.27.0 is not in the version matrix: bracketed by 0.26.0 and" in lines[1]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert rows["0.26.0"].endswith("-> still needed"), rows["0.26.0"]
    newest = FORK.releases[-1].version
    assert rows[newest].endswith("-> effect present (regression cases pass)")


@pytest.mark.parametrize(
    ("applied", "outcome"),
    [(patch_status.APPLIES, "applies"), (patch_status.NEITHER, "upstream")],
)
def test_a_rebase_drops_a_patch_only_where_it_no_longer_applies(
    monkeypatch: pytest.MonkeyPatch, applied: str, outcome: str
):
    # Its cases pass in the record either way; only a rewrite (neither) is upstream's.
    mail = next(p for p in patch_status.read_series() if p.name.startswith("0006-"))
    monkeypatch.setattr(patch_status, "read_series", lambda: [mail])
    monkeypatch.setattr(patch_status, "try_apply", lambda s, _: {mail.name: applied})
    monkeypatch.setattr(rebase, "_effect_recorded", lambda *_: True)
    done = lambda args, cwd, env: subprocess.CompletedProcess(args, 0)
    monkeypatch.setattr(rebase.tree, "git", done)
    got = rebase._sort_series(FORK, Path("work"), {}, Path("sdist"), "0.26.0")
    assert got == {mail.name: outcome}


@pytest.mark.parametrize(
    ("version", "error"),
    [
        ("no-version", "VERSION '{v}' is not a release version -- give it as X.Y.Z"),
        # older than (or the same as) the fork's base: refused before any download
        (OLDER[0], "VERSION {v} is not newer than the fork's base {base} -- give a"),
        (BASE, "VERSION {v} is not newer than the fork's base {base}"),
        # needs the package index (as `make rebase` does): pip finds no such release
        ("9.9.9", "the package index has no vllm {v} sdist -- check the version"),
    ],
)
def test_rebase_to_a_bad_version_says_so_and_leaves_nothing(version, error, toolchain):
    result = _forkbuild(["rebase", version], timeout=300)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    error = error.format(v=version, base=BASE)
    assert lines[-1].startswith(f"forkbuild rebase: error: {error}")
    # forkbuild's progress lines and that one error; none of pip's own output
    assert all(line.startswith("[forkbuild ") for line in lines[:-1]), lines
    assert not (pins.cache_dir() / "rebase" / version).exists()
    assert not list((pins.cache_dir() / "rebase").glob(f".{version}-*"))
    assert not (rebase.rebase_dir() / f"vllm-{version}").exists()


def test_rebase_moves_every_pin_and_keeps_fork_toml_as_written(fork_pins, tmp_path):
    version = NEWER[0]
    found = {
        key: (f"{package}=={version}", f"{package}-{version}.file", sha * 64)
        for (key, (package, _)), sha in zip(rebase.ARTIFACTS.items(), "abc")
    }
    before = pins.PINS_FILE.read_text()
    text = rebase.rewrite_pins(before, fork_pins, version, found)
    raw = tomllib.loads(text)
    assert raw["upstream"]["version"] == version
    assert raw["artifacts"]["wheel-cpu"]["sha256"] == "c" * 64
    assert raw["artifacts"]["sdist"]["filename"] == f"vllm-{version}.file"
    # The old base joins the matrix as a stock release; the new base leaves it.
    assert raw["matrix"]["release"][BASE]["sdist"]["sha256"] == fork_pins.sdist.sha256
    assert version not in raw["matrix"]["release"]
    releases = list(raw["matrix"]["release"])
    assert releases == sorted(releases, key=Version)

    # Every comment stays, in order, and only the moved lines change.
    comments = lambda t: [line for line in t.splitlines() if line.lstrip()[:1] == "#"]
    assert comments(text) == comments(before)
    gone = set(before.splitlines()) - set(text.splitlines())
    moved = ("version =", *(f"{field} =" for field in rebase.PIN_FIELDS))
    assert all(version in line or line.startswith(moved) for line in gone), gone
    (tmp_path / "fork.toml").write_text(text)
    assert pins.load(tmp_path / "fork.toml").upstream_version == version
    broken = before.replace('filename = "vllm-', 'file = "vllm-', 1)
    with pytest.raises(ForkError, match=r"\[artifacts.sdist\] is not in the expected"):
        rebase.rewrite_pins(broken, fork_pins, version, found)


def test_the_series_is_signed_off_by_whoever_runs_it(tmp_path, monkeypatch):
    gitconfig = tmp_path / "gitconfig"  # the only git configuration: none yet
    home = dict.fromkeys(("HOME", "XDG_CONFIG_HOME"), str(tmp_path))
    home |= {"GIT_CONFIG_GLOBAL": str(gitconfig), "GIT_CONFIG_NOSYSTEM": "1"}
    # No git identity at all: `make upstream` stops at once.
    result = _forkbuild(["upstream"], {**os.environ, **home})
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "git has no user.name and no user.email" in last, result.stderr
    assert 'git config --global user.name "Your Name"' in last
    for key, value in home.items():
        monkeypatch.setenv(key, value)
    config = "[user]\n\tname = Ada Reviewer\n\temail = ada@example.org\n"
    gitconfig.write_text(config)
    assert upstream.submitter() == {
        f"GIT_{who}_{what}": value
        for who in ("AUTHOR", "COMMITTER")
        for what, value in (("NAME", "Ada Reviewer"), ("EMAIL", "ada@example.org"))
    }
    gitconfig.write_text("[user]\n\tname = Ada Reviewer\n")
    with pytest.raises(ForkError, match="git has no user.email"):
        upstream.submitter()


def test_the_prs_load_in_sending_order_each_whole():
    prs = upstream.load_prs(NEWEST)
    assert [pr.name for pr in prs] == sorted(pr.name for pr in prs) and len(prs) >= 2
    for pr in prs:
        assert pr.cases and pr.jobs and pr.patches, pr.name
        # nothing sent speaks of this repository or of the release it is a fork of
        upstream.check_words(pr, BASE)
        assert all(marker in pr.description for marker in upstream.MARKERS), pr.name
        files = {c.split("::", 1)[0] for c in pr.cases}
        for patch in pr.patches:  # the cases' files are the files the mail changes
            changes = set(patch_status.read_patch(patch).files)
            assert files <= changes, (pr.name, files - changes)
            assert "Signed-off-by:" not in patch.read_text(), "the submitter signs off"


def test_a_broken_pr_folder_is_refused_with_what_it_lacks(tmp_path):
    folder = tmp_path / "upstream-prs"
    (folder / "01-views").mkdir(parents=True)
    (folder / "mutants").mkdir()  # the mutants' folder is no PR
    meta = folder / "01-views" / "pr.toml"
    meta.write_text(f'release = "{NEWEST}"\ntitle = "[Tests] x"\n')
    lacks = "01-views: pr.toml lacks cases, jobs; no \\*.patch; no description.md"
    with pytest.raises(ForkError, match=lacks):
        upstream.load_prs(NEWEST, folder)
    meta.write_text(meta.read_text() + 'cases = ["a"]\njobs = ["v1-others-cpu"]\n')
    mail = folder / "01-views" / "0001-x.patch"
    mail.write_text("Subject: [Tests] x\n\nfor the fork\n")
    (folder / "01-views" / "description.md").write_text("@@VALIDATION@@ @@MUTANTS@@\n")
    (pr,) = upstream.load_prs(NEWEST, folder)
    assert upstream.load_prs("9.9.9", folder) == []
    with pytest.raises(ForkError, match="0001-x.patch mentions fork"):
        upstream.check_words(pr, BASE)
    mail.write_text(f"Subject: x\n\nas in {BASE}\n")
    (pr,) = upstream.load_prs(NEWEST, folder)
    with pytest.raises(ForkError, match=f"0001-x.patch mentions {BASE}"):
        upstream.check_words(pr, BASE)


PIPE = ".buildkite/test_areas/misc.yaml"  # the pipeline file of the PRs' CPU job
SELECTS = (None, "cpu_test", "'cpu_test'", "cpu_test and not slow_test")


@pytest.mark.parametrize("marker", [*SELECTS, "not cpu_test", "slow_test"])
def test_a_job_runs_cpu_test_cases_only_when_its_marker_selects_them(marker):
    assert upstream.selects_cpu_test(marker) is (marker in SELECTS)


def _job(key: str, device: str, marker: str | None) -> dict:
    return {"key": key, "label": key, "device": device, "marker": marker, "command": ""}


def _pr(case: str, *jobs: str) -> upstream.PullRequest:
    return upstream.PullRequest("01-views", Path("."), "t", (f"{case}::x",), jobs, ())


def test_a_pr_names_the_jobs_that_collect_its_cases_with_cpu_test_selected():
    case = "tests/v1/worker/test_attn_utils.py"
    gpu_only = {case: [_job("v1-executor-worker", "h200_18gb", None)]}
    match = "no job of v1-others-cpu collects.*jobs that run it: v1-executor-worker"
    with pytest.raises(ForkError, match=match):
        upstream.check_job(_pr(case, "v1-others-cpu"), gpu_only)
    # A GPU job that runs the file unfiltered collects its cpu_test cases too.
    said = upstream.check_job(_pr(case, "v1-executor-worker"), gpu_only)
    assert said == f"{case}: 'v1-executor-worker' (v1-executor-worker, h200_18gb): "
    negated = {case: [_job("v1-core", "h200_35gb", "not cpu_test")]}
    with pytest.raises(ForkError, match="no job of v1-core"):
        upstream.check_job(_pr(case, "v1-core"), negated)
    # Each file needs one of the named jobs; every one that collects it is listed.
    other = "tests/v1/core/test_contiguous_kv_packing.py"
    both = {
        case: [*gpu_only[case], _job("v1-others-cpu", "cpu-small", "cpu_test")],
        other: [_job("v1-others-cpu", "cpu-small", "cpu_test")],
    }
    pr = upstream.PullRequest(
        "01", Path("."), "t", (f"{case}::x", f"{other}::y"), ("v1-executor-worker",), ()
    )
    with pytest.raises(ForkError, match=f"collects {other}"):
        upstream.check_job(pr, both)
    pr = dataclasses.replace(pr, jobs=("v1-executor-worker", "v1-others-cpu"))
    assert len(upstream.check_job(pr, both).splitlines()) == 3


def test_the_mypy_hook_is_read_from_the_release_and_locked(fork_pins, toolchain):
    config = upstream.release_hook_config(fork_pins)
    entry, requirements = upstream.mypy_hook(config)
    assert entry == 'python tools/pre_commit/mypy.py "3.11"'
    assert requirements[0].startswith("mypy==")
    lock_file, _, digest = upstream.hook_lock(config)
    lock_text = lock_file.read_text()
    # The lock was made from exactly this hook's requirements (`make lock` remakes it).
    assert f"inputs-sha256: {digest}" in lock_text
    assert f"\n{requirements[0]} \\\n    --hash=sha256:" in lock_text
    other = config.replace(requirements[0], "mypy==0.1")
    assert upstream.mypy_hook(other)[1][0] == "mypy==0.1"
    with pytest.raises(ForkError, match="has no mypy hook with an entry"):
        upstream.mypy_hook("repos: []\n")


@pytest.fixture(scope="module")
def release_hooks(fork_pins, toolchain, tmp_path_factory) -> Path:
    """The newest release's tree with every PR applied in order: what its hooks read."""
    sdist = fetch.fetch(upstream.newest(fork_pins).sdist, lambda: toolchain)
    out = tmp_path_factory.mktemp("release")
    tree._extract_sdist(sdist, out)
    for pr in upstream.load_prs(NEWEST):
        for patch in pr.patches:
            applied = tree.git(["apply", str(patch)], out)
            assert applied.returncode == 0, (pr.name, applied.stderr)
    return out


def series_files() -> list[str]:
    """What the PRs change, all together."""
    prs = upstream.load_prs(NEWEST)
    mails = [patch_status.read_patch(patch) for pr in prs for patch in pr.patches]
    return sorted({f for mail in mails for f in mail.files})


def test_the_series_passes_the_release_hooks_and_cpu_jobs(release_hooks, toolchain):
    files = series_files()
    assert PIPE in files  # the PRs' CI lines
    lines = upstream.run_hooks(toolchain, release_hooks, files)
    hooks = ("ruff check", "ruff format", *upstream.HOOK_SCRIPTS)
    hooks += ("check_buildkite_step_keys",)
    assert lines == [f"{hook}: passed" for hook in hooks]
    for pr in upstream.load_prs(NEWEST):  # each PR's cases run in the CPU job it names
        files = sorted({c.split("::", 1)[0] for c in pr.cases})
        jobs = upstream.collecting_jobs(toolchain, release_hooks, files)
        said = upstream.check_job(pr, jobs)
        assert {line.split(":", 1)[0] for line in said.splitlines()} == set(files)


def test_a_hook_finding_stops_the_upstream_step(release_hooks, toolchain):
    bad = release_hooks / "tests" / "v1" / "worker" / "test_no_header.py"
    misc, kept = release_hooks / PIPE, (release_hooks / PIPE).read_text()
    bad.write_text("import os\n\n\ndef test_nothing():\n    assert os.sep\n")
    try:
        files = [*series_files(), str(bad.relative_to(release_hooks))]
        with pytest.raises(ForkError, match="check_spdx_header") as err:
            upstream.run_hooks(toolchain, release_hooks, files)
        bad.unlink()
        # A pipeline step without its key:
        misc.write_text(kept.replace("  key: v1-others-cpu\n", "", 1))
        with pytest.raises(ForkError, match="check_buildkite_step_keys"):
            upstream.run_hooks(toolchain, release_hooks, [PIPE])
    finally:
        bad.unlink(missing_ok=True)
        misc.write_text(kept)
    assert "fix the test files" in err.value.hint


def test_a_ruff_other_than_the_pinned_is_refused(release_hooks, toolchain, tmp_path):
    copy = tmp_path / "release"  # what the check reads, before any hook runs
    copy.mkdir()
    config = copy / ".pre-commit-config.yaml"
    shutil.copy(release_hooks / config.name, config)
    pinned = upstream.pinned_ruff(copy)
    config.write_text(config.read_text().replace(f"rev: v{pinned}\n", "rev: v0.0.1\n"))
    assert upstream.pinned_ruff(copy) == "0.0.1"
    with pytest.raises(ForkError, match="runs its hooks with ruff 0.0.1") as err:
        upstream.run_hooks(toolchain, copy, series_files())
    assert "pin ruff==0.0.1" in err.value.hint
    config.write_text("repos: []\n")
    with pytest.raises(ForkError, match="pins no ruff-pre-commit rev"):
        upstream.pinned_ruff(copy)
