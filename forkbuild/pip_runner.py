"""Run pip with the machine's own pip configuration; never name an index here."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from forkbuild.errors import ForkError


def run_pip(
    python: Path | str,
    args: Sequence[str],
    *,
    what: str,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    quiet: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m pip ARGS`; on failure raise with pip's last error line.

    With quiet=True the output is captured (for attempts whose failure is expected);
    otherwise it streams, so that long downloads show pip's own progress.
    """
    cmd = [str(python), "-m", "pip", *args]
    result = subprocess.run(
        cmd,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        text=True,
        capture_output=quiet,
        check=False,
    )
    if result.returncode != 0:
        last = _last_error_line(result.stderr or "") if quiet else "see pip's output above"
        raise ForkError(f"pip failed to {what}: {last}", "check the network and disk, then run again")
    return result


def _last_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1]
