"""The patched tree: the release, the series and the overlay, nothing else; the same
inputs give the same commits; a stopped or failed build leaves no tree (Ctrl-C beside
the venv included); the sdist unpacked as data where tarfile has no "data" filter."""

import dataclasses
import io
import os
import shutil
import subprocess
import tarfile
import threading
import time
from pathlib import Path
from unittest.mock import Mock

import pytest

from forkbuild.checks import generate
from forkbuild.core import log
from forkbuild.core.errors import ForkError
from forkbuild.setup import install, tree


def _git(tree_path: Path, *args: str) -> str:
    return subprocess.check_output(["git", *args], cwd=tree_path, text=True)


def check_tree_carries(built: Path, pins, patches_dir: Path = tree.PATCHES_DIR) -> None:
    """The release, a commit per mail (subject, numstat), the overlay; nothing else."""
    facts = generate.series(patches_dir)
    version = pins.upstream_version
    subjects = _git(built, "log", "--format=%s").splitlines()
    assert subjects == [
        "fork: overlay the fork's tests",
        *(patch.subject for patch in reversed(facts)),
        f"vLLM {version} (sdist)",
    ]
    assert _git(built, "describe", "--tags", "--abbrev=0").strip() == f"v{version}"
    for k, patch in enumerate(facts):  # patch k is HEAD~(n-k), under the overlay
        commits = f"HEAD~{len(facts) - k + 1}", f"HEAD~{len(facts) - k}"
        numstat = _git(built, "diff", "--numstat", *commits).splitlines()
        assert [tuple(line.split("\t")) for line in numstat] == [
            (str(a), str(r), f) for a, r, f in patch.numstat
        ], patch.name
    # The #47054 fix is one line: the first patch's commit.
    diff = _git(built, "diff", f"v{version}", f"HEAD~{len(facts)}", "--", "vllm/")
    lines = diff.splitlines()
    assert [ln for ln in lines if ln[:1] in "+-" and ln[:3] not in ("+++", "---")] == [
        "-            .view(kv_cache_shape)",
        "+            .view(permuted_kv_cache_shape)",
    ]
    assert _git(built, "status", "--porcelain") == ""


def test_tree_carries_exactly_the_series_is_kept_and_a_stopped_build_leaves_none(
    fork_pins, scratch_sdist, monkeypatch
):
    stop = threading.Event()
    stop.set()
    with pytest.raises(KeyboardInterrupt):
        tree.build(fork_pins, scratch_sdist, stop=stop)
    assert not tree.tree_dir(fork_pins).exists()
    first = tree.build(fork_pins, scratch_sdist)  # and it removes what the first left
    assert first == tree.tree_dir(fork_pins) and not list(first.parent.glob(".tree-*"))
    check_tree_carries(first, fork_pins)
    # Every file of the release is committed, including ones its own .gitignore matches.
    files = _git(first, "ls-files", "vllm/vllm_flash_attn")
    assert "vllm/vllm_flash_attn/.gitkeep" in files
    # Why extract_data may refuse links without the data filter: the sdist has none.
    with tarfile.open(scratch_sdist) as tar:
        assert not [m.name for m in tar.getmembers() if m.issym() or m.islnk()]
    head = _git(first, "rev-parse", "HEAD")
    marker = first / ".git" / tree.INPUTS_FILE
    mtime = marker.stat().st_mtime_ns  # the marker is there
    start = time.monotonic()
    again = tree.build(fork_pins, scratch_sdist)
    assert time.monotonic() - start < 2
    assert again == first and marker.stat().st_mtime_ns == mtime
    # Fixed commit dates: a forced rebuild from the same inputs gives the same commits.
    forced = tree.build(fork_pins, scratch_sdist, force=True)
    assert _git(forced, "rev-parse", "HEAD") == head
    # A stopped rebuild leaves the previous tree.
    monkeypatch.setattr(tree, "overlay_tests", Mock(side_effect=KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        tree.build(fork_pins, scratch_sdist, force=True)
    assert _git(first, "rev-parse", "HEAD") == head
    assert list(tree.build_dir().glob(".tree-*")) == []


# A patch the series does not have: a new file, so that it applies on any release.
THROWAWAY = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: "vLLM fork" <fork-maintainers@example.invalid>
Date: Thu, 3 Dec 2026 00:00:00 +0000
Subject: [PATCH] fork: a throwaway patch of the tool tests

Origin: vendor
Forwarded: not-needed
---
diff --git a/vllm/fork_throwaway.py b/vllm/fork_throwaway.py
new file mode 100644
--- /dev/null
+++ b/vllm/fork_throwaway.py
@@ -0,0 +1,2 @@
+# added by forkbuild/tests/test_tree.py
+THROWAWAY = True
"""


def test_adding_a_patch_is_its_mail_its_series_line_and_its_modules(
    fork_pins, scratch_sdist, patches
):
    """Issue 35: a patch, its series line and its modules; the rest follows."""
    number = f"{len(tree.read_series(patches)) + 1:04d}"  # after the fork's own
    name = f"{number}-fork-a-throwaway-patch-of-the-tool-tests.patch"
    (patches / name).write_text(THROWAWAY)
    with (patches / "series").open("a") as series:
        series.write(f"{name}\n")
    modules = {name: ("tests/v1/worker/test_fork_throwaway.py",)}
    by_patch = fork_pins.regression_by_patch | modules
    pins = dataclasses.replace(fork_pins, regression_by_patch=by_patch)
    built = tree.build(pins, scratch_sdist, patches_dir=patches)
    check_tree_carries(built, pins, patches)
    row = generate.patch_table(pins, patches).splitlines()[-1]
    assert row.startswith(
        f"| [`{number}`](../patches/{name}) | fork: a throwaway patch"
    )
    assert "`vllm/fork_throwaway.py` +2 -0 | vendor |" in row
    assert row.endswith("| not applied upstream | `test_fork_throwaway.py` |")
    assert name not in generate.patch_table(fork_pins)  # the repository's


@pytest.fixture
def patches(scratch: Path) -> Path:
    """A copy of the fork's patches/ to change."""
    return shutil.copytree(tree.PATCHES_DIR, scratch / "patches")


def test_a_failing_or_missing_patch_leaves_no_tree(fork_pins, scratch_sdist, patches):
    (patch,) = patches.glob("0001-*.patch")
    old, new = " kv_raw_tensor.view(-1, block_stride)", " kv_raw.view(-1)"
    patch.write_text(patch.read_text().replace(old, new))
    with pytest.raises(ForkError) as err:
        tree.build(fork_pins, scratch_sdist, patches_dir=patches)
    message = str(err.value)
    assert patch.name in message and "vllm/v1/worker/gpu/attn_utils.py" in message
    assert not tree.tree_dir(fork_pins).exists()
    assert list(tree.build_dir().glob(".tree-*")) == []
    (patches / "series").write_text("0002-missing.patch\n")  # a line naming no file
    with pytest.raises(ForkError, match="0002-missing.patch"):
        tree.build(fork_pins, scratch_sdist, patches_dir=patches)


# --- tree.extract_data without tarfile's "data" filter (Python before 3.11.4, e.g.
# Debian 12's 3.11.2): the same rules, applied by forkbuild; run here on any Python.
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
    run, data = (tmp_path / "out" / "pkg" / name for name in ("run.sh", "data.txt"))
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


@pytest.mark.parametrize("after", [0.3, 1.5, 3.0])
def test_ctrl_c_beside_the_venv_does_not_wait_for_the_tree(
    fork_pins, scratch_sdist, monkeypatch, after
):
    """Ctrl-C in the venv's step: no wait for the tree thread (8 s+), and no tree."""
    started, raised_at, finished_before = threading.Event(), [], []
    unpacking = lambda msg: started.set() if msg.startswith("tree: unpacking") else None
    monkeypatch.setattr(log, "step", unpacking)

    def interrupted_venv(pins, route_name=None, without_gpu=False):
        assert started.wait(30)
        time.sleep(after)
        raised_at.append(time.monotonic())
        finished_before.append(tree.tree_dir(fork_pins).exists())
        raise KeyboardInterrupt

    monkeypatch.setattr(install, "ensure_toolchain", interrupted_venv)
    with pytest.raises(KeyboardInterrupt):
        install._venv_beside_tree(fork_pins, fork_pins.routes["cpu"])
    # The tree stops at its next file or git command (a second when idle, seconds beside
    # CI's other suites); no tree in place shows it was stopped, not waited for.
    assert time.monotonic() - raised_at[0] < 10.0
    # (a machine that made the whole tree before the interrupt keeps it, whole)
    assert finished_before[0] or not tree.tree_dir(fork_pins).exists()
