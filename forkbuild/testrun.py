"""`make test`: everything CI runs, after installing everything it needs.

1. forkbuild's own tests (bad input, idempotence, the wheel, serving the embedded model);
2. the GPU tests, which on a machine without a GPU must collect and skip with a reason;
3. the CPU suite (fork.toml [tests] suite, under vLLM's own conftest) on the unpatched
   tree, where exactly the regression modules' cases must fail, and on the fork, where
   everything must pass;
4. the patch-status check: every patch's DEP-3 Applied-Upstream confirmed on the
   releases of the version matrix (the matrix itself is the slower `forkbuild matrix`).
1-3 run at once, as separate pytest processes: alone, each leaves much of a 2-core machine
idle (CI measured 1.2 busy cores on average when they ran one after the other). The
terminal shows the fork suite; the others report to files in build/test-results.
It ends with one plain summary line.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from forkbuild import (
    gpu_required,
    install,
    patch_status,
    preflight,
    pytest_runner,
    regression,
)
from forkbuild.errors import ForkError
from forkbuild.pins import REPO_ROOT, Pins, build_dir


def run(pins: Pins, route_name: str | None) -> str:
    """Run everything; return the plain summary line (the caller prints it last)."""
    python, tree_path, route = install.install(pins, route_name)
    results = build_dir() / "test-results"
    results.mkdir(parents=True, exist_ok=True)

    with ThreadPoolExecutor(2) as pool:
        tools_run = pool.submit(
            pytest_runner.run_pytest, python, REPO_ROOT, ["-rfEs", "forkbuild/tests"],
            results / "forkbuild.xml", pythonpath=REPO_ROOT, output=results / "forkbuild.log",
        )
        gpu_run = pool.submit(_run_gpu_tests_on_cpu, pins, python, tree_path, results)
        try:
            suite = regression.check(pins, python, tree_path)
        finally:  # a broken proof must not hide failing tool tests
            tools, gpu = tools_run.result(), gpu_run.result()
            _report(tools, "forkbuild tool tests", results / "forkbuild.log")
    # What the suites compiled (vLLM's engine, pytest, hypothesis...) for the next clone.
    install.keep_bytecode(pins, route, tree_path)
    _check_gpu_tests_skipped(gpu, tools, results)
    print("\npatch status (DEP-3 Applied-Upstream vs the version matrix):")
    patch_status.check(pins, python)

    passed = tools.passed + suite.passed
    failed = tools.failed + tools.errors + suite.failed + suite.errors
    skipped = tools.skipped + suite.skipped + gpu.skipped
    xfailed = tools.xfailed + suite.xfailed + gpu.xfailed
    print(f"\nforkbuild tool tests: {tools}")
    print(f"GPU tests without a GPU: {gpu.skipped} collected and skipped with a reason")
    print(f"fork suite in {tree_path.name}: {suite}")
    summary = f"summary: {passed} passed, {failed} failed, {skipped} skipped, {xfailed} xfailed"
    if failed:
        print(summary)
        raise ForkError(f"{failed} test(s) failed", f"JUnit reports are in {results}")
    return summary


def _report(outcome: pytest_runner.Outcome, what: str, log: object) -> None:
    """Name the failing cases of a run whose report went to a file."""
    bad = [case for case, status in outcome.cases.items() if status in ("failed", "error")]
    for case in bad:
        print(f"{what}: {outcome.cases[case]}: {case}")
    if bad:
        print(f"{what}: pytest's report is in {log}")


def _run_gpu_tests_on_cpu(pins: Pins, python, tree_path, results) -> pytest_runner.Outcome:
    if preflight.has_nvidia_gpu():
        return pytest_runner.Outcome({})
    return pytest_runner.run_pytest(
        python, tree_path, ["-rs", *pins.gpu_tests], results / "gpu-tests-on-cpu.xml",
        output=results / "gpu-tests-on-cpu.log",
    )


def _check_gpu_tests_skipped(
    outcome: pytest_runner.Outcome, tools: pytest_runner.Outcome, results
) -> None:
    """Without a GPU the GPU tests cannot run, but they must still import, collect and
    skip with a reason; the nightly GPU job runs them for real. TOOLS (forkbuild's own
    tests, which hold the serve test) is where the other required GPU case is collected."""
    if preflight.has_nvidia_gpu():
        return
    if not outcome.cases or outcome.skipped != len(outcome.cases):
        raise ForkError(
            f"the GPU tests did not all skip on this CPU machine: {outcome}",
            f"see {results / 'gpu-tests-on-cpu.log'}",
        )
    # The nightly job fails on a required case it does not find; a rename must fail here.
    gpu_required.check_collected({**tools.cases, **outcome.cases})
