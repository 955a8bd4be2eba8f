"""The install's "up to date" is a property of the venv and the tree together: a venv
made anew (`rm -r build/venv`, which forkbuild's own advice names) or one that lost the
editable vLLM is never taken for the one the tree was installed into."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from forkbuild import install


def _site(build: Path) -> Path:
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = build / "venv" / "lib" / minor / "site-packages"
    site.mkdir(parents=True)
    return site


def _editable(site: Path, tree: Path, editable: bool = True) -> None:
    info = site / "vllm-0.25.1+fork.1.cpu.dist-info"
    info.mkdir()
    (info / "direct_url.json").write_text(
        json.dumps({"url": tree.resolve().as_uri(), "dir_info": {"editable": editable}})
    )


def test_the_editable_install_of_this_tree_is_recognized(scratch):
    tree = scratch / "build" / "vllm-0.25.1"
    tree.mkdir(parents=True)
    _editable(_site(scratch / "build"), tree)
    assert install.holds_editable(tree)


def test_a_fresh_venv_without_vllm_is_not_the_installed_one(scratch):
    tree = scratch / "build" / "vllm-0.25.1"
    tree.mkdir(parents=True)
    _site(scratch / "build")
    assert not install.holds_editable(tree)


def test_vllm_of_another_tree_or_not_editable_is_not_this_install(scratch):
    tree = scratch / "build" / "vllm-0.25.1"
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
    tree = scratch / "build" / "vllm-0.25.1"
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
