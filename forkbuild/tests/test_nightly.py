"""The nightly GPU job on CPU, in this order: lock pins and host compilers before the
install, the GPU runs' environment after it, runs stopped at their limit that still
leave a summary, and the job's order with the GPU, the install and the runs faked. Fake
venvs and PATHs; the limited runs are tiny projects."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from forkbuild.core import pytest_runner
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT, GpuKind
from forkbuild.core.pytest_runner import Outcome
from forkbuild.gpu import cuda_toolchain, nightly, required
from forkbuild.setup import install, lock

NVCC = "13.2.86"
PIPELINE = REPO_ROOT / ".buildkite" / "fork_nightly_gpu.yaml"
PYTHON = Path(sys.executable)


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _bin(tmp_path: Path, *names: str) -> str:
    """A PATH of one folder holding executables NAMES."""
    folder = tmp_path / "path"
    for name in names:
        _executable(folder / name)
    return str(folder)


def _lock(tmp_path: Path, names: list[str], runtime: str = "13.2.51") -> Path:
    versions = {"nvidia-cuda-nvcc": NVCC, "nvidia-cuda-runtime": runtime}
    lines = [f"{n}=={versions.get(n, '1.0')} \\\n    --hash=sha256:00\n" for n in names]
    lock_file = tmp_path / "cuda-py311.txt"
    lock_file.write_text("# a lock\n" + "".join(lines))
    return lock_file


ALL_PINS = list(cuda_toolchain.LOCK_PINS)
# nvcc 13.2 with nvidia-cuda-runtime 13.0's headers, which FlashInfer's CCCL refuses.
MISMATCH = r"nvcc 13\.2\.86 but nvidia-cuda-runtime 13\.0\.96.*of CUDA 13\.0 in fork"


@pytest.mark.parametrize(
    ("names", "runtime", "match"),
    [
        (ALL_PINS[1:-1], "13.2.51", r"cuda-py311\.txt does not pin ninja, pytest-t"),
        (ALL_PINS, "13.0.96", MISMATCH),
        (None, "", r"cuda-py311\.txt\.gone is missing"),
    ],
)
def test_the_lock_must_pin_the_gpu_toolchain(tmp_path, names, runtime, match):
    assert cuda_toolchain.check_lock_pins(_lock(tmp_path, ALL_PINS)) == NVCC
    bad = _lock(tmp_path, names, runtime) if names else tmp_path / "cuda-py311.txt.gone"
    with pytest.raises(ForkError, match=match):
        cuda_toolchain.check_lock_pins(bad)


@pytest.mark.parametrize(
    ("names", "env", "missing"),
    [
        (["gcc", "g++", "c++"], {}, []),
        (["clang", "clang++"], {"CC": "clang", "CXX": "clang++"}, []),
        (["ccache", "gcc", "g++", "c++"], {"CC": "ccache gcc"}, []),
        ([], {}, ["gcc or clang (Triton", "c++ (FlashInfer", "gcc and g++ (nvcc"]),
        (["gcc"], {}, ["c++ (FlashInfer", "gcc and g++ (nvcc"]),  # no g++ installed
        (["clang", "c++"], {}, ["gcc and g++ (nvcc"]),  # nvcc's default is gcc
        (["gcc", "g++", "c++"], {"CC": "/opt/none/cc"}, ["/opt/none/cc (Triton"]),
        (["gcc", "g++"], {"CXX": "clang++"}, ["clang++ (FlashInfer"]),
    ],
    ids=["gcc", "clang-CC", "ccache", "none", "gcc-only", "clang", "no-CC", "no-CXX"],
)
def test_missing_host_compilers(tmp_path, names, env, missing):
    env = {"PATH": _bin(tmp_path, *names), **env}
    found = cuda_toolchain.missing_host_compilers(env)
    assert len(found) == len(missing)
    assert all(line.startswith(start) for line, start in zip(found, missing)), found


def test_the_toolchain_check_names_what_is_missing_before_the_install(tmp_path):
    lock_file = _lock(tmp_path, ALL_PINS)
    with pytest.raises(ForkError) as error:
        cuda_toolchain.check_gpu_toolchain(lock_file, {"PATH": _bin(tmp_path, "gcc")})
    assert "\n" not in str(error.value)
    lacks = "c++ (FlashInfer's JIT builds); gcc and g++ (nvcc's host compiler)"
    assert lacks in error.value.cause
    assert "apt-get install gcc g++" in error.value.hint
    env = {"PATH": _bin(tmp_path, "gcc", "g++", "c++")}
    assert cuda_toolchain.check_gpu_toolchain(lock_file, env) == NVCC
    with pytest.raises(ForkError, match="does not pin nvidia-cuda-nvcc"):
        cuda_toolchain.check_gpu_toolchain(_lock(tmp_path, ["ninja"]), env)
    # The real locks: one made without the pins would fail the GPU job only after
    # minutes of install.
    for python in ("3.11", "3.12", "3.13"):
        nvcc = cuda_toolchain.check_lock_pins(lock.path("cuda", python))
        assert nvcc.startswith("13."), python


def _venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv as the CUDA lock fills it, and its toolkit: ninja, and the toolkit of the
    nvidia-cuda-* wheels in site-packages/nvidia/cu13 (no lib64)."""
    venv = tmp_path / "venv"
    toolkit = install.site_packages(venv) / "nvidia" / "cu13"
    for tool in (venv / "bin/ninja", toolkit / "bin/nvcc", toolkit / "nvvm/bin/cicc"):
        _executable(tool)
    _executable(toolkit / "lib" / "libcudart.so.13", "")
    return venv, toolkit


def test_the_gpu_runs_get_the_locks_toolkit_first_checked(tmp_path, monkeypatch):
    (venv, toolkit), libcuda = _venv(tmp_path), _executable(tmp_path / "libcuda.so.1")
    monkeypatch.setenv("PATH", "/opt/agent/bin:/opt/more/bin")  # no ninja there
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda-12.4")
    monkeypatch.setenv("LIBRARY_PATH", "/opt/lib")
    env = cuda_toolchain.prepare_toolchain(venv, NVCC, libcuda)
    # The lock's toolkit, not the agent's: the nightly tests the CUDA the lock pins.
    assert env["CUDA_HOME"] == str(toolkit)
    path = [str(venv / "bin"), str(toolkit / "bin"), "/opt/agent/bin", "/opt/more/bin"]
    assert env["PATH"].split(os.pathsep) == path
    assert shutil.which("ninja", path=env["PATH"]) == str(venv / "bin" / "ninja")
    links = cuda_toolchain.link_dir(venv)
    assert env["LIBRARY_PATH"].split(os.pathsep) == [str(links), "/opt/lib"]
    assert cuda_toolchain.toolchain_env(venv, NVCC, {})["PATH"].count(os.pathsep) == 1
    cudart = toolkit / "lib" / "libcudart.so.13"
    assert (links / "libcudart.so").resolve() == cudart.resolve()
    assert (links / "libcuda.so").resolve() == libcuda.resolve()

    (venv / "bin" / "ninja").unlink()
    (toolkit / "bin" / "nvcc").chmod(0o644)
    cudart.unlink()  # the link now dangles
    missing = f"ninja on PATH, {toolkit / 'bin/nvcc'}, {links / 'libcudart.so'} -- "
    with pytest.raises(ForkError, match=f"incomplete, missing: {re.escape(missing)}"):
        cuda_toolchain.prepare_toolchain(venv, NVCC, libcuda)
    no_driver = r"libcuda\.so\.1 is not in the dynamic linker"
    with monkeypatch.context() as patch, pytest.raises(ForkError, match=no_driver):
        patch.setattr(cuda_toolchain, "_ldconfig_cache", lambda: "")
        cuda_toolchain.prepare_toolchain(venv, NVCC)
    # The driver's libcuda.so.1 is read from ldconfig, found off PATH.
    cache = (
        "1234 libs found in cache `/etc/ld.so.cache'\n"
        "\tlibcudart.so.13 (libc6,x86-64) => /usr/local/cuda/lib64/libcudart.so.13\n"
        "\tlibcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1\n"
        "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
    )
    found = cuda_toolchain.driver_libcuda(cache)
    assert found == Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
    assert cuda_toolchain.driver_libcuda("0 libs found in cache\n") is None
    if not os.access("/sbin/ldconfig", os.X_OK):
        pytest.skip("no /sbin/ldconfig here")
    # An agent's PATH often lacks /sbin, where Debian and Ubuntu keep ldconfig.
    monkeypatch.setenv("PATH", str(tmp_path))
    cache = cuda_toolchain._ldconfig_cache()
    assert "libs found in cache" in cache and "libc.so.6" in cache


def _compile(language: str, source: str, *args: str | Path) -> None:
    """cc (or c++) on SOURCE, given on stdin, with ARGS."""
    compiler = {"c": "cc", "c++": "c++"}[language]
    command = [compiler, "-fPIC", "-x", language, "-", *map(str, args)]
    subprocess.run(command, input=source, text=True, check=True)


@pytest.mark.skipif(
    shutil.which("cc") is None or shutil.which("c++") is None,
    reason="needs a host C and C++ compiler to link",
)
def test_flashinfers_link_step_finds_the_libraries_through_the_link_names(tmp_path):
    # FlashInfer 0.6.13's ninja rule (flashinfer/jit/cpp_ext.py) links each JIT module
    # with `$cxx $in -shared -L$cuda_home/lib64 -L$cuda_home/lib64/stubs -lcudart
    # -lcuda`; the wheels have lib/ and only libcudart.so.13, so it fails; with
    # toolchain_env it links, needing the sonames torch loads (stand-in libraries here).
    venv, home = _venv(tmp_path)
    libcuda, obj, lib = (tmp_path / name for name in ("libcuda.so.1", "m.o", "m.so"))
    for target, function in (
        (home / "lib" / "libcudart.so.13", "cudaGetDeviceCount(int *n)"),
        (libcuda, "cuInit(unsigned flags)"),
    ):
        stub = f"int {function} {{ return 0; }}\n"
        _compile("c", stub, "-shared", f"-Wl,-soname,{target.name}", "-o", target)
    module = 'extern "C" int cudaGetDeviceCount(int *);\n'
    module += 'extern "C" int cuInit(unsigned);\n'
    module += "int count() { int n; return cudaGetDeviceCount(&n) + cuInit(0); }\n"
    _compile("c++", module, "-c", "-o", obj)
    link = ["c++", str(obj), "-shared", f"-L{home}/lib64", f"-L{home}/lib64/stubs"]
    link += ["-lcudart", "-lcuda", "-o", str(lib)]
    bare = {k: v for k, v in os.environ.items() if k != "LIBRARY_PATH"}
    where = ["c++", "-print-file-name=libcudart.so"]
    found = subprocess.run(where, env=bare, capture_output=True, text=True, check=True)
    if found.stdout.strip() == "libcudart.so":  # none where the linker looks by itself
        failed = subprocess.run(link, env=bare, capture_output=True, text=True)
        assert failed.returncode != 0 and "-lcudart" in failed.stderr

    cuda_toolchain.prepare_toolchain(venv, NVCC, libcuda)
    env = {**bare, **cuda_toolchain.toolchain_env(venv, NVCC, bare)}
    subprocess.run(link, env=env, check=True)
    needed = lib.read_bytes()
    assert b"libcudart.so.13" in needed and b"libcuda.so.1" in needed


def _project(tmp_path: Path, body: str) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_cases.py").write_text(body)
    return project


SLEEPER = """\
import os, signal, subprocess, sys, time

def test_a_passes():
    pass

def test_b_hangs():
    # Started in a session of its own as the serve test's servers are, it must not
    # outlive the run. IGNORE_SIGINT: deaf to the graceful stop, only SIGKILL ends it.
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                              start_new_session=True)
    with open(os.environ["PIDS"], "w") as pids:
        pids.write(f"{os.getpid()} {server.pid}")
    if os.environ.get("IGNORE_SIGINT"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(120)

def test_c_finds_what_b_started_gone():
    # Reached only where b failed by its own limit (PER_CASE_TIMEOUT), the run going on.
    stat = "/proc/{}/stat".format(open(os.environ["PIDS"]).read().split()[1])
    if os.path.exists(stat):  # gone, or a zombie waiting for its reaper
        assert open(stat).read().rsplit(")")[-1].split()[0] == "Z"
"""


def _gone(pid: int, within_s: float = 10) -> bool:
    """PID has exited (a zombie waiting for its reaper counts as gone)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


# Limits for a run that must stop in test_b_hangs, doubling: a loaded machine may not
# reach it in 2 s, and each try costs its limit, so small steps keep a loaded run short.
LIMITS_S = (2, 4, 8, 30)


def _run_until_hung(tmp_path: Path, forked: bool = True, **env: str):
    """SLEEPER's run under the first of LIMITS_S at which it reached test_b_hangs
    (which writes the PIDS file): the outcome, the limit and the run's seconds."""
    project, pids = _project(tmp_path, SLEEPER), tmp_path / "pids"
    args, junit = ["--forked"] * forked + ["test_cases.py"], tmp_path / "junit.xml"
    extra = {"PIDS": str(pids), **env}
    for limit in LIMITS_S:
        pids.unlink(missing_ok=True)
        started = time.monotonic()
        outcome = pytest_runner.run_pytest(
            PYTHON, project, args, junit, extra_env=extra, timeout_s=limit
        )
        if pids.exists():
            return outcome, limit, time.monotonic() - started
    pytest.fail(f"test_b_hangs never started within {LIMITS_S[-1]} s")


def _all_gone(tmp_path: Path) -> bool:
    return all(_gone(int(pid)) for pid in (tmp_path / "pids").read_text().split())


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "in-process"])
def test_a_stopped_run_reports_its_cases_and_where_it_hung(tmp_path, capsys, forked):
    outcome, limit, took = _run_until_hung(tmp_path, forked)
    # Stopped by the limit, gracefully: not by the case's own 120 s, nor by SIGKILL.
    assert took < limit + pytest_runner.GRACE_S
    # SIGINT ended the session as Ctrl-C does: what finished is in the JUnit XML.
    passes, hangs = "test_cases.py::test_a_passes", "test_cases.py::test_b_hangs"
    assert outcome.cases == {passes: "passed"}
    stopped = f"stopped after its time limit of {limit} s while running {hangs}"
    assert outcome.killed == stopped
    assert _all_gone(tmp_path)
    # The job's summary names the hung required case twice: where it stopped, not run.
    kind = GpuKind("Made-up", (8, 0), (passes, hangs))
    with pytest.raises(ForkError, match=r"0 failed .*, 1 required case.*, 1 run\(s"):
        nightly.conclude(kind, kind.cases, outcome, Outcome({}), 0, tmp_path)
    summary = _summary(tmp_path)
    assert summary["killed"] == [f"gpu-tests.xml: {stopped}"]
    not_run = f"{hangs}: required but not run (not collected or not reported)"
    assert summary["required_not_run"] == [not_run]
    assert "killed: stopped after" in summary["gpu_tests"]
    printed = capsys.readouterr().out
    assert f"while running {hangs}" in printed
    assert "summary: 1 passed, 0 failed, 0 skipped, 0 xfailed" in printed


def test_what_ignores_the_graceful_stop_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(pytest_runner, "GRACE_S", 2)
    outcome, _, _ = _run_until_hung(tmp_path, IGNORE_SIGINT="1")
    assert outcome.killed.endswith("while running test_cases.py::test_b_hangs")
    assert _all_gone(tmp_path)
    # A benchmark started with SIGINT ignored (a shell's background job): only SIGKILL
    # ends it, and a benchmark stopped at its limit fails the job.
    monkeypatch.setattr(pytest_runner, "GRACE_S", 1)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    code, stopped = pytest_runner.run_limited(
        sleep, cwd=tmp_path, env=dict(os.environ), timeout_s=1
    )
    assert stopped and code != 0
    kind, none = GpuKind("Made-up", (8, 0), ()), Outcome({})
    stop = "stopped after its time limit of 1 s"
    with pytest.raises(ForkError, match=r"1 failed \(benchmark exit -?\d+\), 0 requi"):
        nightly.conclude(kind, (), none, none, code, tmp_path, benchmark_killed=stop)
    assert _summary(tmp_path)["killed"] == [f"benchmark: {stop}"]


def test_the_limits_fail_a_hung_case_alone_and_end_what_it_started(tmp_path):
    """PER_CASE_TIMEOUT under --forked (docs/gpu-nightly.md, "Why the per-case limit is
    set so"), at 2 s: the hung case fails, what it started (an engine core) is gone
    when the next one runs, the run ends with its JUnit XML. The limits end the job
    before Buildkite does."""
    limits = nightly.RUN_LIMITS_S.values()
    runs = sum(limits) + len(limits) * pytest_runner.GRACE_S
    for step in yaml.safe_load(PIPELINE.read_text())["steps"]:
        assert nightly.INSTALL_BUDGET_S + runs < step["timeout_in_minutes"] * 60
    # A hung case is reported by its own limit before its run's limit stops the run.
    assert nightly.RUN_LIMITS_S["gpu-tests"] > required.CASE_LIMIT_S
    assert nightly.RUN_LIMITS_S["serve"] > required.CASE_LIMIT_S
    assert f"--timeout={required.CASE_LIMIT_S}" in nightly.PER_CASE_TIMEOUT
    project, extra = _project(tmp_path, SLEEPER), {"PIDS": str(tmp_path / "pids")}
    # The last --timeout wins: 2 s instead of CASE_LIMIT_S.
    args = ["--forked", *nightly.PER_CASE_TIMEOUT, "--timeout=2", "test_cases.py"]
    junit = tmp_path / "junit.xml"
    outcome = pytest_runner.run_pytest(
        PYTHON, project, args, junit, extra_env=extra, timeout_s=300
    )
    # pytest-forked reports the child's exit as a crash outside the call phase, which
    # JUnit files as an error (the nightly counts errors as failures).
    cases = ("a_passes", "passed"), ("b_hangs", "error")
    cases += (("c_finds_what_b_started_gone", "passed"),)
    assert outcome == Outcome({f"test_cases.py::test_{c}": s for c, s in cases})


@pytest.fixture
def fake_job(tmp_path, monkeypatch, fork_pins):
    """nightly.run on CPU: two H100s of which CUDA_VISIBLE_DEVICES shows one, host
    compilers on PATH, a lock with the toolchain, and every step after the checks
    recorded instead of run."""
    monkeypatch.setenv("FORK_NIGHTLY_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("PATH", _bin(tmp_path, "gcc", "g++", "c++"))
    for compiler in ("CC", "CXX"):
        monkeypatch.delenv(compiler, raising=False)
    monkeypatch.setattr(nightly.preflight, "has_nvidia_gpu", lambda: True)
    h100 = "NVIDIA H100 80GB HBM3, 9.0, 81559 MiB\n"
    gpus = f"index, uuid, name, compute_cap, memory.total [MiB]\n0, GPU-0000, {h100}"
    monkeypatch.setattr(nightly, "_query_gpus", lambda: f"{gpus}1, GPU-1111, {h100}")
    lock_file = _lock(tmp_path, ALL_PINS)
    monkeypatch.setattr(nightly.lock, "path", lambda route, python: lock_file)
    (venv, home), libcuda = _venv(tmp_path), _executable(tmp_path / "libcuda.so.1", "")
    ldconfig = f"\tlibcuda.so.1 (libc6,x86-64) => {libcuda}\n"
    monkeypatch.setattr(cuda_toolchain, "_ldconfig_cache", lambda: ldconfig)
    calls: list[tuple] = []

    def record(name: str, result=None):
        return lambda *args, **kwargs: calls.append((name, args, kwargs)) or result

    installed = (venv / "bin" / "python", tmp_path / "tree", None)
    monkeypatch.setattr(nightly.install, "install", record("install", installed))
    monkeypatch.setattr(cuda_toolchain, "probe_flashinfer_jit", record("jit", 4))
    runner = nightly.pytest_runner
    monkeypatch.setattr(runner, "run_pytest", record("pytest", Outcome({})))
    monkeypatch.setattr(runner, "run_limited", record("benchmark", (0, False)))
    fake = dataclasses.replace(fork_pins, gpu_tests=("tests/v1/worker/test_gpu.py",))
    return fake, calls, str(home)


ORDER = ["install", "jit", "pytest", "pytest", "benchmark"]


def _summary(out: str | Path = "") -> dict:
    out = out or os.environ["FORK_NIGHTLY_OUT"]
    return json.loads((Path(out) / "summary.json").read_text())


def test_the_job_runs_with_the_toolchain_and_limits(fake_job, tmp_path, monkeypatch):
    pins, calls, home = fake_job
    # A missing host compiler stops the job before the install.
    for compiler in ("g++", "c++"):
        (tmp_path / "path" / compiler).unlink()
    with pytest.raises(ForkError, match=r"lacks: c\+\+ \(FlashInfer's JIT builds\); g"):
        nightly.run(pins)
    assert calls == []
    _bin(tmp_path, "g++", "c++")
    with pytest.raises(ForkError, match="required case"):  # the fakes report no case
        nightly.run(pins)
    assert [call[0] for call in calls] == ORDER
    assert calls[0][1][1] == "cuda" and calls[1][1][1]["CUDA_HOME"] == home
    (_, (_, _, gpu_args, _), gpu), (_, _, serve), (_, (bench_cmd,), bench) = calls[2:]
    assert bench_cmd[1] == str(nightly.BENCHMARK)
    assert gpu_args[:3] == ["--forked", "-v", "-rs"]
    assert gpu_args[3:-1] == nightly.PER_CASE_TIMEOUT
    for kwargs, limit in ((gpu, "gpu-tests"), (serve, "serve")):
        assert kwargs["extra_env"]["CUDA_HOME"] == home
        assert kwargs["timeout_s"] == nightly.RUN_LIMITS_S[limit]
    assert bench["env"]["CUDA_HOME"] == home
    assert bench["timeout_s"] == nightly.RUN_LIMITS_S["benchmark"]
    summary = _summary()
    # CUDA_VISIBLE_DEVICES=1: one GPU, so the TP=2 case is not among the required.
    assert summary["gpu_kind"] == "Hopper"
    assert not any("tp2" in line for line in summary["required_not_run"])

    # A collection error in the GPU tests (pytest exit 2) must not lose the serve test,
    # the benchmark or summary.json.
    calls.clear()

    def gpu_run_breaks(*args, **kwargs):
        calls.append(("pytest", args, kwargs))
        if len(calls) == 3:  # the GPU tests' run (after the install and the JIT probe)
            raise ForkError("pytest could not run the tests in tree (exit 2)", "see it")
        return Outcome({})

    monkeypatch.setattr(nightly.pytest_runner, "run_pytest", gpu_run_breaks)
    with pytest.raises(ForkError, match="could not run"):
        nightly.run(pins)
    assert [call[0] for call in calls] == ORDER
    assert _summary()["killed"] == [
        "gpu-tests.xml: could not run: pytest could not run the tests in tree (exit 2) "
        "-- see it"
    ]
