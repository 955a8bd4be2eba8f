"""The CUDA route without a GPU: the install refuses a driverless machine before it
touches anything, the driver stub is made from the symbols an extension imports, and
the check's verdicts on the GPU tests' collection."""

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forkbuild.core import pins, preflight
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import REPO_ROOT
from forkbuild.core.pytest_runner import Outcome
from forkbuild.gpu import cuda_route, driver_stub

NO_GPU = pytest.mark.skipif(preflight.has_nvidia_gpu(), reason="this machine has a GPU")


@NO_GPU
@pytest.mark.parametrize("step", ["install", "test", "regression", "model"])
def test_the_cuda_route_is_refused_at_once_without_a_driver(scratch, step):
    venv = scratch / "build" / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "marker").write_text("the working CPU venv")
    command = [sys.executable, "-m", "forkbuild", step, "--route", "cuda"]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "needs an NVIDIA GPU and its driver" in lines[0]
    assert "make install" in lines[0] and "make test" in lines[0]
    # Nothing was touched: no CUDA venv beside it, the CPU venv as it was.
    assert sorted(p.name for p in (scratch / "build").iterdir()) == ["venv"]
    assert (venv / "marker").read_text() == "the working CPU venv"


def _shared(out: Path, source: str, *flags: str) -> None:
    command = ["cc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(out), *flags]
    subprocess.run(command, input=source, text=True, check=True)


def test_the_stub_answers_no_device_comes_first_defines_imports(monkeypatch, tmp_path):
    source = driver_stub.c_source(["cuCtxGetCurrent", "cuMemCreate"])
    assert "int cuCtxGetCurrent(void) { return 100; }" in source
    assert "int cuMemCreate(void) { return 100; }" in source
    # It comes first on the library path.
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/a:/opt/b")
    path = cuda_route.stub_env(tmp_path)["LD_LIBRARY_PATH"]
    assert path == f"{tmp_path}:/opt/a:/opt/b"
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert cuda_route.stub_env(tmp_path)["LD_LIBRARY_PATH"] == str(tmp_path)
    # Built: it defines every driver entry point an extension imports.
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    pytest.importorskip("elftools")
    tree, fake = tmp_path / "tree", tmp_path  # fake: the driver library's folder
    (tree / "vllm" / "sub").mkdir(parents=True)
    # A driver library to link against, and two extensions: one imports two entry
    # points (and a libc function, which is not the driver's), one none.
    driver = "int cuInit(void){return 0;}\nint cuMemMap(void){return 0;}\n"
    _shared(fake / "libcuda.so.1", driver, "-Wl,-soname,libcuda.so.1")
    (fake / "libcuda.so").symlink_to("libcuda.so.1")
    ext = tree / "vllm" / "sub" / "_ext.abi3.so"
    uses = "#include <string.h>\nint cuInit(void); int cuMemMap(void);\nint use(const "
    uses += "char *s){return cuInit() + cuMemMap() + (int)strlen(s);}\n"
    _shared(ext, uses, f"-L{fake}", "-lcuda")
    _shared(tree / "vllm" / "_plain.abi3.so", "int plain(void){return 1;}\n")

    library, users, symbols = driver_stub.build(tree, tmp_path / "stub")

    assert users == ["vllm/sub/_ext.abi3.so"]
    assert symbols == ["cuInit", "cuMemMap"]
    assert library.name == "libcuda.so.1"
    # The extension loads against the stub (and not without it), and gets "no device".
    probe = (
        "import ctypes,sys; lib=ctypes.CDLL(sys.argv[1]); "
        "print(ctypes.CDLL('libcuda.so.1').cuInit())"
    )
    bare = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    command = [sys.executable, "-c", probe, str(ext)]
    loaded, without = (
        subprocess.run(command, capture_output=True, text=True, env=env)
        for env in ({**bare, "LD_LIBRARY_PATH": str(library.parent)}, bare)
    )
    assert loaded.stdout.strip() == str(driver_stub.CUDA_ERROR_NO_DEVICE), loaded.stderr
    assert without.returncode != 0 and "libcuda.so.1" in without.stderr


REQUIRED = sorted(pins.load().gpu.all_required())


def _collected(reason: str = "needs an NVIDIA GPU: runs vLLM's CUDA kernels", drop=""):
    cases = {case: "skipped" for case in REQUIRED if case != drop}
    cases["tests/v1/worker/test_x.py::test_more"] = "skipped"
    return Outcome(cases, {case: reason for case in cases})


NOT_SKIPPED = Outcome(_collected().cases | {REQUIRED[0]: "error"}, _collected().reasons)
NO_IMPORT = "could not import 'flashinfer': No module named 'flashinfer'"


@pytest.mark.parametrize(
    ("collected", "match"),
    [
        (_collected(), None),  # every GPU case skipped for lack of a device
        (_collected(NO_IMPORT), "another reason than the missing GPU"),
        (NOT_SKIPPED, "did not all skip"),
        (_collected(drop=REQUIRED[0]), "not collected"),  # a required case
    ],
    ids=["skipped", "another-reason", "not-skipped", "not-collected"],
)
def test_the_verdict_on_the_gpu_cases_collected(tmp_path, collected, match):
    with pytest.raises(ForkError, match=match) if match else contextlib.nullcontext():
        cuda_route.check_skipped(collected, tmp_path, required=REQUIRED)


def test_the_check_splits_one_run_by_module_its_stub_stays_in_its_folder(fork_pins):
    cases = {"a/x.py::t1": "passed", "a/y.py::t2": "skipped", "a/x.py::t3": "passed"}
    outcome = Outcome(cases, {"a/y.py::t2": "no GPU"})
    part = cuda_route.part_of(outcome, ("a/y.py",))
    assert part == Outcome({"a/y.py::t2": "skipped"}, {"a/y.py::t2": "no GPU"})
    # The stub is never in a venv, the tree or the CPU build (where `make serve` runs).
    home = cuda_route.home()
    if not (home / "driver-stub").exists():
        pytest.skip("the CUDA route check has not run here yet")
    stubs = {p.resolve() for p in Path(home.parent).rglob("libcuda.so*")}
    assert stubs <= {(home / "driver-stub" / "libcuda.so.1").resolve()}
