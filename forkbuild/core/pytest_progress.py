"""A pytest plugin that names the case in progress, for runs with a time limit
(forkbuild/core/pytest_runner.py copies it beside the run and loads it with `-p`).

pytest writes its JUnit XML only at the end, so a killed run could not say where it
hung: the case in progress is written to FORKBUILD_PYTEST_PROGRESS. logstart and
logfinish run in the main pytest process, also under --forked. Under --forked it also
ends each case with what the case started: a case stopped by its own time limit leaves
vLLM's engine cores behind, holding GPU memory that the next case's profiling counts.
Each case's processes carry a mark of their own (set before the fork, inherited by all
the case starts); what still carries it when the case is reported is killed. (Without
--forked a fixture may outlive a case, so nothing is killed between cases there.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator

CASE_MARK = "FORKBUILD_PYTEST_CASE"
_forked = False


def _write(text: str) -> None:
    with open(os.environ["FORKBUILD_PYTEST_PROGRESS"], "w") as progress:
        progress.write(text)


def pytest_configure(config) -> None:
    global _forked
    _forked = bool(config.getoption("forked", default=False))


def leftovers(mark: str, variable: str = CASE_MARK) -> Iterator[int]:
    """The other processes whose environment holds VARIABLE=MARK (Linux /proc)."""
    wanted = f"{variable}={mark}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as env:
                    if wanted in env.read().split(b"\0"):
                        yield int(entry)
            except OSError:
                continue


def pytest_runtest_logstart(nodeid, location) -> None:
    os.environ[CASE_MARK] = uuid.uuid4().hex
    _write(nodeid)


def pytest_runtest_logfinish(nodeid, location) -> None:
    mark = os.environ.pop(CASE_MARK, None)
    if _forked and mark:
        for pid in leftovers(mark):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    _write("")
