"""Run pytest in a tree and read its per-case results from JUnit XML."""

import contextlib
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from forkbuild.core import log, pytest_progress
from forkbuild.core.errors import ForkError


@dataclass(frozen=True)
class Outcome:
    """One pytest run's node id -> passed | failed | error | skipped | xfailed."""

    cases: dict[str, str]
    reasons: dict[str, str] = field(default_factory=dict)  # skipped case -> why
    killed: str = ""  # why the run was stopped ("": it ended); CASES came before
    # case -> seconds, as JUnit says; not part of what a run found (equal runs differ)
    times: dict[str, float] = field(default_factory=dict, compare=False)
    # failed or errored case -> JUnit's message and text (what it failed with)
    said: dict[str, str] = field(default_factory=dict, compare=False)

    def count(self, status: str) -> int:
        return list(self.cases.values()).count(status)

    passed = property(lambda self: self.count("passed"))
    failed = property(lambda self: self.count("failed"))
    errors = property(lambda self: self.count("error"))
    skipped = property(lambda self: self.count("skipped"))
    xfailed = property(lambda self: self.count("xfailed"))

    def __str__(self) -> str:
        text = f"{self.passed} passed, {self.failed} failed, {self.errors} errors, "
        text += f"{self.skipped} skipped"
        text += f", {self.xfailed} xfailed" if self.xfailed else ""
        return text + (f"; killed: {self.killed}" if self.killed else "")


_STATUSES = (("failure", "failed"), ("error", "error"))  # the last found wins


def read_junit(junit: Path, killed: str = "") -> Outcome:
    cases, reasons, times, said = {}, {}, {}, {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if not name:  # what pytest writes for the case a Ctrl-C (SIGINT) interrupted
            continue
        if classname:
            # "pkg.test_mod.TestClass" -> "pkg/test_mod.py::TestClass::name" (classes:
            # Test* after pytest's python_classes; modules never are)
            parts = classname.split(".")
            cut = next((i for i, p in enumerate(parts) if p[:4] == "Test"), len(parts))
            node = "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], name])
        else:  # a whole module skipped (or broken) at collection: NAME is the module
            node = f"{name.replace('.', '/')}.py::(module)"
        found = [s for c, s in _STATUSES if case.find(c) is not None] or ["passed"]
        for failure in (case.find(c) for c, _ in _STATUSES):
            if failure is not None:
                text = f"{failure.get('message', '')}\n{failure.text or ''}\n"
                said[node] = said.get(node, "") + text
        skipped = case.find("skipped")
        if skipped is not None:  # pytest reports an xfail as a skip of that type
            why, text = skipped.get("message", ""), skipped.text or ""
            xfail = skipped.get("type") == "pytest.xfail"
            found.append("xfailed" if xfail else "skipped")
            if xfail:
                why = f"xfail: {why}"
            elif why == "collection skipped" and "Skipped: " in text:
                why = text.split("Skipped: ", 1)[-1].rstrip("')\"")  # (file, line, '…')
            reasons[node] = why
        # pytest writes a call's failure and its teardown's error after it as two
        # testcases of one name: the case failed (its call), its said has both
        cases[node] = "failed" if cases.get(node) == "failed" else found[-1]
        times[node] = float(case.get("time") or 0.0)
    return Outcome(cases, reasons, killed, times, said)


# At its time limit a run gets SIGINT: pytest ends as on Ctrl-C and still writes the
# JUnit XML of the cases it finished. What still runs GRACE_S later is killed.
GRACE_S = 30
PROGRESS_EVERY_S = 60  # how often the cases done are logged: CI shows more than dots
_PROGRESS_MODULE = "_forkbuild_progress"  # pytest_progress.py, copied beside the run
# Every process a limited run starts carries this variable (its value the run's): what
# escaped its process group (a `vllm serve` in its own session) is found in /proc too.
_RUN_MARK = "FORKBUILD_LIMITED_RUN"


def _signal_run(pgid: int, token: str, sig: int = signal.SIGKILL) -> None:
    """SIG to the process group PGID; a SIGKILL to every process marked TOKEN too."""
    with contextlib.suppress(ProcessLookupError):  # nothing of it is left
        os.killpg(pgid, sig)
    kill = sig == signal.SIGKILL
    for pid in pytest_progress.leftovers(token, _RUN_MARK) if kill else ():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _stop(proc: subprocess.Popen, token: str) -> None:
    """SIGINT to PROC's process group; after GRACE_S, SIGKILL to what is left of it."""
    _signal_run(proc.pid, token, signal.SIGINT)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_run(proc.pid, token)
        proc.wait()


def run_limited(
    cmd: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout_s: float | None,
    tick: Callable[[], None] = lambda: None,
    **popen_args,
) -> tuple[int, bool]:
    """Run CMD in its own session, TICK every PROGRESS_EVERY_S, stopped after TIMEOUT_S
    (None: never); (exit status, stopped?). What it started and left is killed either
    way (forked cases, engine cores, `vllm serve`): it must not hold the GPU."""
    token = uuid.uuid4().hex
    env = {**env, _RUN_MARK: token}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True, **popen_args)
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                return proc.wait(timeout=min(left, PROGRESS_EVERY_S)), False
            except subprocess.TimeoutExpired:
                tick()
        _stop(proc, token)
        return proc.returncode, True
    except BaseException:  # Ctrl-C of forkbuild no longer reaches the new session
        _stop(proc, token)
        raise
    finally:
        _signal_run(proc.pid, token)


def run_pytest(
    python: Path,
    cwd: Path,
    args: list[str],
    junit: Path,
    *,
    pythonpath: Path | str | None = None,  # a str may join several with os.pathsep
    output: Path | None = None,
    extra_env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    prefix: tuple[str, ...] = (),
) -> Outcome:
    """Run pytest with ARGS in CWD; read its JUnit XML. OUTPUT takes the report off the
    terminal; after TIMEOUT_S the Outcome is what was reported, `killed` naming the case
    in progress; PREFIX goes before the interpreter (e.g. `unshare -n`)."""
    env = {**os.environ, **(extra_env or {}), "PYTHONPATH": str(pythonpath or cwd)}
    junit.unlink(missing_ok=True)
    cmd = [*prefix, str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    cmd += [f"--junitxml={junit}", *args, "-p", _PROGRESS_MODULE]
    report = f" (report: {output})" if output else ""
    log.step(f"pytest in {cwd.name}: {' '.join(args)}{report}")
    returncode, killed = _run(cmd, cwd, env, output, timeout_s)
    if killed:
        log.step(f"pytest in {cwd.name}: {killed}")
        try:  # what pytest reported, if it got to write its JUnit XML whole
            return read_junit(junit, killed)
        except (OSError, ET.ParseError):  # not written, or cut off by the SIGKILL
            return Outcome({}, killed=killed)
    if returncode not in (0, 1) or not junit.exists():
        raise ForkError(
            f"pytest could not run the tests in {cwd.name} (exit {returncode})",
            f"see {output or 'its output above'}: a collection or import error is not "
            "a test result",
        )
    return read_junit(junit)


def _run(
    cmd: list[str], cwd: Path, env: dict, output: Path | None, timeout_s: float | None
) -> tuple[int, str]:
    """CMD's exit code, and the note naming the case in progress if it was stopped."""
    with (
        open(output, "w") if output else open(os.devnull) as sink,
        tempfile.TemporaryDirectory(prefix="forkbuild-pytest-") as folder,
    ):
        streams = {"stdout": sink, "stderr": subprocess.STDOUT} if output else {}
        # The progress plugin, copied: the run's own `tests` package wins over ours.
        plugin = Path(folder) / f"{_PROGRESS_MODULE}.py"
        shutil.copyfile(Path(__file__).with_name("pytest_progress.py"), plugin)
        progress = Path(folder) / "running"
        progress.write_text("")
        env["PYTHONPATH"] = f"{folder}{os.pathsep}{env['PYTHONPATH']}"
        env["FORKBUILD_PYTEST_PROGRESS"] = str(progress)

        def tick() -> None:
            done, total, _ = pytest_progress.read(progress.read_text())
            if total:
                log.step(f"pytest in {cwd.name}: {done} of {total} cases done")

        returncode, stopped = run_limited(
            cmd, cwd=cwd, env=env, timeout_s=timeout_s, tick=tick, **streams
        )
        if not stopped:
            return returncode, ""
        running = pytest_progress.read(progress.read_text())[2]
        where = f"while running {running}" if running else "outside a case"
        where += "" if running else " (collecting, or in between)"
        return returncode, f"stopped after its time limit of {timeout_s:g} s {where}"
