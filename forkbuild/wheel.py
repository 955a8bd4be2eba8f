"""A distributable patched wheel for GPU hosts: vllm-<version>+<label>, on the official
CUDA wheel's binaries, built from a clean clone of the tree (the dev tree holds the CPU
binaries of the editable install, which must not leak into it).

A clone, not a `git archive` export: vLLM's package data beyond setup.py's explicit
`package_data` globs (the fallback chat templates, numa_wrapper.sh, the tuned Mamba and
Helion configs, READMEs) reaches its wheel through setuptools' `include_package_data`,
on by default for a pyproject `[project]`, which takes the package files that
setuptools-scm's file finder lists: the files git tracks. In an export there is no git
repository, the finder lists nothing, and those ~40 files were silently left out.

verify_wheel holds the result to the official wheel file by file: every file of it, with
the same content, except what the patch series changes, vllm/_version.py (generated) and
the .dist-info metadata."""

from __future__ import annotations

import csv
import io
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass
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


GENERATED = tree.GENERATED  # setuptools-scm writes the version into it: never equal
SHOWN = 5  # file names an error names at most, per kind


def _is_metadata(name: str) -> bool:
    return name.split("/", 1)[0].endswith(".dist-info")


def patched_paths(patches: list[tree.Patch]) -> set[str]:
    """Every path a `diff --git` header of the series names (old and new side): the
    files the fork changes, adds or removes on purpose."""
    paths: set[str] = set()
    for patch in patches:
        for line in patch.path.read_text(errors="replace").splitlines():
            match = re.fullmatch(r'diff --git "?a/(.+?)"? "?b/(.+?)"?', line)
            if match:
                paths.update(match.groups())
    return paths


def _contents(path: Path) -> dict[str, tuple[str | None, int, int]]:
    """File name -> (sha256 as RECORD states it, size, CRC-32) for every file of the
    wheel. RECORD saves inflating ~400 MB; the zip directory's size and CRC, free to
    read, catch a RECORD that does not describe the bytes next to it."""
    with zipfile.ZipFile(path) as whl:
        infos = [i for i in whl.infolist() if not i.is_dir()]
        records = [
            i.filename
            for i in infos
            if i.filename.endswith(".dist-info/RECORD") and i.filename.count("/") == 1
        ]
        if len(records) != 1:
            raise ForkError(
                f"{path.name} has {len(records)} .dist-info/RECORD files, expected one",
                "rebuild it; a wheel without its RECORD cannot be compared",
            )
        hashes = {
            row[0]: row[1] or None
            for row in csv.reader(io.StringIO(whl.read(records[0]).decode()))
            if row
        }
    return {i.filename: (hashes.get(i.filename), i.file_size, i.CRC) for i in infos}


@dataclass(frozen=True)
class Comparison:
    """The fork's wheel against the official one, .dist-info left out."""

    compared: int  # files of the official wheel held to equal content
    missing: list[str]  # in the official wheel, not in the fork's
    differing: list[str]  # in both, not equal, and not changed by the series
    extra: list[str]  # in the fork's wheel only, and not added by the series
    # in both and changed by the series or generated: allowed to differ
    patched: list[str]

    @property
    def ok(self) -> bool:
        return not (self.missing or self.differing or self.extra)


def compare_wheels(fork: Path, official: Path, patched: set[str]) -> Comparison:
    mine = {n: v for n, v in _contents(fork).items() if not _is_metadata(n)}
    theirs = {n: v for n, v in _contents(official).items() if not _is_metadata(n)}
    exempt = patched | set(GENERATED)
    both = sorted(theirs.keys() & mine.keys())
    return Comparison(
        compared=sum(1 for n in both if n not in exempt),
        missing=sorted(theirs.keys() - mine.keys()),
        differing=[n for n in both if n not in exempt and mine[n] != theirs[n]],
        extra=sorted(n for n in mine.keys() - theirs.keys() if n not in patched),
        patched=[n for n in both if n in exempt],
    )


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return f"{shown}, ... ({len(names) - SHOWN} more)" if len(names) > SHOWN else shown


def comparison_problems(
    result: Comparison, official: Path
) -> tuple[list[str], list[str]]:
    """(problems, what to do) for a comparison that is not ok."""
    problems, hints = [], []
    if result.missing:
        problems.append(
            f"{len(result.missing)} file(s) of {official.name} missing: "
            f"{_some(result.missing)}"
        )
        hints.append(
            "package data comes from the files git tracks in the tree "
            "(setuptools-scm's file finder): build from a git clone of the tree, as "
            "`make wheel` does, and check that `git ls-files` in build/vllm-<version> "
            "lists them"
        )
    if result.differing:
        problems.append(
            f"{len(result.differing)} file(s) differ from {official.name} although no "
            f"patch changes them: {_some(result.differing)}"
        )
        hints.append(
            "rebuild the tree from the pinned sdist (python3 -m forkbuild tree "
            "--force); a change the fork means must be a patch in patches/series"
        )
    if result.extra:
        problems.append(
            f"{len(result.extra)} file(s) not in {official.name} and added "
            "by no "
            f"patch: {_some(result.extra)}"
        )
        hints.append(
            "they leaked into the package (build outputs, the fork's tests?): only the "
            "tree's tracked files belong in it; a file the fork adds must come from a "
            "patch"
        )
    return problems, hints


def verify_wheel(
    path: Path, pins: Pins, official: Path, patches_dir: Path = tree.PATCHES_DIR
) -> None:
    """The wheel must carry the fix and the fork's version, and hold the OFFICIAL wheel
    whose binaries it was built on file for file: every file, the same bytes, except the
    files the patch series changes, vllm/_version.py and the .dist-info metadata;
    nothing
    else besides the files the series adds."""
    missing = sorted(_compiled(official) - _compiled(path))
    result = compare_wheels(
        path, official, patched_paths(tree.read_series(patches_dir))
    )
    with zipfile.ZipFile(path) as whl:
        verdict = fixcheck.classify(whl.read(fixcheck.MODULE_PATH).decode())
        version = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in _metadata(whl).splitlines()
                if ln.startswith("Version:")
            ),
            None,
        )
    problems, hints = [], []
    ours, theirs = _requirements(path), _requirements(official)
    if ours != theirs:
        only = sorted(set(ours) ^ set(theirs))
        problems.append(
            "its METADATA's Requires-Dist/Requires-Python differ from the official "
            f"wheel's in {len(only)} line(s), e.g. {only[0]!r}"
        )
        hints.append(
            f"the fork must depend on exactly what vllm=={pins.upstream_version} "
            "depends on: check the tree's requirements files against the sdist's"
        )
    if verdict != "fixed":
        problems.append(f"{fixcheck.FUNCTION} is {verdict}")
    if version != pins.fork_version:
        problems.append(f"version is {version}, expected {pins.fork_version}")
    if missing:
        problems.append(
            f"{len(missing)} compiled extension(s) missing, e.g. {missing[0]}"
        )
    if not result.ok:
        more, hints = comparison_problems(result, official)
        problems += more
    if problems:
        raise ForkError(
            f"{path.name} is not a good fork wheel: {'; '.join(problems)}",
            "; ".join(hints) if hints else "rebuild it",
        )
    log.step(
        f"wheel: verified {path.name}: version {version}, fix present, "
        f"{result.compared} files of {official.name} ({len(_compiled(official))} "
        f"compiled extensions among them) present and equal, {len(result.patched)} "
        f"changed as the series and the build change them ({', '.join(result.patched)})"
    )


def _requirements(path: Path) -> list[str]:
    """The Requires-Dist and Requires-Python lines of the wheel's METADATA, sorted: what
    an installer takes from it (the rest of .dist-info names the build, not the
    needs)."""
    with zipfile.ZipFile(path) as whl:
        # headers end at the first blank line
        head = _metadata(whl).split("\n\n", 1)[0]
    return sorted(
        line.strip()
        for line in head.splitlines()
        if line.startswith(("Requires-Dist:", "Requires-Python:"))
    )


def _metadata(whl: zipfile.ZipFile) -> str:
    """The wheel's .dist-info/METADATA (StopIteration where it has none)."""
    name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    return whl.read(name).decode()


def _tag_options(official: Path) -> list[str]:
    """pip tags a python-only build for the building interpreter (cp311-cp311-linux);
    the binaries inside are the official wheel's, so bdist_wheel is told the official
    wheel's tags (cp38-abi3-manylinux_2_28) and the wheel installs wherever that one
    does. (Built so, it is zipped once: retagging afterwards rewrote all ~400 MB
    again.)"""
    # name-version-python-abi-platform.whl (fork.toml pins the official file name)
    interpreter, abi, platform_tag = official.name.removesuffix(".whl").split("-")[-3:]
    if abi != "abi3":
        raise ForkError(
            f"{official.name} is not an abi3 wheel",
            "the wheel step expects vLLM's abi3 wheel",
        )
    return [
        f"-C--build-option=--py-limited-api={interpreter}",
        f"-C--build-option=--plat-name={platform_tag}",
    ]


def build(pins: Pins) -> Path:
    python = install.ensure_toolchain(pins)
    route = pins.routes["cuda"]
    sdist = fetch.fetch(pins.sdist, lambda: python)
    binaries = fetch.fetch(route.wheel, lambda: python)
    tree_path = tree.build(pins, sdist)
    lock.check(pins, tree_path)  # the venv it builds in is the tested one
    preflight.check_disk(build_dir(), 2, "building the wheel")
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=build_dir()) as tmp:
        source, out = Path(tmp) / "src", Path(tmp) / "out"
        # A clone: the tracked files only (no editable install's CPU binaries), in a git
        # repository, so that setuptools-scm lists the package data as for the official
        # wheel (see the module's docstring). Local, so the objects are hard links.
        clone = ["clone", "-q", str(tree_path), str(source)]
        tree._git_ok(
            clone,
            Path(tmp),
            None,
            f"clone {tree_path}",
            hint="rebuild the tree: make tree",
        )
        log.step(
            f"wheel: building {pins.fork_version} on {binaries.name} (takes about "
            "a minute)"
        )
        run_pip(
            python,
            [
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                str(out),
                *_tag_options(binaries),
                str(source),
            ],
            what="build the wheel",
            env=install.precompiled_env(pins, route, binaries),
            quiet=True,
        )
        built = sorted(out.glob("vllm-*.whl"))
        tags = "-".join(binaries.name.removesuffix(".whl").split("-")[-3:])
        if len(built) != 1 or not built[0].name.endswith(f"-{tags}.whl"):
            raise ForkError(
                f"pip wheel produced {[p.name for p in built]}, expected "
                "one vllm wheel "
                f"tagged {tags}"
            )
        verify_wheel(built[0], pins, binaries)
        dist_dir().mkdir(parents=True, exist_ok=True)
        final = dist_dir() / built[0].name
        os.replace(built[0], final)
    log.step(f"wheel: {final} ({final.stat().st_size / 2**20:.0f} MiB)")
    return final
