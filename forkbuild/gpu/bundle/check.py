"""`make test`'s check of the GPU bundle without a GPU: the reference host's bundle, a
simulated host's installed offline and run, one package taken out, part 1 alone with its
stand-ins (docs/gpu-nightly.md, "`make test` checks all of this")."""

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from forkbuild.core import fixcheck, log, pytest_runner
from forkbuild.core.errors import ForkError, run_or_fail
from forkbuild.core.hashing import digest_of
from forkbuild.core.pins import REPO_ROOT, Pins, build_dir, load_gpu_bundle
from forkbuild.core.pytest_runner import Outcome
from forkbuild.gpu import cuda_route
from forkbuild.gpu.bundle import build as gpu_bundle
from forkbuild.gpu.bundle import proofs
from forkbuild.gpu.bundle import runner as bundle_run
from forkbuild.setup import fetch, lock, uv

HOST_PYTHON = "3.12"  # the reference host's
# Taken out for the breakage (distribution, module): fastapi, which vllm.entrypoints
# imports (vLLM's tests/conftest.py through `from vllm import LLM`, and the engine).
BREAKAGE = ("fastapi", "fastapi")
# What part 1's case (Triton's cache write and attention) imports while it runs, beside
# vLLM's CUDA platform, which resolving the platform on a GPU host imports.
PART_ONE_IMPORTS = (
    "vllm.platforms.cuda",
    "vllm._custom_ops",
    "vllm.vllm_flash_attn",
    "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
    "vllm.v1.attention.ops.triton_unified_attention",
    "vllm.v1.attention.backends.triton_attn",
)
NO_INDEX = {**bundle_run.OFFLINE, "UV_OFFLINE": "1"}
T, U = TypeVar("T"), TypeVar("U")


def home() -> Path:
    return build_dir() / "bundle-host"


def _offline() -> tuple[str, ...]:
    """A prefix that refuses the network (unshare -n), where this user may use it."""
    unshare = shutil.which("unshare")
    tried = unshare and subprocess.run([unshare, "-n", "true"], capture_output=True)
    return (unshare, "-n") if tried and tried.returncode == 0 else ()


def interpreter(version: str) -> Path:
    """A working Python VERSION (X.Y) here (each is asked: a pyenv shim may fail)."""
    pyenv = Path.home().glob(f".pyenv/versions/{version}.*/bin/python3")
    candidates = [shutil.which(f"python{version}"), *sorted(map(str, pyenv))]
    for candidate in filter(None, [*candidates, f"/usr/bin/python{version}"]):
        done = subprocess.run([candidate, "--version"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.split()[-1].startswith(f"{version}."):
            return Path(candidate)
    raise ForkError(
        f"no Python {version} here to simulate the GPU host with",
        f"install Python {version} (e.g. pyenv install {version}), the reference "
        "host's version",
    )


def simulated_host(pins: Pins) -> tuple[Path, Path]:
    """build/bundle-host/venv (the host's Python, torch, triton, NVIDIA's); its file."""
    lock_file = lock.path("cuda", HOST_PYTHON)
    names = {
        n
        for n in lock.pinned(lock_file)
        if n in ("torch", "triton") or n.startswith(("nvidia-", "cuda-"))
    }
    entries = lock.entries(lock_file, names)
    what = (
        f"a simulated GPU host: Python {HOST_PYTHON}, {len(names)} packages of "
        f"{lock_file.name} (torch, triton, NVIDIA's)"
    )
    flags = ("--quiet", "--no-deps", "--require-hashes")
    venv, key = home() / "venv", digest_of([entries])
    python = uv.stamped_venv(
        pins, venv, interpreter(HOST_PYTHON), entries, key, what, *flags
    )
    # Described as a GPU host describes itself: the runner's inventory.
    done = run_or_fail(
        [str(python), "-m", "forkbuild.gpu.bundle.runner", "inventory"],
        "the runner's inventory failed on the simulated host",
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    host_file = home() / "host.txt"
    host_file.write_text(
        "# The simulated GPU host of forkbuild/gpu/bundle/check.py\n" + done.stdout
    )
    return python, host_file


@dataclass(frozen=True)
class SimHost:
    """The simulated host; SITE: the bundle's site/ unpacked there, its tree/ beside."""

    python: Path
    site: Path
    stub: Path
    results: Path
    offline: tuple[str, ...]


@dataclass(frozen=True)
class Result:
    reference: gpu_bundle.Bundle
    simulated: str  # what the simulated host's bundle showed
    part_one: str

    def line(self) -> str:
        return (
            f"gpu bundle for {self.reference.manifest['made_for']}: "
            f"{self.reference.line()}\n"
            f"gpu bundle on a simulated host {self.simulated}; {self.part_one}"
        )


def meanwhile(background: Callable[[], T], foreground: Callable[[], U]) -> tuple[T, U]:
    """BACKGROUND in a thread while FOREGROUND runs here. Either's error is raised, and
    only once both have ended: nothing is left running unnoticed."""
    with ThreadPoolExecutor(1, thread_name_prefix="forkbuild-meanwhile") as pool:
        pending = pool.submit(background)
        try:
            here = foreground()
        except BaseException:
            if pending.exception():  # waits for it
                log.step(f"meanwhile, this failed too: {pending.exception()}")
            raise
        return pending.result(), here


def check(pins: Pins, results: Path, route: tuple[Path, Path, Path]) -> Result:
    """ROUTE: the CUDA route's python, tree and stub folder (cuda_route.install)."""
    source = gpu_bundle.prepare(pins, results, route)
    # The reference bundle (xz: minutes on a cold cache), needed only by _part_one, is
    # made meanwhile: the two share no scratch path but uv's binary (its uv.partial),
    # extracted first; uv's cache takes concurrent installs.
    uv.binary(pins)
    reference, (host, shown) = meanwhile(
        lambda: gpu_bundle.build(pins, out=home() / "reference", source=source),
        lambda: _on_simulated_host(pins, source, results),
    )
    return Result(reference, shown, _part_one(reference, host))


def _on_simulated_host(
    pins: Pins, source: gpu_bundle.Source, results: Path
) -> tuple[SimHost, str]:
    """The simulated host's bundle installed offline by run.sh and verified; what it
    showed."""
    python, host_file = simulated_host(pins)
    # One part of plain tars: a part's size and xz matter only for transfers.
    plain = dict(part_mib=4096, source=source, codec=gpu_bundle.PLAIN)
    bundle = gpu_bundle.build(pins, host_file, out=home() / "bundle", **plain)
    dest = home() / "installed"
    shutil.rmtree(dest, ignore_errors=True)
    offline = _offline()
    env = {**os.environ, **NO_INDEX, "PYTHON": str(python)}
    env["FORK_BUNDLE_HOME"] = str(dest)
    network = "network refused" if offline else "no index; network not refused"
    log.step(f"bundle check: run.sh --install {dest} ({network})")
    # From a folder of its own: run.sh must start the bundle's runner, not this one.
    done = run_or_fail(
        [*offline, "bash", str(bundle.folder / "run.sh"), "--install", str(dest)],
        "the bundle does not install offline on the simulated host",
        f"see {home()}",
        tail=600,
        env=env,
        cwd=home(),
    )
    site = Path(done.stdout.strip().splitlines()[-1].split(os.pathsep)[-1])
    _refuses_without_gpu(bundle.folder, env)
    extensions = tuple(n for n in bundle.manifest["components"] if n.endswith(".so"))
    wheel = fetch.artifacts_dir() / pins.routes["cuda"].wheel.filename
    loaded = cuda_route.load_extensions(
        python, site, wheel, source.stub, extensions, pythonpath=str(site)
    )
    host = SimHost(python, site, source.stub, results, offline)
    collected, calls = verify(pins, host, "bundle-host")
    breakage = _without(pins, host)
    stock = _stock_overlay(host, bundle_run.stock_file(bundle.manifest, dest))
    figures = _figures_script(host, bundle.manifest["figures"])
    shown = (
        f"(Python {HOST_PYTHON}, torch, triton and NVIDIA's packages only, {network}): "
        f"{len(bundle.parts)} part(s), {len(loaded['loaded'])} compiled extensions "
        f"load, {len(collected.cases)} GPU cases collected and skipped without a "
        "device, the engine's modules import, kernel calls up to dispatch: "
        f"{calls}; without {BREAKAGE[0]}: {breakage}; {stock}; {figures}"
    )
    return host, shown


def _refuses_without_gpu(bundle: Path, env: dict[str, str]) -> None:
    """`run.sh OUT` on this machine: one line, no NVIDIA GPU, nothing run."""
    out = home() / "run-out"
    command = ["bash", str(bundle / "run.sh"), str(out)]
    done = subprocess.run(command, env=env, cwd=home(), capture_output=True, text=True)
    lines = done.stderr.strip().splitlines()
    one_line = len(lines) == 1 and "no NVIDIA GPU" in lines[0]
    if done.returncode == 0 or not one_line or out.exists():
        raise ForkError(
            "run.sh without a GPU did not stop at once with one line: exit "
            f"{done.returncode}, {done.stderr.strip()[-300:]!r}"
        )


def verify(pins: Pins, host: SimHost, name: str) -> tuple[Outcome, Outcome]:
    """(GPU cases, kernel calls) run from the bundle as its runner runs them, the
    engine's modules imported last: each imports, each case skips only for want of a
    device, the calls reach dispatch."""
    settings = load_gpu_bundle()
    nodes = [*pins.gpu_tests, *pins.cuda_route_tests]
    outcome, failed = _run_traced(host, name, nodes, settings.engine_modules)
    logs = str(host.results / f"{name}-tests.log")
    if failed:
        raise ForkError(
            f"the engine's modules do not import from the bundle: {'; '.join(failed)}",
            f"see {host.results / f'{name}-imports.json'}",
        )
    collected = cuda_route.part_of(outcome, pins.gpu_tests)
    calls = cuda_route.part_of(outcome, pins.cuda_route_tests)
    where, required = f"the bundle ({name})", set(settings.needs)
    cuda_route.check_skipped(
        collected, host.results, where=where, logs=logs, required=required
    )
    if calls.failed or calls.errors or calls.skipped or not calls.passed:
        raise ForkError(
            f"the kernel calls do not reach dispatch from the bundle: {calls}",
            f"see {logs}",
        )
    return collected, calls


def _site_copy(host: SimHost, name: str) -> Path:
    """A fresh copy of the host's SITE beside it, hard-linked, as NAME."""
    copy = host.site.parent / name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(host.site, copy, copy_function=os.link)
    return copy


def _without(pins: Pins, host: SimHost) -> str:
    """The check without BREAKAGE (name, module) in a copy of SITE: it names MODULE."""
    name, module = BREAKAGE
    broken = _site_copy(host, f"site-without-{name}")
    infos = list(broken.glob(f"{name.replace('-', '_')}-*.dist-info"))
    if not infos:
        raise ForkError(
            f"the bundle carries no {name} to take out for the breakage check"
        )
    for line in (infos[0] / "RECORD").read_text().splitlines():
        (broken / line.split(",")[0]).unlink(missing_ok=True)
    shutil.rmtree(infos[0], ignore_errors=True)
    shutil.rmtree(broken / module, ignore_errors=True)
    try:
        verify(pins, replace(host, site=broken), f"bundle-host-without-{name}")
    except ForkError as exc:
        log_file = host.results / f"bundle-host-without-{name}-tests.log"
        said = [exc.cause]
        if log_file.is_file():
            lines = log_file.read_text().splitlines()
            said += [line[1:].strip() for line in lines if line.startswith("E ")]
        named = [line for line in said if f"No module named '{module}" in line]
        if not named:
            raise ForkError(
                f"without {name} the bundle check fails for another reason: {exc}",
                "the breakage must show the missing package",
            ) from None
        return f"fails, as it must ({named[0][:200]})"
    finally:
        shutil.rmtree(broken, ignore_errors=True)
    raise ForkError(
        f"the bundle check passes without {name}, which the engine cases import",
        "the check cannot tell a missing package: fix forkbuild/gpu/bundle/check.py",
    )


def _stock_overlay(host: SimHost, stock: Path) -> str:
    """The stock runs' cases as the runner runs them, with stock's module (STOCK) and,
    on purpose, without: each skips only for want of a GPU, and the overlay's record
    passes the runner's check (proofs.not_stock) with it and fails it without."""
    nodes = list(load_gpu_bundle().stock_cases)

    def overlaid(file: Path | None) -> str:
        name = f"bundle-stock-{'overlay' if file else 'without-overlay'}"
        report = host.results / f"{name}.jsonl"
        report.unlink(missing_ok=True)
        overlay = (file, report) if file else None  # without: not loaded at all
        outcome, errors = _run_traced(host, name, nodes, (), (), overlay)
        logs = str(host.results / f"{name}-tests.log")
        where = f"the bundle's stock runs ({name})"
        cuda_route.check_skipped(
            outcome, host.results, where=where, logs=logs, required=nodes
        )
        if errors:
            raise ForkError(f"{where}: {'; '.join(errors)}", f"see {logs}")
        return proofs.not_stock(proofs.read_events(report), stock)

    with_it, without = meanwhile(lambda: overlaid(stock), lambda: overlaid(None))
    if with_it:
        raise ForkError(
            f"with the overlay, {with_it}",
            "check forkbuild/gpu/bundle/stock_overlay.py and the bundle's stock/",
        )
    if not without:
        raise ForkError(
            "without the overlay the stock check still passes: it cannot tell stock's "
            "module from the fork's",
            "fix forkbuild/gpu/bundle/proofs.py not_stock",
        )
    return (
        f"stock's {stock.name} overlaid: {len(nodes)} cases collected and skipped "
        f"without a device, its {fixcheck.FUNCTION} buggy; without the overlay the "
        f"check fails ({without[:200]})"
    )


def _figures_script(host: SimHost, figures: dict) -> str:
    """The benchmark the runner runs for the figures, from the unpacked bundle: its
    imports all resolve (`--help` answers after them) and it takes the runner's flag;
    its model is there."""
    tree, script = host.site.parent / "tree", figures["script"]
    model = host.site.parent / "models" / figures["model"] / "config.json"
    env = {**os.environ, **cuda_route.stub_env(host.stub), **NO_INDEX}
    env["PYTHONPATH"] = bundle_run.pythonpath(host.site.parent)
    done = run_or_fail(
        [*host.offline, str(host.python), script, "--help"],
        f"the bundle's {script} does not start on the simulated host",
        f"its imports must be in the bundle (fork.toml [gpu_bundle] figures): {tree}",
        cwd=tree,
        env=env,
    )
    if "--enforce-eager" not in done.stdout or not model.is_file():
        raise ForkError(
            f"the bundle's {script} lacks --enforce-eager or its model {model}",
            "the runner runs it with both: check fork.toml [gpu_bundle] figures",
        )
    return f"{script} imports from the bundle, its model {model.parent.name} is there"


def _part_one(reference: gpu_bundle.Bundle, host: SimHost) -> str:
    """Part 1 of the reference bundle alone (a copy of SITE without the extensions it
    lacks), its cases run as the runner runs them: they import with stand-ins only."""
    first = reference.parts[0]
    nodes = reference.cases[first.name]
    if not nodes:
        raise ForkError(
            f"{first.name} of the bundle for {reference.manifest['made_for']} adds no "
            "case",
            "fork.toml [gpu_bundle] order, every_case and stand_in decide what it adds",
        )
    later = set(reference.manifest["components"]) - set(first.components)
    absent = sorted(c for c in later if c.endswith(".so"))
    standing_in = bundle_run.stand_ins(reference.manifest, list(first.components))
    alone = _site_copy(host, "site-part-1")
    part = replace(host, site=alone)
    for name in absent:
        (alone / name).unlink(missing_ok=True)
    run = "bundle-part-1"
    try:  # with the stand-ins and without, at once: the last step, one core each
        without, (outcome, errors) = meanwhile(
            lambda: _run_traced(
                part, f"{run}-without-stand-ins", nodes, PART_ONE_IMPORTS
            )[1],
            lambda: _run_traced(part, run, nodes, PART_ONE_IMPORTS, standing_in),
        )
        logs = str(host.results / f"{run}-tests.log")
        where = "part 1 of the bundle"
        cuda_route.check_skipped(
            outcome, host.results, where=where, logs=logs, required=nodes
        )
        if errors:
            raise ForkError(
                f"with {first.name} alone, what its cases import does not import: "
                f"{'; '.join(errors)}",
                f"see {logs}",
            )
    finally:
        shutil.rmtree(alone, ignore_errors=True)
    if not any(m in e for e in without for m in standing_in):
        raise ForkError(
            f"{first.name}'s cases import without the stand-ins for "
            f"{', '.join(standing_in)}: {without or 'no error'}",
            "fork.toml [gpu_bundle] stand_in names a module that is not needed",
        )
    short = ", ".join(n.split("::", 1)[-1] for n in nodes)
    return (
        f"{first.name} alone ({', '.join(a.rsplit('/', 1)[-1] for a in absent)} "
        f"absent): {short} collected, vLLM's CUDA platform imports with a stand-in for "
        f"{', '.join(standing_in)} and not without"
    )


def _run_traced(
    host: SimHost,
    name: str,
    nodes: list[str],
    imports: tuple[str, ...],
    standing_in=(),
    stock: tuple[Path | None, Path] | None = None,
) -> tuple[Outcome, list[str]]:
    """NODES run as the runner runs them, IMPORTS last: outcome and import errors;
    STOCK (stock's file or None, the overlay's report): with the overlay plugin."""
    site, results = host.site, host.results
    tree, report = site.parent / "tree", results / f"{name}-imports.json"
    logs = results / f"{name}-tests.log"
    report.unlink(missing_ok=True)
    env = {
        **bundle_run.case_env(site.parent, standing_in, *(stock or ())),
        **cuda_route.stub_env(host.stub),
        **NO_INDEX,
        "FORKBUILD_TRACE_OUT": str(report),
        "FORKBUILD_TRACE_IMPORT": ",".join(imports),
    }
    outcome = pytest_runner.run_pytest(
        host.python,
        tree,
        [*gpu_bundle.TRACE, *bundle_run.case_args(nodes, standing_in, bool(stock))],
        results / f"{name}-tests.xml",
        pythonpath=os.pathsep.join([str(tree), str(site), str(REPO_ROOT)]),
        output=logs,
        extra_env=env,
        prefix=host.offline,
    )
    if not report.is_file():
        return outcome, [f"no report (see {logs})"]
    return outcome, json.loads(report.read_text())["import_errors"]
