import io
import os
import time

import pytest
from rich.console import Console

from forkbuild.core.errors import ForkError
from forkbuild.setup import fetch, progress


@pytest.fixture(autouse=True)
def _no_download(monkeypatch):
    def download(*args, **kwargs):
        raise AssertionError("fetch went to the network for a cached artifact")

    monkeypatch.setattr(fetch, "run_pip", download)


def _no_pip():
    raise AssertionError("fetch asked for a pip (an environment) for a cached artifact")


def test_cached_artifact_is_verified_not_downloaded(fork_pins, scratch_sdist):
    assert fetch.fetch(fork_pins.sdist, _no_pip) == scratch_sdist


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[:1000] + bytes([d[1000] ^ 0xFF]) + d[1001:],
        lambda d: d[: len(d) // 2],
    ],
    ids=["tampered", "truncated"],
)
def test_bad_artifact_is_deleted_and_refused(fork_pins, scratch_sdist, damage):
    scratch_sdist.write_bytes(damage(scratch_sdist.read_bytes()))
    said = f"sha256 mismatch for {fork_pins.sdist.filename}"
    with pytest.raises(ForkError, match=said) as err:
        fetch.fetch(fork_pins.sdist, _no_pip)
    assert "\n" not in str(err.value)
    assert not scratch_sdist.exists()


def test_unwritable_cache_is_refused_naming_it(fork_pins, tmp_path, monkeypatch):
    """One line naming VLLM_FORK_CACHE before pip runs (it was a traceback)."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("VLLM_FORK_CACHE", str(tmp_path / "a-file" / "cache"))
    said = f"cannot write in .*, which downloading {fork_pins.sdist.filename} needs"
    with pytest.raises(ForkError, match=said) as err:
        fetch.fetch(fork_pins.sdist, _no_pip)
    assert "VLLM_FORK_CACHE" in err.value.hint and "\n" not in str(err.value)


def test_a_download_on_a_terminal_shows_its_bytes_done(tmp_path):
    """rich's bar counts what the download has written so far; a log gets none."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with progress.bytes_in(tmp_path, "file.whl", console) as shown:
        (tmp_path / "pip-tmp").mkdir()
        (tmp_path / "pip-tmp" / "part").write_bytes(b"x" * 3_000_000)
        time.sleep(0.5)
    assert shown and "file.whl" in out.getvalue() and "3.0/? MB" in out.getvalue()
    with progress.bytes_in(tmp_path, "file.whl", Console(file=io.StringIO())) as shown:
        assert not shown


def test_a_live_download_is_left_alone_and_a_dead_ones_removed(scratch, fork_pins):
    """make test fetches in two threads: the second must leave the first's download."""
    artifacts = fetch.artifacts_dir()
    live = artifacts / f".download-{os.getpid()}-abc"
    dead = artifacts / ".download-999999999-abc"  # beyond pid_max: no such process
    old = artifacts / ".download-abc"  # the earlier name, without an owner
    for folder in (live, dead, old):
        (folder / "pip-tmp").mkdir(parents=True)
    (old / fork_pins.sdist.filename).write_bytes(b"partial")  # an interrupted fetch's
    fetch.clean_partial_downloads()
    assert live.is_dir() and not dead.exists() and not old.exists()
