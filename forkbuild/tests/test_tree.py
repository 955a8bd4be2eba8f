from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from forkbuild.core.errors import ForkError
from forkbuild.setup import tree


def _git(tree_path: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=tree_path, check=True, capture_output=True, text=True
    ).stdout


def test_tree_carries_exactly_the_series(fork_pins, scratch_sdist):
    built = tree.build(fork_pins, scratch_sdist)
    subjects = _git(built, "log", "--format=%s").splitlines()
    assert subjects == [
        "fork: overlay the fork's tests",
        "kv_connector: no cross-layer KV blocks for per-token-head KV cache dtypes",
        "offloading: include per-token-head scales in the offloaded page width",
        "triton_reshape_and_cache_flash: take the DiffKV head stride from the cache",
        "offloading: clear surviving requests' transfer jobs in reset_cache",
        "triton_attn: keep per-token-head scale views in a packed layer's page",
        "v1/worker: view packed KV pages in their physical order",
        "vLLM 0.25.1 (sdist)",
    ]
    assert _git(built, "describe", "--tags", "--abbrev=0").strip() == "v0.25.1"
    # The #47054 fix is one line; patch 0002 two, 0003 one, 0004 four, 0005 ten, 0006
    # four (see their headers).
    diff = _git(built, "diff", "v0.25.1", "HEAD~6", "--", "vllm/")
    changed = [
        ln
        for ln in diff.splitlines()
        if ln[:1] in "+-" and ln[:3] not in ("+++", "---")
    ]
    assert changed == [
        "-            .view(kv_cache_shape)",
        "+            .view(permuted_kv_cache_shape)",
    ]
    for commits, stat in [
        (("HEAD~6", "HEAD~5"), "2 insertions(+), 2 deletions(-)"),
        (("HEAD~5", "HEAD~4"), "1 insertion(+)"),
        (("HEAD~4", "HEAD~3"), "4 insertions(+), 3 deletions(-)"),
        (("HEAD~3", "HEAD~2"), "10 insertions(+), 6 deletions(-)"),
        (("HEAD~2", "HEAD~1"), "4 insertions(+)"),
    ]:
        assert _git(built, "diff", "--stat", *commits).strip().endswith(stat)
    assert _git(built, "status", "--porcelain") == ""
    # Every file of the release is committed, including ones its own .gitignore matches.
    assert "vllm/vllm_flash_attn/.gitkeep" in _git(
        built, "ls-files", "vllm/vllm_flash_attn"
    )


def test_rebuild_with_same_inputs_is_a_no_op(fork_pins, scratch_sdist):
    first = tree.build(fork_pins, scratch_sdist)
    head = _git(first, "rev-parse", "HEAD")
    marker = first / ".git" / tree.INPUTS_FILE
    mtime = marker.stat().st_mtime_ns
    start = time.monotonic()
    again = tree.build(fork_pins, scratch_sdist)
    assert time.monotonic() - start < 2
    assert again == first and marker.stat().st_mtime_ns == mtime
    # Fixed commit dates: a forced rebuild from the same inputs gives the same commits.
    assert (
        _git(tree.build(fork_pins, scratch_sdist, force=True), "rev-parse", "HEAD")
        == head
    )


def _patches_copy(tmp: Path) -> Path:
    copy = tmp / "patches"
    shutil.copytree(tree.PATCHES_DIR, copy)
    return copy


def test_patch_that_does_not_apply_stops_and_leaves_no_tree(
    fork_pins, scratch_sdist, scratch
):
    patches = _patches_copy(scratch)
    (patch,) = patches.glob("0001-*.patch")
    patch.write_text(
        patch.read_text().replace(
            " kv_raw_tensor.view(-1, block_stride)", " kv_raw.view(-1)"
        )
    )
    with pytest.raises(ForkError) as err:
        tree.build(fork_pins, scratch_sdist, patches_dir=patches)
    message = str(err.value)
    assert patch.name in message and "vllm/v1/worker/gpu/attn_utils.py" in message
    assert not tree.tree_dir(fork_pins).exists()
    assert list(tree.build_dir().glob(".tree-*")) == []


def test_series_entry_without_file_is_refused(fork_pins, scratch_sdist, scratch):
    patches = _patches_copy(scratch)
    (patches / "series").write_text("0002-missing.patch\n")
    with pytest.raises(ForkError, match="0002-missing.patch"):
        tree.build(fork_pins, scratch_sdist, patches_dir=patches)


def test_interrupted_rebuild_keeps_the_previous_tree(
    fork_pins, scratch_sdist, monkeypatch
):
    good = tree.build(fork_pins, scratch_sdist)
    head = _git(good, "rev-parse", "HEAD")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tree, "overlay_tests", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tree.build(fork_pins, scratch_sdist, force=True)
    assert _git(good, "rev-parse", "HEAD") == head
    assert list(tree.build_dir().glob(".tree-*")) == []
