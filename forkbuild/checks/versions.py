"""Release versions as forkbuild compares them, on the standard library alone.

forkbuild runs on the user's python3 before its venv exists, where `packaging` may be
missing. vLLM's releases (and the fork's pins) are plain X.Y.Z; anything else is refused
with a clear message rather than guessed at.
"""

from __future__ import annotations

import re

from forkbuild.core.errors import ForkError

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


class Release(tuple):
    """(major, minor, micro) of an X.Y.Z release; prints as X.Y.Z."""

    def __str__(self) -> str:
        return ".".join(map(str, self))


def release(text: str, *, what: str = "version") -> Release:
    found = _RELEASE.match(text.strip())
    if not found:
        raise ForkError(
            f"{what} {text!r} is not a release version",
            "give it as X.Y.Z, e.g. 0.26.0 (vLLM's releases on the package index)",
        )
    return Release(int(g) for g in found.groups())
