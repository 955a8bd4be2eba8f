"""`make test`: everything CI runs, after installing everything it needs.

1. forkbuild's own tests (bad input, idempotence, the wheel, serving the embedded model);
2. the CPU suite (fork.toml [tests] suite, under vLLM's own conftest) on the unpatched
   tree, where exactly the regression modules' cases must fail, then on the fork, where
   everything must pass.
It ends with one plain summary line.
"""

from __future__ import annotations

from forkbuild import install, regression
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
    suite = regression.check(pins, python, tree_path)

    passed = tools.passed + suite.passed
    failed = tools.failed + tools.errors + suite.failed + suite.errors
    skipped = tools.skipped + suite.skipped
    print(f"\nforkbuild tool tests: {tools}")
    print(f"fork suite in {tree_path.name}: {suite}")
    summary = f"summary: {passed} passed, {failed} failed, {skipped} skipped"
    if failed:
        print(summary)
        raise ForkError(f"{failed} test(s) failed", f"JUnit reports are in {results}")
    return summary
