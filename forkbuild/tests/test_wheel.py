"""The distributable wheel carries the fix, and the official one's files but for what
the patch series changes."""

import re
import zipfile
from pathlib import Path

import pytest

from forkbuild.core import fixcheck, pins
from forkbuild.core.errors import ForkError
from forkbuild.setup import fetch, tree, wheel
from forkbuild.setup.load_extensions import record_digest

# Package data that setup.py's package_data globs do not name: it reaches vLLM's wheel
# only through include_package_data and setuptools-scm's list of git-tracked files.
PACKAGE_DATA = [
    "vllm/transformers_utils/chat_templates/template_chatml.jinja",
    "vllm/utils/numa_wrapper.sh",
    "vllm/model_executor/layers/mamba/ops/configs/selective_state_update/"
    "headdim=64,dstate=128,device_name=NVIDIA_H200,cache_dtype=float16.json",
    "vllm/kernels/helion/configs/silu_mul_fp8/nvidia_h100.json",
    "vllm/v1/worker/gpu/README.md",
]


def test_the_wheel_is_the_fixed_official_one(fork_pins, tmp_path, monkeypatch):
    """The fix, the version and the package data; the official files but the series'."""
    monkeypatch.setenv("VLLM_FORK_DIST", str(tmp_path))
    fork_wheel = wheel.build(fork_pins)
    official = fetch.artifacts_dir() / fork_pins.routes["cuda"].wheel.filename
    versions = f"vllm-{fork_pins.upstream_version}-", f"vllm-{fork_pins.fork_version}-"
    assert fork_wheel.name == official.name.replace(*versions)
    result = wheel.verify_wheel(fork_wheel, fork_pins, official)  # raises if it is off
    with zipfile.ZipFile(fork_wheel) as whl:
        names = set(whl.namelist())
    assert not [n for n in PACKAGE_DATA if n not in names]
    assert not [n for n in names if n.startswith("tests/")]  # the fork's tests stay out
    assert (result.missing, result.differing, result.extra) == ([], [], [])
    patched = wheel.patched_paths(tree.read_series())
    assert result.patched == sorted([*tree.GENERATED, *patched])
    assert result.compared > 4000


# --- the comparison, on small made-up wheels ------------------------------------------

VERSION, FORK_VERSION = pins.load().upstream_version, pins.load().fork_version
OFFICIAL = f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
FIXED_SOURCE = b"""\
def _reshape_attention_kv_cache(kv_cache, packing):
    if packing is not None:
        return kv_cache.view(permuted_kv_cache_shape)
"""
BUGGY_SOURCE = FIXED_SOURCE.replace(b"(permuted_kv_cache_shape)", b"(kv_cache_shape)")
BASE = {
    fixcheck.MODULE_PATH: FIXED_SOURCE,
    "vllm/__init__.py": b"",
    "vllm/_version.py": f"__version__ = '{VERSION}'\n".encode(),
    "vllm/patched.py": b"upstream\n",
    "vllm/transformers_utils/chat_templates/template_chatml.jinja": b"{{ messages }}\n",
    "vllm/utils/numa_wrapper.sh": b"#!/bin/sh\n",
}


def make_wheel(
    folder: Path,
    version: str,
    files: dict[str, bytes],
    *,
    lie: dict[str, bytes] | None = None,
    requires: tuple[str, ...] = ("torch==2.11.0",),
) -> Path:
    """vllm-VERSION's wheel of FILES; LIE: RECORD's bytes; REQUIRES: its deps."""
    info = f"vllm-{version}.dist-info"
    needs = "".join(f"Requires-Dist: {r}\n" for r in requires)
    metadata = f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n{needs}\n"
    files = {**files, f"{info}/METADATA": f"{metadata}A description.\n".encode()}
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\n"
    stated = {**files, **(lie or {})}
    record = "".join(f"{n},{record_digest(d)},{len(d)}\n" for n, d in stated.items())
    folder.mkdir(exist_ok=True)
    path = folder / OFFICIAL.replace(VERSION, version)
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr(f"{info}/RECORD", f"{record}{info}/RECORD,,\n")
    return path


@pytest.fixture
def series(tmp_path):
    """A patch series that changes vllm/patched.py and adds vllm/added.py."""
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-change.patch").write_text(
        "Subject: [PATCH] change\n\n---\n"
        "diff --git a/vllm/patched.py b/vllm/patched.py\n--- a/vllm/patched.py\n+++ "
        "b/vllm/patched.py\n@@ -1 +1 @@\n-upstream\n+fork\n"
        "diff --git a/vllm/added.py b/vllm/added.py\nnew file mode 100644\n--- "
        "/dev/null\n+++ b/vllm/added.py\n@@ -0,0 +1 @@\n+new\n"
    )
    (patches / "series").write_text("# one patch\n0001-change.patch\n")
    return patches


def test_equal_wheel_passes_metadata_version_and_patched_files_aside(
    fork_pins, tmp_path, series
):
    assert wheel.patched_paths(tree.read_series(series)) == {
        "vllm/patched.py",
        "vllm/added.py",
    }
    assert wheel.patched_paths(tree.read_series()) == {
        "vllm/v1/worker/gpu/attn_utils.py",
        "vllm/v1/attention/backends/triton_attn.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
        "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py",
        "vllm/v1/kv_cache_interface.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py",
        "vllm/v1/worker/kv_connector_model_runner_mixin.py",
        "vllm/v1/kv_offload/cpu/gpu_worker.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py",
    }
    files = {
        **BASE,
        "vllm/patched.py": b"fork\n",
        "vllm/added.py": b"new\n",
        "vllm/_version.py": f"__version__ = '{fork_pins.fork_version}'\n".encode(),
    }
    fork = make_wheel(tmp_path / "fork", FORK_VERSION, files)
    official = make_wheel(tmp_path, VERSION, BASE)
    result = wheel.verify_wheel(fork, fork_pins, official, patches_dir=series)
    assert (result.missing, result.differing, result.extra) == ([], [], [])
    assert result.patched == ["vllm/_version.py", "vllm/patched.py"]
    # the METADATA, WHEEL and RECORD that differ are not compared
    assert result.compared == len(BASE) - 2


SH = "vllm/utils/numa_wrapper.sh"
MISSING = "vllm/transformers_utils/chat_templates/template_chatml.jinja, " + SH
BEYOND = {"tests/v1/worker/test_packed.py": b"", "vllm/_C.abi3.so": b"\x7fELF"}


@pytest.mark.parametrize(
    ("files", "made", "cause", "hint"),
    [
        (
            {n: d for n, d in BASE.items() if not n.endswith((".jinja", ".sh"))},
            {},
            re.escape(f"2 file(s) of {OFFICIAL} missing: {MISSING}") + "$",
            "git clone of the tree",
        ),
        (  # a file the series changes may differ, not be missing
            {n: d for n, d in BASE.items() if n != "vllm/patched.py"},
            {},
            re.escape(f"wheel: 1 file(s) of {OFFICIAL} missing: vllm/patched.py") + "$",
            "git clone of the tree",
        ),
        (
            {**BASE, SH: b"#!/bin/bash\n"},
            {},
            rf"1 file\(s\) differ from .* although no patch changes them: {SH}",
            "patches/series",
        ),
        (  # the same size, and a RECORD that does not describe the bytes
            {**BASE, SH: b"#!/bin/zsh\n"},
            {"lie": {SH: b"#!/bin/sh\n"}},
            rf"wheel: 1 file\(s\) differ from .* although no patch changes them: {SH}$",
            "patches/series",
        ),
        (  # vllm/added.py the series adds: allowed
            {**BASE, **BEYOND, "vllm/added.py": b"new\n"},
            {},
            r"2 file\(s\) not in .* and added by no patch: "
            r"tests/v1/worker/test_packed.py, vllm/_C.abi3.so",
            "",
        ),
        (
            {**BASE, "vllm/_version.py": b"v\n"},
            {"requires": ("torch==2.11.0", "extra-package")},
            "Requires-Dist/Requires-Python differ .* 1 line",
            "",
        ),
        (
            {**BASE, fixcheck.MODULE_PATH: BUGGY_SOURCE},
            {},
            f"{fixcheck.FUNCTION} is buggy",
            "",
        ),
    ],
    ids=[
        *("missing package data", "patched file missing", "differing", "RECORD lies"),
        *("beyond", "requirements", "no fix"),
    ],
)
def test_a_wheel_unlike_the_official_one_is_refused_saying_how(
    fork_pins, tmp_path, series, files, made, cause, hint
):
    official = make_wheel(tmp_path, VERSION, BASE)
    fork = make_wheel(tmp_path / "fork", FORK_VERSION, files, **made)
    with pytest.raises(ForkError) as error:
        wheel.verify_wheel(fork, fork_pins, official, patches_dir=series)
    assert re.search(cause, error.value.cause), error.value.cause
    assert hint in error.value.hint


def test_many_files_are_counted_and_the_first_few_named(fork_pins, tmp_path, series):
    data = {f"vllm/configs/c{i:02}.json": b"{}" for i in range(12)}
    official = make_wheel(tmp_path, VERSION, {**BASE, **data})
    fork = make_wheel(tmp_path / "fork", FORK_VERSION, BASE)
    said = r"12 file\(s\) of .* missing: vllm/configs/c00.json, .*vllm/configs/c04"
    with pytest.raises(ForkError, match=said + r".json, \.\.\. \(7 more\)"):
        wheel.verify_wheel(fork, fork_pins, official, patches_dir=series)
