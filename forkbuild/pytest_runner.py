"""Run pytest in a tree and read its per-case results from JUnit XML."""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from forkbuild import log
from forkbuild.errors import ForkError


@dataclass(frozen=True)
class Outcome:
    """Per-case results of one pytest run: node id -> passed | failed | error | skipped
    | xfailed (JUnit files an xfail as a skip of type pytest.xfail; it is counted apart)."""

    cases: dict[str, str]
    reasons: dict[str, str] = field(default_factory=dict)  # skipped case -> pytest's reason

    def count(self, status: str) -> int:
        return sum(1 for s in self.cases.values() if s == status)

    @property
    def passed(self) -> int:
        return self.count("passed")

    @property
    def failed(self) -> int:
        return self.count("failed")

    @property
    def errors(self) -> int:
        return self.count("error")

    @property
    def skipped(self) -> int:
        return self.count("skipped")

    @property
    def xfailed(self) -> int:
        return self.count("xfailed")

    def __str__(self) -> str:
        text = f"{self.passed} passed, {self.failed} failed, {self.errors} errors, {self.skipped} skipped"
        return text + (f", {self.xfailed} xfailed" if self.xfailed else "")


def _skip_reason(skipped: ET.Element) -> str:
    message = skipped.get("message", "")
    if skipped.get("type") == "pytest.xfail":
        return f"xfail: {message}"
    if message == "collection skipped":  # the reason is in the text: (file, line, 'Skipped: …')
        text = skipped.text or ""
        return text.split("Skipped: ", 1)[-1].rstrip("')\"") if "Skipped: " in text else message
    return message


def _read_junit(junit: Path) -> Outcome:
    cases, reasons = {}, {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if classname:
            node = f"{classname.replace('.', '/')}.py::{name}"
        else:  # a whole module skipped (or broken) at collection: NAME is the module
            node = f"{name.replace('.', '/')}.py::(module)"
        status = "passed"
        for child, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = case.find(child)
            if found is not None:
                status = name
                if name == "skipped":  # pytest reports an xfail as a skip of that type
                    reasons[node] = _skip_reason(found)
                    if found.get("type") == "pytest.xfail":
                        status = "xfailed"
        cases[node] = status
    return Outcome(cases, reasons)


def run_pytest(
    python: Path,
    cwd: Path,
    args: list[str],
    junit: Path,
    *,
    pythonpath: Path | None = None,
    output: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> Outcome:
    """Run pytest with ARGS in CWD (PYTHONPATH first on sys.path); read JUnit XML.

    With OUTPUT, pytest's report goes to that file instead of the terminal: used for the
    unpatched run, whose expected failures must not read as the run's result.
    """
    env = {**os.environ, **(extra_env or {}), "PYTHONPATH": str(pythonpath or cwd)}
    junit.unlink(missing_ok=True)
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *args]
    log.step(f"pytest in {cwd.name}: {' '.join(args)}" + (f" (report: {output})" if output else ""))
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
    return _read_junit(junit)
