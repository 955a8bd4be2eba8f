"""A pytest plugin that names the case in progress and counts the cases done
(forkbuild/core/pytest_runner.py copies it beside the run and loads it with `-p`).

pytest writes its JUnit XML only at the end, so a killed run could not say where it
hung, and a long run showed only dots: the cases done, collected and in progress go to
FORKBUILD_PYTEST_PROGRESS as one tab-separated line (logstart and logfinish run in the
main pytest process, also under --forked). Under --forked it also ends what each case
started: a case stopped by its time limit leaves vLLM's engine cores holding GPU memory
that the next case's profiling counts. Each case's processes carry a mark of their own
(set before the fork, inherited); what still carries it when the case is reported is
killed. (Without --forked a fixture may outlive a case: nothing is killed there.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator

CASE_MARK = "FORKBUILD_PYTEST_CASE"
_forked = False
_counts = {"done": 0, "total": 0}


def _write(running: str) -> None:
    with open(os.environ["FORKBUILD_PYTEST_PROGRESS"], "w") as progress:
        progress.write(f"{_counts['done']}\t{_counts['total']}\t{running}")


def read(text: str) -> tuple[int, int, str]:
    """(cases done, cases collected, the case in progress) from the progress file's
    TEXT; zeros and "" before the first case."""
    done, total, running = (text.split("\t", 2) + ["", "", ""])[:3]
    return int(done or 0), int(total or 0), running.strip()


def pytest_configure(config) -> None:
    global _forked
    # A run started in the background of a shell without job control inherits SIGINT
    # ignored: the graceful stop at a time limit would then never end the session and
    # only the SIGKILL would, losing the JUnit XML of the cases that finished.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
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


def pytest_collection_finish(session) -> None:
    _counts["total"] = len(session.items)
    _write("")


def pytest_runtest_logstart(nodeid, location) -> None:
    os.environ[CASE_MARK] = uuid.uuid4().hex
    _write(nodeid)


def pytest_runtest_logfinish(nodeid, location) -> None:
    mark = os.environ.pop(CASE_MARK, None)
    if _forked and mark:
        for pid in leftovers(mark):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    _counts["done"] += 1
    _write("")
