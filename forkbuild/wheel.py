"""A distributable patched wheel for GPU hosts: vllm-<version>+<label>, on the official
CUDA wheel's binaries, built from a clean export of the tree (the dev tree holds the
CPU binaries of the editable install, which must not leak into it)."""

from __future__ import annotations

import os
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

from forkbuild import fetch, fixcheck, install, lock, log, preflight, tree
from forkbuild.errors import ForkError
from forkbuild.pins import REPO_ROOT, Pins, build_dir
from forkbuild.pip_runner import run_pip


def dist_dir() -> Path:
    return Path(os.environ.get("VLLM_FORK_DIST") or REPO_ROOT / "dist")


def _compiled(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as whl:
        return {n for n in whl.namelist() if n.endswith(".so")}


def verify_wheel(path: Path, pins: Pins, official: Path) -> None:
    """The wheel must carry the fix, the fork's version and every compiled extension
    of the OFFICIAL wheel whose binaries it was built on."""
    missing = sorted(_compiled(official) - _compiled(path))
    with zipfile.ZipFile(path) as whl:
        names = set(whl.namelist())
        verdict = fixcheck.classify(whl.read(fixcheck.MODULE_PATH).decode())
        metadata = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
        version = next(
            (ln.split(":", 1)[1].strip() for ln in whl.read(metadata).decode().splitlines()
             if ln.startswith("Version:")),
            None,
        ) if metadata else None
    problems = []
    if verdict != "fixed":
        problems.append(f"{fixcheck.FUNCTION} is {verdict}")
    if version != pins.fork_version:
        problems.append(f"version is {version}, expected {pins.fork_version}")
    if missing:
        problems.append(f"{len(missing)} compiled extension(s) missing, e.g. {missing[0]}")
    if problems:
        raise ForkError(f"{path.name} is not a good fork wheel: {'; '.join(problems)}", "rebuild it")
    log.step(f"wheel: verified {path.name}: version {version}, fix present, "
             f"all {len(_compiled(official))} compiled extensions of {official.name} present")


def _tag_options(official: Path) -> list[str]:
    """pip tags a python-only build for the building interpreter (cp311-cp311-linux); the
    binaries inside are the official wheel's, so bdist_wheel is told the official wheel's
    tags (cp38-abi3-manylinux_2_28) and the wheel installs wherever that one does. (Built
    so, it is zipped once: retagging afterwards rewrote all ~400 MB again.)"""
    # name-version-python-abi-platform.whl (fork.toml pins the official file name)
    interpreter, abi, platform_tag = official.name.removesuffix(".whl").split("-")[-3:]
    if abi != "abi3":
        raise ForkError(f"{official.name} is not an abi3 wheel", "the wheel step expects vLLM's abi3 wheel")
    return [f"-C--build-option=--py-limited-api={interpreter}",
            f"-C--build-option=--plat-name={platform_tag}"]


def build(pins: Pins) -> Path:
    python = install.ensure_toolchain(pins)
    route = pins.routes["cuda"]
    sdist = fetch.fetch(pins.sdist, lambda: python)
    binaries = fetch.fetch(route.wheel, lambda: python)
    tree_path = tree.build(pins, sdist)
    lock.check(pins, tree_path)  # the venv it builds in is the tested one
    preflight.check_disk(build_dir(), 2, "building the wheel")
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=build_dir()) as tmp:
        export, out = Path(tmp) / "src", Path(tmp) / "out"
        archive = Path(tmp) / "src.tar"
        subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), "HEAD"],
                       cwd=tree_path, check=True)
        with tarfile.open(archive) as tar:
            tree.extract_data(tar, export)
        log.step(f"wheel: building {pins.fork_version} on {binaries.name} (takes about a minute)")
        run_pip(
            python,
            ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
             *_tag_options(binaries), str(export)],
            what="build the wheel",
            env=install.precompiled_env(pins, route, binaries),
            quiet=True,
        )
        built = sorted(out.glob("vllm-*.whl"))
        tags = "-".join(binaries.name.removesuffix(".whl").split("-")[-3:])
        if len(built) != 1 or not built[0].name.endswith(f"-{tags}.whl"):
            raise ForkError(f"pip wheel produced {[p.name for p in built]}, expected one vllm wheel "
                            f"tagged {tags}")
        verify_wheel(built[0], pins, binaries)
        dist_dir().mkdir(parents=True, exist_ok=True)
        final = dist_dir() / built[0].name
        os.replace(built[0], final)
    log.step(f"wheel: {final} ({final.stat().st_size / 2**20:.0f} MiB)")
    return final
