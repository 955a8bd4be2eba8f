"""The bootstrap: `python3 -m forkbuild STEP` starts here, on the standard library alone
(Debian 12's python3 has no `packaging`), gets the pinned uv, makes the tool environment
(VLLM_FORK_TOOLS, default $VLLM_FORK_BUILD/tools) holding exactly locks/tools-pyXY.txt,
verified inside itself, and re-executes the same command there."""

import csv
import fcntl
import functools
import os
import subprocess
import sys
from pathlib import Path

from forkbuild.core import log
from forkbuild.core.errors import ForkError
from forkbuild.core.hashing import digest_of
from forkbuild.core.pins import REPO_ROOT, Pins, build_dir, load, locks_dir
from forkbuild.setup import uv

# What the bootstrap imports (paths in forkbuild/, as gpu/bundle/build.py's
# RUNNER_MODULES): standard library only; test_bare_python holds it to that.
_CORE = ("__init__", "errors", "log", "hashing", "pins", "preflight")
_SETUP = ("__init__", "bootstrap", "uv", "tree", "fetch", "pip_runner")
MODULES = ("__init__", "__main__", *(f"core/{m}" for m in _CORE))
MODULES += (*(f"setup/{m}" for m in _SETUP), "setup/load_extensions")
FORMAT = "forkbuild-lock-1"  # every lock's inputs digest starts with it
DIGEST_LINE = "# inputs-sha256: "


def running_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def tools_dir() -> Path:
    return Path(os.environ.get("VLLM_FORK_TOOLS") or build_dir() / "tools")


def tools_lock(python: str) -> Path:
    return locks_dir() / f"tools-py{python.replace('.', '')}.txt"


def tools_digest(pins: Pins, python: str) -> str:  # of the tools lock's inputs
    return digest_of([FORMAT, "tools", python, pins.lock_platform, *pins.forkbuild])


def recorded_digest(lock_file: Path) -> str | None:
    for line in lock_file.read_text().splitlines():
        if line.startswith(DIGEST_LINE):
            return line[len(DIGEST_LINE) :].strip()
    return None


def _stamp(pins: Pins, lock_file: Path) -> str:
    # The base interpreter, not a venv's: forkbuild started from build/venv's python
    # (the tool tests do) finds the same tool environment good.
    base = os.path.realpath(sys.base_prefix)
    return digest_of([sys.version, base, pins.uv.sha256, lock_file.read_bytes()])


def _checked_lock(pins: Pins, step: str) -> Path:
    lock_file = tools_lock(running_python())
    if not lock_file.is_file():
        raise ForkError(
            f"{lock_file} is missing: forkbuild has no tool environment locked for "
            f"Python {running_python()}",
            f"run forkbuild with a supported Python ({', '.join(pins.pythons)}: "
            "make ... PYTHON=python3.11), or add this one to fork.toml [upstream] "
            "pythons and run `make lock` with a supported one",
        )
    if recorded_digest(lock_file) != tools_digest(pins, running_python()):
        if step != "lock":  # `make lock` runs on the old lock, and rewrites it
            raise ForkError(
                f"{lock_file.name} was not made from fork.toml [toolchain] forkbuild "
                "as it is now",
                "run `make lock` (needs the package index) and commit locks/",
            )
        log.step(f"tools: {lock_file.name} is stale; `lock` rewrites it")
    return lock_file


def check_holds(python: Path, lock_file: Path) -> None:
    """PYTHON holds exactly LOCK_FILE: asked of itself (lock.verify_installed)."""
    verify = [str(python), "-m", "forkbuild.setup.lock", "--verify", str(lock_file)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    options = {"capture_output": True, "text": True, "check": False}
    done = subprocess.run(verify, cwd=REPO_ROOT, env=env, **options)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        hint = "run again: the environment is made afresh from the lock"
        raise ForkError(lines[-1], hint)


def sync(pins: Pins, python: Path, lock_file: Path) -> None:
    """PYTHON's environment made to hold exactly LOCK_FILE, then asked if it does."""
    sync = ["sync", "--require-hashes", "--python", str(python), str(lock_file)]
    uv.install(pins, sync, what=f"the packages of {lock_file.name}", lock=lock_file)
    check_holds(python, lock_file)


def _missing(home: Path) -> str:
    """A file of the environment's packages that is gone (their RECORDs), or ''."""
    site = home / "lib" / f"python{running_python()}" / "site-packages"
    records = sorted(site.glob("*.dist-info/RECORD"))
    if not records:
        return str(site)
    # csv, not importlib.metadata: 3.12.1's Distribution.files leaves out a package's
    # __init__.py (the first row of rich's RECORD), so its loss went unseen.
    for record in records:
        with open(record, newline="") as rows:
            for row in csv.reader(rows):
                if row and not (site / row[0]).exists():
                    return str(site / row[0])
    return ""


def ensure(fork: Pins, step: str = "") -> tuple[Path, bool]:
    """The tool environment's python, and whether it was made (again) just now."""
    lock_file = _checked_lock(fork, step)
    home = tools_dir()
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.with_name(home.name + ".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # one maker at a time; the others reuse it
        missing = _missing(home) if (home / uv.STAMP).is_file() else ""
        if missing:
            log.step(f"tools: {home} lacks {missing}; making it again")
            (home / uv.STAMP).unlink()
        what = f"forkbuild's libraries ({lock_file.name})"
        fill = functools.partial(sync, fork, lock_file=lock_file)
        return uv.venv_in_place(fork, home, _stamp(fork, lock_file), what, fill)


def enter(argv: list[str]) -> None:
    """Re-execute `python -m forkbuild ARGV` in the tool environment, unless in it."""
    step = next((a for a in argv if not a.startswith("-")), "")
    python, made = ensure(load(), step)
    # Children (forkbuild in a test's own build folder) use this environment too.
    os.environ["VLLM_FORK_TOOLS"] = str(tools_dir())
    if Path(sys.prefix).resolve() == tools_dir().resolve() and not made:
        return
    os.execv(python, [str(python), "-m", "forkbuild", *argv])
