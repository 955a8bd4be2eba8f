"""`make generate` (forkbuild/checks/generate.py): the blocks that restate fork.toml
and patches/ are up to date, and a change to the GPU table is one edit of fork.toml,
shown in a scratch copy of the files with blocks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from forkbuild.checks import generate
from forkbuild.core import pins
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT

TRITON = (
    '"tests/v1/worker/test_packed_kv_cache_gpu_kernels.py::'
    'test_triton_attention_over_packed_views" = { kind = "Ampere"'
)
AMPERE_QUEUES = 'queues = { "fork-gpu-ampere-1" = 1 }'


def test_every_generated_block_is_up_to_date():
    stale = [str(f.relative_to(REPO_ROOT)) for f in generate.stale(pins.load())]
    assert stale == [], f"{', '.join(stale)} out of date: run `make generate`"


def _copy(tmp_path: Path, edit: tuple[str, str]) -> tuple[Path, pins.Pins]:
    """The files with blocks and fork.toml, with EDIT (old, new) made in fork.toml and
    `make generate` run there."""
    for path in {"fork.toml", *(b[0] for b in generate.BLOCKS)}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / path, tmp_path / path)
    toml = tmp_path / "fork.toml"
    assert toml.read_text().count(edit[0]) == 1
    toml.write_text(toml.read_text().replace(*edit))
    edited = pins.load(toml)
    assert generate.stale(edited, tmp_path)  # the edit alone leaves them behind
    for file, text in generate.render(edited, tmp_path).items():
        file.write_text(text)
    assert generate.stale(edited, tmp_path) == []
    return tmp_path, edited


def _steps(root: Path) -> dict[str, dict]:
    pipeline = root / ".buildkite" / "fork_nightly_gpu.yaml"
    steps = yaml.safe_load(pipeline.read_text())["steps"]
    return {step["agents"]["queue"]: step for step in steps}


def test_moving_a_gpu_case_to_another_kind_is_one_edit(tmp_path):
    root, edited = _copy(tmp_path, (TRITON, TRITON.replace("Ampere", "Hopper")))
    case = TRITON.split('"')[1]
    assert case not in edited.gpu.kind("Ampere").required(2)
    assert case in edited.gpu.kind("Hopper").required(1)
    steps, before = _steps(root), _steps(REPO_ROOT)
    assert "(1 GPU: 4 required cases)" in steps["fork-gpu-ampere-1"]["label"]
    assert "(1 GPU: 5 required cases)" in before["fork-gpu-ampere-1"]["label"]
    name = f"`{case.rsplit('::', 1)[1]}`"
    for path in ("docs/gpu-nightly.md", ".buildkite/fork_nightly_gpu.yaml"):
        ampere, hopper = (root / path).read_text().split("- Hopper (", 1)
        assert name in hopper and name not in ampere.split("- Ampere (", 1)[1], path
    assert "Ampere (8.0 and newer) 4;" in (root / "README.md").read_text()


def test_adding_a_queue_is_one_edit(tmp_path):
    added = AMPERE_QUEUES.replace("= 1 }", '= 1, "fork-gpu-ampere-2" = 2 }')
    root, edited = _copy(tmp_path, (AMPERE_QUEUES, added))
    steps = _steps(root)
    assert sorted(steps) == sorted(edited.gpu.queues) and len(steps) == 4
    step = steps["fork-gpu-ampere-2"]
    out = "build/gpu-nightly/fork-gpu-ampere-2"
    assert step["env"] == {"FORK_NIGHTLY_OUT": out}
    assert step["artifact_paths"] == [f"{out}/*.{x}" for x in ("xml", "json", "csv")]
    assert "Ampere (2 GPUs: 5 required cases)" in step["label"]
    assert "on 4 GPU agent queues" in (root / "README.md").read_text()
    assert "`fork-gpu-ampere-2` (2 GPUs)" in (root / "docs/gpu-nightly.md").read_text()


def test_a_file_without_its_markers_is_refused():
    with pytest.raises(ForkError, match="has no block 'steps'"):
        generate.replace_block("steps: []\n", "x.yaml", "steps", "fork.toml", "")


def test_a_case_without_a_bundle_entry_is_refused():
    raw = {"kinds": {"A": {"capability": "8.0", "queues": {}}}}
    with pytest.raises(ForkError, match="exactly one of `bundle`"):
        pins.gpu_table({**raw, "cases": {"t.py::a": {"kind": "A"}}})
    with pytest.raises(ForkError, match="unknown kinds: B"):
        pins.gpu_table({**raw, "cases": {"t.py::b": {"kind": "B", "bundle": []}}})
