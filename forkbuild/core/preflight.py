"""Checks that fail fast, before any download or build starts.

forkbuild runs on the standard library alone until its venv exists: this module is the
first it imports, on whatever python3 the user has.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from forkbuild.core.errors import ForkError
from forkbuild.core.pins import Pins, build_dir, cache_dir


def check_python(pins: Pins) -> None:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here not in pins.pythons:
        raise ForkError(
            f"Python {platform.python_version()} is not supported: the fork locks "
            f"Python {', '.join(pins.pythons)}",
            "run forkbuild with one of those, e.g. make ... "
            f"PYTHON=python{pins.pythons[0]}",
        )


def check_machine(pins: Pins) -> None:
    machine = platform.machine()
    if machine not in pins.machines:
        raise ForkError(
            f"machine {machine} is not supported: the pinned vLLM wheels are for "
            f"{', '.join(pins.machines)}",
            "build on an x86_64 Linux host",
        )
    if not sys.platform.startswith("linux"):
        raise ForkError(f"platform {sys.platform} is not supported", "build on Linux")


def setting_for(path: Path) -> str:
    """The variable that moves PATH: VLLM_FORK_CACHE for the download cache (default
    ~/.cache/vllm-fork), VLLM_FORK_BUILD for the build folder (default build/)."""
    for variable, root in (
        ("VLLM_FORK_CACHE", cache_dir()),
        ("VLLM_FORK_BUILD", build_dir()),
    ):
        if path.absolute().is_relative_to(root.absolute()):
            return variable
    return "VLLM_FORK_CACHE / VLLM_FORK_BUILD"


def check_writable(path: Path, what: str) -> None:
    """PATH exists (made if need be) and a file can be written in it, else the variable
    that moves it is named. It writes a file, as root passes os.access and still cannot
    write to a read-only file system."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".forkbuild-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if exc.errno == 28:  # ENOSPC: a full disk, said as such by the caller's checks
            raise
        raise ForkError(
            f"cannot write in {path} ({exc.strerror or exc}), which {what} needs",
            f"make it writable, or set {setting_for(path)} to a writable folder",
        ) from None


def check_disk(path: Path, need_gib: float, what: str) -> None:
    check_writable(path, what)
    free_gib = shutil.disk_usage(path).free / 2**30
    if free_gib < need_gib:
        raise ForkError(
            f"only {free_gib:.1f} GiB free under {path}; {what} needs about "
            f"{need_gib:.1f} GiB",
            f"free some disk space there, or set {setting_for(path)} to a folder on a "
            "disk with room",
        )


def has_nvidia_gpu() -> bool:
    """True where an NVIDIA driver exposes a GPU; asks the driver, not torch (torch may
    be absent)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
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
            # `make serve` says which make variable it passes, so the advice names it.
            option = os.environ.get("FORKBUILD_PORT_OPTION", "--port N")
            raise ForkError(
                f"port {port} on {host} is already in use ({exc.strerror})",
                f"stop what listens there or pass {option}",
            ) from None


def check_all(pins: Pins) -> None:
    check_python(pins)
    check_machine(pins)
