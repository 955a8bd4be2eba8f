"""The install's "up to date" is a property of the venv and the tree together: a venv
made anew (`rm -r build/venv`, which forkbuild's own advice names) or one that lost the
editable vLLM is never taken for the one the tree was installed into."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from forkbuild.core import pins
from forkbuild.setup import install

FORK = pins.load()
CPU = FORK.routes["cpu"]


def _site(build: Path) -> Path:
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = build / "venv" / "lib" / minor / "site-packages"
    site.mkdir(parents=True)
    return site


def _editable(site: Path, tree: Path, editable: bool = True) -> None:
    info = site / f"vllm-{FORK.fork_version}.cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "direct_url.json").write_text(
        json.dumps({"url": tree.resolve().as_uri(), "dir_info": {"editable": editable}})
    )


def _venv(build: Path, venv_id: str, stamp: str = "the lock\n") -> None:
    """A venv as ensure_toolchain leaves it: its toolchain stamp and its id."""
    venv = build / "venv"
    venv.mkdir(exist_ok=True)
    (venv / install.TOOLCHAIN_STAMP).write_text(stamp)
    (venv / install.VENV_ID).write_text(venv_id * 32 + "\n")


@pytest.fixture
def tree(scratch: Path) -> Path:
    """The tree (tree.tree_dir's name), with the digest of its inputs."""
    tree = scratch / "build" / f"vllm-{FORK.upstream_version}"
    (tree / ".git").mkdir(parents=True)
    (tree / ".git" / "forkbuild-inputs").write_text("inputs\n")
    return tree


@pytest.mark.parametrize(
    ("vllm_of", "editable", "held"),
    [("tree", True, True), ("", True, False), ("elsewhere", True, False)]
    + [("tree", False, False)],
    ids=["this tree", "a fresh venv without vllm", "another tree", "not editable"],
)
def test_only_the_editable_install_of_this_tree_is_recognized(
    tree, vllm_of, editable, held
):
    site = _site(tree.parent)
    if vllm_of:
        _editable(site, tree if vllm_of == "tree" else tree.parent / vllm_of, editable)
    assert install.holds_editable(tree) is held


def test_a_venv_made_anew_changes_the_install_stamp(tree):
    """`make install; rm -r build/venv; make install`: the new venv has the same lock
    (same toolchain stamp) but another id, so the tree's stamp no longer matches and the
    editable install is redone."""
    _venv(tree.parent, "a", "same lock\n")
    first = install.install_stamp(CPU, tree)
    assert install.install_stamp(CPU, tree) == first
    _venv(tree.parent, "b", "same lock\n")
    assert install.install_stamp(CPU, tree) != first


@pytest.mark.parametrize("change", ["venv made anew", "vllm lost"])
def test_an_install_whose_venv_changed_is_not_up_to_date(tree, change):
    """A build folder as an install leaves it (a venv with an id and the tree's editable
    vLLM, the tree stamped with both) is up to date until its venv changes."""
    _editable(_site(tree.parent), tree)
    _venv(tree.parent, "c")
    (tree / install.INSTALL_STAMP).write_text(install.install_stamp(CPU, tree) + "\n")
    assert install.is_installed(CPU, tree)
    if change == "venv made anew":  # the issue's: the same lock, another id, no vLLM
        shutil.rmtree(tree.parent / "venv")
        _site(tree.parent)
        _venv(tree.parent, "d")
    else:
        for info in (tree.parent / "venv").rglob("vllm-*.dist-info"):
            shutil.rmtree(info)
    assert not install.is_installed(CPU, tree)


def test_the_venvs_forkbuild_makes_carry_an_id():
    """ensure_toolchain writes the id the stamp needs (the build's own venv, made by the
    install that `make test` ran first)."""
    venv = pins.build_dir() / "venv"
    if not (venv / install.TOOLCHAIN_STAMP).exists():
        pytest.skip("no venv made by forkbuild here yet")
    assert len((venv / install.VENV_ID).read_text().strip()) == 32
