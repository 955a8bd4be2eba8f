"""The install's "up to date" is a property of the venv and the tree together: a venv
made anew (`rm -r build/venv`, which forkbuild's own advice names) or one that lost the
editable vLLM is never taken for the one the tree was installed into."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from forkbuild.core import pins
from forkbuild.setup import install

FORK = pins.load()
TREE = f"vllm-{FORK.upstream_version}"  # tree.tree_dir's name


def _site(build: Path) -> Path:
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = build / "venv" / "lib" / minor / "site-packages"
    site.mkdir(parents=True)
    return site


def _editable(site: Path, tree: Path, editable: bool = True) -> None:
    info = site / f"vllm-{FORK.fork_version}.cpu.dist-info"
    info.mkdir()
    (info / "direct_url.json").write_text(
        json.dumps({"url": tree.resolve().as_uri(), "dir_info": {"editable": editable}})
    )


def test_the_editable_install_of_this_tree_is_recognized(scratch):
    tree = scratch / "build" / TREE
    tree.mkdir(parents=True)
    _editable(_site(scratch / "build"), tree)
    assert install.holds_editable(tree)


def test_a_fresh_venv_without_vllm_is_not_the_installed_one(scratch):
    tree = scratch / "build" / TREE
    tree.mkdir(parents=True)
    _site(scratch / "build")
    assert not install.holds_editable(tree)


def test_vllm_of_another_tree_or_not_editable_is_not_this_install(scratch):
    tree = scratch / "build" / TREE
    tree.mkdir(parents=True)
    site = _site(scratch / "build")
    _editable(site, scratch / "elsewhere")
    assert not install.holds_editable(tree)
    for info in site.glob("vllm-*.dist-info"):
        (info / "direct_url.json").write_text(
            json.dumps({"url": tree.resolve().as_uri(), "dir_info": {}})
        )
    assert not install.holds_editable(tree)


def test_a_venv_made_anew_changes_the_install_stamp(scratch, fork_pins):
    """`make install; rm -r build/venv; make install`: the new venv has the same lock
    (same toolchain stamp) but another id, so the tree's stamp no longer matches and the
    editable install is redone."""
    tree = scratch / "build" / TREE
    (tree / ".git").mkdir(parents=True)
    (tree / ".git" / "forkbuild-inputs").write_text("inputs\n")
    venv = scratch / "build" / "venv"
    venv.mkdir()
    (venv / install.TOOLCHAIN_STAMP).write_text("same lock\n")
    route = fork_pins.routes["cpu"]
    (venv / install.VENV_ID).write_text("a" * 32 + "\n")
    first = install.install_stamp(route, tree)
    assert install.install_stamp(route, tree) == first
    (venv / install.VENV_ID).write_text("b" * 32 + "\n")
    assert install.install_stamp(route, tree) != first


def _installed_here(scratch: Path, route) -> Path:
    """A build folder as an install leaves it: a venv with an id and the tree's editable
    vLLM, the tree stamped with both."""
    tree = scratch / "build" / TREE
    (tree / ".git").mkdir(parents=True)
    (tree / ".git" / "forkbuild-inputs").write_text("inputs\n")
    venv = scratch / "build" / "venv"
    _editable(_site(scratch / "build"), tree)
    (venv / install.TOOLCHAIN_STAMP).write_text("the lock\n")
    (venv / install.VENV_ID).write_text("c" * 32 + "\n")
    (tree / install.INSTALL_STAMP).write_text(install.install_stamp(route, tree) + "\n")
    return tree


def test_rm_venv_then_install_is_not_up_to_date(scratch, fork_pins):
    """The issue's sequence: the venv made anew has the same lock, another id, no
    vLLM."""
    import shutil

    route = fork_pins.routes["cpu"]
    tree = _installed_here(scratch, route)
    assert install.is_installed(route, tree)
    venv = scratch / "build" / "venv"
    shutil.rmtree(venv)
    _site(scratch / "build")
    (venv / install.TOOLCHAIN_STAMP).write_text("the lock\n")
    (venv / install.VENV_ID).write_text("d" * 32 + "\n")
    assert not install.is_installed(route, tree)


def test_a_venv_that_lost_the_editable_vllm_is_not_up_to_date(scratch, fork_pins):
    import shutil

    route = fork_pins.routes["cpu"]
    tree = _installed_here(scratch, route)
    for info in (scratch / "build" / "venv").rglob("vllm-*.dist-info"):
        shutil.rmtree(info)
    assert not install.is_installed(route, tree)


def test_the_venvs_forkbuild_makes_carry_an_id():
    """ensure_toolchain writes the id the stamp needs (the build's own venv, made by the
    install that `make test` ran first)."""
    import pytest

    from forkbuild.core.pins import build_dir

    venv = build_dir() / "venv"
    if not (venv / install.TOOLCHAIN_STAMP).exists():
        pytest.skip("no venv made by forkbuild here yet")
    assert len((venv / install.VENV_ID).read_text().strip()) == 32
