"""Bytecode kept between venvs and trees (docs/setup-and-locks.md#bytecode): safe, as a
.pyc records its source's mtime and size and Python renames a new one over an old."""

import os
import shutil
import sys
from pathlib import Path

from forkbuild.core import log
from forkbuild.core.hashing import digest_of
from forkbuild.core.pins import cache_dir


def store(kind: str, *sources: str | bytes) -> Path:
    """The cache folder of KIND's ("venv", "tree") bytecode from SOURCES, per Python."""
    return cache_dir() / "bytecode" / f"{kind}-{digest_of([sys.version, *sources])}"


def restore(root: Path, kept: Path) -> int:
    """Link KEPT's bytecode into ROOT's source folders lacking it; return how many."""
    return _link_missing(kept, root, f"linked into {root}", by_sources=True)


def keep(root: Path, kept: Path) -> int:
    """Link into KEPT the bytecode under ROOT that KEPT lacks; return how many files."""
    return _link_missing(root, kept, f"kept in {kept}")


def _link_missing(src: Path, dst: Path, what: str, by_sources: bool = False) -> int:
    """Link SRC's .pyc files DST lacks (BY_SOURCES: where DST has the source folder)."""
    linked, failed = 0, []
    for pyc in src.glob("**/__pycache__/*.pyc"):
        dest = dst / pyc.relative_to(src)
        if dest.exists() or (by_sources and not dest.parent.parent.is_dir()):
            continue
        partial = dest.with_name(f"{dest.name}.{os.getpid()}.partial")
        try:  # a hard link, else a copy, renamed into place
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(pyc, partial)
            except OSError:
                shutil.copy2(pyc, partial)
            os.replace(partial, dest)
            linked += 1
        except OSError as exc:
            partial.unlink(missing_ok=True)
            failed.append(exc)
    if failed:
        log.step(
            f"bytecode: {len(failed)} file(s) could not be {what} ({failed[0]}); "
            "Python compiles them instead"
        )
    return linked
