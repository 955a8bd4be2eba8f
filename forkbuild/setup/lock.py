"""`forkbuild lock`: the hash-locked environments (docs/setup-and-locks.md#the-locks),
each with a digest of its inputs: an install refuses a lock whose inputs changed."""

import importlib.metadata
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name as normalize

from forkbuild.core import log
from forkbuild.core.errors import ForkError
from forkbuild.core.hashing import digest_of
from forkbuild.core.pins import Pins, Route, locks_dir
from forkbuild.setup import bootstrap, uv

FORMAT, DIGEST_LINE = bootstrap.FORMAT, bootstrap.DIGEST_LINE
recorded_digest = bootstrap.recorded_digest
running_python = bootstrap.running_python


def path(route: str, python: str) -> Path:
    if route == "tools":
        return bootstrap.tools_lock(python)
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
            words = line.split()
            if len(words) == 2 and words[0] in ("-r", "--requirement"):
                todo.append(current.parent / words[1])
    return files


def inputs_digest(pins: Pins, route: Route, python: str, tree_path: Path) -> str:
    """The digest of what the lock of ROUTE for PYTHON is made from."""
    files = _requirement_files(tree_path, route.requirements)
    return digest_of(
        [FORMAT, route.name, python, pins.lock_platform, *pins.toolchain, *route.extra]
        + [f"exclude {name}" for name in route.exclude]
        + [f"{f.relative_to(tree_path)}\n".encode() + f.read_bytes() for f in files]
    )


class _Lock(NamedTuple):
    target: Path
    digest: str  # of its inputs
    wanted: list[str]  # its requirements.in
    what: str  # what it is
    source: str  # what of fork.toml (and vLLM) it is made from
    python: str
    exclude: tuple[str, ...] = ()


def _locks(pins: Pins, tree_path: Path) -> list[_Lock]:
    """Every lock fork.toml asks for."""
    made, tools = [], ("forkbuild's tool environment", "[toolchain] forkbuild")
    for py in pins.pythons:
        digest = bootstrap.tools_digest(pins, py)
        made.append(_Lock(path("tools", py), digest, [*pins.forkbuild], *tools, py))
        for r in pins.routes.values():
            wanted = [*pins.toolchain, *r.extra, f"-r {tree_path / r.requirements}"]
            digest = inputs_digest(pins, r, py, tree_path)
            what = f"the {r.name} route's venv"
            source = f"[toolchain] and [routes.{r.name}] and vLLM "
            source += f"{pins.upstream_version}'s {r.requirements}"
            lock = _Lock(path(r.name, py), digest, wanted, what, source, py, r.exclude)
            made.append(lock)
    return made


def stale(pins: Pins, tree_path: Path) -> list[str]:
    """Every lock that is missing or was made from other inputs than today's."""
    wrong = []
    for lock_file, digest, *_ in _locks(pins, tree_path):
        if not lock_file.is_file():
            wrong.append(f"{lock_file.name} (missing)")
        elif recorded_digest(lock_file) != digest:
            wrong.append(f"{lock_file.name} (its inputs changed)")
    return wrong


def check(pins: Pins, tree_path: Path) -> None:
    if wrong := stale(pins, tree_path):
        raise ForkError(
            "the locks no longer match the requirements they were made from: "
            f"{', '.join(wrong)}",
            "run `make lock` (needs the package index) and commit locks/",
        )


def _pin(line: str) -> Requirement | None:
    """The `name==version` requirement a lock or freeze line starts, else None."""
    if not line or line[0] in " \t#-":
        return None
    try:
        requirement = Requirement(line.rstrip(" \\"))
    except InvalidRequirement:
        return None
    versions = [s.version for s in requirement.specifier if s.operator == "=="]
    return requirement if len(versions) == 1 else None


def pinned(lock_file: Path) -> dict[str, str]:
    """name -> version of every package a lock (or freeze) pins (PEP 503 names)."""
    found = filter(None, map(_pin, lock_file.read_text().splitlines()))
    return {normalize(r.name): next(iter(r.specifier)).version for r in found}


def entries(lock_file: Path, names: set[str]) -> str:
    """The pin and --hash lines of NAMES: for `uv pip install --require-hashes`."""
    kept, keep = [], False
    for line in lock_file.read_text().splitlines():
        if requirement := _pin(line):
            keep = normalize(requirement.name) in names
        elif not line.startswith((" ", "\t")):
            keep = False
        if keep:
            kept.append(line)
    return "".join(f"{line}\n" for line in kept)


def resolve(
    pins: Pins,
    requirements: str,
    python: str,
    name: str,
    exclude: tuple[str, ...] | list[str] = (),
    previous: str = "",
) -> str:
    """Lock lines for REQUIREMENTS on PYTHON, less EXCLUDE, keeping PREVIOUS's pins."""
    locks_dir().mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".lock-", dir=locks_dir()) as tmp:
        source, out = Path(tmp) / "requirements.in", Path(tmp) / "lock.txt"
        source.write_text(requirements)
        out.write_text(previous)  # uv keeps the output file's pins where it can
        excludes = []
        if exclude:
            (Path(tmp) / "excludes.txt").write_text("".join(f"{n}\n" for n in exclude))
            excludes = ["--excludes", str(Path(tmp) / "excludes.txt")]
        compile_ = ["pip", "compile", str(source), "--generate-hashes", "--no-header"]
        compile_ += ["--no-annotate", "--python-version", python, "--quiet"]
        compile_ += ["--python-platform", pins.lock_platform, *excludes, "-o", str(out)]
        uv.run(pins, compile_, what=f"resolve {name}")
        return out.read_text()


def generate(pins: Pins, tree_path: Path) -> list[Path]:
    """(Re)write every lock whose inputs changed; the others are left as they are."""
    written = []
    for made in _locks(pins, tree_path):
        target = made.target
        if target.is_file() and recorded_digest(target) == made.digest:
            log.step(f"lock: {target.name} is up to date")
            continue
        log.step(f"lock: resolving {target.name} (Python {made.python})")
        wanted = "".join(f"{r}\n" for r in made.wanted)
        old = target.read_text() if target.is_file() else ""
        body = resolve(pins, wanted, made.python, target.name, made.exclude, old)
        header = (
            f"# {target.name}: {made.what} on Python {made.python} "
            f"({pins.lock_platform}), every package with its sha256.\n"
            "# Made by `make lock` (uv pip compile --generate-hashes) from fork.toml "
            f"{made.source}; do not edit.\n{DIGEST_LINE}{made.digest}\n"
        )
        partial = target.with_name(f".{target.name}.partial")
        try:  # renamed whole: the lock is the old one or the new one
            partial.write_text(header + body)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        log.step(f"lock: wrote {target} ({len(pinned(target))} packages)")
        written.append(target)
    return written


def verify_installed(lock_file: Path) -> None:
    """This environment holds exactly what LOCK_FILE pins (the bootstrap asks it)."""
    dists = importlib.metadata.distributions()
    have = {normalize(d.metadata["Name"]): d.version for d in dists}
    want = pinned(lock_file)
    if have != want:
        diff = sorted(set(have.items()) ^ set(want.items()))
        raise ForkError(
            f"{sys.prefix} differs from {lock_file.name} in {len(diff)} package(s), "
            f"e.g. {'=='.join(diff[0])}"
        )


if __name__ == "__main__":  # python -m forkbuild.setup.lock --verify LOCK
    try:
        verify_installed(Path(sys.argv[2]))
    except ForkError as exc:
        sys.exit(str(exc))
