"""Release versions: packaging's, plain X.Y.Z only (as vLLM's); others refused."""

from packaging.version import InvalidVersion, Version

from forkbuild.core.errors import ForkError

Release = Version


def release(text: str, *, what: str = "version") -> Release:
    try:
        found = Version(text.strip())
    except InvalidVersion:
        found = None
    plain = found is not None and str(found) == found.base_version == text.strip()
    if not plain or found.epoch or len(found.release) != 3:
        raise ForkError(
            f"{what} {text!r} is not a release version",
            "give it as X.Y.Z, e.g. 0.26.0 (vLLM's releases on the package index)",
        )
    return found
