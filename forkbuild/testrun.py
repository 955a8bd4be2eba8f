"""`make test`: everything CI runs, after installing everything it needs.

1. forkbuild's own tests (bad input, idempotence, the wheel, serving the embedded model);
2. the regression check: the regression modules fail unpatched and pass patched;
3. the fork's tests inside the patched tree, under vLLM's own conftest.
It ends with one plain summary line.
"""

from __future__ import annotations

from forkbuild import install, regression, tree
from forkbuild.errors import ForkError
from forkbuild.pins import REPO_ROOT, Pins, build_dir


def run(pins: Pins, route_name: str | None) -> str:
    """Run everything; return the plain summary line (the caller prints it last)."""
    python, tree_path, _ = install.install(pins, route_name)
    results = build_dir() / "test-results"
    results.mkdir(parents=True, exist_ok=True)

    tools = regression.run_pytest(
        python, REPO_ROOT, ["forkbuild/tests"], results / "forkbuild.xml", pythonpath=REPO_ROOT
    )
    proven = regression.check(pins, python, tree_path)
    fork_tests = [str(p.relative_to(REPO_ROOT)) for p in tree.overlay_files() if p.suffix == ".py"
                  and p.name.startswith("test_")]
    suite = regression.run_pytest(python, tree_path, fork_tests, results / "fork-tests.xml")

    stock = dict(proven)["stock"]
    passed = tools.passed + suite.passed
    failed = tools.failed + tools.errors + suite.failed + suite.errors
    skipped = tools.skipped + suite.skipped
    print(f"\nforkbuild tool tests: {tools}")
    print(f"fork tests in {tree_path.name}: {suite}")
    print(f"regression proof: {stock.failed}/{stock.tests} cases fail on unpatched v{pins.upstream_version}, "
          f"all pass on the fork")
    summary = f"summary: {passed} passed, {failed} failed, {skipped} skipped"
    if failed:
        print(summary)
        raise ForkError(f"{failed} test(s) failed", f"JUnit reports are in {results}")
    return summary
