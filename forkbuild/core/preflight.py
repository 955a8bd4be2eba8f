"""Checks that fail fast, before any download or build (standard library only)."""

import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from forkbuild.core.errors import ForkError
from forkbuild.core.pins import Pins, build_dir, cache_dir


def check_all(pins: Pins) -> None:
    """This Python and machine are ones the fork locks and has wheels for."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here not in pins.pythons:
        raise ForkError(
            f"Python {platform.python_version()} is not supported: the fork locks "
            f"Python {', '.join(pins.pythons)}",
            f"run it on one of them, e.g. make ... PYTHON=python{pins.pythons[0]}",
        )
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
    """The variable that moves PATH (the download cache's or the build folder's)."""
    roots = {"VLLM_FORK_CACHE": cache_dir(), "VLLM_FORK_BUILD": build_dir()}
    here = path.absolute()
    inside = [v for v, root in roots.items() if here.is_relative_to(root.absolute())]
    return inside[0] if inside else "VLLM_FORK_CACHE / VLLM_FORK_BUILD"


def check_writable(path: Path, what: str) -> None:
    """PATH takes a file, else its variable is named (os.access: root passes on ro)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(prefix=".forkbuild-write-test-", dir=path).close()
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
    """Whether an NVIDIA driver exposes a GPU (asked, not torch: it may be absent)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
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
