"""Prove the regression tests: they must fail on unpatched vLLM and pass on the fork.

The unpatched tree is a git worktree of the fork's tree at v<version> with the fork's
tests cherry-picked on top, sharing the fork's venv: only the patch series differs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from forkbuild import fixcheck, log, tree
from forkbuild.errors import ForkError
from forkbuild.pins import Pins, build_dir


@dataclass(frozen=True)
class Outcome:
    tests: int
    failed: int
    errors: int
    skipped: int

    @property
    def passed(self) -> int:
        return self.tests - self.failed - self.errors - self.skipped

    def __str__(self) -> str:
        return f"{self.passed} passed, {self.failed} failed, {self.errors} errors, {self.skipped} skipped"


def stock_dir(pins: Pins) -> Path:
    return build_dir() / f"vllm-{pins.upstream_version}-stock"


def make_stock_tree(pins: Pins, fork_tree: Path) -> Path:
    """(Re)create the unpatched worktree; cheap, so it is always made afresh."""
    stock = stock_dir(pins)
    env = {**os.environ, **tree.IDENTITY, "GIT_COMMITTER_DATE": "@0 +0000"}
    if stock.exists():
        shutil.rmtree(stock)
    tree.git(["worktree", "prune"], fork_tree, env)
    made = tree.git(
        ["worktree", "add", "-q", "--force", "-B", "stock", str(stock), f"v{pins.upstream_version}"],
        fork_tree, env,
    )
    if made.returncode != 0:
        raise ForkError(f"could not create the unpatched worktree: {made.stderr.strip()}", "run `make tree`")
    picked = tree.git(["cherry-pick", "fork"], stock, env)  # the tests overlay: the fork branch's tip
    if picked.returncode != 0:
        raise ForkError(f"could not add the fork's tests to the unpatched tree: {picked.stderr.strip()}")
    # The compiled extensions and generated version file are build outputs of the editable
    # install, untracked in git; the unpatched tree needs the same ones to import alike.
    for built in [*fork_tree.glob("vllm/**/*.so"), fork_tree / "vllm" / "_version.py"]:
        target = stock / built.relative_to(fork_tree)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)
    verdict = fixcheck.classify((stock / fixcheck.MODULE_PATH).read_text())
    if verdict != "buggy":
        raise ForkError(f"the unpatched tree's {fixcheck.FUNCTION} reads as {verdict}, expected buggy")
    return stock


def run_pytest(
    python: Path,
    cwd: Path,
    modules: list[str],
    junit: Path,
    *,
    pythonpath: Path | None = None,
    output: Path | None = None,
) -> Outcome:
    """Run pytest on MODULES in CWD (PYTHONPATH first on sys.path); count from JUnit XML.

    With OUTPUT, pytest's report goes to that file instead of the terminal: used for the
    unpatched run, whose expected failures must not read as the run's result.
    """
    env = {**os.environ, "PYTHONPATH": str(pythonpath or cwd)}
    junit.unlink(missing_ok=True)
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *modules]
    log.step(f"pytest in {cwd.name}: {' '.join(modules)}" + (f" (report: {output})" if output else ""))
    with open(output, "w") if output else open(os.devnull) as sink:
        result = subprocess.run(
            cmd, cwd=cwd, env=env, check=False,
            stdout=sink if output else None, stderr=subprocess.STDOUT if output else None,
        )
    if result.returncode not in (0, 1) or not junit.exists():
        raise ForkError(
            f"pytest could not run the tests in {cwd.name} (exit {result.returncode})",
            f"see {output or 'its output above'}: a collection or import error is not a test result",
        )
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return Outcome(*(int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")))


def imported_from(python: Path, tree_path: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__file__)"],
        cwd=tree_path, env={**os.environ, "PYTHONPATH": str(tree_path)},
        capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        raise ForkError(f"`import vllm` fails in {tree_path.name}: {out.stderr.strip().splitlines()[-1:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def check(pins: Pins, python: Path, fork_tree: Path) -> list[tuple[str, Outcome]]:
    modules = list(pins.regression_tests)
    stock = make_stock_tree(pins, fork_tree)
    results = build_dir() / "test-results"
    results.mkdir(exist_ok=True)
    rows = []
    for name, path, must in (("fork", fork_tree, "pass"), ("stock", stock, "fail")):
        origin = imported_from(python, path)
        if not origin.resolve().is_relative_to(path.resolve()):
            raise ForkError(f"in {path.name}, `import vllm` resolved to {origin}; the check would be void")
        outcome = run_pytest(
            python, path, modules, results / f"regression-{name}.xml",
            output=results / f"regression-{name}.log",
        )
        ok = outcome.tests > 0 and outcome.errors == 0 and outcome.skipped == 0 and (
            outcome.failed == 0 if must == "pass" else outcome.failed == outcome.tests
        )
        rows.append((name, path, must, outcome, ok))
    print("\nregression check:", ", ".join(modules))
    for name, path, must, outcome, ok in rows:
        print(f"  {name:5} {path.name:24} must {must}: {outcome}  -> {'OK' if ok else 'WRONG'}")
    bad = [r for r in rows if not r[4]]
    if bad:
        raise ForkError(
            "the regression tests do not separate the trees: "
            + "; ".join(f"{r[0]} must {r[2]} but got {r[3]}" for r in bad),
            "a regression case that passes without the fix proves nothing; fix the test",
        )
    return [(name, outcome) for name, _, _, outcome, _ in rows]
