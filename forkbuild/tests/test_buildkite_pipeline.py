"""The nightly GPU and the CI pipeline against Buildkite's schema (buildkite-sdk), and
what it cannot know: command files, artifacts and the download cache are where used."""

import fnmatch
import json
import re
import shlex
from importlib.resources import files
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
import yaml

from forkbuild.core import pins
from forkbuild.core.pins import REPO_ROOT
from forkbuild.gpu import nightly

PIPELINE = REPO_ROOT / ".buildkite" / "fork_nightly_gpu.yaml"
CI_PIPELINE = REPO_ROOT / ".buildkite" / "fork_ci.yaml"
# A cold `make test` takes about 12 minutes on 2 cores; the fork's CI stops a job at 90.
CI_RUN_MIN, CI_LIMIT_MIN = 12, 90
# What forkbuild/gpu/nightly.py writes into its output folder.
REPORTS = ["gpus.csv", "gpu-tests.xml", "serve-gpu.xml", "benchmark.json"]
REPORTS += ["summary.json"]
NIGHTLY, CI = (yaml.safe_load(path.read_text()) for path in (PIPELINE, CI_PIPELINE))

# No skip without buildkite-sdk, a test tool: an unvalidated pipeline must not pass.
SCHEMA = json.loads((files("buildkite_sdk") / "schema.json").read_text())


def _errors(instance, definition: str | None = None) -> list[str]:
    """Schema violations of INSTANCE, against the whole schema or one definition."""
    schema = {**SCHEMA, "$ref": f"#/definitions/{definition}"} if definition else SCHEMA
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(instance)
    ]


def test_the_schema_is_buildkites_draft_07_and_refuses_broken_steps():
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert SCHEMA["definitions"]["commandStep"]["additionalProperties"] is False
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    # The keys of vLLM's test_areas files, which its generator drops, are no step keys.
    step = dict(NIGHTLY["steps"][0], device="h100", num_devices=1, nightly=True)
    step["source_file_dependencies"] = ["fork.toml"]
    (error,) = _errors(step, "commandStep")
    assert "Additional properties are not allowed" in error
    assert _errors({**NIGHTLY, "steps": [step]}) != []
    # The same on a CI step with a misspelt key and a timeout that is no number.
    first = _command_steps(CI)[0]
    step = dict(first, artifacts_paths=["build/test-results/*.xml"])
    assert any("Additional properties" in e for e in _errors(step, "commandStep"))
    step = dict(first, timeout_in_minutes="forty-five")
    assert _errors(step, "commandStep") != []
    assert _errors({**CI, "steps": [step]}) != []


def test_every_nightly_step_has_a_gpu_queue_a_file_to_run_its_reports(monkeypatch):
    steps = NIGHTLY["steps"]
    queues = sorted(step["agents"]["queue"] for step in steps)
    assert queues == sorted(pins.load().gpu.queues), queues
    assert len({step["key"] for step in steps}) == len(steps)
    monkeypatch.delenv("FORK_NIGHTLY_OUT", raising=False)
    monkeypatch.delenv("VLLM_FORK_BUILD", raising=False)
    default = PurePosixPath(nightly.out_dir().relative_to(REPO_ROOT).as_posix())
    for step in steps:
        label = step["label"]
        assert step.get("timeout_in_minutes"), label
        # Its command runs a file of this repository, its artifacts are the reports in
        # the nightly's output folder.
        interpreter, script = shlex.split(step["command"])
        assert interpreter == "bash" and (REPO_ROOT / script).is_file(), label
        out = PurePosixPath(step.get("env", {}).get("FORK_NIGHTLY_OUT", default))
        assert not out.is_absolute() and out.is_relative_to(default), (label, out)
        # nightly.py takes a relative FORK_NIGHTLY_OUT from the repository root, which
        # is where Buildkite resolves artifact_paths.
        monkeypatch.setenv("FORK_NIGHTLY_OUT", str(out))
        assert nightly.out_dir() == REPO_ROOT / out
        patterns = step["artifact_paths"]
        for pattern in patterns:
            assert PurePosixPath(pattern).parent == out, (label, pattern)
        for report in REPORTS:
            found = any(fnmatch.fnmatch(f"{out}/{report}", p) for p in patterns)
            assert found, (label, report)


# -- the fork's CI on every push and pull request --------------------------------------
def _step_kind(step) -> str:
    """The schema definition of STEP's kind (a wait step, else a command step)."""
    wait = step in ("wait", "waiter") or isinstance(step, dict) and "wait" in step
    return "waitStep" if wait else "commandStep"


def _command_steps(pipeline: dict) -> list[dict]:
    return [step for step in pipeline["steps"] if _step_kind(step) == "commandStep"]


@pytest.mark.parametrize("pipeline", [NIGHTLY, CI], ids=["nightly", "ci"])
def test_the_pipelines_are_valid_for_buildkite(pipeline):
    # Each step against its own kind first: against the anyOf of all step kinds, the
    # error jsonschema picks is often another kind's ("is not of type 'string'").
    for step in pipeline["steps"]:
        label = step.get("label") if isinstance(step, dict) else step
        assert _errors(step, _step_kind(step)) == [], label
    assert _errors(pipeline) == []
    # The top level admits extra keys in the schema, but Buildkite reads only its own.
    assert set(pipeline) <= set(SCHEMA["properties"]), set(pipeline)


def test_the_ci_pipeline_runs_make_test_on_a_cpu_queue_in_time(monkeypatch):
    # one job: make test runs its parts at once itself
    (step,) = _command_steps(CI)
    assert 2 * CI_RUN_MIN <= step["timeout_in_minutes"] <= CI_LIMIT_MIN
    assert step["command"] == "bash .ci/run"
    run = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", run, re.M), "bash .ci/run no longer runs it"
    gpu_queues = {s["agents"]["queue"] for s in NIGHTLY["steps"]}
    # with a GPU, make test takes the CUDA route
    assert step["agents"]["queue"] not in gpu_queues
    assert "gpu" not in step["agents"]["queue"]
    assert step["key"] not in {s["key"] for s in NIGHTLY["steps"]}
    # The download cache where forkbuild reads it.
    env = step["env"]
    cache = PurePosixPath(env["VLLM_FORK_CACHE"])
    # Absolute: outside the checkout, which Buildkite cleans of ignored files.
    assert cache.is_absolute(), cache
    monkeypatch.setenv("VLLM_FORK_CACHE", str(cache))
    assert pins.cache_dir() == Path(str(cache))
    # build/ stays in the checkout: the reports are uploaded from there, and each build
    # is a fresh clone with a warm cache, as the README's figures are measured.
    assert "VLLM_FORK_BUILD" not in env and "VLLM_FORK_DIST" not in env
    # It uploads every JUnit report of make test.
    monkeypatch.delenv("VLLM_FORK_BUILD", raising=False)
    results = PurePosixPath(pins.build_dir().relative_to(REPO_ROOT), "test-results")
    patterns = step["artifact_paths"]
    assert all(PurePosixPath(p).parent == results for p in patterns), patterns
    # The JUnit files the modules of `make test` write into build/test-results.
    reports = set()
    for module in ("checks/testrun", "checks/regression", "gpu/cuda_route"):
        source = (REPO_ROOT / "forkbuild" / f"{module}.py").read_text()
        reports |= set(re.findall(r"""results\s*/\s*["']([\w.-]+\.xml)["']""", source))
    assert {"forkbuild.xml", "suite-fork.xml", "suite-stock.xml"} <= reports, reports
    for report in reports:
        assert any(fnmatch.fnmatch(f"{results}/{report}", p) for p in patterns), report
    assert f"{results}/*.xml" in patterns
