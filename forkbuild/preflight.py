"""Checks that fail fast, before any download or build starts."""

from __future__ import annotations

import platform
import shutil
import socket
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet

from forkbuild.errors import ForkError
from forkbuild.pins import Pins


def check_python(pins: Pins) -> None:
    here = platform.python_version()
    if here not in SpecifierSet(pins.python):
        raise ForkError(
            f"Python {here} is not supported by vLLM {pins.upstream_version} (needs {pins.python})",
            "run forkbuild with a supported python3, e.g. PYTHON=python3.11 make ...",
        )


def check_machine(pins: Pins) -> None:
    machine = platform.machine()
    if machine not in pins.machines:
        raise ForkError(
            f"machine {machine} is not supported: the pinned vLLM wheels are for {', '.join(pins.machines)}",
            "build on an x86_64 Linux host",
        )
    if not sys.platform.startswith("linux"):
        raise ForkError(f"platform {sys.platform} is not supported", "build on Linux")


def check_disk(path: Path, need_gib: float, what: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    free_gib = shutil.disk_usage(path).free / 2**30
    if free_gib < need_gib:
        raise ForkError(
            f"only {free_gib:.1f} GiB free under {path}; {what} needs about {need_gib:.0f} GiB",
            "free some disk space or point VLLM_FORK_CACHE / VLLM_FORK_BUILD elsewhere",
        )


def has_nvidia_gpu() -> bool:
    """True where an NVIDIA driver exposes a GPU; asks the driver, not torch (torch may be absent)."""
    if Path("/proc/driver/nvidia/gpus").is_dir() and any(Path("/proc/driver/nvidia/gpus").iterdir()):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    import subprocess

    result = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return result.returncode == 0 and "GPU" in result.stdout


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ForkError(
                f"port {port} on {host} is already in use ({exc.strerror})",
                "stop what listens there or pass --port N",
            ) from None


def check_all(pins: Pins) -> None:
    check_python(pins)
    check_machine(pins)
