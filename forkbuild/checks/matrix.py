"""`forkbuild matrix`: the fork's CPU suite on each [matrix] release (its sdist as git
in build/matrix/vllm-<version>, the fork's tests, its wheel's compiled extensions, its
torch) and on the fork: docs/version-matrix.md and .json (read by patch-status)."""

import json
import platform
import shutil
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

from forkbuild.checks import regression
from forkbuild.core import fixcheck, log
from forkbuild.core.errors import ForkError
from forkbuild.core.hashing import digest_of
from forkbuild.core.pins import REPO_ROOT, Pins, Release, build_dir
from forkbuild.core.pytest_runner import run_pytest
from forkbuild.setup import fetch, install, tree, uv

DOCS = REPO_ROOT / "docs"
TABLE = DOCS / "version-matrix.md"
RECORD = DOCS / "version-matrix.json"
FORK_ROW = "fork"  # the record's key for the patched tree
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu"}  # else 0.33.0's CUDA extensions want a GPU


def matrix_dir() -> Path:
    return build_dir() / "matrix"


def release_tree(pins: Pins, release: Release) -> Path:
    """build/matrix/vllm-<version>: the stock release + the fork's tests + binaries."""
    toolchain = lambda: install.ensure_toolchain(pins, "cpu")  # pip reads sdists: torch
    sdist = fetch.fetch(release.sdist, toolchain)
    binaries = fetch.fetch(release.binaries, toolchain)
    inputs = [release.sdist.sha256, release.binaries.sha256]
    for path in tree.overlay_files():
        inputs += [str(path.relative_to(tree.TESTS_DIR)), path.read_bytes()]
    digest = digest_of(["matrix-tree-1", *inputs])
    final = matrix_dir() / f"vllm-{release.version}"
    marker = final / ".git" / tree.INPUTS_FILE
    if marker.exists() and marker.read_text().strip() == digest:
        log.step(f"matrix: {final} is up to date")
        return final
    matrix_dir().mkdir(parents=True, exist_ok=True)
    for stale in matrix_dir().glob(".tree-*"):
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=".tree-new-", dir=matrix_dir()) as made:
        tmp = Path(made)  # moved into place whole; a failed build is deleted
        env = tree.commit_release(tmp, sdist, release.version, release.sdist.sha256)
        tree.overlay_tests(tmp, env)
        add_binaries(tmp, binaries, release.version)
        (tmp / ".git" / tree.INPUTS_FILE).write_text(digest + "\n")
        tree.swap_into_place(tmp, final)
    log.step(f"matrix: {final} built")
    return final


def add_binaries(dest: Path, wheel: Path, version: str) -> None:
    """The wheel's files beside the sdist's, and version metadata naming the CPU."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith("vllm/") and n[-1] != "/"]
        added = [zf.extract(n, dest) for n in names if not (dest / n).exists()]
    label = f"{version}+cpu"
    (dest / "vllm" / "_version.py").write_text(
        f"__version__ = version = {label!r}\n__version_tuple__ = version_tuple = "
        f"{(*map(int, version.split('.')), 'cpu')!r}\n"
    )
    # First on sys.path, this metadata wins over whatever vLLM the venv has installed.
    meta = dest / "vllm.egg-info"
    meta.mkdir()
    (meta / "PKG-INFO").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {label}\n"
    )
    log.step(f"matrix: {len(added)} file(s) from {wheel.name} added beside the sources")


def release_python(pins: Pins, release: Release, release_tree_path: Path) -> Path:
    """The fork's venv on the fork's torch, else one per torch with the release's own
    requirements."""
    if release.torch == pins.torch:
        python, _, _ = install.install(pins, "cpu")
        return python
    prefix = f"torch-{release.torch}-"  # its wheels' file names
    wheels = [sha for name, sha in pins.torch_sha256.items() if name.startswith(prefix)]
    if not wheels:
        raise ForkError(
            f"vLLM {release.version} needs torch {release.torch}, which fork.toml does "
            "not pin",
            "add its wheels' sha256 to [matrix.torch-sha256]",
        )
    home = matrix_dir() / f"venv-torch-{release.torch}"
    # A stock release is tested on its own requirement ranges (what its users get), not
    # on a lock; its torch is checked against fork.toml's pins all the same.
    hashes = [f"--hash=sha256:{sha}" for sha in wheels]
    requirements = [" ".join([f"torch=={release.torch}", *hashes]), *pins.test]
    req_file = release_tree_path / "requirements" / "common.txt"
    key = digest_of([platform.python_version(), *requirements, req_file.read_bytes()])
    text = "".join(f"{r}\n" for r in requirements) + f"-r {req_file}\n"
    what = f"torch {release.torch} and vLLM {release.version}'s requirements"
    return uv.stamped_venv(pins, home, Path(sys.executable), text, key, what)


def read_line(tree_path: Path) -> str:
    module = tree_path / fixcheck.MODULE_PATH
    source = module.read_text() if module.exists() else ""
    verdict = fixcheck.classify(source)
    if verdict == "unknown" and fixcheck.FUNCTION not in source:
        return "removed (layout rewrite)"
    return verdict


def run(pins: Pins, versions: list[str] | None = None) -> None:
    wanted = [pins.release(v) for v in versions] if versions else list(pins.releases)
    rows = {}
    for index, release in enumerate(wanted, 1):
        log.step(f"matrix: [{index}/{len(wanted)}] vLLM {release.version}")
        path = release_tree(pins, release)
        python = release_python(pins, release, path)
        rows[release.version] = _row(pins, release, python, path, release.version)
    if not versions or pins.upstream_version in versions:
        python, fork_tree, _ = install.install(pins, "cpu")
        wheel = pins.routes["cpu"].wheel
        fork = Release(pins.upstream_version, pins.torch, pins.sdist, wheel)
        rows[FORK_ROW] = _row(pins, fork, python, fork_tree, FORK_ROW)
    write(pins, rows)


def _row(pins: Pins, release: Release, python: Path, path: Path, key: str) -> dict:
    """The record's row KEY (a release version, or FORK_ROW): the suite run there."""
    regression.check_imports_from(python, path)
    results = build_dir() / "test-results"
    results.mkdir(parents=True, exist_ok=True)
    # The fork's CPU test modules, as overlaid on PATH: their cpu_test cases.
    tests = [p for p in tree.overlay_files() if p.match("test_*.py")]
    modules = [str(Path("tests") / p.relative_to(tree.TESTS_DIR)) for p in tests]
    not_cpu = (*pins.gpu_tests, *pins.cuda_route_tests)
    args = [m for m in modules if m not in not_cpu and (path / m).is_file()]
    args += ["-m", "cpu_test"]
    junit, output = results / f"matrix-{key}.xml", results / f"matrix-{key}.log"
    outcome = run_pytest(python, path, args, junit, output=output, extra_env=CPU_ENV)
    log.step(f"matrix: vLLM {release.version}: {outcome}")
    fork = f"{pins.upstream_version} + patches/ (the fork)"
    return {
        "title": fork if key == FORK_ROW else key,
        "torch": release.torch,
        "binaries": release.binaries.filename,
        "line": read_line(path),  # what the #47054 code reads as there
        "sdist_sha256": release.sdist.sha256,
        "note": release.note,
        "cases": dict(sorted(outcome.cases.items())),
        "skip_reasons": dict(sorted(outcome.reasons.items())),
    }


def _statuses(cases: dict[str, str], modules: tuple[str, ...], inside: bool) -> list:
    """The statuses of the CASES in MODULES (INSIDE) or in none of them."""
    return [s for c, s in cases.items() if (c.split("::", 1)[0] in modules) == inside]


def _counts(statuses: list[str]) -> str:  # passed / failed, errors / skipped, xfailed
    n = Counter(statuses)
    return f"{n['passed']} / {n['failed'] + n['error']} / {n['skipped'] + n['xfailed']}"


def reading(statuses: list[str]) -> str:
    """What the STATUSES of one patch's regression cases say about a release."""
    if bad := sum(s in ("failed", "error") for s in statuses):
        return f"needed ({bad} fail)"
    return "has the fix" if "passed" in statuses else "not testable"


def write(pins: Pins, rows: dict[str, dict]) -> None:
    """ROWS (_row's) into the record, which keeps the others; the table from it."""
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {"rows": {}}
    record["rows"] |= rows
    order = [r.version for r in pins.releases] + [FORK_ROW]
    record["rows"] = {k: record["rows"][k] for k in order if k in record["rows"]}
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    table = render(pins, record)
    TABLE.write_text(table)
    print(table)
    wrote = [str(p.relative_to(REPO_ROOT)) for p in (TABLE, RECORD)]
    log.step(f"matrix: wrote {' and '.join(wrote)}")


INTRO = """\
# Version matrix: the fork's CPU suite on stock vLLM releases

Made by `python3 -m forkbuild matrix` (about 15 minutes on 2 cores); do not edit by \
hand.
Each release runs from its pinned sdist with the compiled extensions of its pinned
binary wheel, on the torch it pins; the fork's test modules are the same everywhere.
Per patch, its regression modules (fork.toml [tests.regression]): passed / failed
(incl. errors) / skipped, and what they say: the release still needs the patch, or
has the fix. The last column counts every other fork case. Patches:

"""


def render(pins: Pins, record: dict) -> str:
    patches, rows = pins.regression_by_patch, record["rows"].values()
    ids = [name.split("-", 1)[0] for name in patches]
    lines = [
        *INTRO.splitlines(),
        *(f"- {n}: `patches/{name}`" for n, name in zip(ids, patches)),
        "",
        "| release | torch | compiled extensions from | packed branch of "
        "`_reshape_attention_kv_cache` "
        + "".join(f"| patch {n} cases | patch {n} " for n in ids)
        + "| other fork cases |",
        "| --- | --- | --- | --- " + "| --- | --- " * len(patches) + "| --- |",
    ]
    for row in rows:
        per_patch = [_statuses(row["cases"], m, True) for m in patches.values()]
        others = _statuses(row["cases"], pins.regression_tests, False)
        lines.append(
            f"| {row['title']} | {row['torch']} | `{row['binaries']}` | {row['line']} "
            + "".join(f"| {_counts(s)} | {reading(s)} " for s in per_patch)
            + f"| {_counts(others)} |"
        )
    notes = [f"- {row['title']}: {row['note']}" for row in rows if row.get("note")]
    if notes:
        lines += ["", "## Notes", "", *notes]
    lines += ["", "## Why cases skip (or xfail: pytest reports them as skipped)", ""]
    for row in rows:
        for reason, count in sorted(Counter(row["skip_reasons"].values()).items()):
            lines.append(f"- {row['title']}: {count} case(s): {reason}")
    return "\n".join(lines) + "\n"
