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


def _venv(build: Path, venv_id: str, stamp: str = "the lock\n") -> Path:
    """A venv as ensure_toolchain leaves it: its toolchain stamp and its id."""
    venv = build / "venv"
    venv.mkdir(exist_ok=True)
    (venv / install.TOOLCHAIN_STAMP).write_text(stamp)
    (venv / install.VENV_ID).write_text(venv_id * 32 + "\n")
    return venv


@pytest.fixture
def tree(scratch: Path) -> Path:
    """The tree (tree.tree_dir's name), with the digest of its inputs."""
    tree = scratch / "build" / f"vllm-{FORK.upstream_version}"
    (tree / ".git").mkdir(parents=True)
    (tree / ".git" / "forkbuild-inputs").write_text("inputs\n")
    return tree


def test_the_editable_install_of_this_tree_is_recognized(tree):
    _editable(_site(tree.parent), tree)
    assert install.holds_editable(tree)


def test_a_fresh_venv_without_vllm_is_not_the_installed_one(tree):
    _site(tree.parent)
    assert not install.holds_editable(tree)


def test_vllm_of_another_tree_or_not_editable_is_not_this_install(tree):
    site = _site(tree.parent)
    _editable(site, tree.parent / "elsewhere")
    assert not install.holds_editable(tree)
    _editable(site, tree, editable=False)
    assert not install.holds_editable(tree)


def test_a_venv_made_anew_changes_the_install_stamp(tree, fork_pins):
    """`make install; rm -r build/venv; make install`: the new venv has the same lock
    (same toolchain stamp) but another id, so the tree's stamp no longer matches and the
    editable install is redone."""
    route = fork_pins.routes["cpu"]
    _venv(tree.parent, "a", "same lock\n")
    first = install.install_stamp(route, tree)
    assert install.install_stamp(route, tree) == first
    _venv(tree.parent, "b", "same lock\n")
    assert install.install_stamp(route, tree) != first


@pytest.fixture
def installed(tree: Path, fork_pins) -> Path:
    """A build folder as an install leaves it: a venv with an id and the tree's editable
    vLLM, the tree stamped with both."""
    _editable(_site(tree.parent), tree)
    _venv(tree.parent, "c")
    route = fork_pins.routes["cpu"]
    (tree / install.INSTALL_STAMP).write_text(install.install_stamp(route, tree) + "\n")
    assert install.is_installed(route, tree)
    return tree


def test_rm_venv_then_install_is_not_up_to_date(installed, fork_pins):
    """The issue's sequence: the venv made anew has the same lock, another id, no
    vLLM."""
    shutil.rmtree(installed.parent / "venv")
    _site(installed.parent)
    _venv(installed.parent, "d")
    assert not install.is_installed(fork_pins.routes["cpu"], installed)


def test_a_venv_that_lost_the_editable_vllm_is_not_up_to_date(installed, fork_pins):
    for info in (installed.parent / "venv").rglob("vllm-*.dist-info"):
        shutil.rmtree(info)
    assert not install.is_installed(fork_pins.routes["cpu"], installed)


def test_the_venvs_forkbuild_makes_carry_an_id():
    """ensure_toolchain writes the id the stamp needs (the build's own venv, made by the
    install that `make test` ran first)."""
    venv = pins.build_dir() / "venv"
    if not (venv / install.TOOLCHAIN_STAMP).exists():
        pytest.skip("no venv made by forkbuild here yet")
    assert len((venv / install.VENV_ID).read_text().strip()) == 32
