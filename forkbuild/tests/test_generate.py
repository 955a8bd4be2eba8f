"""`make generate`: the blocks that restate fork.toml and patches/ are up to date, and a
change to the GPU table is one edit of fork.toml (in a scratch copy)."""

import shutil
from pathlib import Path

import pytest
import yaml

from forkbuild.checks import generate
from forkbuild.core import pins
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT

TABLE = pins.load().gpu
OLDEST, NEWEST = TABLE.kinds[0], TABLE.kinds[-1]


def test_every_generated_block_is_up_to_date():
    stale = [str(f.relative_to(REPO_ROOT)) for f in generate.stale(pins.load())]
    assert stale == [], f"{', '.join(stale)} out of date: run `make generate`"


def _generate_in_copy(tmp_path: Path, containing: str, old: str, new: str) -> pins.Pins:
    """fork.toml and the blocks' files copied, OLD made NEW on fork.toml's one line that
    holds CONTAINING, the blocks regenerated."""
    for path in {"fork.toml", *(b[0] for b in generate.BLOCKS)}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / path, tmp_path / path)
    toml = tmp_path / "fork.toml"
    lines = toml.read_text().splitlines(keepends=True)
    (i,) = [i for i, line in enumerate(lines) if containing in line]
    assert old in lines[i], lines[i]
    lines[i] = lines[i].replace(old, new, 1)
    toml.write_text("".join(lines))
    edited = pins.load(toml)
    assert generate.stale(edited, tmp_path)  # the edit alone leaves them behind
    generate.write(edited, tmp_path)
    assert generate.stale(edited, tmp_path) == {}
    return edited


def _steps(root: Path) -> dict[str, dict]:
    steps = yaml.safe_load((root / generate.PIPELINE).read_text())["steps"]
    return {step["agents"]["queue"]: step for step in steps}


def _required(step: dict) -> int:
    return int(step["label"].rsplit(": ", 1)[1].split()[0])  # "(1 GPU: 5 required"


def test_moving_a_gpu_case_to_another_kind_is_one_edit(tmp_path):
    case = next(c.node for c in TABLE.cases.values() if c.kind == OLDEST.name)
    old, new = f'kind = "{OLDEST.name}"', f'kind = "{NEWEST.name}"'
    edited = _generate_in_copy(tmp_path, f'"{case}"', old, new)
    assert case not in edited.gpu.kind(OLDEST.name).required(2)
    assert case in edited.gpu.kind(NEWEST.name).required(1)
    steps, before = _steps(tmp_path), _steps(REPO_ROOT)
    for queue, _ in OLDEST.queues:
        assert _required(steps[queue]) == _required(before[queue]) - 1
    name = f"`{case.rsplit('::', 1)[1]}`"
    for path in ("docs/gpu-nightly.md", ".buildkite/fork_nightly_gpu.yaml"):
        items = (tmp_path / path).read_text().split(f"- {NEWEST.name} (", 1)
        assert name in items[1] and name not in items[0].split(f"- {OLDEST.name} (")[1]
    since = ".".join(map(str, OLDEST.min_capability))
    count = len(edited.gpu.kind(OLDEST.name).cases)
    readme = (tmp_path / "README.md").read_text()
    assert f"{OLDEST.name} ({since} and newer) {count}" in readme


def test_adding_a_queue_is_one_edit(tmp_path):
    queue = "fork-gpu-made-up-2"
    edit = f"{OLDEST.name} = {{", "queues = { ", f'queues = {{ "{queue}" = 2, '
    edited = _generate_in_copy(tmp_path, *edit)
    steps = _steps(tmp_path)
    assert sorted(steps) == sorted(edited.gpu.queues)
    assert len(steps) == len(TABLE.queues) + 1
    out = f"build/gpu-nightly/{queue}"
    assert steps[queue]["env"] == {"FORK_NIGHTLY_OUT": out}
    paths = [f"{out}/*.{x}" for x in ("xml", "json", "csv")]
    assert steps[queue]["artifact_paths"] == paths
    assert f"{OLDEST.name} (2 GPUs: " in steps[queue]["label"]
    assert _required(steps[queue]) == len(OLDEST.required(2))
    readme = (tmp_path / "README.md").read_text()
    assert f"on {len(TABLE.queues) + 1} GPU agent queues" in readme
    assert f"`{queue}` (2 GPUs)" in (tmp_path / "docs/gpu-nightly.md").read_text()


def test_a_file_without_its_markers_or_a_case_without_a_bundle_entry_is_refused():
    with pytest.raises(ForkError, match="has no block 'steps'"):
        generate.replace_block("steps: []\n", "x.yaml", "steps", "fork.toml", "")
    kinds = {"A": {"capability": "8.0", "queues": {}}}
    with pytest.raises(ForkError, match="gives neither `bundle`"):
        pins.gpu_table({"kinds": kinds, "cases": {"t.py::a": {"kind": "A"}}})
