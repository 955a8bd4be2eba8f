"""The nightly GPU job: build the fork on the CUDA route, run the GPU tests (each case
in its own process: a kernel crash fails one case, not the job), the serve-level test
and the offload benchmark; JUnit XML and JSON land in one folder for the pipeline.
A case that this GPU kind must run (forkbuild/gpu_required.py) and that skipped or is
absent fails the job like a failure: a skip is how a missing kernel shows."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from forkbuild import gpu_required, install, log, preflight, pytest_runner
from forkbuild.errors import ForkError
from forkbuild.pins import REPO_ROOT, Pins, build_dir

BENCHMARK = REPO_ROOT / "benchmarks" / "offload_throughput_gpu.py"


def out_dir() -> Path:
    """FORK_NIGHTLY_OUT, a relative one taken from the repository root (where the
    pipeline's artifact_paths are), so that pytest and the benchmark, which run in the
    tree, write to the same place."""
    return REPO_ROOT / (os.environ.get("FORK_NIGHTLY_OUT") or build_dir() / "gpu-nightly")


def run(pins: Pins) -> str:
    # Before minutes of CUDA install: without a GPU there is nothing to run.
    if not preflight.has_nvidia_gpu():
        raise ForkError(
            "no NVIDIA GPU on this machine: the nightly GPU job needs one "
            "(Ampere runs FA2 and Triton cases; Hopper adds FA3 and the FLASH_ATTN engine cases)",
            "run it on the GPU runner; on CPU, `make test` covers what runs without a GPU",
        )
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    gpus = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,compute_cap,memory.total", "--format=csv"],
        capture_output=True, text=True, check=False,
    ).stdout
    (out / "gpus.csv").write_text(gpus)
    log.step(f"nightly: GPUs\n{gpus}")
    # Before the install too: a GPU older than every kind has nothing it must run.
    kind, required = gpu_required.select(gpu_required.parse_nvidia_smi(gpus))
    log.step(f"nightly: {kind.name}, {len(required)} case(s) that must run")

    python, tree_path, _ = install.install(pins, "cuda")
    kernels_and_engine = pytest_runner.run_pytest(
        python, tree_path, ["--forked", "-v", "-rs", *pins.gpu_tests], out / "gpu-tests.xml"
    )
    serve = pytest_runner.run_pytest(
        python, REPO_ROOT, ["--forked", "-v", "-rs", "forkbuild/tests/test_serve_gpu.py"],
        out / "serve-gpu.xml", pythonpath=REPO_ROOT,
    )
    log.step("nightly: offload benchmark")
    bench = subprocess.run(
        [str(python), str(BENCHMARK), "--out", str(out / "benchmark.json")],
        cwd=tree_path, env={**os.environ, "PYTHONPATH": str(tree_path)}, check=False,
    )
    return conclude(kind, required, kernels_and_engine, serve, bench.returncode, out)


def conclude(
    kind: gpu_required.Kind,
    required: tuple[str, ...],
    gpu_tests: pytest_runner.Outcome,
    serve: pytest_runner.Outcome,
    benchmark_exit: int,
    out: Path,
) -> str:
    """Write summary.json; return the summary line, or fail on a failure, a benchmark
    that exited non-zero, or a case KIND requires that skipped or never ran."""
    outcomes = (gpu_tests, serve)
    not_run = gpu_required.not_run(required, outcomes)
    failed = sum(o.failed + o.errors for o in outcomes) + (benchmark_exit != 0)
    summary = {
        "gpu_kind": kind.name, "gpu_tests": str(gpu_tests), "serve": str(serve),
        "benchmark_exit": benchmark_exit, "required_not_run": not_run,
        "junit": ["gpu-tests.xml", "serve-gpu.xml"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    passed = sum(o.passed for o in outcomes)
    skipped = sum(o.skipped for o in outcomes)
    xfailed = sum(o.xfailed for o in outcomes)
    line = f"summary: {passed} passed, {failed} failed, {skipped} skipped, {xfailed} xfailed"
    if failed or not_run:
        for problem in not_run:
            print(problem)
        print(line)
        raise ForkError(
            f"the nightly GPU job failed on {kind.name}: {failed} failed (benchmark exit "
            f"{benchmark_exit}), {len(not_run)} required case(s) did not run (listed above)",
            f"reports are in {out} (summary.json, JUnit XML); a skip reason such as an "
            "FA3 import error points at the CUDA install",
        )
    return line
