"""The one error type (a cause plus what to do), and how a must-succeed command runs."""

import os
import subprocess
from pathlib import Path
from typing import Any


class ForkError(Exception):
    """A failure the user can act on; the CLI prints it as one line, exits non-zero."""

    def __init__(self, cause: str, hint: str = "") -> None:
        super().__init__(cause)
        self.cause, self.hint = cause, hint

    def __str__(self) -> str:
        return f"{self.cause} -- {self.hint}" if self.hint else self.cause


def run_or_fail(
    cmd: list[str],
    cause: str,
    hint: str = "",
    *,
    report: Path | None = None,
    tail: int = 400,
    **kwargs: Any,
) -> subprocess.CompletedProcess[str]:
    """Run CMD (output captured, or in REPORT); failing: CAUSE, what it said last."""
    with open(report or os.devnull, "w") as sink:
        streams = {"stdout": sink, "stderr": subprocess.STDOUT} if report else {}
        done = subprocess.run(
            cmd, capture_output=not report, text=True, check=False, **streams, **kwargs
        )
    if done.returncode == 0:
        return done
    said = (Path(report).read_text() if report else done.stderr or done.stdout).strip()
    # A crash's traceback is the useful part of captured output; a report has it.
    end = said.splitlines()[-1] if report and said else said[-tail:]
    hint = hint or (f"see {report}" if report else "")
    raise ForkError(f"{cause}: {end or 'no output'}", hint)
