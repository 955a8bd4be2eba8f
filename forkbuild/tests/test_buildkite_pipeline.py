""".buildkite/fork_nightly_gpu.yaml is a pipeline Buildkite accepts: checked against
Buildkite's own pipeline schema (shipped in the buildkite-sdk package, a test tool of
fork.toml), plus what the schema cannot know: the command files exist here and the
artifacts are where the nightly job writes its reports."""

from __future__ import annotations

import fnmatch
import importlib.resources
import json
import shlex
from pathlib import PurePosixPath

import jsonschema
import pytest
import yaml

from forkbuild import nightly
from forkbuild.pins import REPO_ROOT

PIPELINE = REPO_ROOT / ".buildkite" / "fork_nightly_gpu.yaml"
# What forkbuild/nightly.py writes into its output folder.
REPORTS = ("gpus.csv", "gpu-tests.xml", "serve-gpu.xml", "benchmark.json", "summary.json")


@pytest.fixture(scope="module")
def schema() -> dict:
    # No skip when buildkite-sdk is absent: it is part of the test toolchain, and a
    # pipeline nobody validated must not pass quietly.
    resource = importlib.resources.files("buildkite_sdk").joinpath("schema.json")
    return json.loads(resource.read_text())


@pytest.fixture(scope="module")
def pipeline() -> dict:
    return yaml.safe_load(PIPELINE.read_text())


def _errors(schema: dict, instance, definition: str | None = None) -> list[str]:
    """Schema violations of INSTANCE, against the whole schema or one of its definitions."""
    if definition:
        schema = {"definitions": schema["definitions"], "$ref": f"#/definitions/{definition}"}
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in validator.iter_errors(instance)
    ]


def test_the_schema_is_buildkites_draft_07(schema):
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["definitions"]["commandStep"]["additionalProperties"] is False
    jsonschema.Draft7Validator.check_schema(schema)


def test_the_pipeline_is_valid_for_buildkite(schema, pipeline):
    # Each step as a command step first: against the anyOf of all step kinds, the error
    # jsonschema picks is often another kind's ("is not of type 'string'").
    for step in pipeline["steps"]:
        assert _errors(schema, step, "commandStep") == [], step.get("label")
    assert _errors(schema, pipeline) == []
    # The top level admits extra keys in the schema, but Buildkite reads only its own.
    assert set(pipeline) <= set(schema["properties"]), set(pipeline) - set(schema["properties"])


def test_the_schema_refuses_the_test_area_shape(schema, pipeline):
    # The keys of vLLM's test_areas files, which its generator drops, are no step keys.
    step = dict(pipeline["steps"][0], device="h100", num_devices=1, nightly=True,
                source_file_dependencies=["fork.toml"])
    (error,) = _errors(schema, step, "commandStep")
    assert "Additional properties are not allowed" in error
    assert _errors(schema, {**pipeline, "steps": [step]}) != []


def test_every_step_targets_a_gpu_queue_with_a_timeout(pipeline):
    steps = pipeline["steps"]
    queues = [step["agents"]["queue"] for step in steps]
    assert len(set(queues)) == len(steps) == 3, queues  # Hopper 1 GPU, Hopper 2 GPUs, Ampere
    assert len({step["key"] for step in steps}) == len(steps)
    assert all(step.get("timeout_in_minutes") for step in steps)


def test_every_command_runs_a_file_of_this_repository(pipeline):
    for step in pipeline["steps"]:
        commands = step["command"]
        for command in [commands] if isinstance(commands, str) else commands:
            interpreter, script, *_ = shlex.split(command)
            assert interpreter == "bash", command
            assert (REPO_ROOT / script).is_file(), f"{step['label']}: {script} is not in the repo"


def test_artifacts_are_the_reports_in_the_nightly_output_folder(pipeline, monkeypatch):
    monkeypatch.delenv("FORK_NIGHTLY_OUT", raising=False)
    monkeypatch.delenv("VLLM_FORK_BUILD", raising=False)
    default = PurePosixPath(nightly.out_dir().relative_to(REPO_ROOT).as_posix())
    for step in pipeline["steps"]:
        label = step["label"]
        out = PurePosixPath(step.get("env", {}).get("FORK_NIGHTLY_OUT", default))
        assert not out.is_absolute() and out.is_relative_to(default), (label, out)
        # nightly.py takes a relative FORK_NIGHTLY_OUT from the repository root, which is
        # where Buildkite resolves artifact_paths.
        monkeypatch.setenv("FORK_NIGHTLY_OUT", str(out))
        assert nightly.out_dir() == REPO_ROOT / out
        patterns = step["artifact_paths"]
        patterns = [patterns] if isinstance(patterns, str) else patterns
        for pattern in patterns:
            assert PurePosixPath(pattern).parent == out, (label, pattern)
        for report in REPORTS:
            assert any(fnmatch.fnmatch(f"{out}/{report}", p) for p in patterns), (label, report)
