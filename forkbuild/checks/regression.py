"""Prove the regression tests fail on unpatched vLLM (a worktree at v<version> plus the
fork's tests, on the fork's venv) and pass on the fork."""

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from forkbuild.core import fixcheck
from forkbuild.core.errors import ForkError, run_or_fail
from forkbuild.core.pins import Pins, build_dir
from forkbuild.core.pytest_runner import Outcome, run_pytest
from forkbuild.setup import install, tree

BAD = ("failed", "error")
Run = tuple[Path, Outcome]  # a tree, and what the suite did there


def make_stock_tree(pins: Pins, fork_tree: Path) -> Path:
    """(Re)create the unpatched worktree; cheap, so it is always made afresh."""
    stock = build_dir() / f"vllm-{pins.upstream_version}-stock"
    env = {**os.environ, **tree.IDENTITY, "GIT_COMMITTER_DATE": "@0 +0000"}
    version, hint = f"v{pins.upstream_version}", "run `make tree`"
    tree.fresh_worktree(fork_tree, stock, version, env, "-B", "stock", hint=hint)
    # the tests overlay: the fork branch's tip
    tree.git_ok(["cherry-pick", "fork"], stock, env, "add the fork's tests")
    # The compiled extensions and version file are the editable install's untracked
    # outputs; the unpatched tree needs the same ones to import alike.
    for built in [*fork_tree.glob("vllm/**/*.so"), fork_tree / "vllm" / "_version.py"]:
        target = stock / built.relative_to(fork_tree)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)
    verdict = fixcheck.classify((stock / fixcheck.MODULE_PATH).read_text())
    if verdict != "buggy":
        read = f"the unpatched tree's {fixcheck.FUNCTION} reads as {verdict}"
        raise ForkError(f"{read}, expected buggy")
    return stock


def check_imports_from(python: Path, path: Path) -> None:
    out = run_or_fail(
        [str(python), "-m", "forkbuild.setup.install_probe", "origin"],
        f"`import vllm` fails in {path.name}",
        cwd=path,
        env={**os.environ, "PYTHONPATH": install.probe_path(path)},
    )
    origin = Path(out.stdout.strip().splitlines()[-1])
    if not origin.resolve().is_relative_to(path.resolve()):
        void = f"in {path.name}, `import vllm` resolved to {origin}"
        raise ForkError(f"{void}; the check would be void")


def check(pins: Pins, python: Path, fork_tree: Path) -> Outcome:
    """Run the suite on the unpatched tree and the fork at once; the fork's outcome."""
    results = build_dir() / "test-results"
    results.mkdir(exist_ok=True)

    def on_stock_tree() -> Run:
        stock = make_stock_tree(pins, fork_tree)
        check_imports_from(python, stock)
        junit, output = results / "suite-stock.xml", results / "suite-stock.log"
        return stock, run_pytest(python, stock, [*pins.suite], junit, output=output)

    # Both trees at once (they share only the venv); the unpatched run's expected
    # failures go to a file, the terminal shows the fork's.
    with ThreadPoolExecutor(1) as pool:
        stock_run = pool.submit(on_stock_tree)
        check_imports_from(python, fork_tree)
        fork_junit = results / "suite-fork.xml"
        on_fork = run_pytest(python, fork_tree, [*pins.suite], fork_junit)
        stock, on_stock = stock_run.result()

    _report(pins, results, (fork_tree, on_fork), (stock, on_stock))
    problems = [f"{c} {s} on the fork" for c, s in on_fork.cases.items() if s in BAD]
    # On stock, regression cases must fail (an error is no proof), the others must not.
    for case, status in on_stock.cases.items():
        proves = case.split("::", 1)[0] in pins.regression_tests
        if status != "failed" if proves else status in BAD:
            problems.append(f"{case} {status} on v{pins.upstream_version}")
    ran = {c.split("::", 1)[0] for c in on_stock.cases}
    problems += [f"{m} ran no case" for m in pins.regression_tests if m not in ran]
    if problems:
        raise ForkError(
            f"{len(problems)} case(s) break the proof, e.g. {problems[0]}",
            "a regression case must fail without the fix and pass with it; other cases "
            "pass on both",
        )
    return on_fork


def _report(pins: Pins, results: Path, fork: Run, stock: Run) -> None:
    """Print both trees' outcomes and each regression module's failures on stock."""
    on_stock, listing = stock[1], results / "regression-cases-failing-on-stock.txt"
    failing = sorted(c for c, s in on_stock.cases.items() if s == "failed")
    listing.write_text("\n".join(failing) + "\n")
    print(f"\nregression proof ({' '.join(pins.suite)}):")
    print(f"  fork  {fork[0].name:24} {fork[1]}")
    print(f"  stock {stock[0].name:24} {on_stock}")
    for module in pins.regression_tests:
        in_module = [c for c in on_stock.cases if c.startswith(module + "::")]
        share = f"{sum(c in failing for c in in_module)}/{len(in_module)}"
        print(f"  {module}: {share} fail on v{pins.upstream_version}")
    print(f"  failing cases listed in {listing}")
