"""`make test`: at once (alone, each leaves 2 cores half idle) the tool tests, the CUDA
route and its GPU bundle (without a GPU), the regression proof; then patch status. The
terminal shows the fork suite (the rest: build/test-results), then one summary."""

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from forkbuild.checks import patch_status, regression
from forkbuild.core import preflight
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT, Pins, build_dir
from forkbuild.core.pytest_runner import Outcome, run_pytest
from forkbuild.gpu import cuda_route
from forkbuild.gpu.bundle import check as bundle_check
from forkbuild.setup import install

Checked = tuple[cuda_route.Result, bundle_check.Result]
NO_CUDA_CHECK = (
    "cuda route without a GPU: not checked (this machine has a GPU: `make nightly` "
    "runs the CUDA route for real)"
)


def run(pins: Pins, route_name: str | None) -> str:
    """Run everything; return the plain summary line (the caller prints it last)."""
    python, tree_path, route = install.install(pins, route_name)
    results = build_dir() / "test-results"
    results.mkdir(parents=True, exist_ok=True)

    with ThreadPoolExecutor(2) as pool:
        tools_log, tools_xml = results / "forkbuild.log", results / "forkbuild.xml"
        tests = (python, REPO_ROOT, ["-rfEs", "forkbuild/tests"], tools_xml)
        tools_run = pool.submit(
            run_pytest, *tests, pythonpath=REPO_ROOT, output=tools_log
        )
        cuda_run = pool.submit(_check_cuda_route, pins, results)
        try:
            suite = regression.check(pins, python, tree_path)
        finally:  # a broken proof must not hide failing tool tests or a failed route
            tools = tools_run.result()  # its report went to a file: name what failed
            bad = [(c, s) for c, s in tools.cases.items() if s in ("failed", "error")]
            for case, status in bad:
                print(f"forkbuild tool tests: {status}: {case}")
            if bad:
                print(f"forkbuild tool tests: pytest's report is in {tools_log}")
            if (error := cuda_run.exception()) and sys.exc_info()[1] is not None:
                print(f"cuda route and gpu bundle without a GPU: error: {error}")
        cuda = cuda_run.result()
    # What the suites compiled, for the next clone.
    install.keep_bytecode(pins, route, tree_path)
    print("\npatch status (DEP-3 Applied-Upstream vs the version matrix):")
    patch_status.check(pins, python)

    cuda, bundle = cuda or (None, None)
    calls = cuda.calls.passed if cuda else 0
    # The serve test's GPU case is also among the tool tests' skips: counted once.
    gpu_skipped = len(set(cuda.gpu_cases.cases) - set(tools.cases)) if cuda else 0
    both = Outcome({**tools.cases, **suite.cases})  # forkbuild/tests/ and tests/
    failed = both.failed + both.errors
    print(f"\nforkbuild tool tests: {tools}")
    print(f"{cuda.line()}\n{bundle.line()}" if cuda else NO_CUDA_CHECK)
    print(f"fork suite in {tree_path.name}: {suite}")
    summary = f"summary: {both.passed + calls} passed, {failed} failed, "
    summary += f"{both.skipped + gpu_skipped} skipped, {both.xfailed} xfailed"
    if failed:
        print(summary)
        raise ForkError(f"{failed} test(s) failed", f"JUnit reports are in {results}")
    return summary


def _check_cuda_route(pins: Pins, results: Path) -> Checked | None:
    """Without a GPU: the CUDA route, its cases while its bundle (needing only the
    install) is checked on a simulated host."""
    if preflight.has_nvidia_gpu():
        return None
    route = cuda_route.install(pins, results)
    return bundle_check.meanwhile(
        lambda: cuda_route.check(pins, results, route),
        lambda: bundle_check.check(pins, results, route.route),
    )
