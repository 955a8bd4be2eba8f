"""errors.run_or_fail: a failing command becomes one ForkError line with the end of
what it said; a report file holds the whole output."""

from __future__ import annotations

import sys

import pytest

from forkbuild.core.errors import ForkError, run_or_fail

SAYS = [sys.executable, "-c", "import sys; print('out'); sys.exit('first\\nlast')"]


def test_success_returns_the_captured_output():
    done = run_or_fail([sys.executable, "-c", "print('hello')"], "cannot fail")
    assert done.stdout == "hello\n"


def test_failure_says_the_end_of_stderr_and_keeps_the_hint():
    with pytest.raises(ForkError) as err:
        run_or_fail(SAYS, "it broke", "do this", tail=4)
    assert (err.value.cause, err.value.hint) == ("it broke: last", "do this")


def test_failure_with_a_report_says_its_last_line_and_where_it_is(tmp_path):
    report = tmp_path / "run.log"
    with pytest.raises(ForkError) as err:
        run_or_fail(SAYS, "it broke", report=report)
    assert report.read_text().split() == ["out", "first", "last"]
    assert (err.value.cause, err.value.hint) == ("it broke: last", f"see {report}")


def test_a_silent_failure_says_so(tmp_path):
    for report in (None, tmp_path / "run.log"):
        silent = [sys.executable, "-c", "raise SystemExit(3)"]
        with pytest.raises(ForkError) as err:
            run_or_fail(silent, "it broke", report=report)
        assert err.value.cause == "it broke: no output"
