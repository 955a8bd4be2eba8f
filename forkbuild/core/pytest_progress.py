"""A pytest plugin (pytest_runner's `-p`): JUnit XML comes only at the end, so cases
done, collected, in progress go to FORKBUILD_PYTEST_PROGRESS. Under --forked, what a
case left (marked) is killed: a stopped case's engine cores hold the next one's GPU."""

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator

CASE_MARK = "FORKBUILD_PYTEST_CASE"
_state = {"done": 0, "total": 0, "forked": False}  # this session's


def _write(running: str) -> None:
    with open(os.environ["FORKBUILD_PYTEST_PROGRESS"], "w") as progress:
        progress.write(f"{_state['done']}\t{_state['total']}\t{running}")


def read(text: str) -> tuple[int, int, str]:
    """(done, collected, in progress) from the progress file; 0, 0, "" at first."""
    done, total, running = (text.split("\t", 2) + ["", "", ""])[:3]
    return int(done or 0), int(total or 0), running.strip()


def pytest_configure(config) -> None:
    # Started in the background without job control, SIGINT comes ignored: the graceful
    # stop would never end the session, and the SIGKILL would lose the JUnit XML.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _state["forked"] = bool(config.getoption("forked", default=False))


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
    _state["total"] = len(session.items)
    _write("")


def pytest_runtest_logstart(nodeid, location) -> None:
    os.environ[CASE_MARK] = uuid.uuid4().hex
    _write(nodeid)


def pytest_runtest_logfinish(nodeid, location) -> None:
    mark = os.environ.pop(CASE_MARK, None)
    if _state["forked"] and mark:
        for pid in leftovers(mark):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    _state["done"] += 1
    _write("")
