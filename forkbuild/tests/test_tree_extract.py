"""tree.extract_data where tarfile has no "data" filter (Python before 3.11.4, e.g.
Debian 12's 3.11.2): the same rules, applied by forkbuild. Run here on any Python, with
the filter taken away from tarfile."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from forkbuild.core.errors import ForkError
from forkbuild.setup import tree


def _archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes = b"x", mode: int = 0o644):
    """A file of someone else's (uid 4242)."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.uname = len(data), mode, "someone"
    info.uid = info.gid = 4242
    return info, data


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


@pytest.fixture
def no_data_filter(monkeypatch):
    monkeypatch.delattr(tarfile, "data_filter", raising=False)


def test_plain_files_are_unpacked_as_data(no_data_filter, tmp_path):
    members = [
        _file("pkg/run.sh", b"#!/bin/sh\n", 0o4755),
        _file("pkg/data.txt", b"data", 0o666),
    ]
    with tarfile.open(_archive(tmp_path / "a.tar", members)) as tar:
        tree.extract_data(tar, tmp_path / "out")
    run, data = (
        tmp_path / "out" / "pkg" / "run.sh",
        tmp_path / "out" / "pkg" / "data.txt",
    )
    assert data.read_bytes() == b"data"
    assert run.stat().st_mode & 0o7777 == 0o755  # set-id bit gone, still executable
    assert data.stat().st_mode & 0o7777 == 0o644  # no group or world write
    assert run.stat().st_uid == os.getuid()  # not the archive's uid, even as root


@pytest.mark.parametrize(
    ("members", "error"),
    [
        ([_file("../evil")], "would land outside"),
        ([_file("/tmp/evil")], "would land outside"),
        ([_link("inside", "..")], "is a link"),
        ([_link("hard", "pkg/x", tarfile.LNKTYPE)], "is a link"),
        # a link made by an earlier member would carry a later one out of DEST
        ([_link("s1", "."), _link("s1/s2", ".."), _file("s2/evil")], "is a link"),
    ],
    ids=["dot-dot", "absolute", "symlink", "hard link", "link chain"],
)
def test_what_could_leave_the_folder_is_refused_before_anything_is_written(
    no_data_filter, tmp_path, members, error
):
    archive = _archive(tmp_path / "a.tar", members)
    out = tmp_path / "out"
    out.mkdir()
    with tarfile.open(archive) as tar, pytest.raises(ForkError, match=error):
        tree.extract_data(tar, out)
    assert not any(out.iterdir())
    assert not (tmp_path / "evil").exists()


def test_the_pinned_sdist_holds_no_link(real_sdist):
    """Why refusing links costs nothing: vLLM's sdist has none."""
    with tarfile.open(real_sdist) as tar:
        assert not [m.name for m in tar.getmembers() if m.issym() or m.islnk()]
