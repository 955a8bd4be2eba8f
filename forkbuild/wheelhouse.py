"""Install Python packages through a wheelhouse kept outside the clone.

pip's HTTP cache keeps nothing on the fork's machines, so warm runs would download
gigabytes again. Every package goes through <cache>/wheelhouse instead: install from it
offline first; only when something is missing, `pip download` into it and retry.
torch, the largest download, is checked against the sha256 pins in fork.toml.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from forkbuild import log
from forkbuild.errors import ForkError
from forkbuild.hashing import sha256_file
from forkbuild.pins import Pins, cache_dir
from forkbuild.pip_runner import run_pip


def wheelhouse() -> Path:
    path = cache_dir() / "wheelhouse"
    path.mkdir(parents=True, exist_ok=True)
    return path


def verify_torch_wheels(pins: Pins, torch: str | None = None) -> None:
    for wheel in sorted(wheelhouse().glob(f"torch-{torch or pins.torch}-*.whl")):
        pinned = pins.torch_sha256.get(wheel.name)
        if pinned is None:
            raise ForkError(
                f"no sha256 pinned for {wheel.name}",
                "check the file against the release and add it to fork.toml "
                "([toolchain.torch-sha256] or [matrix.torch-sha256])",
            )
        if sha256_file(wheel) != pinned:
            wheel.unlink()
            raise ForkError(
                f"sha256 mismatch for {wheel.name}; the file was deleted",
                "run again to download it afresh",
            )


def install(
    pins: Pins,
    python: Path,
    requirements: Sequence[str],
    *,
    what: str,
    requirement_files: Sequence[Path] = (),
    torch: str | None = None,
) -> None:
    """Install REQUIREMENTS into PYTHON's venv; TORCH: the torch version they pin, when it
    is not the toolchain's (its wheels are checked against their pins all the same)."""
    args: list[str] = [*requirements]
    for req_file in requirement_files:
        args += ["-r", str(req_file)]
    offline = ["install", "--no-index", "--find-links", str(wheelhouse()), *args]
    verify_torch_wheels(pins, torch)
    log.step(f"install: installing {what} (from the wheelhouse where it has them)")
    try:
        run_pip(python, offline, what=f"install {what}", quiet=True)
        log.step(f"install: {what} installed from the wheelhouse")
        return
    except ForkError:
        pass
    log.step(f"install: downloading {what} into {wheelhouse()}")
    run_pip(
        python,
        ["download", "--progress-bar", "off", "-d", str(wheelhouse()), *args],
        what=f"download {what}",
    )
    verify_torch_wheels(pins, torch)
    run_pip(python, offline, what=f"install {what}")
    log.step(f"install: {what} installed")
