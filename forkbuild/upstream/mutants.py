"""The differential mutants of `forkbuild upstream`: breakages of the release's packed
KV cache path (upstream-prs/mutants/<release>/), each applied alone and run against the
release's tests and the PRs' cases; a PR is worth what it kills that those miss."""

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import tomllib
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from forkbuild.core import log
from forkbuild.core.errors import ForkError, run_or_fail
from forkbuild.core.pins import REPO_ROOT
from forkbuild.core.pytest_runner import Outcome, read_junit, run_pytest
from forkbuild.setup import tree

MUTANTS_DIR = REPO_ROOT / "upstream-prs" / "mutants"
TABLE = REPO_ROOT / "upstream-prs" / "mutants-table.template.md"
# A PR set must prove itself on at least this many breakages the release's tests miss.
MIN_SURVIVORS = 8
PrCases = dict[str, tuple[str, ...]]  # each PR's name -> its cases


@dataclass(frozen=True)
class Mutant:
    name: str  # what it breaks, as the PR description's table shows it
    diff: str  # one file's unified diff against the release, as `git apply` takes it
    tests: tuple[str, ...]  # the release's own test files of that file, as shipped
    # A GPU job that a change to the file triggers and that would likely catch it (read,
    # not run: docs/upstream-triggered-jobs.md), or "" where none would.
    gpu_job: str = ""

    @property
    def path(self) -> str:  # the file in the release tree: the diff's "--- a/" line
        return self.diff.split("\n", 1)[0].removeprefix("--- a/")


def for_release(version: str, folder: Path = MUTANTS_DIR) -> tuple[Mutant, ...]:
    """The mutants of vLLM VERSION in their files' order, with their release tests."""
    where = folder / version
    try:
        meta = tomllib.loads((where / "mutants.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        said = f"there are no mutants of vLLM {version}'s packed-view code ({err})"
        read = "read the release's packed path and its own tests of it, and write them"
        hint = f"{read} in {where}/ (NN-name.diff and mutants.toml)"
        raise ForkError(said, hint) from None
    tests = {path: tuple(t["run"]) for t in meta["tests"].values() for path in t["of"]}
    found = []
    for stem, about in sorted(meta["mutants"].items()):
        # newline="": CRLF stays CRLF, as in the file git applies it to
        diff = (where / f"{stem}.diff").open(newline="").read()
        mutant = Mutant(about["name"], diff, (), about.get("gpu_job", ""))
        if mutant.path not in tests:
            said = f"{where}/mutants.toml names no release tests of {mutant.path}"
            grep = "grep the release's tests/ for the code the mutant changes"
            raise ForkError(said, f"{grep} and list them in its [tests]")
        found.append(dataclasses.replace(mutant, tests=tests[mutant.path]))
    return tuple(found)


@contextlib.contextmanager
def applied(worktree: Path, mutant: Mutant) -> Iterator[None]:
    """MUTANT applied in WORKTREE (git apply: all or nothing), then undone."""
    # Outside the worktree: its untracked files are part of a run's key.
    with tempfile.NamedTemporaryFile("w", suffix=".diff", newline="") as patch:
        patch.write(mutant.diff), patch.flush()
        done = tree.git(["apply", "--whitespace=nowarn", patch.name], worktree)
    if done.returncode != 0:
        errs = "; ".join(done.stderr.split("\n")).strip("; ")
        said = f"git apply refused mutant '{mutant.name}' on {mutant.path}: {errs}"
        against = "the release's code is not what the mutant was written against"
        hint = "rewrite the mutant's diff in upstream-prs/mutants/<release>/ from the"
        raise ForkError(f"{said}: {against}", f"{hint} release's code")
    _drop_bytecode(worktree / mutant.path)
    try:
        yield
    finally:
        what = f"restore {mutant.path} in {worktree}"
        tree.git_ok(["checkout", "--", mutant.path], worktree, None, what)
        _drop_bytecode(worktree / mutant.path)


def _drop_bytecode(source: Path) -> None:
    # A .pyc is trusted on the source's mtime (whole seconds) and size: a mutant of the
    # same size written within the second would otherwise run the old code.
    for pyc in (source.parent / "__pycache__").glob(f"{source.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def killers(outcome: Outcome, baseline: Outcome | None = None) -> list[str]:
    """The cases failing in OUTCOME that passed in BASELINE; a case BASELINE lacks
    counts when its function (or module) passed: a mutant can rename ids."""
    failed = sorted(c for c, s in outcome.cases.items() if s in ("failed", "error"))
    if baseline is None:
        return failed
    passed = {c for c, s in baseline.cases.items() if s == "passed"}
    functions = {c.split("[", 1)[0] for c in passed}
    modules = {c.split("::", 1)[0] for c in passed}

    def ran_before(case: str) -> bool:
        if case in baseline.cases:
            return case in passed
        if case.endswith("::(module)"):
            return case.split("::", 1)[0] in modules
        return case.split("[", 1)[0] in functions

    return [c for c in failed if ran_before(c)]


AFRESH = "run the step again: it makes its worktrees afresh"
# Files a run or a hook leaves in a worktree that decide no result.
_TOOL_CACHES = ("__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache")


@dataclass(frozen=True)
class Runs:
    """The pytest runs of one differential, each kept in CACHE by its _key."""

    python: Path
    results: Path
    cache: Path
    extra_env: dict[str, str] | None = None

    def run(
        self,
        worktree: Path,
        pytest_args: list[str],
        name: str,
        mutant: Mutant | None = None,
        keep: Callable[[Outcome], bool] = lambda outcome: True,
    ) -> Outcome:
        """One pytest run, MUTANT applied and undone; a run made before is read back (a
        stopped step resumes), kept if it ended and KEEP agrees."""
        if mutant is not None:
            log.step(f"mutants: {mutant.name} vs {name}")
        self.results.mkdir(parents=True, exist_ok=True)
        key = self._key(worktree, mutant, pytest_args)
        if (outcome := self._read_back(key, name)) is not None:
            return outcome
        if mutant is not None:
            pytest_args = [*pytest_args, "--continue-on-collection-errors"]
        report, output = self.results / f"{name}.xml", self.results / f"{name}.log"
        args = (self.python, worktree, pytest_args, report)
        with applied(worktree, mutant) if mutant else contextlib.nullcontext():
            outcome = run_pytest(*args, output=output, extra_env=self.extra_env)
        if mutant is not None:  # raw: differential() subtracts what fails unmutated
            n = len(killers(outcome))
            log.step(f"mutants: {name}: {n or 'no'} case{'(s)' * bool(n)} failed")
        if not outcome.killed and keep(outcome):
            self.cache.mkdir(parents=True, exist_ok=True)
            for suffix in (".log", ".xml"):  # the XML last and whole: it means kept
                partial = self.cache / f"{key}{suffix}.partial"
                shutil.copyfile(self.results / f"{name}{suffix}", partial)
                os.replace(partial, self.cache / f"{key}{suffix}")
        return outcome

    def _read_back(self, key: str, name: str) -> Outcome | None:
        """The run kept under KEY, its report and log copied as NAME's; None: none."""
        try:
            outcome = read_junit(self.cache / f"{key}.xml")
        except (OSError, ET.ParseError):  # none, or cut off: a miss
            return None
        for suffix in (".xml", ".log"):
            if (kept := self.cache / f"{key}{suffix}").is_file():
                shutil.copyfile(kept, self.results / f"{name}{suffix}")
        said = f"the same run was made before ({self.cache / key}.xml): {outcome}"
        log.step(f"mutants: {name}: {said}")
        return outcome

    def _key(self, worktree: Path, mutant: Mutant | None, args: list[str]) -> str:
        """What decides a run's result; the tree object, not the commit: the PRs' mails
        are re-signed with a new date each time."""

        def git_out(*args: str) -> str:
            failed = f"git {' '.join(args)} failed in {worktree}"
            return run_or_fail(["git", *args], failed, AFRESH, cwd=worktree).stdout

        if changed := git_out("status", "--porcelain", "--untracked-files=no").strip():
            # a mutant left behind by a killed run: every result would be wrong
            first = changed.splitlines()[0]
            said = f"{worktree} has changes its commit does not hold: {first}"
            raise ForkError(said, AFRESH)
        skip = [f"--exclude={cache}" for cache in _TOOL_CACHES]
        untracked = sorted(
            f"{name}:{(worktree / name).stat().st_size}"
            for name in git_out("ls-files", "--others", "-z", *skip).split("\0")
            if name and (worktree / name).is_file()
        )
        lib = self.python.parent.parent / "lib"
        parts = [
            str(self.python),
            sorted(p.name for p in lib.glob("python*/site-packages/*.dist-info")),
            git_out("rev-parse", "HEAD^{tree}").strip(),
            untracked,
            [mutant.path, mutant.diff] if mutant else None,
            args,
            sorted((self.extra_env or {}).items()),
            sorted(  # what of the caller's pytest or vLLM read, not the fork's own
                (k, v)
                for k, v in os.environ.items()
                if k.startswith(("VLLM_", "PYTEST_", "TORCH", "OMP_", "CUDA_", "HF_"))
                and not k.startswith("VLLM_FORK_")
            ),
        ]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Row:
    """One mutant: what the release's own tests did with it, and each PR's cases."""

    mutant: Mutant
    upstream_killers: list[str]  # the release's cases it made fail (the first: -x)
    by_pr: dict[str, list[str]]  # PR name -> its cases that failed

    @property
    def survivor(self) -> bool:  # missed by the release's own tests, run here (CPU)
        return not self.upstream_killers

    @property
    def counts(self) -> bool:
        """Caught by no CI job a change to the file triggers: it measures a PR."""
        return self.survivor and not self.mutant.gpu_job


def deselect(baseline: Outcome) -> list[str]:
    """pytest arguments leaving out each case failing unmutated: it kills nothing, costs
    time and would stop `-x` at a failure that is no kill."""
    return [
        arg
        for case, status in sorted(baseline.cases.items())
        if status in ("failed", "error") and not case.endswith("::(module)")
        for arg in ("--deselect", case)
    ]


def _upstream_killers(
    runs: Runs, stock: Path, mutant: Mutant, baseline: Outcome, what: str
) -> list[str]:
    """The release's cases MUTANT makes fail, up to the first (-x); were a deselection
    to miss, -x could stop at an old failure and hide a kill: then run it whole."""
    args = [*mutant.tests, *deselect(baseline), "-x"]
    found = killers(fast := runs.run(stock, args, what, mutant), baseline)
    if (fast.failed or fast.errors) and not found:
        log.step(f"mutants: {what} stopped at a case failing unmutated too: run whole")
        whole = runs.run(stock, list(mutant.tests), f"{what}-whole", mutant)
        found = killers(whole, baseline)
    return found


def _all_pass(outcome: Outcome) -> bool:  # what the PRs' cases must do unmutated
    return outcome.passed > 0 and not (outcome.failed or outcome.errors)


def _baselines(
    runs: Runs, stock: Path, mutants: tuple[Mutant, ...]
) -> dict[tuple[str, ...], Outcome]:
    """Each set of the release's tests, run once unmutated: some case must pass."""
    baselines = {}
    for number, tests in enumerate(sorted({m.tests for m in mutants}), 1):
        paths = ", ".join(sorted({m.path for m in mutants if m.tests == tests}))
        name = f"baseline-{number}"
        baseline = runs.run(stock, list(tests), name, keep=lambda o: o.passed > 0)
        if not baseline.passed:
            said = f"no case of the release's own tests of {paths} passes unmutated"
            see = f"see {runs.results / f'{name}.log'}"
            raise ForkError(f"{said}: {baseline}", see)
        log.step(f"mutants: the release's tests of {paths}, unmutated: {baseline}")
        baselines[tests] = baseline
    return baselines


def owns(cases: tuple[str, ...], case: str) -> bool:
    """CASE is one of CASES, or a parameter set or a case of one of them."""
    return any(case == c or case.startswith((c + "[", c + "::")) for c in cases)


def differential(
    runs: Runs, stock: Path, with_prs: Path, found: tuple[Mutant, ...], prs: PrCases
) -> list[Row]:
    """Every mutant against the release's tests of its file (on STOCK) and the PRs'
    cases (WITH_PRS, each credited to the PR that owns it); each set of release tests
    runs unmutated first: what fails there is no kill. Two worktrees: side by side."""
    cases = [case for pr_cases in prs.values() for case in pr_cases]
    if side_by_side := stock.resolve() != with_prs.resolve():
        # Each of two runs at once gets its share of the cores (torch takes them all
        # otherwise), the unmutated runs too: load cannot make a mutated run fail.
        threads = str(max(1, (os.cpu_count() or 2) // 2))
        env = {**(runs.extra_env or {}), "OMP_NUM_THREADS": threads}
        runs = dataclasses.replace(runs, extra_env=env)
    clean = runs.run(with_prs, cases, "clean-prs", keep=_all_pass)
    if not _all_pass(clean):
        see = f"see {runs.results / 'clean-prs.log'}"
        raise ForkError(f"the PRs' cases do not pass unmutated: {clean}", see)
    baselines = _baselines(runs, stock, found)
    rows = []
    with ThreadPoolExecutor(max_workers=2 if side_by_side else 1) as pool:
        for number, mutant in enumerate(found, 1):
            mine = pool.submit(runs.run, with_prs, cases, f"pr-cases-{number}", mutant)
            if not side_by_side:
                mine.result()
            base, what = baselines[mutant.tests], f"release-tests-{number}"
            up = _upstream_killers(runs, stock, mutant, base, what)
            failed = killers(mine.result(), clean)
            by_pr = {n: [c for c in failed if owns(cs, c)] for n, cs in prs.items()}
            rows.append(Row(mutant, up, by_pr))
    return rows


def check(rows: list[Row], pr_names: list[str]) -> None:
    """Each mutant that counts is killed by some PR, each PR kills one, and they are at
    least MIN_SURVIVORS."""
    survivors = [r for r in rows if r.counts]
    unkilled = [r.mutant.name for r in survivors if not any(r.by_pr.values())]
    idle = [n for n in pr_names if not any(r.by_pr[n] for r in survivors)]
    problems = []
    if unkilled:
        said = f"{len(unkilled)} mutant(s) survive the triggered CI jobs and every PR: "
        problems.append(said + "; ".join(unkilled))
    if idle:
        miss = "kill(s) no mutant the triggered CI jobs miss: not worth sending"
        problems.append(f"{', '.join(idle)} {miss}")
    if len(survivors) < MIN_SURVIVORS:
        problems.append(
            f"only {len(survivors)} mutant(s) survive the release's tests and the "
            f"triggered GPU jobs ({MIN_SURVIVORS} wanted across the packed path)"
        )
    if problems:
        hint = "see dist/upstream/mutants/ and upstream-prs/mutants/"
        raise ForkError("; ".join(problems), hint)


def table(rows: list[Row], pr: str) -> str:
    """PR's table (upstream-prs/mutants-table.template.md): the mutants it kills that
    no triggered CI job catches, then each as a diff, to apply and run both again."""
    listed = [row for row in rows if row.counts and row.by_pr[pr]]
    paths = {r.mutant.path for r in rows if r.by_pr[pr]}
    mine = [r for r in rows if r.mutant.path in paths]
    on_gpu = [r for r in mine if r.survivor and r.mutant.gpu_job]
    names = sorted({t for r in mine for t in r.mutant.tests})
    line = "| {0.name} | `{0.path}` | no | no | {1} |\n"
    shown = "{0.name}, in `{0.path}`:\n\n```diff\n{1}\n```\n\n"
    diffs = [(r.mutant, r.mutant.diff.rstrip("\n")) for r in listed]
    filled = TABLE.read_text().format(
        rows="".join(line.format(r.mutant, _cases(r.by_pr[pr])) for r in listed),
        tried=len(mine),
        tests=", ".join(f"`{t}`" for t in names),
        caught=sum(1 for r in mine if not r.survivor),
        on_gpu=len(on_gpu),
        gpu_jobs="".join(f"; {r.mutant.name}: {r.mutant.gpu_job}" for r in on_gpu),
        diffs="".join(shown.format(mutant, diff) for mutant, diff in diffs),
    )
    return filled.rstrip("\n")


def _cases(cases: list[str]) -> str:
    """Failed cases by function, a parametrized one with how many parameter sets failed
    (a mutant can rename them)."""
    names = [case.split("::", 1)[1].split("[", 1)[0] for case in cases]
    parametrized = {n for n, case in zip(names, cases) if "[" in case}
    return ", ".join(
        f"`{name}`"
        + (f" ({n} parameter set{'s' * (n > 1)})" if name in parametrized else "")
        for name, n in Counter(names).items()
    )


def summary(rows: list[Row], pr: str | None = None) -> str:
    """PROOF.txt lines: per mutant, the release's tests' verdict and the PRs'."""
    out = []
    for row in rows:
        if pr is None:
            verdict = "; ".join(f"{n}: {len(c)}" for n, c in row.by_pr.items())
        elif row.by_pr[pr]:
            verdict = f"this PR kills it with {len(row.by_pr[pr])} case(s)"
        elif others := [n for n, c in row.by_pr.items() if c]:
            verdict = f"not this PR's (killed by {', '.join(others)})"
        else:
            verdict = "killed by no PR"
        if row.upstream_killers:
            first = row.upstream_killers[0]
            up = f"the release's tests kill it (first failing case: {first})"
        elif row.mutant.gpu_job:
            gpu = f"a triggered GPU job would likely catch it: {row.mutant.gpu_job}"
            up = f"the release's tests miss it; {gpu}"
        else:
            up = "the release's tests miss it; no triggered GPU job executes it (read)"
        out.append(f"mutant {row.mutant.name} [{row.mutant.path}]: {up}; {verdict}")
    return "\n".join(out)
