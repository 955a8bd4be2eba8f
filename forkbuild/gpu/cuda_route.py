"""The CUDA route checked without a GPU (in `make test`), through a driver stub: most of
what can break in the nightly is not the GPU. What it checks: docs/tests.md, step 2."""

import json
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from forkbuild.core import log, preflight, pytest_runner
from forkbuild.core.errors import ForkError, run_or_fail
from forkbuild.core.pins import REPO_ROOT, Pins, build_dir
from forkbuild.core.pytest_runner import Outcome
from forkbuild.gpu import cuda_toolchain, driver_stub
from forkbuild.gpu import required as gpu_required
from forkbuild.setup import fetch, lock


def home() -> Path:
    return build_dir() / "cuda-route"


@dataclass(frozen=True)
class Result:
    loaded: dict  # load_extensions' report
    jit_modules: int  # FlashInfer modules whose JIT build graph resolved
    gpu_cases: Outcome
    calls: Outcome

    def line(self) -> str:
        loaded, other = len(self.loaded["loaded"]), len(self.loaded["other_pythons"])
        return (
            f"cuda route without a GPU: {loaded} of {self.loaded['candidates']} "
            f"compiled extensions load ({other} more are for other "
            f"Pythons), FlashInfer's JIT on the lock's nvcc ({self.jit_modules} module "
            f"build graphs), {len(self.gpu_cases.cases)} GPU cases collected and "
            f"skipped without a device, kernel calls up to dispatch: {self.calls}"
        )


def install_cuda_route(pins: Pins, results: Path) -> tuple[Path, Path]:
    """What a GPU host runs, minus the GPU, in build/cuda-route: (python, tree)."""
    report = results / "cuda-route-install.log"
    log.step(f"cuda route: forkbuild install --route cuda in {home()} ({report})")
    args = ("-m", "forkbuild", "install", "--route", "cuda", "--without-gpu")
    run_or_fail(
        [sys.executable, *args],
        "the CUDA route's install failed",
        report=report,
        cwd=REPO_ROOT,
        env={**os.environ, "VLLM_FORK_BUILD": str(home())},
    )
    python = home() / "venv" / "bin" / "python"
    tree = home() / f"vllm-{pins.upstream_version}"
    if not (python.exists() and tree.is_dir()):
        raise ForkError(
            f"the CUDA route's install left no {python} or {tree}", f"see {report}"
        )
    return python, tree


def build_driver_stub(python: Path, tree: Path) -> Path:
    """build/cuda-route/driver-stub/libcuda.so.1 for the extensions in TREE."""
    out = home() / "driver-stub"
    done = run_or_fail(
        [str(python), "-m", "forkbuild.gpu.driver_stub", str(tree), str(out)],
        "could not build the driver stub",
        "the check needs a C compiler (cc or gcc) and the CUDA venv's pyelftools",
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    log.step(f"cuda route: {done.stdout.strip()}")
    return out


def stub_env(stub: Path) -> dict[str, str]:
    """The stub found before any other libcuda.so.1."""
    paths = [str(stub), *filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":"))]
    return {"LD_LIBRARY_PATH": ":".join(paths)}


def load_extensions(
    python: Path,
    tree: Path,
    wheel: Path,
    stub: Path,
    only: tuple[str, ...] = (),
    pythonpath: str = "",
) -> dict:
    """setup/load_extensions.py with the stub: WHEEL's extensions (or ONLY) in TREE."""
    path = os.pathsep.join(filter(None, [pythonpath, str(REPO_ROOT)]))
    module = "forkbuild.setup.load_extensions"
    done = run_or_fail(
        [str(python), "-m", module, str(wheel), str(tree), *only],
        "the CUDA build's extension check crashed",
        "read the error above: the locked torch or the wheel may not match",
        tail=600,
        cwd=tree,
        env={**os.environ, **stub_env(stub), "PYTHONPATH": path},
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["failed"]:
        bad = "; ".join(f"{path}: {why}" for path, why in result["failed"].items())
        raise ForkError(
            f"compiled extensions of the CUDA wheel do not load: {bad}",
            "the locked torch must be the one the wheel was built against",
        )
    if result["cuda_available"]:
        raise ForkError(
            "torch reports a GPU through the driver stub",
            "the stub must answer every driver call with CUDA_ERROR_NO_DEVICE",
        )
    if missing := [op for op, schema in result["ops"].items() if not schema]:
        raise ForkError(
            f"the CUDA build registers no {', '.join(missing)}",
            "the kernel test calls these ops: check the wheel's extensions",
        )
    return result


def part_of(outcome: Outcome, modules: tuple[str, ...]) -> Outcome:
    cases = {c: s for c, s in outcome.cases.items() if c.split("::")[0] in modules}
    return Outcome(cases, {c: r for c, r in outcome.reasons.items() if c in cases})


# How every GPU module's skipif reason for lack of a device starts: anything else (an
# FA3 that does not import, a missing package) is not "no GPU here".
NO_DEVICE = "needs an NVIDIA GPU"


def check_skipped(
    collected: Outcome,
    results: Path,
    *,
    where: str = "the CUDA build",
    logs: str = "",
    required: Collection[str],
) -> None:
    """Every GPU case skipped for lack of a device (an import error skips too, and
    would show only on the GPU runner); every node id of REQUIRED among them."""
    logs = logs or (
        f"{results / 'cuda-route-tests.log'} and {results / 'cuda-route-serve-gpu.log'}"
    )
    not_skipped = [c for c, status in collected.cases.items() if status != "skipped"]
    if not collected.cases or not_skipped:
        raise ForkError(
            f"the GPU tests under {where} did not all skip without a GPU: {collected}"
            + (f", e.g. {not_skipped[0]}" if not_skipped else ""),
            f"see {logs}",
        )
    reasons = collected.reasons.items()
    if wrong := {c: r for c, r in reasons if not r.startswith(NO_DEVICE)}:
        case, why = next(iter(wrong.items()))
        raise ForkError(
            f"{len(wrong)} GPU case(s) skipped under {where} for another reason than "
            f"the missing GPU, e.g. {case}: {why}",
            "that reason would skip them on the GPU runner too: fix the import or "
            "install",
        )
    gpu_required.check_collected(collected.cases, required)


@dataclass
class Installed:
    """The CUDA route installed, its driver stub built and its extensions loaded."""

    python: Path
    tree: Path
    stub: Path
    loaded: dict

    @property
    def route(self) -> tuple[Path, Path, Path]:
        return self.python, self.tree, self.stub


def install(pins: Pins, results: Path) -> Installed:
    """The route's first half: what the GPU bundle is made from (bundle/check.py)."""
    if preflight.has_nvidia_gpu():  # the stub is for machines without a driver only
        raise ForkError(
            "this machine has a GPU: the CUDA route runs there", "run `make nightly`"
        )
    python, tree = install_cuda_route(pins, results)
    wheel = fetch.artifacts_dir() / pins.routes["cuda"].wheel.filename
    stub = build_driver_stub(python, tree)
    loaded = load_extensions(python, tree, wheel, stub)
    log.step(
        f"cuda route: {len(loaded['loaded'])} compiled extensions load against the "
        "locked torch through the driver stub"
    )
    return Installed(python, tree, stub, loaded)


def check(pins: Pins, results: Path, route: Installed) -> Result:
    """The route's second half: FlashInfer's JIT, the GPU cases and the kernel calls."""
    python, tree, stub = route.route
    # FlashInfer's JIT in the nightly's environment, the stub as libcuda.so.1.
    nvcc = cuda_toolchain.check_lock_pins(lock.path("cuda", lock.running_python()))
    venv, libcuda = python.parent.parent, stub / driver_stub.SONAME
    env = cuda_toolchain.prepare_toolchain(venv, nvcc, libcuda) | stub_env(stub)
    work, report = home() / "flashinfer-jit", results / "cuda-route-flashinfer-jit.log"
    jit_modules = cuda_toolchain.probe_flashinfer_jit(
        python, env, nvcc, work, report, "cuda route"
    )
    # The GPU tests and the serve test collected (each must skip), and the kernel calls
    # (must pass), which share the GPU modules' run (one vLLM import less).

    def run(where: Path, args: list[str], xml: Path, **kwargs) -> Outcome:
        output, stubbed = xml.with_suffix(".log"), stub_env(stub)
        return pytest_runner.run_pytest(
            python, where, args, xml, output=output, extra_env=stubbed, **kwargs
        )

    tests = ["-rfEs", *pins.gpu_tests, *pins.cuda_route_tests]
    in_tree = run(tree, tests, results / "cuda-route-tests.xml")
    # The required cases of forkbuild's own tests (the serve test), from the GPU table.
    own = {c.split("::")[0] for c in pins.gpu.all_required()} - set(pins.gpu_tests)
    xml = results / "cuda-route-serve-gpu.xml"
    serve = run(REPO_ROOT, ["-rs", *sorted(own)], xml, pythonpath=REPO_ROOT)
    gpu = part_of(in_tree, pins.gpu_tests)
    calls = part_of(in_tree, pins.cuda_route_tests)
    collected = Outcome(gpu.cases | serve.cases, gpu.reasons | serve.reasons)
    check_skipped(collected, results, required=pins.gpu.all_required())
    if calls.failed or calls.errors or calls.skipped or not calls.passed:
        raise ForkError(
            f"the kernel test's calls do not reach the CUDA ops' dispatch: {calls}",
            f"see {results / 'cuda-route-tests.log'}",
        )
    return Result(route.loaded, jit_modules, collected, calls)
