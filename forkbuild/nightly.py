"""The nightly GPU job: build the fork on the CUDA route, run the GPU tests (each case
in its own process: a kernel crash fails one case, not the job), the serve-level test
and the offload benchmark; JUnit XML and JSON land in one folder for the pipeline.
A case that this GPU kind must run (forkbuild/gpu_required.py) and that skipped or is
absent fails the job like a failure: a skip is how a missing kernel shows."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from forkbuild import gpu_required, install, lock, log, preflight, pytest_runner
from forkbuild.gpu_required import PER_CASE_TIMEOUT
from forkbuild.errors import ForkError
from forkbuild.pins import REPO_ROOT, Pins, build_dir

BENCHMARK = REPO_ROOT / "benchmarks" / "offload_throughput_gpu.py"

# Time limits, in seconds. Buildkite stops the step after 60 minutes
# (timeout_in_minutes in .buildkite/fork_nightly_gpu.yaml), and a step stopped there
# writes no summary.json; these stop each part first, so that the job always ends
# with its reports. The install is not limited (forkbuild's own code, which stops on
# its own errors): INSTALL_BUDGET_S is what the limits leave it (measured: 2.5 min
# cold on a GPU host), and a test checks that everything fits in the step's timeout.
# CASE_LIMIT_S and PER_CASE_TIMEOUT: forkbuild/gpu_required.py (the GPU bundle uses them too).
RUN_LIMITS_S = {"gpu-tests": 25 * 60, "serve": 12 * 60, "benchmark": 8 * 60}
INSTALL_BUDGET_S = 12 * 60

# What the GPU runs need from the CUDA lock: FlashInfer 0.6.13 JIT-compiles its paged
# prefill and decode modules with nvcc (nvidia-cuda-nvcc, its cicc in nvidia-nvvm, the
# headers of nvidia-cuda-crt and nvidia-cuda-runtime) and a bare `ninja` from PATH, and
# links them against libcudart; pytest-timeout gives PER_CASE_TIMEOUT.
LOCK_PINS = ("ninja", "nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-runtime",
             "pytest-timeout")


def out_dir() -> Path:
    """FORK_NIGHTLY_OUT, a relative one taken from the repository root (where the
    pipeline's artifact_paths are), so that pytest and the benchmark, which run in the
    tree, write to the same place."""
    return REPO_ROOT / (os.environ.get("FORK_NIGHTLY_OUT") or build_dir() / "gpu-nightly")


# --- the toolchain -------------------------------------------------------------------


def check_lock_pins(lock_file: Path) -> str:
    """Fail unless LOCK_FILE pins every package of LOCK_PINS; return nvcc's version.
    Read from the lock before minutes of install, not found missing after it."""
    if not lock_file.is_file():
        raise ForkError(f"{lock_file} is missing", "run `make lock` and commit locks/")
    pinned = lock.pinned(lock_file)
    missing = [name for name in LOCK_PINS if name not in pinned]
    if missing:
        raise ForkError(
            f"{lock_file.name} does not pin {', '.join(missing)}, which the GPU tests need "
            "(FlashInfer's JIT builds: nvcc and ninja; the per-case time limit: pytest-timeout)",
            "add them to fork.toml ([toolchain] test or [routes.cuda] extra) and run `make lock`",
        )
    nvcc, runtime = pinned["nvidia-cuda-nvcc"], pinned["nvidia-cuda-runtime"]
    # FlashInfer's CCCL (cuda/std/__cccl/cuda_toolkit.h) stops every JIT build whose nvcc
    # is not of the CUDA major.minor of the toolkit headers (cuda_runtime_api.h, from
    # nvidia-cuda-runtime, which torch pins): "CUDA compiler and CUDA toolkit headers
    # are incompatible".
    if _major_minor(nvcc) != _major_minor(runtime):
        raise ForkError(
            f"{lock_file.name} pins nvidia-cuda-nvcc {nvcc} but nvidia-cuda-runtime {runtime}: "
            "FlashInfer's JIT builds refuse an nvcc of another CUDA version than the headers",
            f"pin nvidia-cuda-nvcc, nvidia-nvvm and nvidia-cuda-crt of CUDA "
            f"{'.'.join(_major_minor(runtime))} in fork.toml [routes.cuda] and run `make lock`",
        )
    return nvcc


def _major_minor(version: str) -> tuple[str, str]:
    major, minor, *_ = version.split(".") + ["0"]
    return major, minor


def _resolves(command: str | None, path: str) -> bool:
    """Whether COMMAND (a name, a path, or a command line such as `ccache gcc`) is an
    executable on PATH."""
    words = shlex.split(command) if command else []
    return bool(words) and shutil.which(words[0], path=path) is not None


def missing_host_compilers(env: Mapping[str, str]) -> list[str]:
    """The host compilers the GPU runs need and ENV lacks, each with who needs it. The
    CUDA lock brings nvcc and ninja, not these."""
    path, cc = env.get("PATH", ""), env.get("CC")
    missing = []
    # Triton 3.6 builds each kernel's launcher with $CC, else gcc, else clang (not cc).
    triton_cc = [cc] if cc else ["gcc", "clang"]
    if not any(_resolves(compiler, path) for compiler in triton_cc):
        missing.append(f"{' or '.join(triton_cc)} (Triton's kernel launchers)")
    # FlashInfer's ninja files compile its .cpp sources and link every module with $CXX.
    cxx = env.get("CXX") or "c++"
    if not _resolves(cxx, path):
        missing.append(f"{cxx} (FlashInfer's JIT builds)")
    # nvcc's host compiler: FlashInfer passes -ccbin $CC when CC is set; else nvcc runs
    # gcc from PATH on C++ (g++'s compiler proper, which gcc alone lacks).
    if not cc and not (_resolves("gcc", path) and _resolves("g++", path)):
        missing.append("gcc and g++ (nvcc's host compiler)")
    return missing


def check_gpu_toolchain(lock_file: Path, env: Mapping[str, str] = os.environ) -> str:
    """Before the install: the agent's host compilers and the pins of the CUDA lock that
    the GPU runs need. Returns the lock's nvcc version (which names its toolkit folder)."""
    missing = missing_host_compilers(env)
    if missing:
        raise ForkError(
            f"the GPU tests need a host compiler that this agent lacks: {'; '.join(missing)}",
            "install gcc and g++ on the agent (Debian/Ubuntu: apt-get install gcc g++), or "
            "set CC/CXX; nvcc and ninja come from the CUDA lock",
        )
    return check_lock_pins(lock_file)


def cuda_home(venv: Path, nvcc_version: str) -> Path:
    """Where the lock's nvidia-cuda-* wheels put the toolkit: site-packages/nvidia/cuNN
    with bin/nvcc, nvvm/bin/cicc, include/, and lib/libcudart.so.NN (no lib64, and no
    unversioned libcudart.so: see link_dir)."""
    return install.site_packages(venv) / "nvidia" / f"cu{nvcc_version.split('.')[0]}"


def link_dir(venv: Path) -> Path:
    """Link names for FlashInfer's link step, which runs `c++ ... -L$CUDA_HOME/lib64
    -lcudart -lcuda`: the wheels have lib/ and only libcudart.so.NN, and many drivers
    install only libcuda.so.1, so `-lcudart` and `-lcuda` find nothing. Here libcudart.so
    and libcuda.so point at those files (the linked module then needs the same sonames
    that torch and Triton load). In the venv: it lives and goes with it."""
    return venv / "fork-cuda-links"


def toolchain_env(
    venv: Path, nvcc_version: str, base: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The variables the GPU pytest runs and the benchmark get on top of BASE.

    CUDA_HOME is the lock's toolkit even where the agent sets its own: FlashInfer takes
    its nvcc, headers and libcudart from CUDA_HOME, and the nightly must test the CUDA
    the lock pins (the one torch was built for), not whichever toolkit an agent has.
    The venv's bin/ (ninja) comes first on PATH, then the toolkit's bin/ (nvcc, for tools
    that look on PATH); LIBRARY_PATH, which gcc and clang search for -l, the link names.
    """
    home = cuda_home(venv, nvcc_version)
    return {
        "PATH": os.pathsep.join([str(venv / "bin"), str(home / "bin"), *_entries(base, "PATH")]),
        "CUDA_HOME": str(home),
        "LIBRARY_PATH": os.pathsep.join([str(link_dir(venv)), *_entries(base, "LIBRARY_PATH")]),
    }


def _entries(env: Mapping[str, str], name: str) -> list[str]:
    return [entry for entry in env.get(name, "").split(os.pathsep) if entry]


def driver_libcuda(ldconfig_output: str) -> Path | None:
    """The driver's libcuda.so.1 for this machine from `ldconfig -p`, as Triton finds it."""
    for line in ldconfig_output.splitlines():
        name, _, location = line.strip().partition(" => ")
        if name.startswith("libcuda.so.1 ") and "x86-64" in name:
            return Path(location.strip())
    return None


def _ldconfig_cache() -> str:
    ldconfig = "/sbin/ldconfig" if Path("/sbin/ldconfig").exists() else shutil.which("ldconfig")
    if ldconfig is None:
        return ""
    return subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=False).stdout


def make_link_dir(venv: Path, nvcc_version: str, libcuda: Path | None) -> None:
    """Write link_dir(VENV) afresh: libcudart.so to the lock's runtime, libcuda.so to the
    driver's LIBCUDA (None: not found)."""
    if libcuda is None:
        raise ForkError(
            "the driver's libcuda.so.1 is not in the dynamic linker's cache (ldconfig -p): "
            "Triton and FlashInfer link their kernels' modules against it",
            "install the NVIDIA driver's libraries on the agent (or run ldconfig)",
        )
    links = link_dir(venv)
    shutil.rmtree(links, ignore_errors=True)
    links.mkdir(parents=True)
    cudart = f"libcudart.so.{nvcc_version.split('.')[0]}"
    (links / "libcudart.so").symlink_to(cuda_home(venv, nvcc_version) / "lib" / cudart)
    (links / "libcuda.so").symlink_to(libcuda)


def missing_tools(env: Mapping[str, str], links: Path) -> list[str]:
    """What of the installed toolchain ENV (toolchain_env) and LINKS (link_dir) lack."""
    home, path = Path(env["CUDA_HOME"]), env["PATH"]
    wanted = {
        "ninja on PATH": shutil.which("ninja", path=path) is not None,
        f"{home / 'bin' / 'nvcc'}": os.access(home / "bin" / "nvcc", os.X_OK),
        f"{home / 'nvvm' / 'bin' / 'cicc'}": os.access(home / "nvvm" / "bin" / "cicc", os.X_OK),
    }
    for name in ("libcudart.so", "libcuda.so"):
        wanted[f"{links / name}"] = (links / name).exists()  # False also for a dangling link
    return [what for what, found in wanted.items() if not found]


def prepare_toolchain(venv: Path, nvcc_version: str) -> dict[str, str]:
    """After the install: the link names, then check that nvcc, cicc, ninja and the
    libraries resolve in toolchain_env; return that environment."""
    make_link_dir(venv, nvcc_version, driver_libcuda(_ldconfig_cache()))
    env = toolchain_env(venv, nvcc_version)
    if os.environ.get("CUDA_HOME", env["CUDA_HOME"]) != env["CUDA_HOME"]:
        log.step(f"nightly: CUDA_HOME={env['CUDA_HOME']} (the lock's) instead of the agent's "
                 f"{os.environ['CUDA_HOME']}")
    missing = missing_tools(env, link_dir(venv))
    if missing:
        raise ForkError(
            f"the installed CUDA toolchain is incomplete, missing: {', '.join(missing)}",
            "the venv does not hold what the CUDA lock pins: rerun `make install ROUTE=cuda`",
        )
    return env


# --- the job -------------------------------------------------------------------------


def _query_gpus() -> str:
    return subprocess.run(
        ["nvidia-smi", f"--query-gpu={gpu_required.NVIDIA_SMI_QUERY}", "--format=csv"],
        capture_output=True, text=True, check=False,
    ).stdout


def run(pins: Pins) -> str:
    # Before minutes of CUDA install: without a GPU there is nothing to run.
    if not preflight.has_nvidia_gpu():
        raise ForkError(
            "no NVIDIA GPU on this machine: the nightly GPU job needs one (Ampere runs the "
            "FA2, Triton and FlashInfer cases; Hopper adds FA3 and the FLASH_ATTN engine cases)",
            "run it on the GPU runner; on CPU, `make test` covers what runs without a GPU",
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
    kind, required = gpu_required.select(gpu_required.parse_nvidia_smi(gpus, visible))
    log.step(f"nightly: {kind.name}, {len(required)} case(s) that must run")
    nvcc_version = check_gpu_toolchain(lock.path("cuda", lock.running_python()))

    python, tree_path, _ = install.install(pins, "cuda")
    env = prepare_toolchain(python.parent.parent, nvcc_version)
    check_jit(python, env, nvcc_version, out)
    kernels_and_engine = _run_or_note(
        python, tree_path, ["--forked", "-v", "-rs", *PER_CASE_TIMEOUT, *pins.gpu_tests],
        out / "gpu-tests.xml", extra_env=env, timeout_s=RUN_LIMITS_S["gpu-tests"],
    )
    serve = _run_or_note(
        python, REPO_ROOT,
        ["--forked", "-v", "-rs", *PER_CASE_TIMEOUT, "forkbuild/tests/test_serve_gpu.py"],
        out / "serve-gpu.xml", pythonpath=REPO_ROOT, extra_env=env, timeout_s=RUN_LIMITS_S["serve"],
    )
    log.step("nightly: offload benchmark")
    bench_exit, bench_stopped = pytest_runner.run_limited(
        [str(python), str(BENCHMARK), "--out", str(out / "benchmark.json")],
        cwd=tree_path, env={**os.environ, **env, "PYTHONPATH": str(tree_path)},
        timeout_s=RUN_LIMITS_S["benchmark"],
    )
    bench_killed = f"stopped after its time limit of {RUN_LIMITS_S['benchmark']} s"
    return conclude(kind, required, kernels_and_engine, serve, bench_exit, out,
                    benchmark_killed=bench_killed if bench_stopped else "")


def check_jit(python: Path, env: dict[str, str], nvcc_version: str, out: Path) -> None:
    """FlashInfer's JIT toolchain on this agent, in seconds, before the tests: the same
    probe as `make test`'s CUDA route check (forkbuild/cuda_route.py), here with the
    agent's own driver and host compiler."""
    from forkbuild import cuda_route

    modules = cuda_route.probe_flashinfer_jit(python, env, nvcc_version, out / "flashinfer-jit",
                                              out / "flashinfer-jit.log")
    log.step(f"nightly: FlashInfer's JIT finds the lock's nvcc and ninja ({modules} module build "
             "graphs), and a CUDA file compiles and links on this agent")


def _run_or_note(*args, **kwargs) -> pytest_runner.Outcome:
    """run_pytest, but a run that pytest could not carry out (a collection error, an
    internal error: exit status 2 to 5) becomes an outcome that says so, so that the
    later runs still happen and summary.json still names what went wrong."""
    try:
        return pytest_runner.run_pytest(*args, **kwargs)
    except ForkError as exc:
        log.step(f"nightly: {exc}")
        return pytest_runner.Outcome({}, killed=f"could not run: {exc}")


def conclude(
    kind: gpu_required.Kind,
    required: tuple[str, ...],
    gpu_tests: pytest_runner.Outcome,
    serve: pytest_runner.Outcome,
    benchmark_exit: int,
    out: Path,
    *,
    benchmark_killed: str = "",
) -> str:
    """Write summary.json; return the summary line, or fail on a failure, a benchmark
    that exited non-zero, a run stopped at its time limit, or a case KIND requires that
    skipped or never ran (a stopped run's unfinished cases among them)."""
    outcomes = (gpu_tests, serve)
    not_run = gpu_required.not_run(required, outcomes)
    failed = sum(o.failed + o.errors for o in outcomes) + (benchmark_exit != 0)
    killed = [f"{name}: {note}" for name, note in (
        ("gpu-tests.xml", gpu_tests.killed), ("serve-gpu.xml", serve.killed),
        ("benchmark", benchmark_killed),
    ) if note]
    summary = {
        "gpu_kind": kind.name, "gpu_tests": str(gpu_tests), "serve": str(serve),
        "benchmark_exit": benchmark_exit, "required_not_run": not_run, "killed": killed,
        "junit": ["gpu-tests.xml", "serve-gpu.xml"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    passed = sum(o.passed for o in outcomes)
    skipped = sum(o.skipped for o in outcomes)
    xfailed = sum(o.xfailed for o in outcomes)
    line = f"summary: {passed} passed, {failed} failed, {skipped} skipped, {xfailed} xfailed"
    if failed or not_run or killed:
        for problem in (*killed, *not_run):
            print(problem)
        print(line)
        raise ForkError(
            f"the nightly GPU job failed on {kind.name}: {failed} failed (benchmark exit "
            f"{benchmark_exit}), {len(not_run)} required case(s) did not run, {len(killed)} "
            "run(s) stopped at their time limit or could not run (listed above)",
            f"reports are in {out} (summary.json, JUnit XML); a skip reason such as an "
            "FA3 import error points at the CUDA install",
        )
    return line
