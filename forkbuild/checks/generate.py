"""`make generate`: rewrite the BLOCKS that restate fork.toml and patches/, each between
a Markdown or YAML comment pair, nothing else (test_generate.py fails on stale ones)."""

import email
import email.policy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from forkbuild.checks import patch_status
from forkbuild.core import log
from forkbuild.core.errors import ForkError, run_or_fail
from forkbuild.core.pins import REPO_ROOT, Pins
from forkbuild.gpu import pipeline
from forkbuild.setup import tree

COMMAND = "make generate"


@dataclass(frozen=True)
class PatchFacts:
    """One mail of the series: subject, DEP-3 fields, `git apply --numstat`."""

    name: str
    subject: str
    fields: dict[str, str]
    numstat: tuple[tuple[int, int, str], ...]


def read_mail(path: Path) -> PatchFacts:
    message = email.message_from_bytes(path.read_bytes(), policy=email.policy.default)
    subject = " ".join(str(message["Subject"]).split())
    if subject.startswith("["):  # [PATCH] or [PATCH n/m]
        subject = subject.split("] ", 1)[1]
    fields = patch_status.read_patch(path).fields
    numstat = ["git", "apply", "--numstat", str(path)]
    unread = f"{path.name} is no diff git reads"
    done = run_or_fail(numstat, unread, "regenerate it with git format-patch")
    stat = [line.split("\t", 2) for line in done.stdout.splitlines()]
    numbers = tuple((int(a), int(r), f) for a, r, f in stat)
    return PatchFacts(path.name, subject, fields, numbers)


def series(patches_dir: Path = tree.PATCHES_DIR) -> list[PatchFacts]:
    """The mails of patches/series, in the order git am applies them."""
    return [read_mail(patch.path) for patch in tree.read_series(patches_dir)]


def patch_table(p: Pins, patches_dir: Path = tree.PATCHES_DIR) -> str:
    head = "patch | subject | lines changed | origin (DEP-3) | upstream | regression"
    rows = [f"| {head} modules |", "| --- | --- | --- | --- | --- | --- |"]
    for patch in series(patches_dir):
        changes = "; ".join(f"`{f}` +{a} -{r}" for a, r, f in patch.numstat)
        origin = patch.fields.get("Origin", "none given")
        if "Bug" in patch.fields:
            origin += f"; bug {patch.fields['Bug']}"
        upstream = patch.fields.get("Applied-Upstream", "not applied upstream")
        modules = p.regression_by_patch.get(patch.name, ())
        named = ", ".join(f"`{Path(m).name}`" for m in modules)
        named = named or "**none: add them to fork.toml [tests.regression]**"
        link = f"[`{patch.name[:4]}`](../patches/{patch.name})"
        cells = [link, patch.subject, changes, origin, upstream, named]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def tree_log(p: Pins) -> str:
    facts = series()
    added = [str(sum(a for a, _, _ in f.numstat)) for f in facts]
    version, width = p.upstream_version, 44
    lines = [
        "```console",
        f"$ git -C build/vllm-{version} log --oneline",
        "…       fork: overlay the fork's tests",
        *(f"…       {patch.subject}" for patch in reversed(facts)),
        f"{'2dcc02b vLLM ' + version + ' (sdist)':<{width}} <- tagged v{version}",
        f"$ git -C build/vllm-{version} diff v{version} -- vllm/     # exactly the "
        f"series: {' + '.join(added)} lines added",
        "```",
    ]
    return "\n".join(lines)


# (file, block, source, text): what each block holds.
Render = Callable[[Pins], str]
GPU, PIPELINE = "fork.toml [gpu]", ".buildkite/fork_nightly_gpu.yaml"
BLOCKS: tuple[tuple[str, str, str, Render], ...] = (
    ("README.md", "gpu-kinds", GPU, lambda p: pipeline.readme_prose(p.gpu)),
    ("docs/gpu-nightly.md", "gpu-kinds", GPU, lambda p: pipeline.kinds_prose(p.gpu)),
    (PIPELINE, "gpu-kinds", GPU, lambda p: pipeline.kinds_prose(p.gpu)),
    (PIPELINE, "steps", GPU, lambda p: pipeline.steps_yaml(p.gpu).rstrip("\n")),
    ("docs/patches-and-tree.md", "patch-table", "patches/", patch_table),
    ("docs/patches-and-tree.md", "tree-log", "patches/", tree_log),
)


def replace_block(text: str, path: str, block: str, source: str, body: str) -> str:
    yaml = path.endswith((".yaml", ".yml"))
    start = f"generated: {block}, from {source} by `{COMMAND}`; edit that, not this"
    wrap = "# {}" if yaml else "<!-- {} -->"  # the block's first and last lines
    begin, end = wrap.format(start), wrap.format(f"end of generated: {block}")
    head, found, rest = text.partition(begin + "\n")
    old, found_end, tail = rest.partition(end + "\n")
    if not (found and found_end):
        raise ForkError(
            f"{path} has no block {block!r} (the lines {begin!r} ... {end!r})",
            "restore the two marker lines where the block goes",
        )
    prefix = "# " if yaml and block != "steps" else ""  # steps: the YAML itself
    lines = [(prefix + line).rstrip() for line in body.split("\n")]
    return head + begin + "\n" + "\n".join(lines) + "\n" + end + "\n" + tail


def stale(p: Pins, root: Path = REPO_ROOT) -> dict[Path, str]:
    """The files with a block out of date, each as it should read."""
    texts: dict[Path, str] = {}
    for path, block, source, text in BLOCKS:
        file = root / path
        current = texts.get(file) or file.read_text()
        texts[file] = replace_block(current, path, block, source, text(p))
    return {f: text for f, text in texts.items() if f.read_text() != text}


def write(p: Pins, root: Path = REPO_ROOT) -> str:
    """`make generate`: rewrite every stale block; return the closing line."""
    changed = stale(p, root)
    for file, text in changed.items():
        file.write_text(text)
        log.step(f"generate: rewrote {file.relative_to(root)}")
    return f"generate: {len(changed)} file(s) changed"
