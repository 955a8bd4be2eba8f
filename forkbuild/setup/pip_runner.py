"""Run pip with the machine's own pip configuration; never name an index here. pip only
downloads (uv, the one installer, has no download command): the pinned files and uv."""

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from forkbuild.core.errors import ForkError


def run_pip(
    python: Path | str | Sequence[str],
    args: Sequence[str],
    *,
    what: str,
    env: Mapping[str, str] | None = None,
    quiet: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`PYTHON -m pip ARGS`; a failure says pip's last error; QUIET captures."""
    pip = [str(python), "-m", "pip"] if isinstance(python, (str, Path)) else python
    result = subprocess.run(
        [*pip, *args], env=env, text=True, capture_output=quiet, check=False
    )
    if result.returncode != 0:
        last = "see pip's output above"
        if quiet:
            lines = [ln.strip() for ln in result.stderr.splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("ERROR")]
            last = (errors or lines or ["no output"])[-1]
        raise ForkError(
            f"pip failed to {what}: {last}",
            "check the network and disk, then run again",
        )
    return result
