"""Release versions: plain X.Y.Z (as vLLM's), packaging's Version; others refused."""

import re

from packaging.version import Version

from forkbuild.core.errors import ForkError

Release = Version
PLAIN = re.compile(r"(0|[1-9]\d*)(\.(0|[1-9]\d*)){2}")  # no leading zeros, as printed


def release(text: str, *, what: str = "version") -> Release:
    if not PLAIN.fullmatch(text.strip()):
        raise ForkError(
            f"{what} {text!r} is not a release version",
            "give it as X.Y.Z, e.g. 0.26.0 (vLLM's releases on the package index)",
        )
    return Version(text.strip())
