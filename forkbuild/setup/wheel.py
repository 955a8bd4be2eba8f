"""A distributable patched wheel for GPU hosts on the official CUDA wheel's binaries,
built from a clean clone of the tree (the dev tree holds the editable install's CPU
binaries; not a `git archive` export: ~40 files of package data reach the wheel only as
files git tracks). verify_wheel holds it to the official wheel file by file."""

import email.message
import email.parser
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from forkbuild.core import fixcheck, log, preflight
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT, Pins, build_dir
from forkbuild.setup import fetch, install, lock, tree
from forkbuild.setup.load_extensions import wheel_record
from forkbuild.setup.pip_runner import run_pip


def dist_dir() -> Path:
    return Path(os.environ.get("VLLM_FORK_DIST") or REPO_ROOT / "dist")


SHOWN = 5  # file names an error names at most, per kind


def patched_paths(patches: list[tree.Patch]) -> set[str]:
    """Every path a `diff --git` header of the series names (old and new side)."""
    header = re.compile(r'^diff --git "?a/(.+?)"? "?b/(.+?)"?\r?$', re.MULTILINE)
    texts = [patch.path.read_text(errors="replace") for patch in patches]
    return {path for text in texts for pair in header.findall(text) for path in pair}


def _contents(path: Path) -> dict[str, tuple[str, int, int]]:
    """Name -> (RECORD's sha256: no inflating, size, CRC: a RECORD that lies)."""
    with zipfile.ZipFile(path) as whl:
        infos = [i for i in whl.infolist() if not i.is_dir()]
    records = [i for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename)]
    if len(records) != 1:
        raise ForkError(
            f"{path.name} has {len(records)} .dist-info/RECORD files, expected one",
            "rebuild it; a wheel without its RECORD cannot be compared",
        )
    hashes = wheel_record(path)  # "" where RECORD gives none
    data = [i for i in infos if not i.filename.split("/")[0].endswith(".dist-info")]
    return {i.filename: (hashes.get(i.filename, ""), i.file_size, i.CRC) for i in data}


@dataclass(frozen=True)
class Comparison:
    """The fork's wheel against the official one, .dist-info left out."""

    compared: int  # files of the official wheel held to equal content
    missing: list[str]  # in the official wheel, not in the fork's
    differing: list[str]  # in both, not equal, and not changed by the series
    extra: list[str]  # in the fork's wheel only, and not added by the series
    patched: list[str]  # in both, changed by the series or generated: may differ


def compare_wheels(fork: Path, official: Path, patched: set[str]) -> Comparison:
    mine, theirs = _contents(fork), _contents(official)
    exempt = patched | set(tree.GENERATED)  # setuptools-scm's version: never equal
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


HINTS = {  # what to do about each kind of file a comparison finds
    "missing": "package data comes from the files git tracks in the tree "
    "(setuptools-scm's file finder): build from a git clone of the tree, as `make "
    "wheel` does, and check that `git ls-files` in build/vllm-<version> lists them",
    "differing": "rebuild the tree from the pinned sdist (python3 -m forkbuild tree "
    "--force); a change the fork means must be a patch in patches/series",
    "extra": "they leaked into the package (build outputs, the fork's tests?): only "
    "the tree's tracked files belong in it; a file the fork adds must come from a "
    "patch",
}


def verify_wheel(
    path: Path, pins: Pins, official: Path, patches_dir: Path = tree.PATCHES_DIR
) -> Comparison:
    """The fix, the version, OFFICIAL's files and only the series' files added."""
    patched = patched_paths(tree.read_series(patches_dir))
    result = compare_wheels(path, official, patched)
    compiled = [n for n in _contents(official) if n.endswith(".so")]
    missing = [n for n in result.missing if n.endswith(".so")]
    with zipfile.ZipFile(path) as whl:
        verdict = fixcheck.classify(whl.read(fixcheck.MODULE_PATH).decode())
    version = _metadata(path)["Version"]
    said = {
        "missing": f"of {official.name} missing",
        "differing": f"differ from {official.name} although no patch changes them",
        "extra": f"not in {official.name} and added by no patch",
    }
    found = {kind: getattr(result, kind) for kind in said if getattr(result, kind)}
    problems = [f"{len(n)} file(s) {said[k]}: {_some(n)}" for k, n in found.items()]
    hints = [HINTS[kind] for kind in found]
    needs = ("Requires-Dist", "Requires-Python")
    ours, theirs = (
        {f"{k}: {v}" for k, v in _metadata(each).items() if k in needs}
        for each in (path, official)
    )
    if ours != theirs:
        only = sorted(ours ^ theirs)
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
    if problems:
        raise ForkError(
            f"{path.name} is not a good fork wheel: {'; '.join(problems)}",
            "; ".join(hints) if hints else "rebuild it",
        )
    log.step(
        f"wheel: verified {path.name}: version {version}, fix present, "
        f"{result.compared} files of {official.name} ({len(compiled)} "
        f"compiled extensions among them) present and equal, {len(result.patched)} "
        f"changed as the series and the build change them ({', '.join(result.patched)})"
    )
    return result


def _metadata(path: Path) -> email.message.Message:
    """The headers of the wheel's METADATA (StopIteration where it has none)."""
    with zipfile.ZipFile(path) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.HeaderParser().parsestr(whl.read(name).decode())


def _tags(wheel: Path) -> list[str]:
    """[python, abi, platform] of name-version-python-abi-platform.whl."""
    return wheel.name.removesuffix(".whl").split("-")[-3:]


def _tag_options(official: Path) -> list[str]:
    """The official wheel's tags for bdist_wheel (retagging rewrote all ~400 MB)."""
    interpreter, abi, platform_tag = _tags(official)
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
        # A clone, not an export (module docstring); local: the objects are hard links.
        clone = ["clone", "-q", str(tree_path), str(source)]
        hint = "rebuild the tree: make tree"
        tree.git_ok(clone, Path(tmp), None, f"clone {tree_path}", hint=hint)
        about = "(takes about a minute)"
        log.step(f"wheel: building {pins.fork_version} on {binaries.name} {about}")
        args = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
        args += [*_tag_options(binaries), str(source)]
        env = install.precompiled_env(pins, route, binaries)
        run_pip(python, args, what="build the wheel", env=env, quiet=True)
        built = sorted(out.glob("vllm-*.whl"))
        tags = "-".join(_tags(binaries))
        if len(built) != 1 or not built[0].name.endswith(f"-{tags}.whl"):
            raise ForkError(
                f"pip wheel produced {[p.name for p in built]}, expected one vllm "
                f"wheel tagged {tags}"
            )
        verify_wheel(built[0], pins, binaries)
        dist_dir().mkdir(parents=True, exist_ok=True)
        final = dist_dir() / built[0].name
        os.replace(built[0], final)
    log.step(f"wheel: {final} ({final.stat().st_size / 2**20:.0f} MiB)")
    return final
