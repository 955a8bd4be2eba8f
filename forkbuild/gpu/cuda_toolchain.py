"""The CUDA lock's toolchain for the nightly and the CUDA route check: its pins, the
host compilers, CUDA_HOME, FlashInfer's link names, the JIT probe."""

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from packaging.version import Version

from forkbuild.core import log
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT
from forkbuild.setup import install, lock

# What the GPU runs need from the CUDA lock: FlashInfer 0.6.13 JIT-compiles its paged
# prefill and decode modules with nvcc (its cicc in nvidia-nvvm, headers in -crt and
# -runtime) and `ninja` from PATH; pytest-timeout gives PER_CASE_TIMEOUT.
LOCK_PINS = ("ninja", "nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt")
LOCK_PINS += ("nvidia-cuda-runtime", "pytest-timeout")


def check_lock_pins(lock_file: Path) -> str:
    """nvcc's version; fails, before minutes of install, unless LOCK_FILE pins all."""
    if not lock_file.is_file():
        raise ForkError(f"{lock_file} is missing", "run `make lock` and commit locks/")
    pinned = lock.pinned(lock_file)
    if missing := [name for name in LOCK_PINS if name not in pinned]:
        raise ForkError(
            f"{lock_file.name} does not pin {', '.join(missing)}, which the GPU tests "
            "need (FlashInfer's JIT builds: nvcc and ninja; the per-case time limit: "
            "pytest-timeout)",
            "add them to fork.toml ([toolchain] test or [routes.cuda] extra) and run "
            "`make lock`",
        )
    nvcc, runtime = pinned["nvidia-cuda-nvcc"], pinned["nvidia-cuda-runtime"]
    cuda = Version(runtime).release[:2]
    # FlashInfer's CCCL (cuda/std/__cccl/cuda_toolkit.h) stops every JIT build whose
    # nvcc is not of the CUDA major.minor of nvidia-cuda-runtime's headers (torch pins
    # it): "CUDA compiler and CUDA toolkit headers are incompatible".
    if Version(nvcc).release[:2] != cuda:
        raise ForkError(
            f"{lock_file.name} pins nvidia-cuda-nvcc {nvcc} but nvidia-cuda-runtime "
            f"{runtime}: FlashInfer's JIT builds refuse an nvcc of another CUDA "
            "version than the headers",
            f"pin nvidia-cuda-nvcc, nvidia-nvvm and nvidia-cuda-crt of CUDA "
            f"{'.'.join(map(str, cuda))} in fork.toml [routes.cuda] and run "
            "`make lock`",
        )
    return nvcc


def _resolves(command: str | None, path: str) -> bool:
    """Whether COMMAND (or a command line such as `ccache gcc`) is on PATH."""
    words = shlex.split(command) if command else []
    return bool(words) and shutil.which(words[0], path=path) is not None


def missing_host_compilers(env: Mapping[str, str]) -> list[str]:
    """The host compilers (not in the CUDA lock) that ENV lacks, each with its user."""
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
    """Before the install: the host compilers and the lock's pins; its nvcc version."""
    if missing := missing_host_compilers(env):
        raise ForkError(
            "the GPU tests need a host compiler that this agent lacks: "
            f"{'; '.join(missing)}",
            "install gcc and g++ on the agent (Debian/Ubuntu: apt-get install gcc "
            "g++), or set CC/CXX; nvcc and ninja come from the CUDA lock",
        )
    return check_lock_pins(lock_file)


def link_dir(venv: Path) -> Path:
    """Link names for FlashInfer's `c++ ... -lcudart -lcuda`: the wheels have only
    libcudart.so.NN, many drivers only libcuda.so.1 (the sonames torch loads)."""
    return venv / "fork-cuda-links"


def toolchain_env(
    venv: Path, nvcc_version: str, base: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """On top of BASE. CUDA_HOME is the lock's even where the agent has one: FlashInfer
    takes nvcc, headers and libcudart from it, for the CUDA torch was built for."""
    # The lock's toolkit: bin/, nvvm/, include/, lib/ (no lib64: see link_dir).
    home = install.site_packages(venv) / "nvidia" / f"cu{nvcc_version.split('.')[0]}"
    path = _join(venv / "bin", home / "bin", base.get("PATH", ""))
    library_path = _join(link_dir(venv), base.get("LIBRARY_PATH", ""))
    return {"PATH": path, "CUDA_HOME": str(home), "LIBRARY_PATH": library_path}


def _join(*parts: Path | str) -> str:
    """PARTS (paths, or lists such as PATH) as one list, without empty entries."""
    return os.pathsep.join(e for p in parts for e in str(p).split(os.pathsep) if e)


def driver_libcuda(ldconfig_output: str) -> Path | None:
    """The driver's libcuda.so.1 from `ldconfig -p`, as Triton finds it."""
    for line in ldconfig_output.splitlines():
        name, _, location = line.strip().partition(" => ")
        if name.startswith("libcuda.so.1 ") and "x86-64" in name:
            return Path(location.strip())
    return None


def _ldconfig_cache() -> str:
    search = os.pathsep.join(["/sbin", os.environ.get("PATH", os.defpath)])
    ldconfig = shutil.which("ldconfig", path=search)
    done = ldconfig and subprocess.run([ldconfig, "-p"], capture_output=True, text=True)
    return done.stdout if done else ""


def prepare_toolchain(
    venv: Path, nvcc_version: str, libcuda: Path | None = None
) -> dict[str, str]:
    """After the install: link_dir(VENV) afresh, libcuda.so to LIBCUDA (else the
    driver's), and toolchain_env once all resolve there."""
    if (libcuda := libcuda or driver_libcuda(_ldconfig_cache())) is None:
        raise ForkError(
            "the driver's libcuda.so.1 is not in the dynamic linker's cache (ldconfig "
            "-p): Triton and FlashInfer link their kernels' modules against it",
            "install the NVIDIA driver's libraries on the agent (or run ldconfig)",
        )
    env = toolchain_env(venv, nvcc_version)
    links, home = link_dir(venv), Path(env["CUDA_HOME"])
    shutil.rmtree(links, ignore_errors=True)
    links.mkdir(parents=True)
    cudart = f"libcudart.so.{nvcc_version.split('.')[0]}"
    (links / "libcudart.so").symlink_to(home / "lib" / cudart)
    (links / "libcuda.so").symlink_to(libcuda)
    if (agent_home := os.environ.get("CUDA_HOME", str(home))) != str(home):
        log.step(f"CUDA_HOME={home} (the lock's) instead of the agent's {agent_home}")
    missing = [] if shutil.which("ninja", path=env["PATH"]) else ["ninja on PATH"]
    tools = (home / "bin" / "nvcc", home / "nvvm" / "bin" / "cicc")
    missing += [str(tool) for tool in tools if not os.access(tool, os.X_OK)]
    # exists() is False for a dangling link
    missing += [str(link) for link in sorted(links.iterdir()) if not link.exists()]
    if missing:
        raise ForkError(
            f"the CUDA toolchain installed in {venv} is incomplete, missing: "
            f"{', '.join(missing)}",
            "the venv lacks what the CUDA lock pins: check its nvidia-cuda-* and ninja "
            "pins, and rerun the install (`make install ROUTE=cuda`)",
        )
    return env


def probe_flashinfer_jit(
    python: Path, env: dict[str, str], nvcc: str, work: Path, report: Path, who: str
) -> int:
    """flashinfer_jit_probe.py with ENV: what FlashInfer's JIT would miss, in seconds,
    not in the first FlashInfer case, logged for WHO; the build graphs checked."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    probe = [str(python), "-m", "forkbuild.gpu.flashinfer_jit_probe", str(work)]
    run_env = {**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)}
    run_env["FLASHINFER_WORKSPACE_BASE"] = str(work)
    run_env["FLASHINFER_CUDA_ARCH_LIST"] = "8.0 9.0a"
    done = subprocess.run(probe, cwd=work, env=run_env, capture_output=True, text=True)
    report.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise ForkError(
            f"FlashInfer's JIT probe crashed: {done.stderr.strip()[-600:]}",
            f"see {report}",
        )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    venv = python.parent.parent
    if problems := jit_problems(found, env["CUDA_HOME"], venv, nvcc):
        raise ForkError(
            "FlashInfer's JIT would fail on the GPU runner: " + "; ".join(problems),
            f"see {report}",
        )
    modules = len(found["modules"])
    log.step(
        f"{who}: FlashInfer's JIT finds the lock's nvcc and ninja; {modules} paged "
        "prefill build graphs resolve, a CUDA file compiles and links"
    )
    return modules


def jit_problems(found: dict, home: str, venv: Path, nvcc_version: str) -> list[str]:
    """What the probe's report FOUND shows FlashInfer's JIT would miss."""
    problems, cuda_at = [], found["cuda_home"]
    if Path(cuda_at) != Path(home):
        problems.append(f"FlashInfer takes CUDA from {cuda_at}, not the lock's")
    if not found["ninja"] or Path(found["ninja"]).parent != venv / "bin":
        problems.append(f"ninja resolves to {found['ninja']}, not the venv's")
    if not found["cuda_version"].startswith(nvcc_version.rsplit(".", 1)[0]):
        cuda = found["cuda_version"]
        problems.append(f"FlashInfer reads CUDA {cuda}, the lock pins {nvcc_version}")
    modules = found["modules"].items()
    problems += [f"no build graph for {m}" for m, ok in modules if not ok]
    if not found["compiled"]:
        why = found["compile_error"]
        problems.append(f"the lock's nvcc cannot compile and link: {why}")
    elif len(links := found["links"]) != 2:  # the runtime and the driver, by soname
        problems.append(f"the linked module needs only {links} of libcudart, libcuda")
    return problems
