"""fork.toml [gpu] written out for `make generate` (checks/generate.py): the nightly
pipeline's steps (one per agent queue) and the GPU kinds' prose of README.md, the
pipeline and docs/gpu-nightly.md."""

import textwrap

import yaml

from forkbuild.core.pins import GpuTable
from forkbuild.gpu import nightly

COMMAND = "bash .ci/gpu-nightly"  # = make nightly
OUT_ROOT = "build/gpu-nightly"  # nightly.out_dir()'s default, from the repository root
REPORTS = ("*.xml", "*.json", "*.csv")
WIDTH = 92  # the docs' lines, and the pipeline's comments with their "# "


def _gpus(count: int) -> str:
    return f"{count} GPU" + ("s" if count > 1 else "")


def _short(node: str) -> str:
    return f"`{node.rsplit('::', 1)[-1]}`"


def steps(table: GpuTable) -> list[dict]:
    """One step per agent queue, newest kind first, its reports from its own folder."""
    return [
        {
            "label": f"#47054 nightly, {kind.name} ({_gpus(count)}: "
            f"{len(kind.required(count))} required cases)",
            "key": f"nightly-{queue}",
            "agents": {"queue": queue},
            "command": COMMAND,
            "env": {"FORK_NIGHTLY_OUT": f"{OUT_ROOT}/{queue}"},
            "timeout_in_minutes": nightly.STEP_LIMIT_MIN,
            "retry": {"automatic": [{"exit_status": -1, "limit": 1}]},
            "artifact_paths": [f"{OUT_ROOT}/{queue}/{p}" for p in REPORTS],
        }
        for kind in reversed(table.kinds)
        for queue, count in kind.queues
    ]


def steps_yaml(table: GpuTable) -> str:
    return yaml.safe_dump({"steps": steps(table)}, sort_keys=False, width=88)


def kinds_prose(table: GpuTable) -> str:
    """Markdown: per kind, its capability, queues and the cases older kinds lack."""
    lines, seen = [], set()
    for kind in table.kinds:
        major, minor = kind.min_capability
        single = [c for c in kind.cases if c not in seen]
        multi = [c for c in kind.multi_gpu_cases if c not in seen]
        seen |= {*single, *multi}
        what = ", ".join(map(_short, single)) or "no case of its own"
        if multi:
            what += "; with two GPUs also " + ", ".join(map(_short, multi))
        verb = "adds" if kind is not table.kinds[0] else "must run"
        named = [f"`{queue}` ({_gpus(count)})" for queue, count in kind.queues]
        queues = ("queue " if len(named) == 1 else "queues ") + ", ".join(named)
        item = f"- {kind.name} (compute capability {major}.{minor} and newer; "
        lines.append(_wrap(item + f"{queues}) {verb} {what}.", "  "))
    return "\n".join(lines)


def readme_prose(table: GpuTable) -> str:
    """The README's summary: the queues and what each kind must run, counted."""
    parts = []
    for kind in table.kinds:
        major, minor = kind.min_capability
        multi = len(kind.multi_gpu_cases)
        more = f" ({multi} more with two GPUs)" if multi else ""
        parts.append(f"{kind.name} ({major}.{minor} and newer) {len(kind.cases)}{more}")
    return _wrap(
        f"`.buildkite/fork_nightly_gpu.yaml` runs `make nightly` every night on "
        f"{len(table.queues)} GPU agent queues. Its GPU kinds (fork.toml `[gpu]`) must "
        f"run: {'; '.join(parts)} cases, its own and every older kind's."
    )


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False)
