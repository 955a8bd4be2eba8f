"""The backport audit (docs/backport-audit.md) sorts every change 0.26.0 made to the files
the #47054 configuration runs: every audited file that differs between the fork's sdist and
0.26.0's has a row in the audit's file table, so a rebase cannot take a change unsorted.
The check is forkbuild.rebase.unsorted_files, shown to fail on a broken copy."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from forkbuild import fetch, install, pins, rebase
from forkbuild.errors import ForkError


def _pip() -> Path:
    if not install.venv_python().exists():
        pytest.skip("the sdist is not cached and there is no toolchain venv to fetch it: run `make matrix`")
    return install.venv_python()


def _sdist(artifact: pins.Artifact) -> Path:
    try:
        return fetch.fetch(artifact, _pip, quiet=True)
    except ForkError as exc:
        pytest.skip(f"{artifact.filename} is not cached and cannot be fetched: {exc}")


@pytest.fixture(scope="module")
def sdists(fork_pins: pins.Pins) -> tuple[Path, Path]:
    return _sdist(fork_pins.sdist), _sdist(fork_pins.release(rebase.AUDIT_RELEASE).sdist)


def test_every_changed_audited_file_has_a_row_in_the_audit(sdists):
    audited = rebase.audited_set()
    assert "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py" in audited
    assert "vllm/v1/worker/gpu/attn_utils.py" in audited
    assert "vllm/v1/attention/backends/flash_attn.py" in audited  # the GPU path, added
    assert rebase.unsorted_files(*sdists, audited, rebase.AUDIT_DOC.read_text()) == []


def test_the_file_table_names_only_audited_files():
    assert rebase.audit_table_files(rebase.AUDIT_DOC.read_text()) == set(rebase.audited_set())


def _sdist_of(path: Path, top: str, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_changed_file_without_a_row_is_reported(tmp_path):
    old = _sdist_of(tmp_path / "old.tar.gz", "vllm-1.0.0", {
        "vllm/a.py": "a = 1\n", "vllm/b.py": "b = 1\n", "vllm/same.py": "s = 1\n", "vllm/gone.py": "g\n",
    })
    new = _sdist_of(tmp_path / "new.tar.gz", "vllm-1.1.0", {
        "vllm/a.py": "a = 2\n", "vllm/b.py": "b = 2\n", "vllm/same.py": "s = 1\n",
    })
    audited = ["vllm/a.py", "vllm/b.py", "vllm/same.py", "vllm/gone.py"]
    assert rebase.differing_files(old, new, audited) == ["vllm/a.py", "vllm/b.py", "vllm/gone.py"]
    doc = "| file | hunks |\n| --- | --- |\n| `vllm/a.py` | 1 |\n| a.py | 1 |\nsee `vllm/b.py`\n"
    # b.py is only mentioned in prose and gone.py nowhere: both are unsorted.
    assert rebase.unsorted_files(old, new, audited, doc) == ["vllm/b.py", "vllm/gone.py"]
    assert rebase.unsorted_files(old, new, audited, doc + "| `vllm/b.py` | 1 |\n| `vllm/gone.py` | 1 |\n") == []


def test_the_audited_set_is_read_from_its_section(tmp_path):
    listing = tmp_path / "files.txt"
    listing.write_text(
        "# header\n[audited]  # comment\nvllm/a.py\n\nvllm/b.py  # why\n[added]\nvllm/b.py  # why\n"
        "[excluded]\nvllm/c.py\n"
    )
    assert rebase.audited_set(listing) == ["vllm/a.py", "vllm/b.py"]
