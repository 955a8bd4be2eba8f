"""Step 1: the pinned upstream artifacts, downloaded by name with pip into
<cache>/artifacts only once their sha256 matched: an interrupted or tampered download
never looks like a good one."""

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from forkbuild.core import log, preflight
from forkbuild.core.errors import ForkError
from forkbuild.core.hashing import sha256_file
from forkbuild.core.pins import Artifact, cache_dir
from forkbuild.setup.pip_runner import run_pip


def artifacts_dir() -> Path:
    return cache_dir() / "artifacts"


def verify(path: Path, artifact: Artifact) -> None:
    """Check a file against its pin; a mismatching file is deleted, never kept."""
    actual = sha256_file(path)
    if actual != artifact.sha256:
        path.unlink(missing_ok=True)
        raise ForkError(
            f"sha256 mismatch for {artifact.filename}: got {actual}, fork.toml pins "
            f"{artifact.sha256}; the file was deleted",
            "run again to download it afresh; if it mismatches again, do not change "
            "the pin without checking the upstream release",
        )


PipCommand = Path | str | Sequence[str]


def fetch(
    artifact: Artifact, pip: Callable[[], PipCommand], *, quiet: bool = False
) -> Path:
    """ARTIFACT's verified path; PIP() only to download (the sdist's: the venv's)."""
    clean_partial_downloads()
    target = artifacts_dir() / artifact.filename
    if target.exists():
        verify(target, artifact)
        log.step(f"fetch: {artifact.filename} already cached and verified")
        return target
    # 1 GiB: the largest file, the CUDA wheel, is 239 MiB; refuses an unwritable cache.
    preflight.check_disk(artifacts_dir(), 1, f"downloading {artifact.filename}")
    log.step(f"fetch: downloading {artifact.requirement} with pip")
    # The owner's pid in the name: a concurrent fetch (make test fetches in two
    # threads, CI jobs share a cache) leaves a live download alone.
    owned = f".download-{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=owned, dir=artifacts_dir()) as tmp:
        _download(artifact, pip(), Path(tmp), quiet)
        got = Path(tmp) / artifact.filename
        if not got.exists():
            files = sorted(p.name for p in Path(tmp).iterdir() if p.is_file())
            raise ForkError(
                f"pip saved {', '.join(files) or 'nothing'}, not the pinned {got.name}",
                "the index serves other files for this requirement; check fork.toml",
            )
        verify(got, artifact)
        os.replace(got, target)
    log.step(f"fetch: {artifact.filename} verified ({target.stat().st_size >> 20} MiB)")
    return target


def _download(artifact: Artifact, pip: PipCommand, into: Path, quiet: bool) -> None:
    args = ["download", "--no-deps", "--progress-bar", "off", "-d", str(into)]
    if artifact.filename.endswith(".whl"):
        args += ["--only-binary", ":all:"]
    else:
        name = artifact.requirement.split("==")[0]
        args += ["--no-binary", name, "--no-build-isolation"]
    args.append(artifact.requirement)
    what = f"download {artifact.requirement}"
    if quiet:  # uv's own wheel, for the bootstrap: the standard library alone
        run_pip(pip, args, what=what, quiet=True)
        return
    from forkbuild.setup import progress  # rich: in the tool environment only

    # pip writes its partial download in TMPDIR: there, the bar sees it grow.
    (into / "pip-tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(into / "pip-tmp")}
    with progress.bytes_in(into, artifact.requirement) as shown:
        run_pip(pip, args, what=what, env=env, quiet=shown)


def clean_partial_downloads() -> None:
    """Remove the temporary folders of interrupted fetches, never one still running."""
    for stale in artifacts_dir().glob(".download-*"):
        pid = stale.name.split("-")[1]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
