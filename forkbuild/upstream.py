"""`forkbuild upstream`: the fork's tests as a patch series for vLLM, with proof.

Against the newest release of the version matrix (the last of fork.toml [matrix]):
1. a worktree of its stock tree gets the fork's test modules that run there (every
   module with passing and no failing cases in that release's matrix record), plus the
   test helpers they import at module level; one commit, `git format-patch` into
   dist/upstream/;
2. a PR description in vLLM's template (purpose, test plan, test result with the
   version matrix table);
3. the proof: a second, fresh worktree of the release, `git am` of the series, the
   release's own binaries beside it, pytest on the added modules. It must pass;
4. the release's pre-commit hooks for test files pass on the added files, and every
   hand-written breakage of the release's packed-view code (forkbuild/mutants.py),
   applied alone to the proof tree, fails some case; the table goes into the PR text.
Nothing in the series refers to forkbuild: the tests import only vLLM and each other.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

from forkbuild import fetch, install, log, matrix, mutants, tree
from forkbuild.errors import ForkError
from forkbuild.pins import REPO_ROOT, Pins, build_dir
from forkbuild.pytest_runner import Outcome, run_pytest

DIST = REPO_ROOT / "dist" / "upstream"
TEST_PACKAGE = "tests.v1.worker."
COMMIT_MESSAGE = """\
[Tests] Regression tests for packed (cross-layer) KV cache views

With cross-layer KV blocks (OffloadingConnector, enable_cross_layers_blocks)
each block row packs one page per layer. Two defects of that layout were
fixed without a test: #47054 (FlashAttention read its pages in the wrong
order: illegal memory access on GPT-OSS; fixed by #47314 in 0.26.0) and
Triton's per-token-head KV scales, which every packed layer took from the
same bytes (fixed by the 0.26.0 rewrite of _ensure_scale_caches).

{files}

{evidence}

Signed-off-by: {identity}
"""


def newest(pins: Pins):
    if not pins.releases:
        raise ForkError("fork.toml lists no [matrix] releases", "add the newest upstream release")
    return pins.releases[-1]


# Modules that run on the newest release but protect nothing upstream has: they check
# the fork's own tools (the reference of the GPU kernel test, which needs a GPU and
# the per-backend API, and is not sent).
NOT_FOR_UPSTREAM = {
    "tests/v1/worker/test_attention_reference_cpu.py",
}


def modules_that_run(pins: Pins, version: str) -> list[str]:
    """Test modules with passing and no failing cases on VERSION, per the matrix record
    (less NOT_FOR_UPSTREAM)."""
    rows = json.loads(matrix.RECORD.read_text())["rows"] if matrix.RECORD.exists() else {}
    row = rows.get(version)
    if row is None or row["sdist_sha256"] != pins.release(version).sdist.sha256:
        raise ForkError(
            f"the version matrix has no current record of vLLM {version}",
            f"run `python3 -m forkbuild matrix {version}` first",
        )
    by_module: dict[str, list[str]] = {}
    for case, status in row["cases"].items():
        by_module.setdefault(case.split("::", 1)[0], []).append(status)
    return sorted(
        m for m, s in by_module.items()
        if "passed" in s and not {"failed", "error"} & set(s) and m not in NOT_FOR_UPSTREAM
    )


def per_release(pins: Pins, modules: list[str]) -> dict[str, tuple[int, int, int]]:
    """(passed, failed, skipped) of MODULES' cases on each stock release of the record."""
    rows = json.loads(matrix.RECORD.read_text())["rows"]
    counts = {}
    for release in pins.releases:
        row = rows.get(release.version)
        if row is None:
            continue
        statuses = [s for c, s in row["cases"].items() if c.split("::", 1)[0] in modules]
        counts[release.version] = (
            statuses.count("passed"),
            sum(s in ("failed", "error") for s in statuses),
            statuses.count("skipped") + statuses.count("xfailed"),
        )
    return counts


def evidence(counts: dict[str, tuple[int, int, int]]) -> str:
    failing = [v for v, (_, f, _) in counts.items() if f]
    passing = [v for v, (p, f, _) in counts.items() if p and not f]
    return (
        f"they fail on {', '.join(failing) or 'none'} (the releases with the bug) "
        f"and pass on {', '.join(passing) or 'none'}."
    )


def summary(path: str) -> str:
    """The first line of a test module's docstring."""
    source = (tree.TESTS_DIR.parent / path).read_text()
    return (ast.get_docstring(ast.parse(source)) or "").split("\n", 1)[0].strip()


def with_helpers(modules: list[str]) -> list[str]:
    """MODULES plus the fork's test files they import at module level, transitively."""
    wanted, todo = set(), list(modules)
    while todo:
        module = todo.pop()
        if module in wanted:
            continue
        wanted.add(module)
        source = (tree.TESTS_DIR.parent / module).read_text()
        for node in ast.parse(source).body:  # module level only: lazy imports stay out
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                if name.startswith(TEST_PACKAGE):
                    todo.append(name.replace(".", "/") + ".py")
    # A fork module imported anywhere else (inside a function) must come along too,
    # or the series would refer to a file upstream does not have.
    for module in wanted:
        source = (tree.TESTS_DIR.parent / module).read_text()
        for node in ast.walk(ast.parse(source)):
            name = node.module if isinstance(node, ast.ImportFrom) else None
            if name and name.startswith(TEST_PACKAGE) and name.replace(".", "/") + ".py" not in wanted:
                raise ForkError(
                    f"{module} imports {name} inside a function; the series would lack it",
                    "import it at module level or drop the dependency",
                )
    return sorted(wanted)


def submitter() -> dict[str, str]:
    """The git identity of whoever runs `make upstream` (git config user.name and
    user.email, as `git commit` reads them from here): the series' author, and its
    DCO sign-off. Without one, stop: a sign-off is a statement only its author makes."""
    found = {}
    for key in ("user.name", "user.email"):
        got = tree.git(["config", "--get", key], REPO_ROOT)
        found[key] = got.stdout.strip() if got.returncode == 0 else ""
    missing = [key for key, value in found.items() if not value]
    if missing:
        raise ForkError(
            f"git has no {' and no '.join(missing)}: the series is signed off (DCO) by "
            "whoever runs `make upstream`",
            'set yours: git config --global user.name "Your Name" && '
            "git config --global user.email you@example.com",
        )
    name, email = found["user.name"], found["user.email"]
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email,
            "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email}


# The release's own hooks (tools/pre_commit/) that its .pre-commit-config.yaml applies to
# test files, beside ruff check and ruff format.
HOOK_SCRIPTS = ("check_spdx_header", "check_forbidden_imports", "check_test_tethering")


def pinned_ruff(release_tree: Path) -> str:
    """The ruff version the release's .pre-commit-config.yaml pins (ruff-pre-commit rev)."""
    config = (release_tree / ".pre-commit-config.yaml").read_text()
    found = re.search(r"astral-sh/ruff-pre-commit\s*\n\s*rev:\s*v?([0-9][0-9.]*)", config)
    if not found:
        raise ForkError(f"{release_tree.name}/.pre-commit-config.yaml pins no ruff-pre-commit rev",
                        "read the release's hooks and update forkbuild/upstream.py")
    return found[1]


def run_hooks(python: Path, release_tree: Path, files: list[str]) -> list[str]:
    """Run the release's pre-commit hooks for test files on FILES, from RELEASE_TREE
    (its ruff configuration, its hook scripts, its Buildkite jobs) with the ruff
    version it pins, which must be the fork's venv's (hash-locked). Returns one line per
    hook; raises with every finding."""
    ruff = python.parent / "ruff"
    wanted = pinned_ruff(release_tree)
    have = subprocess.run([str(ruff), "--version"], capture_output=True, text=True, check=False)
    if have.returncode != 0 or have.stdout.split()[-1:] != [wanted]:
        raise ForkError(
            f"{release_tree.name} runs its hooks with ruff {wanted}; the fork's venv has "
            f"{have.stdout.strip() or 'none'}",
            f"pin ruff=={wanted} in fork.toml [toolchain] test, then `make lock`",
        )
    hooks = [
        ("ruff check", [str(ruff), "check", "--no-cache", *files]),
        ("ruff format", [str(ruff), "format", "--check", "--no-cache", *files]),
        *((name, [str(python), f"tools/pre_commit/{name}.py", *files]) for name in HOOK_SCRIPTS),
    ]
    lines, findings = [], []
    for name, cmd in hooks:
        done = subprocess.run(cmd, cwd=release_tree, capture_output=True, text=True, check=False)
        said = (done.stdout + done.stderr).strip()
        lines.append(f"{name}: {'passed' if done.returncode == 0 else 'FAILED'}")
        if done.returncode != 0:
            findings.append(f"{name}: {said.splitlines()[0] if said else f'exit {done.returncode}'}")
            log.step(f"upstream: hook {name} failed:\n{said}")
    if findings:
        raise ForkError(
            f"{len(findings)} of the release's pre-commit hooks fail on the series: "
            + "; ".join(findings),
            "fix the test files (vLLM's CI runs the same hooks) and run `make upstream` again",
        )
    log.step(f"upstream: the release's hooks pass on {len(files)} file(s) (ruff {wanted})")
    return lines


def _worktree(repo: Path, path: Path, tag: str, branch: str) -> None:
    env = {**os.environ, **tree.IDENTITY}
    if path.exists():
        shutil.rmtree(path)
    tree.git(["worktree", "prune"], repo, env)
    made = tree.git(["worktree", "add", "-q", "--force", "-B", branch, str(path), tag], repo, env)
    if made.returncode != 0:
        raise ForkError(f"could not create a worktree of {tag}: {made.stderr.strip()}")


def build(pins: Pins) -> Path:
    author = submitter()  # before minutes of work
    release = newest(pins)
    version = release.version
    modules = modules_that_run(pins, version)
    if not modules:
        raise ForkError(f"no fork test module passes on vLLM {version}", "see docs/version-matrix.md")
    files = with_helpers(modules)
    repo = matrix.release_tree(pins, release)
    work = build_dir() / "upstream" / "work"
    env = {**os.environ, **tree.IDENTITY}
    counts = per_release(pins, modules)

    _worktree(repo, work, f"v{version}", "upstream-tests")
    for rel in files:
        text = (tree.TESTS_DIR.parent / rel).read_text()
        if "forkbuild" in text:
            raise ForkError(f"{rel} mentions forkbuild", "upstream tests must not depend on the fork's tooling")
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    identity = f"{author['GIT_AUTHOR_NAME']} <{author['GIT_AUTHOR_EMAIL']}>"
    tree._git_ok(["add", *files], work, env, "stage the tests")
    listed = "\n".join(textwrap.fill(f"- {f}: {summary(f)}", 72, subsequent_indent="  ") for f in files)
    message = COMMIT_MESSAGE.format(
        identity=identity,
        files=listed,
        evidence=textwrap.fill(f"Run unchanged against released vLLM, {evidence(counts)}", 72),
    )
    tree._git_ok(["commit", "-q", "-m", message], work, {**env, **author}, "commit the tests")

    if DIST.exists():
        shutil.rmtree(DIST)
    DIST.mkdir(parents=True)
    tree._git_ok(
        ["format-patch", "-q", "--zero-commit", "--no-signature", "-o", str(DIST), f"v{version}..HEAD"],
        work, env,
        "write the patch series",
    )
    series = sorted(DIST.glob("*.patch"))
    log.step(f"upstream: {len(series)} patch(es) against v{version} in {DIST}")

    outcome = prove(pins, release, repo, series, modules)
    proof_tree = build_dir() / "upstream" / "proof"
    hooks = run_hooks(install.ensure_toolchain(pins), proof_tree, files)
    verdicts = mutants.kill(
        matrix.release_python(pins, release, proof_tree), proof_tree, mutants.for_release(version),
        [*modules, "-m", "cpu_test"], DIST / "mutants", extra_env=matrix.CPU_ENV,
    )
    with (DIST / "PROOF.txt").open("a") as proof:
        proof.write("".join(f"hook {line}\n" for line in hooks))
        proof.write("".join(f"mutant killed by {len(v.killers)} case(s): {v.mutant.name}\n"
                            for v in verdicts))
    (DIST / "PR_DESCRIPTION.md").write_text(
        describe(version, files, modules, outcome, counts, mutants.table(verdicts))
    )
    log.step(f"upstream: PR description and proof written to {DIST}")
    return DIST


def prove(pins: Pins, release, repo: Path, series: list[Path], modules: list[str]) -> Outcome:
    """git am the series onto a fresh worktree of the release and run the tests there."""
    proof = build_dir() / "upstream" / "proof"
    env = {**os.environ, **tree.IDENTITY}
    _worktree(repo, proof, f"v{release.version}", "upstream-proof")
    applied = tree.git(["am", "--keep-cr", *map(str, series)], proof, env)
    if applied.returncode != 0:
        raise ForkError(f"the series does not apply with git am: {applied.stdout.strip()[-300:]}")
    binaries = fetch.fetch(release.binaries, lambda: install.ensure_toolchain(pins, "cpu"))
    matrix.add_binaries(proof, binaries, release.version)
    python = matrix.release_python(pins, release, proof)
    outcome = run_pytest(
        python, proof, [*modules, "-m", "cpu_test", "-rs"], DIST / "proof-junit.xml",
        output=DIST / "proof-pytest.log", extra_env=matrix.CPU_ENV,
    )
    log_lines = [
        f"vLLM {release.version} sdist {release.sdist.sha256}",
        f"git am {' '.join(p.name for p in series)}: applied",
        f"pytest {' '.join(modules)} -m cpu_test: {outcome}",
        *(f"  {case} {status}" for case, status in sorted(outcome.cases.items())),
    ]
    (DIST / "PROOF.txt").write_text("\n".join(log_lines) + "\n")
    if outcome.failed or outcome.errors or not outcome.passed:
        raise ForkError(f"the tests do not pass on v{release.version} after git am: {outcome}",
                        f"see {DIST / 'proof-pytest.log'}")
    return outcome


def describe(
    version: str, files: list[str], modules: list[str], outcome: Outcome,
    counts: dict[str, tuple[int, int, int]], mutation_table: str,
) -> str:
    record = json.loads(matrix.RECORD.read_text())["rows"]
    table_lines = [
        "| vLLM | packed branch of `_reshape_attention_kv_cache` | passed | failed | skipped |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {v} | {record[v]['line']} | {p} | {f} | {sk} |" for v, (p, f, sk) in counts.items()),
    ]
    listed = "\n".join(f"- `{f}`: {summary(f)}" for f in files)
    return f"""\
## Purpose

Regression tests for packed (cross-layer) KV caches, whose block rows hold one page per
layer. Two defects of that layout were fixed without a test: #47054 (FlashAttention
received its pages in the wrong order and crashed with an illegal memory access on
GPT-OSS under the `OffloadingConnector` with `enable_cross_layers_blocks`; fixed by
#47314 in 0.26.0) and Triton's per-token-head KV scales, which every packed layer took
from the same bytes, silently (fixed when 0.26.0 rewrote `_ensure_scale_caches`).

On vLLM {version} packing comes from the resolved `KVCacheLayout`: the block-outermost
layouts (`BLHNC`, `BLNHC`, e.g. through `VLLM_KV_CACHE_LAYOUT`) pack; the
`OffloadingConnector` itself asks for the layer-compact `LBHNC`, and
`enable_cross_layers_blocks` no longer changes the plan. The tests walk that path on
CPU with vLLM's own code: the planner places a GPT-OSS-shaped hybrid model's layers
as the layout says (equal and unequal page sizes, padded pages); the v1 and v2 model
runners' views walk each layer's own page in the layout's physical order, alias the
allocation at the tensor's offset and write nothing outside the pages; the
`OffloadingConnector` worker registers packed rows as one block-row tensor, and a
store and load of rows reads every layer back exactly; where the series has them,
Triton's cache-write and unified-attention kernels (under `TRITON_INTERPRET=1`) read
and write exactly each layer's bytes, and each layer's per-token-head scales lie in its
own page. Not run: the CUDA transfer worker of the CPU offloading spec (a subclass of
the spec records what it would receive) and the v1 runner's constructor (its own
`initialize_kv_cache_tensors` runs on a runner object holding only what that method
reads). `pytest.mark.cpu_test`; no mocks of the code under test.

Files:
{listed}

## Test Plan

```
pytest {' '.join(modules)} -m cpu_test
```

Also run, unchanged, against the stock releases below, each from its sdist with the
compiled extensions of its own wheel, on CPU: {evidence(counts)}

## Test Result

On vLLM {version} with this series applied by `git am`: {outcome}. The release's own
pre-commit hooks for test files pass on the series, run from that tree: ruff check and
ruff format at the version `.pre-commit-config.yaml` pins, `check_spdx_header`,
`check_forbidden_imports` and `check_test_tethering`.

{chr(10).join(table_lines)}

Mutation check: each breakage below, made by hand in vLLM {version}'s packed-view code
and applied alone to the tree with this series, fails the cases named.

{mutation_table}

(Modules written for both layout APIs run the same cases through the per-backend API up
to 0.26 and through `create_kv_cache_views` after the rewrite; the layout-API modules
skip before it. Further tests of the downstream suite drive the per-backend API that
the rewrite removed, and its GPU and CPU-engine tests have not run on {version}; they
are not part of this PR.)

---
<details>
<summary>Essential Elements of an Effective PR Description Checklist</summary>

- [x] The purpose of the PR.
- [x] The test plan.
- [x] The test results.
- [ ] (Optional) Documentation update: none needed.

The commit is signed off (DCO) by whoever ran `make upstream`, with their git identity.
</details>
"""
