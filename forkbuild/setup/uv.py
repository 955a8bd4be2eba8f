"""uv, the fork's one installer, as fork.toml pins it: extracted from its sha256-checked
wheel, held to its RECORD; its cache, offline first (docs/setup-and-locks.md)."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from forkbuild.core import log, preflight
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import Pins, build_dir, cache_dir
from forkbuild.setup import fetch, tree
from forkbuild.setup.load_extensions import record_digest, wheel_record


def bootstrap_pip() -> list[str]:
    """A pip to download uv: this Python's, else ensurepip's wheel (or Debian's)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    spec = importlib.util.find_spec("ensurepip")
    if spec is not None and spec.origin:
        kept = sysconfig.get_config_var("WHEEL_PKG_DIR")
        for folder in filter(None, [Path(spec.origin).parent / "_bundled", kept]):
            wheels = sorted(Path(folder).glob("pip-*.whl"))
            if wheels:  # pip runs from a wheel file
                return [sys.executable, str(wheels[-1] / "pip")]
    raise ForkError(
        f"{sys.executable} has neither pip nor ensurepip, which forkbuild needs once "
        "to fetch uv",
        "install your distribution's python3-venv or python3-pip package "
        "(Debian/Ubuntu: apt install python3-venv), or run with another interpreter: "
        "make ... PYTHON=/path/to/python3",
    )


_verified: dict[str, Path] = {}  # per process: the binary is checked once


def binary(pins: Pins) -> Path:
    """The verified uv binary, bootstrapped on first use."""
    if pins.uv.sha256 in _verified:
        return _verified[pins.uv.sha256]
    wheel_path = fetch.fetch(pins.uv, bootstrap_pip, quiet=True)
    version = pins.uv.requirement.split("==", 1)[1]
    target = cache_dir() / "uv" / version / "uv"
    member = f"uv-{version}.data/scripts/uv"
    expected = wheel_record(wheel_path).get(member, "")
    if not expected.startswith("sha256="):
        raise ForkError(f"{member} has no sha256 in the uv wheel's RECORD")
    if not (target.exists() and record_digest(target.read_bytes()) == expected):
        target.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel_path) as wheel:
            data = wheel.read(member)
        if record_digest(data) != expected:
            raise ForkError(
                f"the uv binary extracted from {wheel_path.name} does not match its "
                "RECORD"
            )
        partial = target.with_name("uv.partial")
        partial.write_bytes(data)
        partial.chmod(0o755)
        partial.replace(target)
        log.step(f"uv: {pins.uv.requirement} ready at {target}")
    _verified[pins.uv.sha256] = target
    return target


def uv_cache() -> Path:
    return cache_dir() / "uv-cache"


_writable: set[Path] = set()  # per process: the cache is checked once


class _Final(ForkError):
    """A uv failure no download mends: a hash mismatch, a full or unwritable disk."""


_MISMATCH = re.compile(
    r"Hash mismatch for `(?P<what>[^`]+)`.*?Expected:\s+sha256:(?P<expected>\w{64})"
    r".*?Computed:\s+sha256:(?P<computed>[0-9a-f]{64})",
    re.DOTALL,
)
# uv's I/O errors end in "(os error N)"; the line names the path in `...` or "...".
_OS_ERROR = re.compile(r"(?P<reason>[A-Z][A-Za-z -]+) \(os error (?P<errno>\d+)\)")
_PATH = re.compile(r"[`\"](?P<path>/[^`\"]+)[`\"]")
_UNWRITABLE = {1, 13, 20, 30}  # EPERM, EACCES, ENOTDIR, EROFS


def _disk_failure(output: str, what: str) -> ForkError | None:
    """A full or unwritable disk, said with its folder and the setting that moves it."""
    for line in output.splitlines():
        found = _OS_ERROR.search(line)
        if not found or int(found["errno"]) not in {28, *_UNWRITABLE}:
            continue
        named = _PATH.search(line)
        path = Path(named["path"]) if named else uv_cache()
        roots = (uv_cache(), build_dir())
        folder = next((r for r in roots if path.is_relative_to(r.absolute())), path)
        setting = preflight.setting_for(path)
        if int(found["errno"]) == 28:
            return _Final(
                f"no space left on the disk of {folder} when uv tried to {what}",
                f"free disk space there, or set {setting} to a folder on a disk with "
                "room; then run again (uv keeps what it downloaded)",
            )
        return _Final(
            f"uv cannot write in {folder} ({found['reason']}) when it tried to {what}",
            f"make it writable, or set {setting} to a writable folder",
        )
    return None


def _failure(output: str, what: str, lock: Path | None) -> ForkError:
    if found := _MISMATCH.search(output):
        where = f"{lock.name} pins" if lock else "the requirements pin"
        return _Final(
            f"sha256 mismatch for {found['what']}: the download has "
            f"{found['computed']}, {where} {found['expected']}; nothing was installed",
            "run again (the download is not kept); if it mismatches again, do not edit "
            "the lock: check the package on the index",
        )
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("error:", "cause:", "Caused by:"))]
    return _disk_failure(output, what) or ForkError(
        f"uv failed to {what}: {' '.join(errors[-2:] or lines[-1:] or ['no output'])}",
        "check the network and disk, then run again",
    )


def run(
    pins: Pins,
    args: Sequence[str],
    *,
    what: str,
    lock: Path | None = None,
    extra_env: dict[str, str] | None = None,
    stream: bool = False,
) -> str:
    """`uv ARGS`' output (STREAM: also shown as it comes); a failure says uv's cause."""
    if uv_cache() not in _writable:
        # uv locks its cache even to read: refuse one it cannot write (naming
        # VLLM_FORK_CACHE) before uv fails in its own words.
        preflight.check_writable(uv_cache(), "uv")
        _writable.add(uv_cache())
    env = {**os.environ, **(extra_env or {}), "UV_CACHE_DIR": str(uv_cache())}
    # UV_PYTHON_DOWNLOADS: venvs use forkbuild's own interpreter
    env |= {"UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"}
    command, lines = [str(binary(pins)), *args], []
    out, both = subprocess.PIPE, subprocess.STDOUT
    with subprocess.Popen(command, env=env, text=True, stdout=out, stderr=both) as proc:
        for line in proc.stdout or ():
            lines.append(line)
            if stream:
                print(f"  uv: {line.rstrip()}", flush=True)
    if proc.returncode != 0:
        raise _failure("".join(lines), what, lock)
    return "".join(lines)


def install(
    pins: Pins, args: Sequence[str], *, what: str, lock: Path | None = None
) -> None:
    """`uv pip ARGS` (installing WHAT) offline first: then what the cache lacks."""
    try:
        run(pins, ["pip", *args, "--offline"], what=f"install {what}", lock=lock)
    except _Final:
        raise
    except ForkError:
        log.step(f"install: downloading what uv's cache lacks for {what}")
        run(pins, ["pip", *args], what=f"install {what}", lock=lock, stream=True)


STAMP = ".forkbuild-venv"  # in a venv: the digest of what it was made from


def venv_in_place(
    pins: Pins,
    home: Path,
    key: str,
    what: str,
    fill: Callable[[Path], None],
    interpreter: Path | str = sys.executable,
) -> tuple[Path, bool]:
    """HOME's venv, and if made now: kept while stamped KEY, else made whole, FILLed."""
    stamp, python = home / STAMP, home / "bin" / "python"
    if stamp.is_file() and stamp.read_text().strip() == key and python.exists():
        return python, False
    partial = home.with_name(home.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    log.step(f"install: creating {home} for {what}")
    try:  # relocatable: its scripts find their python anywhere
        create = ["venv", "--quiet", "--relocatable", "--python", str(interpreter)]
        run(pins, [*create, str(partial)], what=f"create the venv for {what}")
        fill(partial / "bin" / "python")
        (partial / STAMP).write_text(key + "\n")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    tree.swap_into_place(partial, home)
    return python, True


def stamped_venv(
    pins: Pins,
    home: Path,
    interpreter: Path,
    requirements: str,
    key: str,
    what: str,
    *flags: str,
) -> Path:
    """HOME's venv of INTERPRETER with REQUIREMENTS (text) `uv pip install FLAGS`-ed."""

    def fill(python: Path) -> None:
        listed = python.parent.parent / "requirements.txt"
        listed.write_text(requirements)
        args = ["install", *flags, "--python", str(python), "-r", str(listed)]
        install(pins, args, what=what)

    return venv_in_place(pins, home, key, what, fill, interpreter)[0]
