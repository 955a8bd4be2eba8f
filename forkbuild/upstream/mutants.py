"""The differential mutation proof of `forkbuild upstream`: small breakages of the
release's packed KV cache path, applied one at a time, run against the release's own
tests of that path (as shipped) and against the PRs' cases. A PR is worth what it kills
that the release's tests miss.

Each mutant is one text substitution, written by hand from reading that release's code
(offset, strides, layout order, view vs copy: the ways #47054-like defects happen),
applied as the unified diff the PR descriptions show. It must match exactly once: when
the release's code changes, the step names the mutant to rewrite rather than testing
something else.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from forkbuild.core import log
from forkbuild.core.errors import ForkError
from forkbuild.core.pytest_runner import Outcome, read_junit, run_pytest
from forkbuild.setup import tree


@dataclass(frozen=True)
class Mutant:
    name: str  # what it breaks, as the PR description's table shows it
    path: str  # the file in the release tree
    original: str  # text that occurs exactly once in it
    mutated: str
    # A GPU job that a change to PATH triggers and that would likely catch it (read,
    # not run: docs/upstream-triggered-jobs.md), or "" where none would.
    gpu_job: str = ""

    def diff(self, text: str) -> str:
        """The mutant as a unified diff of TEXT (its file in the release), which
        `git apply` takes: what the tool applies and the PR descriptions show."""
        found = text.count(self.original)
        if found != 1:
            raise ForkError(
                f"mutant '{self.name}' matches {found} times in {self.path} "
                "(once expected): "
                "the release's code is not what the mutant was written against",
                "rewrite the mutant in forkbuild/upstream/mutants.py from the "
                "release's code",
            )
        if not text.endswith("\n"):
            raise ForkError(
                f"{self.path} does not end with a newline, which a diff of it would "
                "have to mark",
                "write the mutant against a file that does, or mark it here",
            )

        def lines(of: str) -> list[str]:  # on "\n" only, as git reads them
            return [line + "\n" for line in of.split("\n")[:-1]]

        return "".join(
            difflib.unified_diff(
                lines(text),
                lines(text.replace(self.original, self.mutated)),
                f"a/{self.path}",
                f"b/{self.path}",
            )
        )


# The code of the packed KV cache path in vLLM 0.33.0, by what it does.
_VIEWS = (
    "vllm/v1/kv_cache_interface.py"  # compute_layout_strides, create_kv_cache_views
)
_LAYOUT = "vllm/v1/kv_cache_layout.py"  # KVCacheLayout's stride orders
_ALLOC = "vllm/v1/worker/utils.py"  # allocate_kv_cache
_PLANNER = "vllm/v1/core/kv_cache_planning.py"  # packing groups into block rows
# The OffloadingConnector worker's registration (register_kv_caches).
_OFFLOAD = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py"
_TRITON = "vllm/v1/attention/backends/triton_attn.py"  # per-token-head scale views

# A PR set must prove itself on at least this many breakages the release's tests miss.
MIN_SURVIVORS = 8

# Per release that `make upstream` may target (fork.toml [matrix]'s newest): breakages
# of the packed path that its own tests (RELEASE_TESTS) miss.
MUTANTS: dict[str, tuple[Mutant, ...]] = {
    "0.33.0": (
        Mutant(
            "a packed block split into kernel blocks (the dense-page guard only "
            "rejects blocks smaller than a page)",
            _VIEWS,
            "        if block_stride != dense_page_size:\n",
            "        if block_stride < dense_page_size:\n",
        ),
        Mutant(
            "every group split by the first group's kernel block size",
            _ALLOC,
            "kernel_block_size = kernel_block_sizes[group_id]",
            "kernel_block_size = kernel_block_sizes[0]",
            gpu_job="`v1-executor-worker` "
            "(`test_gpu_model_runner.py::test_hybrid_attention_mamba_tensor_shapes`: "
            "a Mamba hybrid whose groups have other kernel block sizes)",
        ),
        Mutant(
            "BLNHC stored heads-before-tokens (an alias of BLHNC)",
            _LAYOUT,
            "    BLNHC = (1, 0, 3, 2, 4)",
            "    BLNHC = (1, 0, 2, 3, 4)",
        ),
        Mutant(
            "views placed from the storage's start, not the backing tensor's",
            _VIEWS,
            "storage_offset=raw.storage_offset() + kv_cache_tensor.offset,",
            "storage_offset=kv_cache_tensor.offset,",
        ),
        Mutant(
            "the next page size of a packed row starts after the unpadded pages",
            _PLANNER,
            "spec.page_size_bytes if layout.is_block_outermost else layer_stride",
            "spec.real_page_size_bytes if layout.is_block_outermost else layer_stride",
        ),
        Mutant(
            "a packed row's pages padded to the block stride alignment "
            "(the layer-outer block stride taken in a block-outer row)",
            _PLANNER,
            "spec.page_size_bytes if layout.is_block_outermost else layer_stride",
            "padded_page if layout.is_block_outermost else layer_stride",
        ),
        Mutant(
            "an unaligned page takes its padded page as block stride, "
            "not the packed row",
            _PLANNER,
            "if block_stride is None and padded_page != spec.page_size_bytes:",
            "if padded_page != spec.page_size_bytes:",
        ),
        Mutant(
            "the connector moves one layer's page of a packed row, not the whole row",
            _OFFLOAD,
            "[CanonicalKVCacheTensor(packed_tensor, block_stride)]",
            "[CanonicalKVCacheTensor(packed_tensor, tensor.shape[1])]",
        ),
        Mutant(
            "the registered packed tensor steps by one layer's page, not by the row",
            _OFFLOAD,
            "                (block_stride, 1),\n                storage_offset=0,",
            "                (tensor.shape[1], 1),\n                storage_offset=0,",
        ),
        Mutant(
            "only the first offloaded group references the packed row",
            _OFFLOAD,
            "[[CanonicalKVCacheRef(0, block_stride)] for _ in selected_groups]",
            "[[CanonicalKVCacheRef(0, block_stride)]]",
        ),
        Mutant(
            "per-token-head scales: layer's storage offset ignored "
            "(views start at offset 0)",
            _TRITON,
            "base_off_f32 = to_f32_units(kv_cache.storage_offset())",
            "base_off_f32 = 0",
        ),
        Mutant(
            "per-token-head scales: page-sized block stride "
            "instead of the packed row's",
            _TRITON,
            "block_f32 = to_f32_units(strides[0])",
            "block_f32 = to_f32_units(nkv * block_size * content)",
        ),
        Mutant(
            "per-token-head scales: head stride assumed NHD (one content row)",
            _TRITON,
            "head_f32 = to_f32_units(strides[1])",
            "head_f32 = to_f32_units(content)",
        ),
        Mutant(
            "per-token-head scales: slot stride assumed HND (one content row)",
            _TRITON,
            "slot_f32 = to_f32_units(strides[2])",
            "slot_f32 = to_f32_units(content)",
        ),
        Mutant(
            "per-token-head scales: K scale view's slot and head strides swapped",
            _TRITON,
            "stride=(block_f32, slot_f32, head_f32),\n"
            "            storage_offset=k_scale_off_f32,",
            "stride=(block_f32, head_f32, slot_f32),\n"
            "            storage_offset=k_scale_off_f32,",
        ),
        Mutant(
            "per-token-head scales: K scale placed before the K data, not after it",
            _TRITON,
            "k_scale_off_f32 = base_off_f32 + to_f32_units(hs)",
            "k_scale_off_f32 = base_off_f32",
        ),
        Mutant(
            "per-token-head scales: V scale offset misses the K scale padding",
            _TRITON,
            "v_scale_off_f32 = base_off_f32 + to_f32_units(padded_hs + hs)",
            "v_scale_off_f32 = base_off_f32 + to_f32_units(hs + hs)",
        ),
        Mutant(
            "per-token-head scales: views rebuilt and reset to 1.0 on every call",
            _TRITON,
            "        if self._k_scale_cache is not None:\n            return\n",
            "",
        ),
        Mutant(
            "per-token-head K/V views: split at head_size, ignoring the inline scale",
            _TRITON,
            "padded_hs = kv_cache.shape[-1] // 2\n        key_cache, value_cache",
            "padded_hs = self.head_size\n        key_cache, value_cache",
        ),
        Mutant(
            "fp8_per_token_head K/V views: not retyped to the fp8 dtype",
            _TRITON,
            "if self._kv_quant_mode == KVQuantMode.FP8_PER_TOKEN_HEAD:",
            "if self._kv_quant_mode == KVQuantMode.FP8_PER_TENSOR:",
        ),
        Mutant(
            "int4_per_token_head page: two values per byte not packed "
            "(content not halved)",
            _TRITON,
            "hs_k, hs_v = hs_k // 2, hs_v // 2",
            "hs_k, hs_v = hs_k, hs_v",
        ),
    ),
}

# The release's own tests of each mutated file, as shipped: every file of its tests/
# that reaches the mutated functions and runs on CPU. They run whole, unfiltered; a case
# failing here unmutated (a model download, a GPU) kills nothing.
_VIEW_TESTS = (
    "tests/v1/worker/test_attn_utils.py",
    "tests/v1/core/test_contiguous_kv_packing.py",
    "tests/v1/core/test_kv_cache_planning.py",
    "tests/v1/worker/test_kv_block_zeroer.py",
    "tests/v1/worker/test_dsv4_packed_zeroer_geometry.py",
    "tests/v1/worker/test_kv_cache_allocation_scope.py",
    "tests/v1/simple_kv_offload/test_worker.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_worker.py",
    "tests/v1/attention/test_sparse_mla_kv_cache_layout.py",
)
_PLANNER_TESTS = (
    "tests/v1/core/test_contiguous_kv_packing.py",
    "tests/v1/core/test_kv_cache_planning.py",
    "tests/v1/core/test_kv_cache_config_builder.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/attention/test_sparse_mla_kv_cache_layout.py",
    "tests/v1/worker/test_dsv4_packed_zeroer_geometry.py",
    "tests/v1/worker/test_attn_utils.py",
    "tests/v1/simple_kv_offload/test_worker.py",
)
_OFFLOAD_TESTS = (
    "tests/v1/kv_connector/unit/offloading_connector/test_worker.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_canonical_mapping.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_worker_metadata.py",
    "tests/v1/kv_offload/cpu",
)
# Not tests/v1/attention/test_attention_backends.py: none of its cases reaches the
# scale views on CPU, and its 115 GPU cases fail here; it would only cost time.
_SCALE_TESTS = (
    "tests/quantization/test_per_token_kv_cache.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_canonical_mapping.py",
)
RELEASE_TESTS: dict[str, dict[str, tuple[str, ...]]] = {
    "0.33.0": {
        _VIEWS: _VIEW_TESTS,
        _LAYOUT: _VIEW_TESTS,
        _ALLOC: _VIEW_TESTS,
        _PLANNER: _PLANNER_TESTS,
        _OFFLOAD: _OFFLOAD_TESTS,
        _TRITON: _SCALE_TESTS,
    },
}


def for_release(version: str) -> tuple[Mutant, ...]:
    if version not in MUTANTS or version not in RELEASE_TESTS:
        raise ForkError(
            f"forkbuild/upstream/mutants.py has no mutants of vLLM {version}'s "
            "packed-view code",
            "read the release's packed path and its own tests of it, and write them",
        )
    return MUTANTS[version]


def release_tests(version: str, path: str) -> tuple[str, ...]:
    """The release's own test files of the code in PATH, as shipped."""
    for_release(version)
    if path not in RELEASE_TESTS[version]:
        raise ForkError(
            f"forkbuild/upstream/mutants.py names no release tests of {path} for "
            f"vLLM {version}",
            "grep the release's tests/ for the code the mutant changes and list them",
        )
    return RELEASE_TESTS[version][path]


def apply(worktree: Path, mutant: Mutant) -> None:
    """Apply MUTANT's diff to WORKTREE with `git apply`."""
    target = worktree / mutant.path
    # newline="": CRLF stays CRLF in the diff, as in the file git applies it to
    diff = mutant.diff(target.open(newline="").read() if target.is_file() else "")
    # Outside the worktree: its untracked files are part of a run's key.
    with tempfile.NamedTemporaryFile("w", suffix=".diff", newline="") as patch:
        patch.write(diff)
        patch.flush()
        done = tree.git(["apply", "--whitespace=nowarn", patch.name], worktree)
    if done.returncode != 0:
        raise ForkError(
            f"git apply refused mutant '{mutant.name}' on {mutant.path}: "
            f"{done.stderr.strip()}",
            "rewrite the mutant in forkbuild/upstream/mutants.py from the release's "
            "code",
        )
    _drop_bytecode(target)


def restore(worktree: Path, mutant: Mutant) -> None:
    what = f"restore {mutant.path} in {worktree}"
    tree.git_ok(["checkout", "--", mutant.path], worktree, None, what)
    _drop_bytecode(worktree / mutant.path)


def _drop_bytecode(source: Path) -> None:
    # A .pyc is trusted on the source's mtime (whole seconds) and size: a mutant of the
    # same size written within the second would otherwise run the old code.
    for pyc in (source.parent / "__pycache__").glob(f"{source.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def killers(outcome: Outcome, baseline: Outcome | None = None) -> list[str]:
    """The cases that fail (or error) in OUTCOME and, with BASELINE, passed there (what
    fails or skips unmutated kills nothing). A case BASELINE lacks counts when its
    function (or module, if it no longer collects) passed: a mutant can rename ids."""
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


# Files a run or a hook leaves in a worktree that decide no result.
_TOOL_CACHES = ("__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache")


@dataclass(frozen=True)
class Runs:
    """The pytest runs of one differential: PYTHON runs them, each with EXTRA_ENV, its
    report in RESULTS/NAME.{xml,log}; with CACHE, each is kept there by what decides
    its result (see _key)."""

    python: Path
    results: Path
    extra_env: dict[str, str] | None = None
    cache: Path | None = None

    def mutated(
        self, worktree: Path, mutant: Mutant, args: list[str], name: str
    ) -> Outcome:
        """ARGS in WORKTREE with MUTANT applied alone, and undone."""
        log.step(f"mutants: {mutant.name} vs {name}")
        outcome = self.run(worktree, args, name, mutant)
        found = killers(outcome)  # raw: differential() subtracts what fails unmutated
        said = f"{len(found)} case(s) failed" if found else "no case failed"
        log.step(f"mutants: {name}: {said}")
        return outcome

    def run(
        self,
        worktree: Path,
        pytest_args: list[str],
        name: str,
        mutant: Mutant | None = None,
        keep: Callable[[Outcome], bool] = lambda outcome: True,
    ) -> Outcome:
        """One pytest run in WORKTREE, with MUTANT applied and undone when given. With
        CACHE, a run made before of the same content is read back, so a stopped step
        resumes where it stopped; a run is kept only when it ended by itself and KEEP
        accepts it (an unmutated run the step rejects is made again next time)."""
        self.results.mkdir(parents=True, exist_ok=True)
        key = ""
        if self.cache is not None:
            key = self._key(worktree, mutant, pytest_args)
            try:
                outcome = read_junit(self.cache / f"{key}.xml")
            except (OSError, ET.ParseError):  # none, or cut off: a miss
                pass
            else:
                for suffix in (".xml", ".log"):
                    kept = self.cache / f"{key}{suffix}"
                    if kept.is_file():
                        shutil.copyfile(kept, self.results / f"{name}{suffix}")
                log.step(
                    f"mutants: {name}: the same run was made before "
                    f"({self.cache / key}.xml): {outcome}"
                )
                return outcome
        if mutant is not None:
            pytest_args = [*pytest_args, "--continue-on-collection-errors"]
        try:
            if mutant is not None:
                apply(worktree, mutant)
            outcome = run_pytest(
                self.python,
                worktree,
                pytest_args,
                self.results / f"{name}.xml",
                output=self.results / f"{name}.log",
                extra_env=self.extra_env,
            )
        finally:
            if mutant is not None:
                restore(worktree, mutant)
        if self.cache is not None and not outcome.killed and keep(outcome):
            self.cache.mkdir(parents=True, exist_ok=True)
            for suffix in (".log", ".xml"):  # the XML last and whole: it means kept
                partial = self.cache / f"{key}{suffix}.partial"
                shutil.copyfile(self.results / f"{name}{suffix}", partial)
                os.replace(partial, self.cache / f"{key}{suffix}")
        return outcome

    def _key(
        self, worktree: Path, mutant: Mutant | None, pytest_args: list[str]
    ) -> str:
        """What decides a run's result: the interpreter and the packages beside it, the
        worktree's tree object (not its commit: the PRs' mails are re-signed with a new
        date each time), its untracked files' names and sizes (the release's binaries),
        the mutant, the arguments, the environment given and what of the caller's
        pytest or vLLM read."""

        def git_out(args: list[str]) -> str:
            done = tree.git(args, worktree)
            if done.returncode != 0:
                raise ForkError(
                    f"git {' '.join(args)} failed in {worktree}: {done.stderr.strip()}",
                    "run the step again: it makes its worktrees afresh",
                )
            return done.stdout

        changed = git_out(["status", "--porcelain", "--untracked-files=no"]).strip()
        if changed:  # a mutant left behind by a killed run: every result would be wrong
            raise ForkError(
                f"{worktree} has changes its commit does not hold: "
                f"{changed.splitlines()[0]}",
                "run the step again: it makes its worktrees afresh",
            )
        untracked = sorted(
            f"{name}:{(worktree / name).stat().st_size}"
            for name in git_out(["ls-files", "--others", "-z"]).split("\0")
            if name
            and not set(Path(name).parts) & set(_TOOL_CACHES)
            and (worktree / name).is_file()
        )
        site = self.python.parent.parent / "lib"
        installed = sorted(
            p.name for p in site.glob("python*/site-packages/*.dist-info")
        )
        callers = sorted(
            (k, v)
            for k, v in os.environ.items()  # not the fork's own VLLM_FORK_*
            if k.startswith(("VLLM_", "PYTEST_", "TORCH", "OMP_", "CUDA_", "HF_"))
            and not k.startswith("VLLM_FORK_")
        )
        parts = [
            str(self.python),
            installed,
            git_out(["rev-parse", "HEAD^{tree}"]).strip(),
            untracked,
            [mutant.path, mutant.original, mutant.mutated] if mutant else None,
            pytest_args,
            sorted((self.extra_env or {}).items()),
            callers,
        ]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Row:
    """One mutant: what the release's own tests did with it, and each PR's cases."""

    mutant: Mutant
    upstream_tests: tuple[str, ...]  # the release's test files of the mutated code
    upstream_killers: list[str]  # their cases it made fail (the first one, under -x)
    by_pr: dict[str, list[str]]  # PR name -> its cases that failed
    diff: str = field(default="", compare=False)  # shown (Mutant.diff), not compared

    @property
    def survivor(self) -> bool:
        """Missed by the release's own tests of the mutated code, run here (CPU)."""
        return not self.upstream_killers

    @property
    def counts(self) -> bool:
        """Caught by no CI job that a change to the mutated file triggers: missed by the
        release's tests run here, and by the triggered GPU jobs as read. Only such a
        mutant measures a PR."""
        return self.survivor and not self.mutant.gpu_job


def deselect(baseline: Outcome) -> list[str]:
    """pytest arguments leaving out each case that fails unmutated: it can kill nothing,
    costs time (a model download refused offline, a CUDA call), and would stop `-x` at a
    failure that is no kill."""
    return [
        arg
        for case, status in sorted(baseline.cases.items())
        if status in ("failed", "error") and not case.endswith("::(module)")
        for arg in ("--deselect", case)
    ]


def _upstream_killers(
    runs: Runs,
    stock: Path,
    mutant: Mutant,
    tests: tuple[str, ...],
    baseline: Outcome,
    what: str,
) -> list[str]:
    """The release's cases that MUTANT makes fail, run without those failing unmutated
    up to the first failure (-x). Were a deselection to miss pytest's node id, -x could
    stop at an old failure and hide a kill: such a run is made again whole."""
    fast = runs.mutated(stock, mutant, [*tests, *deselect(baseline), "-x"], what)
    found = killers(fast, baseline)
    if (fast.failed or fast.errors) and not found:
        log.step(f"mutants: {what} stopped at a case failing unmutated too: run whole")
        whole = runs.mutated(stock, mutant, list(tests), f"{what}-whole")
        found = killers(whole, baseline)
    return found


def _all_pass(outcome: Outcome) -> bool:  # what the PRs' cases must do unmutated
    return outcome.passed > 0 and not (outcome.failed or outcome.errors)


def _some_pass(outcome: Outcome) -> bool:  # what the release's tests must do unmutated
    return outcome.passed > 0


def differential(
    python: Path,
    stock: Path,
    with_prs: Path,
    mutants: tuple[Mutant, ...],
    upstream_tests: dict[str, tuple[str, ...]],
    pr_cases: list[str],
    owners: dict[str, Callable[[str], bool]],
    results: Path,
    extra_env: dict[str, str] | None = None,
    cache: Path | None = None,
) -> list[Row]:
    """Every mutant against the release's own tests of the file it changes (STOCK
    worktree, UPSTREAM_TESTS: path -> test files) and against the PRs' cases (WITH_PRS:
    all PRs applied; a case is credited to the PR that OWNS it). Each set of release
    tests runs once unmutated first: what fails there already is no kill. When STOCK and
    WITH_PRS are two worktrees, a mutant's two runs go side by side (two cores)."""
    results.mkdir(parents=True, exist_ok=True)
    side_by_side = stock.resolve() != with_prs.resolve()
    if side_by_side:
        # Two runs at once: each gets its share of the cores (torch takes them all
        # otherwise), and the unmutated runs get the same, so that load cannot make a
        # mutated run fail where its unmutated one passed.
        extra_env = {
            **(extra_env or {}),
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2)),
        }
    runs = Runs(python, results, extra_env, cache)
    clean = runs.run(with_prs, pr_cases, "clean-prs", keep=_all_pass)
    if not _all_pass(clean):
        raise ForkError(
            f"the PRs' cases do not pass unmutated: {clean}",
            f"see {results / 'clean-prs.log'}",
        )
    baselines: dict[tuple[str, ...], Outcome] = {}
    test_sets = sorted({upstream_tests[m.path] for m in mutants})
    for number, tests in enumerate(test_sets, 1):
        paths = sorted({m.path for m in mutants if upstream_tests[m.path] == tests})
        baseline = runs.run(stock, list(tests), f"baseline-{number}", keep=_some_pass)
        if not _some_pass(baseline):
            raise ForkError(
                f"no case of the release's own tests of {', '.join(paths)} passes "
                f"unmutated: {baseline}",
                f"see {results / f'baseline-{number}.log'}",
            )
        log.step(
            f"mutants: the release's tests of {', '.join(paths)}, unmutated: {baseline}"
        )
        baselines[tests] = baseline
    rows = []
    with ThreadPoolExecutor(max_workers=2 if side_by_side else 1) as pool:
        for number, mutant in enumerate(mutants, 1):
            tests = upstream_tests[mutant.path]
            mine = pool.submit(
                runs.mutated, with_prs, mutant, pr_cases, f"pr-cases-{number}"
            )
            if not side_by_side:
                mine.result()
            up = _upstream_killers(
                runs, stock, mutant, tests, baselines[tests], f"release-tests-{number}"
            )
            failed = killers(mine.result(), clean)
            by_pr = {
                name: [c for c in failed if owns(c)] for name, owns in owners.items()
            }
            diff = mutant.diff((stock / mutant.path).open(newline="").read())
            rows.append(Row(mutant, tests, up, by_pr, diff))
    return rows


def check(rows: list[Row], pr_names: list[str]) -> None:
    """Every mutant that no triggered CI job catches (Row.counts) is killed by some PR,
    each PR kills at least one of them, and they are at least MIN_SURVIVORS."""
    survivors = [r for r in rows if r.counts]
    unkilled = [r.mutant.name for r in survivors if not any(r.by_pr.values())]
    idle = [n for n in pr_names if not any(r.by_pr[n] for r in survivors)]
    problems = []
    if unkilled:
        problems.append(
            f"{len(unkilled)} mutant(s) survive the triggered CI jobs and every PR: "
            + "; ".join(unkilled)
        )
    if idle:
        problems.append(
            f"{', '.join(idle)} kill(s) no mutant the triggered CI jobs miss: "
            "not worth sending"
        )
    if len(survivors) < MIN_SURVIVORS:
        problems.append(
            f"only {len(survivors)} mutant(s) survive the release's tests and the "
            f"triggered GPU jobs ({MIN_SURVIVORS} wanted across the packed path)"
        )
    if problems:
        raise ForkError(
            "; ".join(problems),
            "see dist/upstream/mutants/ and forkbuild/upstream/mutants.py",
        )


def table(rows: list[Row], pr: str) -> str:
    """PR's table for its description: the mutants that no CI job a change to the
    mutated file triggers catches and that it kills, then each of them as a diff, so
    that a reviewer can apply it and run both again."""
    lines = [
        "| mutant | file | caught by a CI job that a change to the file triggers "
        "| killed by this PR |",
        "| --- | --- | --- | --- |",
    ]
    listed = [row for row in rows if row.counts and row.by_pr[pr]]
    for row in listed:
        lines.append(
            f"| {row.mutant.name} | `{row.mutant.path}` | no | "
            f"{_cases(row.by_pr[pr])} |"
        )
    paths = {r.mutant.path for r in rows if r.by_pr[pr]}
    mine = [r for r in rows if r.mutant.path in paths]
    caught = sum(1 for r in mine if not r.survivor)
    on_gpu = [r for r in mine if r.survivor and r.mutant.gpu_job]
    tests = sorted({t for r in mine for t in r.upstream_tests})
    lines.append("")
    lines.append(
        f"Mutants tried on the code these tests cover: {len(mine)}, each one change to "
        f"vLLM's code, applied alone. The release's own tests of that code, as shipped "
        f"({', '.join(f'`{t}`' for t in tests)}), run on CPU, "
        f"kill {caught} of them. The GPU jobs whose `source_file_dependencies` a "
        "change to the mutated file triggers were read case by case (which cases "
        f"execute the mutated line, and would they fail): {len(on_gpu)} of the rest "
        "would likely be caught there"
        + "".join(f"; {r.mutant.name}: {r.mutant.gpu_job}" for r in on_gpu)
        + ". The table lists the others that this PR kills."
    )
    lines += [
        "",
        "<details>",
        "<summary>The mutants, each as `git apply` takes it on the release "
        "(what was applied)</summary>",
        "",
    ]
    for row in listed:
        lines += [
            f"{row.mutant.name}, in `{row.mutant.path}`:",
            "",
            "```diff",
            *row.diff.rstrip("\n").splitlines(),
            "```",
            "",
        ]
    lines.append("</details>")
    return "\n".join(lines)


def _cases(cases: list[str]) -> str:
    """Failed cases by test function: a parametrized one with how many of its parameter
    sets failed (a mutant can rename them: two enum members made one)."""
    counts: dict[str, int] = {}
    parametrized = set()
    for case in cases:
        name = case.split("::", 1)[1].split("[", 1)[0]
        counts[name] = counts.get(name, 0) + 1
        if "[" in case:
            parametrized.add(name)
    return ", ".join(
        f"`{name}`"
        + (
            f" ({n} parameter set{'s' if n > 1 else ''})"
            if name in parametrized
            else ""
        )
        for name, n in counts.items()
    )


def summary(rows: list[Row], pr: str | None = None) -> str:
    """PROOF.txt lines: per mutant, the release's tests' verdict and the PRs'."""
    out = []
    for row in rows:
        others = [n for n, c in row.by_pr.items() if c]
        if pr is None:
            verdict = "; ".join(f"{n}: {len(c)}" for n, c in row.by_pr.items())
        elif row.by_pr[pr]:
            verdict = f"this PR kills it with {len(row.by_pr[pr])} case(s)"
        elif others:
            verdict = f"not this PR's (killed by {', '.join(others)})"
        else:
            verdict = "killed by no PR"
        if row.upstream_killers:
            first = row.upstream_killers[0]
            up = f"the release's tests kill it (first failing case: {first})"
        elif row.mutant.gpu_job:
            up = (
                "the release's tests miss it; a triggered GPU job would likely catch "
                f"it: {row.mutant.gpu_job}"
            )
        else:
            up = "the release's tests miss it; no triggered GPU job executes it (read)"
        out.append(f"mutant {row.mutant.name} [{row.mutant.path}]: {up}; {verdict}")
    return "\n".join(out)
