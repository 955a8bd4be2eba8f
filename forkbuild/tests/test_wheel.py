"""The distributable wheel: built on the official CUDA binaries, carries the fix."""

from __future__ import annotations

import zipfile

import pytest

from forkbuild import fetch, fixcheck, wheel
from forkbuild.errors import ForkError


@pytest.fixture(scope="module")
def fork_wheel(fork_pins, tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("VLLM_FORK_DIST", str(dist))
    try:
        yield wheel.build(fork_pins)
    finally:
        monkeypatch.undo()


@pytest.fixture(scope="module")
def official(fork_pins):
    return fetch.artifacts_dir() / fork_pins.routes["cuda"].wheel.filename


def test_wheel_carries_fix_and_version(fork_pins, fork_wheel, official):
    assert fork_wheel.name == official.name.replace(
        f"vllm-{fork_pins.upstream_version}-", f"vllm-{fork_pins.fork_version}-"
    )
    wheel.verify_wheel(fork_wheel, fork_pins, official)  # raises if anything is off


def test_wheel_without_fix_is_rejected(fork_pins, fork_wheel, official, tmp_path):
    doctored = tmp_path / fork_wheel.name
    with zipfile.ZipFile(fork_wheel) as src, zipfile.ZipFile(doctored, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == fixcheck.MODULE_PATH:
                data = data.replace(b".view(permuted_kv_cache_shape)", b".view(kv_cache_shape)")
            # stored, not deflated: the check reads either, and deflating ~400 MB costs ~25 s
            dst.writestr(item, data, compress_type=zipfile.ZIP_STORED)
    with pytest.raises(ForkError, match="is buggy"):
        wheel.verify_wheel(doctored, fork_pins, official)
