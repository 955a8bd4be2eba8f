"""fixcheck and preflight: the verdicts and refusals every other step relies on."""

from __future__ import annotations

import dataclasses
import socket
import tarfile

import pytest

from forkbuild.core import fixcheck, pins, preflight
from forkbuild.core.errors import ForkError


@pytest.fixture(scope="module")
def released_source(real_sdist, fork_pins) -> str:
    inner = f"vllm-{fork_pins.upstream_version}/{fixcheck.MODULE_PATH}"
    with tarfile.open(real_sdist) as tar:
        return tar.extractfile(inner).read().decode()


def test_fixcheck_tells_released_from_fixed(released_source):
    assert fixcheck.classify(released_source) == "buggy"
    fixed = released_source.replace(
        ".view(kv_cache_shape)", ".view(permuted_kv_cache_shape)"
    )
    assert fixcheck.classify(fixed) == "fixed"
    # Reformatting does not fool it; code that no longer has the branch is "unknown".
    noted = fixed.replace(".view(dtype)\n", ".view(dtype)  # note\n")
    assert fixcheck.classify(noted) == "fixed"
    for gone in ("def _reshape_attention_kv_cache():\n    pass\n", "not python ("):
        assert fixcheck.classify(gone) == "unknown"


def test_unsupported_python_and_machine_are_refused(fork_pins):
    with pytest.raises(ForkError, match="is not supported: the fork locks Python 2.7"):
        preflight.check_python(dataclasses.replace(fork_pins, pythons=("2.7",)))
    with pytest.raises(ForkError, match="machine .* is not supported"):
        preflight.check_machine(dataclasses.replace(fork_pins, machines=("riscv64",)))


def test_no_space_is_refused_before_work(tmp_path, monkeypatch):
    with pytest.raises(ForkError, match="GiB free under"):
        preflight.check_disk(tmp_path, 10**9, "the test")
    # The advice names the variable that moves the folder that is short of space.
    monkeypatch.setenv("VLLM_FORK_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ForkError) as err:
        preflight.check_disk(tmp_path / "cache" / "uv-cache", 10**9, "uv's downloads")
    assert "set VLLM_FORK_CACHE to a folder on a disk with room" in err.value.hint


@pytest.mark.parametrize("variable", ["VLLM_FORK_CACHE", "VLLM_FORK_BUILD"])
def test_unwritable_cache_or_build_is_refused_with_its_variable(
    tmp_path, monkeypatch, variable
):
    """A folder below a file (read-only: test_uv_cache.py): a line, not a traceback."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(variable, str(tmp_path / "a-file" / "folder"))
    cache = variable == "VLLM_FORK_CACHE"
    folder = pins.cache_dir() / "artifacts" if cache else pins.build_dir()
    refused = r"cannot write in .*a-file/folder.* \(Not a directory\)"
    with pytest.raises(ForkError, match=refused) as err:
        preflight.check_disk(folder, 1, "the test")
    assert err.value.hint == f"make it writable, or set {variable} to a writable folder"


def test_port_in_use_is_refused(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        in_use = f"port {port} on 127.0.0.1 is already in use"
        with pytest.raises(ForkError, match=in_use) as err:
            preflight.check_port_free("127.0.0.1", port)
        assert "pass --port N" in err.value.hint
        # Through `make serve` (the Makefile names its variable) the advice is PORT=N.
        monkeypatch.setenv("FORKBUILD_PORT_OPTION", "PORT=N (make serve PORT=8001)")
        with pytest.raises(ForkError) as err:
            preflight.check_port_free("127.0.0.1", port)
        assert "pass PORT=N" in err.value.hint
