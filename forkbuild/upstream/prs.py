"""`forkbuild upstream` (docs/upstream-alignment.md): each PR of upstream-prs/ proved
alone on a fresh worktree of the newest [matrix] release, then all together, then by the
mutants (mutants.py); into dist/upstream/<name>/, signed off by whoever runs it."""

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml
from packaging.version import InvalidVersion, Version

from forkbuild.checks import matrix, patch_status
from forkbuild.core import log
from forkbuild.core.errors import ForkError, run_or_fail
from forkbuild.core.hashing import digest_of
from forkbuild.core.pins import REPO_ROOT, Pins, Release, build_dir, locks_dir
from forkbuild.core.pytest_runner import Outcome, run_pytest
from forkbuild.setup import fetch, install, lock, tree, uv
from forkbuild.upstream import mutants

DIST = REPO_ROOT / "dist" / "upstream"
PRS_DIR = REPO_ROOT / "upstream-prs"
VALIDATION = PRS_DIR / "validation.template.md"  # @@VALIDATION@@, str.format fields
JOBS_SCRIPT = Path(__file__).with_name("release_ci_jobs.py")
# Words that speak of this repository, not vLLM (check_words adds the fork's release).
NOT_FOR_UPSTREAM_WORDS = ("forkbuild", "fork", "series", "matrix", "downstream")
# The places in description.md that the proof fills in (each exactly once).
MARKERS = ("@@VALIDATION@@", "@@MUTANTS@@")
# The cases of one PR must fit in a CPU job beside everything it already runs.
MAX_CASES_S = 60.0
# Offline: the release's cases that download models fail at once (no kill), not hang.
CPU_OFFLINE = {**matrix.CPU_ENV, "HF_HUB_OFFLINE": "1"}
README = "see upstream-prs/README.md"
# pytest's short summary names every case with its outcome: what Validation shows.
REPORT_ARGS = ("-rA",)


@dataclass(frozen=True)
class PullRequest:
    name: str  # its folder; sorts in sending order
    folder: Path
    title: str
    cases: tuple[str, ...]  # pytest node ids (or files) of the cases it adds
    # Buildkite keys of the release's jobs, CPU or GPU, of which one must collect each
    # case's file with cpu_test selected (a GPU job that runs the file unfiltered does)
    jobs: tuple[str, ...]
    patches: tuple[Path, ...]

    @property
    def description(self) -> str:
        return (self.folder / "description.md").read_text()


def load_prs(version: str, folder: Path = PRS_DIR) -> list[PullRequest]:
    """The PRs for vLLM VERSION, in sending order; each folder is checked whole."""
    prs = []
    for sub in sorted(folder.glob("*/")):
        if sub.name == mutants.MUTANTS_DIR.name:  # the mutants' folder is no PR
            continue
        try:
            meta = tomllib.loads((sub / "pr.toml").read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            hint = f"each upstream-prs/<name>/ needs pr.toml ({README})"
            raise ForkError(f"{sub / 'pr.toml'} cannot be read: {err}", hint) from None
        keys = ("release", "title", "cases", "jobs")
        patches = tuple(sorted(sub.glob("*.patch")))
        missing = ", ".join(k for k in keys if k not in meta)
        lacks = [f"pr.toml lacks {missing}"] if missing else []
        lacks += [] if patches else ["no *.patch"]
        lacks += [] if (sub / "description.md").is_file() else ["no description.md"]
        if lacks:
            hint = f"{README} for what a PR folder holds"
            raise ForkError(f"{sub.name}: {'; '.join(lacks)}", hint)
        if meta["release"] == version:
            title, cases, jobs = meta["title"], (*meta["cases"],), (*meta["jobs"],)
            prs.append(PullRequest(sub.name, sub, title, cases, jobs, patches))
    return prs


def newest(pins: Pins) -> Release:
    if not pins.releases:
        hint = "add the newest upstream release"
        raise ForkError("fork.toml lists no [matrix] releases", hint)
    return pins.releases[-1]


def submitter() -> dict[str, str]:
    """The git identity of whoever runs the step: the PRs' author, signing off (DCO)."""
    config = lambda key: tree.git(["config", "--get", f"user.{key}"], REPO_ROOT)
    found = {key: config(key).stdout.strip() for key in ("name", "email")}
    if missing := [f"user.{key}" for key, value in found.items() if not value]:
        said = f"git has no {' and no '.join(missing)}: the PRs are signed off (DCO)"
        yours = 'git config --global user.name "Your Name" && git config --global'
        hint = f"set yours: {yours} user.email you@example.com"
        raise ForkError(f"{said} by whoever runs `make upstream`", hint)
    return {
        f"GIT_{who}_{key.upper()}": value
        for who in ("AUTHOR", "COMMITTER")
        for key, value in found.items()
    }


def check_words(pr: PullRequest, fork_of: str) -> None:
    """Nothing a PR sends may speak of this repository or of FORK_OF, its release."""
    words = (*NOT_FOR_UPSTREAM_WORDS, fork_of)
    for path in (*pr.patches, pr.folder / "description.md"):
        text = path.read_text().lower()
        if said := [w for w in words if re.search(rf"\b{re.escape(w)}\b", text)]:
            hint = "a PR speaks of vLLM only: rewrite those lines"
            raise ForkError(f"{pr.name}/{path.name} mentions {', '.join(said)}", hint)


# The release's own tools/pre_commit/ hooks for test files, beside ruff and mypy.
HOOK_SCRIPTS = ("check_spdx_header", "check_forbidden_imports", "check_test_tethering")
HOOKS_LOCK = "release-hooks-py311.txt"
UPDATE = "forkbuild/upstream/prs.py"  # what reads the release's hooks
Jobs = dict[str, list[dict]]  # test file -> the release's CI jobs that collect it


def _repos(config_text: str) -> list[dict]:
    return (yaml.safe_load(config_text) or {}).get("repos") or []


def _config(release_tree: Path) -> str:
    return (release_tree / ".pre-commit-config.yaml").read_text()


def pinned_ruff(release_tree: Path) -> str:
    """The ruff version (ruff-pre-commit rev) the release's pre-commit config pins."""
    for repo in _repos(_config(release_tree)):
        if str(repo.get("repo", "")).endswith("/astral-sh/ruff-pre-commit"):
            try:
                return str(Version(str(repo.get("rev"))))  # v0.14.0 -> 0.14.0
            except InvalidVersion:
                break
    said = f"{release_tree.name}/.pre-commit-config.yaml pins no ruff-pre-commit rev"
    raise ForkError(said, "read the release's hooks and update " + UPDATE)


def mypy_hook(config_text: str) -> tuple[str, list[str]]:
    """(entry, additional_dependencies) of the release's mypy hook."""
    for repo in _repos(config_text):
        for hook in repo.get("hooks") or []:
            deps = hook.get("additional_dependencies")
            if hook.get("id") == "mypy" and hook.get("entry") and deps:
                return str(hook["entry"]), [str(d) for d in deps]
    said = "the release's .pre-commit-config.yaml has no mypy hook with an entry"
    hint = "read its hooks and update " + UPDATE
    raise ForkError(f"{said} and additional_dependencies", hint)


def hook_lock(config_text: str) -> tuple[Path, list[str], str]:
    """HOOKS_LOCK, the requirements of CONFIG_TEXT's mypy hook, and their digest."""
    _, requirements = mypy_hook(config_text)
    digest = digest_of(["release-hooks-1", *requirements])
    return locks_dir() / HOOKS_LOCK, requirements, digest


def release_hook_config(pins: Pins) -> str:
    """The newest release's .pre-commit-config.yaml, read from its verified sdist."""
    sdist = fetch.fetch(newest(pins).sdist, lambda: install.ensure_toolchain(pins))
    name = ".pre-commit-config.yaml"
    if not (found := patch_status.sdist_files(sdist, frozenset({name}))):
        raise ForkError(f"{sdist.name} has no {name}")
    return found[name].decode()


def lock_hooks(pins: Pins, config_text: str) -> Path:
    """HOOKS_LOCK: the release's mypy hook, hash-locked; remade if the hook changes."""
    target, requirements, digest = hook_lock(config_text)
    if target.is_file() and lock.recorded_digest(target) == digest:
        log.step(f"lock: {target.name} is up to date")
        return target
    inputs = "".join(f"{r}\n" for r in requirements)
    body = lock.resolve(pins, inputs, "3.11", target.name)
    target.write_text(f"""\
# {target.name}: the mypy hook of vLLM's .pre-commit-config.yaml
# ({", ".join(requirements)}),
# every package with its sha256. Made by `make lock` from the newest release of
# fork.toml [matrix]; `make upstream` installs it to run that hook; do not edit.
{lock.DIGEST_LINE}{digest}
{body}""")
    log.step(f"lock: wrote {target}")
    return target


def hooks_python(pins: Pins, release_tree: Path) -> Path:
    """The venv of the release's mypy hook from its lock, which must match the hook."""
    lock_file, requirements, made_for = hook_lock(_config(release_tree))
    if not lock_file.is_file() or lock.recorded_digest(lock_file) != made_for:
        said = f"{lock_file.name} is missing or was made for another mypy hook than"
        hook = f"{release_tree.name}'s ({', '.join(requirements)})"
        raise ForkError(f"{said} {hook}", "run `make lock` to resolve it again")
    venv, tools = build_dir() / "upstream/hooks-venv", install.ensure_toolchain(pins)
    text, key = lock_file.read_text(), digest_of([lock_file.read_bytes()])
    what = "the release's mypy hook (hash-locked)"
    return uv.stamped_venv(pins, venv, tools, text, key, what, "--require-hashes")


def _hooks(
    python: Path, ruff: str, release_tree: Path, files: list[str], mypy: bool
) -> list[tuple[str, list[str]]]:
    """(name, command) of each hook, with the files its filter passes."""
    py_files = [f for f in files if f.endswith(".py")]
    tethers = re.compile(r"(tests/.*\.py|\.buildkite/.*\.yaml)$")
    tethered = [f for f in files if tethers.match(f)]
    hooks = [
        ("ruff check", [ruff, "check", "--no-cache", *py_files]),
        ("ruff format", [ruff, "format", "--check", "--no-cache", *py_files]),
    ]
    for name in HOOK_SCRIPTS:
        hook_files = tethered if name == "check_test_tethering" else py_files
        hooks.append((name, [str(python), f"tools/pre_commit/{name}.py", *hook_files]))
    if any(re.match(r"\.buildkite/.*\.ya?ml$", f) for f in files):
        # pass_filenames: false; it reads every pipeline file itself
        step_keys = [str(python), "tools/pre_commit/check_buildkite_step_keys.py"]
        hooks.append(("check_buildkite_step_keys", step_keys))
    if mypy:
        entry, _ = mypy_hook(_config(release_tree))
        hooks.append(("mypy", [*shlex.split(entry), *py_files]))
    return hooks


def run_hooks(
    python: Path, release_tree: Path, files: list[str], mypy_python: Path | None = None
) -> list[str]:
    """The release's hooks for FILES in RELEASE_TREE, with the ruff it pins (the fork's
    venv's) and with MYPY_PYTHON its mypy hook: one line per hook, or every finding."""
    ruff, wanted = str(python.parent / "ruff"), pinned_ruff(release_tree)
    have = subprocess.run([ruff, "--version"], capture_output=True, text=True)
    if have.returncode != 0 or have.stdout.split()[-1:] != [wanted]:
        said = f"{release_tree.name} runs its hooks with ruff {wanted}; the fork's"
        hint = f"pin ruff=={wanted} in fork.toml [toolchain] test, then `make lock`"
        raise ForkError(f"{said} venv has {have.stdout.strip() or 'none'}", hint)
    env = None  # the mypy hook's entry runs the `python` first on PATH: its venv's
    if mypy_python is not None:
        path = f"{mypy_python.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        env = {**os.environ, "PATH": path}
    kw = {"cwd": release_tree, "capture_output": True, "text": True, "env": env}
    lines, findings = [], []
    for name, cmd in _hooks(python, ruff, release_tree, files, env is not None):
        done = subprocess.run(cmd, **kw)
        said = (done.stdout + done.stderr).strip()
        lines.append(f"{name}: {'passed' if done.returncode == 0 else 'FAILED'}")
        if done.returncode != 0:
            last = said.splitlines()[-1] if said else f"exit {done.returncode}"
            findings.append(f"{name}: {last}")
            log.step(f"upstream: hook {name} failed:\n{said}")
    if findings:
        said = f"{len(findings)} of the release's pre-commit hooks fail: "
        hint = "fix the test files (vLLM's CI runs the same hooks) and run again"
        raise ForkError(said + "; ".join(findings), hint)
    said = f"the release's hooks pass on {len(files)} file(s) (ruff {wanted}"
    log.step(f"upstream: {said}{', mypy' if mypy_python else ''})")
    return lines


def collecting_jobs(python: Path, work: Path, files: list[str]) -> Jobs:
    """The release's Buildkite jobs that collect each test file (release_ci_jobs.py)."""
    cmd = [str(python), str(JOBS_SCRIPT), *files]
    what = f"could not read {work.name}'s Buildkite jobs"
    return json.loads(run_or_fail(cmd, what, tail=300, cwd=work).stdout)


def selects_cpu_test(marker: str | None) -> bool:
    """Whether a pytest `-m` expression (None: no filter) selects cpu_test cases."""
    return marker is None or bool(re.search(r"(?<!not )\bcpu_test\b", marker))


def check_job(pr: PullRequest, jobs: Jobs) -> str:
    """PROOF.txt's lines: for each case's file, the jobs of pr.toml `jobs` that collect
    it with cpu_test selected (read from the release's pipelines, not run); one must."""
    lines = []
    for test_file in sorted({c.split("::", 1)[0] for c in pr.cases}):
        runs = jobs.get(test_file, [])
        named = [j for j in runs if j["key"] in pr.jobs]
        if not (hits := [j for j in named if selects_cpu_test(j["marker"])]):
            others = ", ".join(sorted({j["key"] or j["label"] for j in runs})) or "none"
            said = f"{pr.name}: no job of {', '.join(pr.jobs)} collects {test_file}"
            said += f" with cpu_test selected (jobs that run it: {others})"
            mark = "mark the cases cpu_test and name a job that runs the file (or add"
            raise ForkError(said, f"{mark} it to a CPU job's commands in the PR)")
        for job in hits:
            label, key, device, command = (
                job[k] for k in ("label", "key", "device", "command")
            )
            lines.append(f"{test_file}: '{label}' ({key}, {device}): {command}")
    return "\n".join(lines)


def changed_files(work: Path, base: str) -> list[str]:
    diff = tree.git(["diff", "--name-only", f"{base}..HEAD"], work)
    return sorted(diff.stdout.split())


def lines_added(work: Path, base: str) -> int:
    got = tree.git(["diff", "--numstat", f"{base}..HEAD"], work).stdout.splitlines()
    return sum(int(line.split()[0]) for line in got if line.split()[0].isdigit())


@dataclass
class Context:
    release: Release
    repo: Path  # the release's git repository (tag v<version>)
    python: Path  # the release's venv
    wheel: Path  # the release's binaries
    author: dict[str, str]
    toolchain: Path  # the fork's venv: ruff at the release's pin, runs the hook scripts

    @property
    def tag(self) -> str:
        return f"v{self.release.version}"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **tree.IDENTITY, **self.author}

    def fresh(self, name: str, mails: list[Path], binaries: bool = True) -> Path:
        """A fresh worktree of the release, MAILS applied by git am, binaries beside."""
        work, env = build_dir() / "upstream" / name, self.env
        tree.fresh_worktree(self.repo, work, self.tag, env, "--detach")
        # --keep-non-patch: keep "[Tests]" in the subject; only "[PATCH]" is stripped.
        am = ["am", "--keep-cr", "--keep-non-patch", *map(str, mails)]
        if mails and (applied := tree.git(am, work, env)).returncode != 0:
            tree.git(["am", "--abort"], work, env)
            said = (applied.stdout + applied.stderr).strip()[-300:]
            names = ", ".join(m.name for m in mails)
            why = f"{names} do not apply with git am on {work.name}: {said}"
            raise ForkError(why, "refresh the PR's patch against the release")
        if binaries:
            matrix.add_binaries(work, self.wheel, self.release.version)
        return work

    def cases_pass(
        self, work: Path, cases: list[str], out: Path, name: str, what: str
    ) -> Outcome:
        """CASES in WORK on CPU, offline, reports in OUT as NAME-*: all pass or WHAT."""
        log_file = out / f"{name}-pytest.log"
        args = (self.python, work, [*REPORT_ARGS, *cases], out / f"{name}-junit.xml")
        outcome = run_pytest(*args, output=log_file, extra_env=CPU_OFFLINE)
        if outcome.passed != len(outcome.cases):  # a failure, error or skip
            raise ForkError(f"{what}: {outcome}", f"see {log_file}")
        return outcome

    def sdist_line(self) -> str:
        return f"vLLM {self.release.version} sdist {self.release.sdist.sha256}\n"


def signed_mail(ctx: Context, pr: PullRequest, out: Path) -> Path:
    """The PR's commit re-authored and signed off by the submitter: a mail in OUT."""
    work = ctx.fresh("sign", list(pr.patches), binaries=False)
    amend = ["commit", "-q", "--amend", "--no-edit", "--reset-author", "--signoff"]
    tree.git_ok(amend, work, ctx.env, "sign off the commit")
    out.mkdir(parents=True, exist_ok=True)
    write = ["format-patch", "-q", "--zero-commit", "--no-signature", "-o", str(out)]
    tree.git_ok([*write, f"{ctx.tag}..HEAD"], work, ctx.env, "write the PR's patch")
    (mail,) = sorted(out.glob("*.patch"))
    return mail


def pytest_report(log_file: Path) -> str:
    """The end of what pytest printed: its short test summary and closing line."""
    lines = log_file.read_text().splitlines()
    heads = [i for i, line in enumerate(lines) if "short test summary info" in line]
    return "\n".join(lines[heads[-1] :] if heads else lines[-1:])


@dataclass
class Proof:
    pr: PullRequest
    mail: Path
    outcome: Outcome
    hooks: list[str]
    ci: str  # the jobs that collect the cases' files (check_job)
    added: int

    @property
    def seconds(self) -> float:
        return sum(self.outcome.times.values())

    def case_lines(self, form: str) -> list[str]:
        t, cases = self.outcome.times, sorted(self.outcome.cases.items())
        return [form.format(case=c, status=s, seconds=t.get(c, 0)) for c, s in cases]


def prove(ctx: Context, pr: PullRequest, mail: Path, mypy_python: Path) -> Proof:
    """PR alone on a fresh worktree: git am, its cases, the hooks, the job."""
    work = ctx.fresh(f"proof-{pr.name}", [mail])
    what = f"{pr.name}: its cases do not all pass on {ctx.tag} after git am"
    outcome = ctx.cases_pass(work, list(pr.cases), mail.parent, "proof", what)
    files = changed_files(work, ctx.tag)
    hooks = run_hooks(ctx.toolchain, work, files, mypy_python)
    tests = [f for f in files if f.startswith("tests/") and f.endswith(".py")]
    ci = check_job(pr, collecting_jobs(ctx.python, work, tests))
    proof = Proof(pr, mail, outcome, hooks, ci, lines_added(work, ctx.tag))
    if proof.seconds > MAX_CASES_S:
        took = f"{proof.seconds:.1f} s on CPU, over {MAX_CASES_S:.0f} s"
        hint = "make them smaller: the CPU job runs them beside everything else"
        raise ForkError(f"{pr.name}: its cases take {took}", hint)
    return proof


def build(pins: Pins) -> Path:
    author = submitter()  # before minutes of work
    release = newest(pins)
    version = release.version
    if not (prs := load_prs(version)):
        hint = f"write them against the newest release ({README})"
        raise ForkError(f"upstream-prs/ has no PR for vLLM {version}", hint)
    for pr in prs:
        check_words(pr, pins.upstream_version)
    found = mutants.for_release(version)  # before minutes of work too
    repo = matrix.release_tree(pins, release)
    python = matrix.release_python(pins, release, repo)
    cpu = fetch.fetch(release.binaries, lambda: install.ensure_toolchain(pins, "cpu"))
    ctx = Context(release, repo, python, cpu, author, install.ensure_toolchain(pins))
    mypy_python = hooks_python(pins, ctx.repo)
    shutil.rmtree(DIST, ignore_errors=True)
    proofs = []
    for number, pr in enumerate(prs, 1):
        log.step(f"upstream: [{number}/{len(prs)}] {pr.name}: alone on {ctx.tag}")
        proofs.append(prove(ctx, pr, signed_mail(ctx, pr, DIST / pr.name), mypy_python))
    log.step(f"upstream: all {len(prs)} PRs together on a fresh {ctx.tag}")
    together = ctx.fresh("proof-all", [p.mail for p in proofs])
    all_cases = [c for pr in prs for c in pr.cases]
    failing = f"the PRs together do not pass on {ctx.tag}"
    joint = ctx.cases_pass(together, all_cases, DIST, "all", failing)
    changed = changed_files(together, ctx.tag)
    joint_hooks = run_hooks(ctx.toolchain, together, changed, mypy_python)
    kept = build_dir() / "upstream" / "runs"
    runs = mutants.Runs(python, DIST / "mutants", kept, CPU_OFFLINE)
    cases = {pr.name: pr.cases for pr in prs}
    rows = mutants.differential(runs, ctx.fresh("stock", []), together, found, cases)
    mutants.check(rows, [pr.name for pr in prs])
    for proof in proofs:
        write_pr(ctx, proof, rows)
    mails = " ".join(f"{p.mail.parent.name}/{p.mail.name}" for p in proofs)
    (DIST / "PROOF.txt").write_text(
        f"{ctx.sdist_line()}git am {mails}: applied in order\n"
        f"pytest {' '.join(all_cases)} -m cpu_test: {joint}\n"
        + "".join(f"hook {line}\n" for line in joint_hooks)
        + f"{mutants.summary(rows)}\n"
    )
    log.step(f"upstream: {len(prs)} PR(s) with descriptions and proof in {DIST}")
    return DIST


def validation(ctx: Context, proof: Proof) -> str:
    """@@VALIDATION@@: upstream-prs/validation.template.md filled in from PROOF."""
    env = " ".join(f"{k}={v}" for k, v in sorted(CPU_OFFLINE.items()))
    args = " ".join([*REPORT_ARGS, *proof.pr.cases])
    fields = dict(tag=ctx.tag, torch=ctx.release.torch, ci=proof.ci)
    fields |= dict(command=f"{env} python -m pytest -q {args}")
    fields |= dict(report=pytest_report(proof.mail.parent / "proof-pytest.log"))
    fields |= dict(hooks="\n".join(proof.hooks), seconds=proof.seconds)
    return VALIDATION.read_text().format(**fields).rstrip("\n")


def write_pr(ctx: Context, proof: Proof, rows: list[mutants.Row]) -> None:
    pr, out = proof.pr, proof.mail.parent
    text = pr.description
    for marker in MARKERS:
        if text.count(marker) != 1:
            said = f"{pr.name}/description.md must hold {marker} exactly once"
            raise ForkError(said, README)
    text = text.replace("@@VALIDATION@@", validation(ctx, proof))
    text = text.replace("@@MUTANTS@@", mutants.table(rows, pr.name))
    (out / "PR_DESCRIPTION.md").write_text(f"# {pr.title}\n\n{text}")
    (out / "PROOF.txt").write_text(
        f"{ctx.sdist_line()}git am {proof.mail.name} on a fresh worktree of "
        f"{ctx.tag}: applied\nlines added: {proof.added}\n"
        f"pytest {' '.join(pr.cases)}: {proof.outcome} ({proof.seconds:.1f} s)\n"
        + "".join(proof.case_lines("  {case} {status} {seconds:.2f} s\n"))
        + "".join(f"hook {line}\n" for line in proof.hooks)
        + "".join(f"ci: {line}\n" for line in proof.ci.splitlines())
        + f"{mutants.summary(rows, pr.name)}\n"
    )
