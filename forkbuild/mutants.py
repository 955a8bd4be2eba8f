"""The mutation proof of `forkbuild upstream`: small breakages of the release's packed-view
code, applied one at a time to the proof worktree; the series' tests must fail on each.

Each mutant is one text substitution, written by hand from reading that release's code
(offset, strides, layout order, view vs copy: the ways #47054-like defects happen). It
must match exactly once; when the release's code changes, the step stops and names the
mutant to rewrite rather than testing something else. The file is restored by git after
each run, and its bytecode removed both times so that no stale .pyc stands in for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forkbuild import log, tree
from forkbuild.errors import ForkError
from forkbuild.pytest_runner import Outcome, run_pytest


@dataclass(frozen=True)
class Mutant:
    name: str  # what it breaks, as the PR description's table shows it
    path: str  # the file in the release tree
    original: str  # text that occurs exactly once in it
    mutated: str


_VIEWS = "vllm/v1/kv_cache_interface.py"  # create_kv_cache_views, compute_layout_strides
# The OffloadingConnector worker's registration (register_kv_caches).
_OFFLOAD = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py"

# Per release that `make upstream` may target: fork.toml [matrix]'s newest.
MUTANTS: dict[str, tuple[Mutant, ...]] = {
    "0.33.0": (
        Mutant(
            "the tensor's byte offset ignored",
            _VIEWS,
            "storage_offset=raw.storage_offset() + kv_cache_tensor.offset,",
            "storage_offset=raw.storage_offset(),",
        ),
        Mutant(
            "the layer stride ignored (recomputed from the page size)",
            _VIEWS,
            "fixed_strides=(layer_stride, block_stride, None, None, None),",
            "fixed_strides=(None, block_stride, None, None, None),",
        ),
        Mutant(
            "the block stride ignored (recomputed from the pages of the view's layers)",
            _VIEWS,
            "fixed_strides=(layer_stride, block_stride, None, None, None),",
            "fixed_strides=(layer_stride, None, None, None, None),",
        ),
        Mutant(
            "the layout's order dropped (logical order taken as physical, as in #47054)",
            _VIEWS,
            "    order = layout.stride_order\n",
            "    order = tuple(range(len(layout.stride_order)))\n",
        ),
        Mutant(
            # Not `max(current_stride, padded)` dropped alone: the assert after it
            # would stop that mutant, not the tests.
            "page padding ignored where strides are derived (padded pages laid out dense)",
            _VIEWS,
            'padded_page_size = getattr(spec, "page_size_padded", None)',
            "padded_page_size = None",
        ),
        Mutant(
            "each layer's view copied instead of aliased",
            _VIEWS,
            "        views.append(cache_logical)\n",
            "        views.append(cache_logical.clone())\n",
        ),
        Mutant(
            "the connector does not see packed rows (registers each layer's page)",
            _OFFLOAD,
            "if tensor.stride(0) != tensor.shape[1]",
            "if tensor.stride(0) < tensor.shape[1]",
        ),
        Mutant(
            "the connector moves one layer's page of a packed row, not the whole row",
            _OFFLOAD,
            "[CanonicalKVCacheTensor(packed_tensor, block_stride)]",
            "[CanonicalKVCacheTensor(packed_tensor, tensor.shape[1])]",
        ),
    ),
}


@dataclass(frozen=True)
class Verdict:
    mutant: Mutant
    outcome: Outcome

    @property
    def killers(self) -> list[str]:
        return sorted(c for c, s in self.outcome.cases.items() if s in ("failed", "error"))


def for_release(version: str) -> tuple[Mutant, ...]:
    if version not in MUTANTS:
        raise ForkError(
            f"forkbuild/mutants.py has no mutants of vLLM {version}'s packed-view code",
            "read the release's create_kv_cache_views (or its successor) and write them",
        )
    return MUTANTS[version]


def apply(worktree: Path, mutant: Mutant) -> None:
    target = worktree / mutant.path
    text = target.read_text() if target.is_file() else ""
    found = text.count(mutant.original)
    if found != 1:
        raise ForkError(
            f"mutant '{mutant.name}' matches {found} times in {mutant.path} (once expected): "
            "the release's code is not what the mutant was written against",
            "rewrite the mutant in forkbuild/mutants.py from the release's code",
        )
    target.write_text(text.replace(mutant.original, mutant.mutated))
    _drop_bytecode(target)


def restore(worktree: Path, mutant: Mutant) -> None:
    restored = tree.git(["checkout", "--", mutant.path], worktree)
    if restored.returncode != 0:
        raise ForkError(f"git could not restore {mutant.path} in {worktree}: {restored.stderr.strip()}")
    _drop_bytecode(worktree / mutant.path)


def _drop_bytecode(source: Path) -> None:
    # A .pyc is trusted on the source's mtime (whole seconds) and size: a mutant of the
    # same size written within the second would otherwise run the old code.
    for pyc in (source.parent / "__pycache__").glob(f"{source.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def kill(python: Path, worktree: Path, mutants: tuple[Mutant, ...], pytest_args: list[str],
         results: Path, extra_env: dict[str, str] | None = None) -> list[Verdict]:
    """Run PYTEST_ARGS in WORKTREE once per mutant; every mutant must make a case fail."""
    results.mkdir(parents=True, exist_ok=True)
    verdicts = []
    for number, mutant in enumerate(mutants, 1):
        log.step(f"mutants: [{number}/{len(mutants)}] {mutant.name}")
        try:
            apply(worktree, mutant)
            outcome = run_pytest(
                python, worktree, pytest_args,
                results / f"mutant-{number}.xml", output=results / f"mutant-{number}.log",
                extra_env=extra_env,
            )
        finally:
            restore(worktree, mutant)
        verdict = Verdict(mutant, outcome)
        verdicts.append(verdict)
        log.step(f"mutants: [{number}/{len(mutants)}] "
                 + (f"killed by {len(verdict.killers)} case(s)" if verdict.killers else "SURVIVED"))
    survivors = [v.mutant.name for v in verdicts if not v.killers]
    if survivors:
        raise ForkError(
            f"{len(survivors)} of {len(mutants)} mutant(s) survived the series' tests: "
            + "; ".join(survivors),
            f"strengthen the tests so that each breakage fails a case (logs in {results})",
        )
    return verdicts


def table(verdicts: list[Verdict]) -> str:
    """The PR description's mutation table."""
    lines = ["| mutant (in the release) | file | cases failed | killed by |", "| --- | --- | --- | --- |"]
    for v in verdicts:
        modules: dict[str, int] = {}
        for case in v.killers:
            name = Path(case.split("::", 1)[0]).name
            modules[name] = modules.get(name, 0) + 1
        by = ", ".join(f"`{m}` ({n})" for m, n in sorted(modules.items()))
        lines.append(f"| {v.mutant.name} | `{v.mutant.path}` | {len(v.killers)} of "
                     f"{len(v.outcome.cases)} | {by} |")
    return "\n".join(lines)
