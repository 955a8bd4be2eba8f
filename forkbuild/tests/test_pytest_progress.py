"""A long pytest run logs how many of its cases are done, so that CI shows more than
dots; the progress file's line is read back whole (the killed-run note's case)."""

from __future__ import annotations

import re
import signal
import sys

from forkbuild.core import pytest_progress, pytest_runner

CASES = """import time, pytest
@pytest.mark.parametrize("n", range(3))
def test_slow(n):
    time.sleep(0.6)
"""


def test_a_run_logs_its_cases_done_and_collected(tmp_path, monkeypatch, capsys):
    (tmp_path / "test_cases.py").write_text(CASES)
    monkeypatch.setattr(pytest_runner, "PROGRESS_EVERY_S", 0.25)
    outcome = pytest_runner.run_pytest(
        sys.executable, tmp_path, ["test_cases.py"], tmp_path / "junit.xml"
    )
    assert outcome.passed == 3
    logged = capsys.readouterr().err
    counts = re.findall(r"pytest in \S+: (\d) of (\d) cases done", logged)
    assert counts and {total for _, total in counts} == {"3"}, counts
    done = [int(d) for d, _ in counts]
    assert done == sorted(done) and done[-1] >= 1


def test_the_progress_line_is_read_back_whole():
    assert pytest_progress.read("") == (0, 0, "")
    line = "2\t5\tt.py::test_x[a b]"
    assert pytest_progress.read(line) == (2, 5, "t.py::test_x[a b]")
    assert pytest_progress.read("5\t5\t") == (5, 5, "")


HANGS = """import time
def test_a_passes():
    pass
def test_b_hangs():
    time.sleep(120)
"""


def test_a_run_started_with_sigint_ignored_still_stops_gracefully(tmp_path):
    """`bash run.sh OUT &`, nohup: SIGINT comes ignored; the stop must still end it."""
    (tmp_path / "test_cases.py").write_text(HANGS)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the run
    try:
        args = (sys.executable, tmp_path, ["test_cases.py"], tmp_path / "junit.xml")
        outcome = pytest_runner.run_pytest(*args, timeout_s=20)
    finally:
        signal.signal(signal.SIGINT, before)
    assert outcome.cases == {"test_cases.py::test_a_passes": "passed"}
    assert outcome.killed.endswith("while running test_cases.py::test_b_hangs")
