"""Which of a vLLM release's Buildkite jobs run a test file, by the release's own
tethering hook (tools/pre_commit/check_test_tethering.py). Run in the release tree with
the release's Python (the hook needs PyYAML and regex): `python release_ci_jobs.py
TEST_FILE...` prints test file -> the jobs whose commands collect it (label, key,
device, the command and its `-m` expression: the hook ignores markers)."""

import json
import runpy
import shlex
import sys
from pathlib import Path


def _load_hook(tree: Path) -> dict:  # the release's own reading of its pipelines
    path = tree / "tools" / "pre_commit" / "check_test_tethering.py"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: is this a vLLM release tree?")
    return runpy.run_path(str(path), run_name="release_tethering")


def _marker(command: str) -> str | None:
    """The `-m` expression of a pytest command line (None: no marker filter)."""
    try:
        tokens = shlex.split(command)
    except ValueError:
        return None
    for index, token in enumerate(tokens):
        if token == "-m" and index + 1 < len(tokens) and tokens[index - 1] != "python":
            return tokens[index + 1]
        if token.startswith("-m") and len(token) > 2 and not token.startswith("-m="):
            return token[2:]
    return None


def jobs_running(tree: Path, test_files: list[str]) -> dict[str, list[dict]]:
    import yaml

    hook = _load_hook(tree)
    found: dict[str, list[dict]] = {f: [] for f in test_files}
    for yaml_path in hook["_pipeline_yaml_paths"]():
        doc = yaml.safe_load(yaml_path.read_text()) or {}
        if not isinstance(doc, dict):
            continue
        for step in hook["_iter_job_steps"](doc):
            commands = [*(step.get("commands") or []), step.get("command")]
            job = {k: step.get(k, "") for k in ("label", "key", "device")}
            for command in (c for c in commands if isinstance(c, str) and c):
                said = {"command": command, "marker": _marker(command)}
                selections = hook["_parse_command"](command)
                for test_file in test_files:
                    normalized = hook["normalize_test_path"](test_file)
                    if any(s.runs(normalized) for s in selections):
                        found[test_file].append(job | said)
    return found


if __name__ == "__main__":
    print(json.dumps(jobs_running(Path.cwd(), sys.argv[1:]), indent=1))
