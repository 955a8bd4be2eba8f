"""`forkbuild patch-status`: each patch's DEP-3 `Applied-Upstream: vX` confirmed on
every [matrix] release (docs/upstream-alignment.md); a patch that claims nothing is
carried, and the report says where it would apply, so a rebase knows what to drop."""

import email
import json
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from forkbuild.checks import matrix, versions
from forkbuild.core import log
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import Pins, Release
from forkbuild.setup import fetch, install, tree

APPLIES, REVERSED, NEITHER = "applies", "reverse-applies", "neither"
# At or after the claimed release, a patch that applies cleanly is not upstream's: the
# code it changes is still as it was (a neighbouring change may make its cases pass).
STILL_APPLIES = "the patch still applies: its own change is absent"
ANOTHER_CHANGE = "; the cases pass through another change"
Contents = dict[str, bytes]  # a file's path inside the release -> its bytes


@dataclass(frozen=True)
class PatchInfo:
    name: str
    path: Path
    fields: dict[str, str]  # DEP-3 fields
    files: tuple[str, ...]  # paths the diff touches

    @property
    def applied_upstream(self) -> versions.Release | None:
        value = self.fields.get("Applied-Upstream", "").strip()
        if not value or value.lower() in ("no", "not-needed"):
            return None
        try:
            return versions.release(value.split(",")[0].split()[0].lstrip("v"))
        except ForkError:
            said = f"{self.name}: Applied-Upstream {value!r} names no release"
            hint = "write it as `Applied-Upstream: v<version>` (DEP-3), or leave it out"
            raise ForkError(said, hint) from None


def read_patch(path: Path) -> PatchInfo:
    """A `git format-patch` mail's DEP-3 `Key: value` lines (before the diffstat)."""
    message = email.message_from_bytes(path.read_bytes())
    body = message.get_payload(decode=True).decode("utf-8", "replace")
    fields: dict[str, str] = {}
    for line in body.split("\n---\n", 1)[0].splitlines():
        key, sep, value = line.partition(": ")
        if sep and key.replace("-", "").isalnum() and " " not in key:
            fields[key] = value.strip()
    diffs = [line for line in body.splitlines() if line.startswith("diff --git a/")]
    if not (files := tuple(line.split(" b/", 1)[1] for line in diffs)):
        raise ForkError(
            f"{path.name} has no diff", "regenerate it with git format-patch"
        )
    return PatchInfo(path.name, path, fields, files)


def read_series(patches_dir: Path = tree.PATCHES_DIR) -> list[PatchInfo]:
    return [read_patch(patch.path) for patch in tree.read_series(patches_dir)]


def sdist_files(sdist: Path, names: frozenset[str]) -> Contents:
    """The files NAMES (paths inside the release) of SDIST, read in one pass."""
    found = {}
    with tarfile.open(sdist) as tar:
        for member in tar:
            inner = member.name.split("/", 1)[-1]
            if inner in names and member.isfile():
                found[inner] = tar.extractfile(member).read()
    return found


def try_apply(patches: list[PatchInfo], sdist: Path) -> dict[str, str]:
    """Does each patch apply to SDIST, reverse-apply, or neither (SDIST read once)?"""
    files = sdist_files(sdist, frozenset(f for patch in patches for f in patch.files))
    return {patch.name: _verdict(patch, files) for patch in patches}


def _verdict(patch: PatchInfo, files: Contents) -> str:
    with tempfile.TemporaryDirectory(prefix="patch-status-") as tmp:
        for inner in patch.files:
            if inner in files:
                target = Path(tmp) / inner
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(files[inner])
        for args, verdict in ((["--check"], APPLIES), (["--check", "-R"], REVERSED)):
            cmd = ["git", "apply", *args, str(patch.path.resolve())]
            if subprocess.run(cmd, cwd=tmp, capture_output=True).returncode == 0:
                return verdict
    return NEITHER


def recorded(release: Release, modules: tuple[str, ...]) -> str:
    """The matrix record on MODULES' cases on RELEASE: 'fail', 'pass', or why not."""
    if not matrix.RECORD.exists():
        return "no matrix record"
    row = json.loads(matrix.RECORD.read_text())["rows"].get(release.version)
    if row is None:
        return "not in the matrix record"
    if row["sdist_sha256"] != release.sdist.sha256:
        return "matrix record is of another sdist"
    statuses = [s for c, s in row["cases"].items() if c.split("::", 1)[0] in modules]
    if any(s in ("failed", "error") for s in statuses):
        return "fail"
    return "pass" if "passed" in statuses else "no regression case ran"


def _judge(
    claim: versions.Release | None, version: str, applied: str, record: str
) -> tuple[bool, str]:
    """Is CLAIM confirmed on VERSION, given try_apply and recorded; what it means."""
    if claim is None:
        has = applied == REVERSED
        return True, "upstream has it: set Applied-Upstream" if has else "carried"
    if versions.release(version) < claim:
        ok = applied == APPLIES or record == "fail"
        return ok, "still needed" if ok else "cannot show it is still needed"
    if record == "fail":  # upstream's change does not make the tests pass
        return False, "regression cases fail where upstream should have it"
    if applied == APPLIES:  # so a passing record is some other change's doing
        return False, STILL_APPLIES + (ANOTHER_CHANGE if record == "pass" else "")
    if applied == REVERSED:
        return True, "upstream has it (reverse-applies)"
    if record == "pass":
        return True, "effect present (regression cases pass)"
    return False, "cannot show upstream has it"


def _bracket(claim: versions.Release, matrix_versions: list[str]) -> str | None:
    """The line for a claim that names no matrix release: the rows before and after it
    bracket it (the first release itself is read in the sdists: docs/backport-audit.md);
    None where no matrix release is newer, so nothing can show that upstream has it."""
    before = [v for v in matrix_versions if versions.release(v) < claim]
    after = [v for v in matrix_versions if versions.release(v) > claim]
    if not after:
        return None
    what = f"v{claim} is not in the version matrix: bracketed by"
    return f"  ({what} {before[-1] if before else 'none'} and {after[0]})"


def check(
    pins: Pins, python: Path | None = None, patches_dir: Path = tree.PATCHES_DIR
) -> list[str]:
    """Confirm every patch's claim (raise if one is not); the report lines."""
    pip = lambda: python or install.ensure_toolchain(pins)
    patches = read_series(patches_dir)
    sdists = {r.version: fetch.fetch(r.sdist, pip) for r in pins.releases}
    verdicts = {v: try_apply(patches, sdist) for v, sdist in sdists.items()}
    lines, problems = [], []
    for patch in patches:
        claim = patch.applied_upstream
        if not (modules := pins.regression_by_patch.get(patch.name)):
            said = f"{patch.name} has no regression modules in fork.toml"
            hint = "every patch needs a test that fails without it: name its module"
            raise ForkError(f"{said} [tests.regression]", f"{hint} there")
        header = patch.fields.get("Applied-Upstream", "(none)")
        lines.append(f"{patch.name}: Applied-Upstream {header}")
        if claim is not None and str(claim) not in verdicts:
            if bracket := _bracket(claim, list(verdicts)):
                lines.append(bracket)
            else:
                said = "not in the version matrix, none newer"
                problems.append(f"{patch.name} claims v{claim}: {said}")
        for release in pins.releases:
            version = release.version
            applied = verdicts[version][patch.name]
            record = recorded(release, modules)
            ok, meaning = _judge(claim, version, applied, record)
            row = f"patch {applied:15} matrix: {record:24} -> {meaning}"
            lines.append(f"  {version:8} {row}")
            if not ok:
                said = f"{meaning} (patch {applied}, matrix: {record})"
                problems.append(f"{patch.name} on {version}: {said}")
    print("\n".join(lines))
    if problems:
        said = f"{len(problems)} patch header claim(s) not confirmed, e.g."
        hint = "fix the DEP-3 header, or rerun `python3 -m forkbuild matrix` if the"
        raise ForkError(f"{said} {problems[0]}", f"{hint} record is stale")
    log.step("patch-status: every Applied-Upstream claim confirmed")
    return lines
