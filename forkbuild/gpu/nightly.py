"""The nightly GPU job: the GPU tests (each case forked: a kernel crash fails one case),
the serve test and the offload benchmark on the CUDA route. A required case that skipped
or is absent fails the job (required.py): a skip is how a missing kernel shows."""

import json
import os
import subprocess
from pathlib import Path

from forkbuild.core import log, preflight, pytest_runner
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT, GpuKind, Pins, build_dir
from forkbuild.core.pytest_runner import Outcome
from forkbuild.gpu import cuda_toolchain
from forkbuild.gpu import required as gpu_required
from forkbuild.gpu.required import PER_CASE_TIMEOUT
from forkbuild.setup import install, lock

BENCHMARK = REPO_ROOT / "benchmarks" / "offload_throughput_gpu.py"

# Time limits, in seconds: each run stops before Buildkite's 60-minute step limit, so
# the job always ends with its reports; INSTALL_BUDGET_S is what they leave the install
# (a test checks the sum). Per case: gpu_required.CASE_LIMIT_S (docs/gpu-nightly.md).
RUN_LIMITS_S = {"gpu-tests": 25 * 60, "serve": 12 * 60, "benchmark": 8 * 60}
INSTALL_BUDGET_S = 12 * 60
STEP_LIMIT_MIN = 60  # the pipeline's timeout_in_minutes (forkbuild/gpu/pipeline.py)


def out_dir() -> Path:
    """FORK_NIGHTLY_OUT, relative to the repository root as the artifact_paths are."""
    out = os.environ.get("FORK_NIGHTLY_OUT") or build_dir() / "gpu-nightly"
    return REPO_ROOT / out


def _query_gpus() -> str:
    smi = ["nvidia-smi", f"--query-gpu={gpu_required.NVIDIA_SMI_QUERY}", "--format=csv"]
    return subprocess.run(smi, capture_output=True, text=True, check=False).stdout


def run(pins: Pins) -> str:
    # Before minutes of CUDA install: without a GPU there is nothing to run.
    if not preflight.has_nvidia_gpu():
        raise ForkError(
            "no NVIDIA GPU on this machine: the nightly GPU job needs one of the kinds "
            f"of fork.toml [gpu] ({', '.join(k.name for k in pins.gpu.kinds)})",
            "run it on the GPU runner; on CPU, `make test` covers what runs without a "
            "GPU",
        )
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    gpus = _query_gpus()
    (out / "gpus.csv").write_text(gpus)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if visible is None else repr(visible)
    log.step(f"nightly: GPUs (CUDA_VISIBLE_DEVICES {shown})\n{gpus}")
    # Before the install too: a GPU older than every kind has nothing it must run, and
    # an agent without a host compiler cannot build FlashInfer's kernels.
    capabilities = gpu_required.parse_nvidia_smi(gpus, visible)
    kind, required = gpu_required.select(capabilities, pins.gpu)
    log.step(f"nightly: {kind.name}, {len(required)} case(s) that must run")
    nvcc = cuda_toolchain.check_gpu_toolchain(lock.path("cuda", lock.running_python()))
    python, tree_path, _ = install.install(pins, "cuda")
    env = cuda_toolchain.prepare_toolchain(python.parent.parent, nvcc)
    # FlashInfer's JIT toolchain on this agent, in seconds, before the tests.
    where = (out / "flashinfer-jit", out / "flashinfer-jit.log")
    cuda_toolchain.probe_flashinfer_jit(python, env, nvcc, *where, "nightly")
    *runs, killed = _runs(pins, python, tree_path, env, out)
    return conclude(kind, required, *runs, out, benchmark_killed=killed)


def _runs(
    pins: Pins, python: Path, tree: Path, env: dict[str, str], out: Path
) -> tuple[Outcome, Outcome, int, str]:
    """The runs' outcomes, the benchmark's exit status, why it was stopped (or "")."""
    forked, limits = ["--forked", "-v", "-rs", *PER_CASE_TIMEOUT], RUN_LIMITS_S

    def run(where: Path, tests, xml: str, limit: str, **kw) -> Outcome:
        """A run pytest could not carry out becomes an outcome that says so."""
        kw |= {"extra_env": env, "timeout_s": limits[limit]}
        args = [*forked, *tests]
        try:
            return pytest_runner.run_pytest(python, where, args, out / xml, **kw)
        except ForkError as exc:
            log.step(f"nightly: {exc}")
            return Outcome({}, killed=f"could not run: {exc}")

    gpu_tests = run(tree, pins.gpu_tests, "gpu-tests.xml", "gpu-tests")
    serve_test = ["forkbuild/tests/test_serve_gpu.py"]
    serve = run(REPO_ROOT, serve_test, "serve-gpu.xml", "serve", pythonpath=REPO_ROOT)
    log.step("nightly: offload benchmark")
    code, stopped = pytest_runner.run_limited(
        [str(python), str(BENCHMARK), "--out", str(out / "benchmark.json")],
        cwd=tree,
        env={**os.environ, **env, "PYTHONPATH": str(tree)},
        timeout_s=limits["benchmark"],
    )
    killed = f"stopped after its time limit of {limits['benchmark']} s"
    return gpu_tests, serve, code, killed if stopped else ""


def conclude(
    kind: GpuKind,
    required: tuple[str, ...],
    gpu_tests: Outcome,
    serve: Outcome,
    benchmark_exit: int,
    out: Path,
    *,
    benchmark_killed: str = "",
) -> str:
    """Write summary.json; the summary line, or fail on a failure, a failed benchmark,
    a stopped run, or a required case that skipped or never ran."""
    both = Outcome(gpu_tests.cases | serve.cases, gpu_tests.reasons | serve.reasons)
    not_run = gpu_required.not_run(required, [both])
    failed = both.failed + both.errors + (benchmark_exit != 0)
    stops = (gpu_tests.killed, serve.killed, benchmark_killed)
    names = ("gpu-tests.xml", "serve-gpu.xml", "benchmark")
    killed = [f"{name}: {note}" for name, note in zip(names, stops) if note]
    summary = {
        "gpu_kind": kind.name,
        "gpu_tests": str(gpu_tests),
        "serve": str(serve),
        "benchmark_exit": benchmark_exit,
        "required_not_run": not_run,
        "killed": killed,
        "junit": ["gpu-tests.xml", "serve-gpu.xml"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    line = f"summary: {both.passed} passed, {failed} failed, {both.skipped} skipped, "
    line += f"{both.xfailed} xfailed"
    if failed or not_run or killed:
        print(*killed, *not_run, line, sep="\n")
        raise ForkError(
            f"the nightly GPU job failed on {kind.name}: {failed} failed (benchmark "
            f"exit {benchmark_exit}), {len(not_run)} required case(s) did not run, "
            f"{len(killed)} run(s) stopped at their time limit or could not run "
            "(listed above)",
            f"reports are in {out} (summary.json, JUnit XML); a skip reason such as an "
            "FA3 import error points at the CUDA install",
        )
    return line
