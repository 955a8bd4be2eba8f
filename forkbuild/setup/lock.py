"""`forkbuild lock`: the hash-locked environments, one per route and supported Python.

locks/ROUTE-pyXY.txt pins every package of the route's venv (fork.toml's toolchain, the
route's extras and vLLM's requirement file in the tree) with its sha256, resolved by
`uv pip compile --generate-hashes` for fork.toml's lock_platform. Each lock records a
digest of its inputs; an install refuses a lock whose inputs changed since, so the venv
installed is the one locked and tested. Only `forkbuild lock` needs the network.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from forkbuild.core import log
from forkbuild.core.errors import ForkError
from forkbuild.core.hashing import digest_of
from forkbuild.core.pins import Pins, Route, locks_dir
from forkbuild.setup import uv

FORMAT = "forkbuild-lock-1"
DIGEST_LINE = "# inputs-sha256: "
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def running_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def path(route: str, python: str) -> Path:
    return locks_dir() / f"{route}-py{python.replace('.', '')}.txt"


def _requirement_files(tree_path: Path, relative: str) -> list[Path]:
    """The route's requirement file and those it includes with -r, in reading order."""
    files, todo = [], [tree_path / relative]
    while todo:
        current = todo.pop(0)
        if current in files:
            continue
        if not current.is_file():
            raise ForkError(
                f"{current} is missing from the tree", "rebuild it: make tree"
            )
        files.append(current)
        for line in current.read_text().splitlines():
            found = re.match(r"^\s*(?:-r|--requirement)\s+(\S+)", line)
            if found:
                todo.append(current.parent / found[1])
    return files


def inputs_digest(pins: Pins, route: Route, python: str, tree_path: Path) -> str:
    """The digest of what the lock of ROUTE for PYTHON is made from."""
    files = _requirement_files(tree_path, route.requirements)
    return digest_of(
        [
            FORMAT,
            route.name,
            python,
            pins.lock_platform,
            *_wanted(pins, route),
            *(f"exclude {name}" for name in route.exclude),
            *(f"{f.relative_to(tree_path)}\n".encode() + f.read_bytes() for f in files),
        ]
    )


def _wanted(pins: Pins, route: Route) -> list[str]:
    """The requirements a lock resolves besides the tree's own file."""
    return [*pins.toolchain, *route.extra]


def recorded_digest(lock_file: Path) -> str | None:
    for line in lock_file.read_text().splitlines():
        if line.startswith(DIGEST_LINE):
            return line[len(DIGEST_LINE) :].strip()
    return None


def stale(pins: Pins, tree_path: Path) -> list[str]:
    """Every lock that is missing or was made from other inputs than today's."""
    wrong = []
    for route in pins.routes.values():
        for python in pins.pythons:
            lock_file = path(route.name, python)
            if not lock_file.is_file():
                wrong.append(f"{lock_file.name} (missing)")
            elif recorded_digest(lock_file) != inputs_digest(
                pins, route, python, tree_path
            ):
                wrong.append(f"{lock_file.name} (its inputs changed)")
    return wrong


def check(pins: Pins, tree_path: Path) -> None:
    wrong = stale(pins, tree_path)
    if wrong:
        raise ForkError(
            "the locks no longer match the requirements they were made from: "
            f"{', '.join(wrong)}",
            "run `make lock` (needs the package index) and commit locks/",
        )


def pinned(lock_file: Path) -> dict[str, str]:
    """name -> version of every package a lock pins (names normalized as in PEP 503)."""
    return pinned_lines(lock_file.read_text())


def pinned_lines(text: str) -> dict[str, str]:
    """name -> version of `name==version` lines (a freeze)."""
    return {normalize(m[1]): m[2] for m in map(_PIN.match, text.splitlines()) if m}


def entries(lock_file: Path, names: set[str]) -> str:
    """The lock's own lines (the pin and its --hash lines) for the packages NAMES
    (normalized), as a requirements file that `uv pip install --require-hashes`
    takes."""
    kept, keep = [], False
    for line in lock_file.read_text().splitlines():
        pin = _PIN.match(line)
        if pin:
            keep = normalize(pin[1]) in names
        elif not line.startswith((" ", "\t")):
            keep = False
        if keep:
            kept.append(line)
    return "".join(f"{line}\n" for line in kept)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _header(pins: Pins, route: Route, python: str, digest: str) -> str:
    return (
        f"# {path(route.name, python).name}: the {route.name} route's venv on Python "
        f"{python} ({pins.lock_platform}), every package with its sha256.\n"
        "# Made by `make lock` (uv pip compile --generate-hashes) from fork.toml "
        f"[toolchain] and [routes.{route.name}] and vLLM {pins.upstream_version}'s "
        f"{route.requirements}; do not edit.\n"
        f"{DIGEST_LINE}{digest}\n"
    )


def resolve(
    pins: Pins,
    requirements: str,
    python: str,
    name: str,
    exclude: tuple[str, ...] | list[str] = (),
) -> str:
    """uv pip compile of REQUIREMENTS (requirements.in text) for PYTHON on the lock
    platform, every package with its sha256, EXCLUDE left out; the lock's lines."""
    locks_dir().mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".lock-", dir=locks_dir()) as tmp:
        source, out = Path(tmp) / "requirements.in", Path(tmp) / "lock.txt"
        source.write_text(requirements)
        excludes = []
        if exclude:
            (Path(tmp) / "excludes.txt").write_text("".join(f"{n}\n" for n in exclude))
            excludes = ["--excludes", str(Path(tmp) / "excludes.txt")]
        uv.run(
            pins,
            ["pip", "compile", str(source), "--generate-hashes", "--no-header"]
            + ["--no-annotate", "--python-version", python]
            + ["--python-platform", pins.lock_platform, *excludes]
            + ["--quiet", "-o", str(out)],
            what=f"resolve {name}",
        )
        return out.read_text()


def generate(pins: Pins, tree_path: Path) -> list[Path]:
    """(Re)write every lock whose inputs changed; the others are left as they are."""
    locks_dir().mkdir(exist_ok=True)
    written = []
    for route in pins.routes.values():
        for python in pins.pythons:
            digest = inputs_digest(pins, route, python, tree_path)
            target = path(route.name, python)
            if target.is_file() and recorded_digest(target) == digest:
                log.step(f"lock: {target.name} is up to date")
                continue
            log.step(
                f"lock: resolving {target.name} (route {route.name}, Python {python})"
            )
            wanted = [*_wanted(pins, route), f"-r {tree_path / route.requirements}"]
            requirements = "".join(f"{r}\n" for r in wanted)
            body = resolve(pins, requirements, python, target.name, route.exclude)
            partial = target.with_name(f".{target.name}.partial")
            try:  # renamed whole: the lock is the old one or the new one
                partial.write_text(_header(pins, route, python, digest) + body)
                partial.replace(target)
            finally:
                partial.unlink(missing_ok=True)
            log.step(f"lock: wrote {target} ({len(pinned(target))} packages)")
            written.append(target)
    return written
