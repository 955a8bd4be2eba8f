"""The nightly GPU job: build the fork on the CUDA route, run the GPU tests (each case
in its own process: a kernel crash fails one case, not the job), the serve-level test
and the offload benchmark; JUnit XML and JSON land in one folder for the pipeline."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from forkbuild import install, log, preflight, pytest_runner
from forkbuild.errors import ForkError
from forkbuild.pins import REPO_ROOT, Pins, build_dir

BENCHMARK = REPO_ROOT / "benchmarks" / "offload_throughput_gpu.py"


def out_dir() -> Path:
    return Path(os.environ.get("FORK_NIGHTLY_OUT") or build_dir() / "gpu-nightly")


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
    failed = sum(o.failed + o.errors for o in (kernels_and_engine, serve)) + (bench.returncode != 0)
    summary = {
        "gpu_tests": str(kernels_and_engine), "serve": str(serve),
        "benchmark_exit": bench.returncode, "junit": ["gpu-tests.xml", "serve-gpu.xml"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    passed = kernels_and_engine.passed + serve.passed
    skipped = kernels_and_engine.skipped + serve.skipped
    line = f"summary: {passed} passed, {failed} failed, {skipped} skipped"
    if failed:
        print(line)
        raise ForkError(f"the nightly GPU job failed ({summary})", f"reports are in {out}")
    return line
