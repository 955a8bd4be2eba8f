"""Command line: python3 -m forkbuild STEP. Each step runs the steps it depends on."""

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from forkbuild.checks import generate, matrix, patch_status, regression, testrun
from forkbuild.core import log, pins
from forkbuild.core.errors import ForkError
from forkbuild.core.pins import Pins
from forkbuild.gpu import nightly
from forkbuild.gpu.bundle import build as gpu_bundle
from forkbuild.serve import server as serve
from forkbuild.setup import fetch, install, lock, tree, wheel
from forkbuild.upstream import prs as upstream
from forkbuild.upstream import rebase

Args = argparse.Namespace


def _sdist(p: Pins) -> Path:
    # pip runs in a route's venv (the sdist's metadata needs torch), made if missing
    return fetch.fetch(p.sdist, lambda: install.ensure_toolchain(p))


def _fetch(args: Args, p: Pins) -> None:
    route = install.pick_route(p, args.route)
    _sdist(p)
    fetch.fetch(route.wheel, lambda: install.ensure_toolchain(p))


def _lock(args: Args, p: Pins) -> None:
    lock.generate(p, tree.build(p, _sdist(p)))
    upstream.lock_hooks(p, upstream.release_hook_config(p))


def _model(args: Args, p: Pins) -> None:
    python, _, _ = install.install(p, args.route)
    for name in serve.EMBEDDED:
        print(serve.ensure_tiny_model(python, name))


def _gpu_bundle(args: Args, p: Pins) -> str:
    host = Path(args.host) if args.host else None
    bundle = gpu_bundle.build(p, host, part_mib=args.part_mib)
    return f"gpu bundle {bundle.folder}: {bundle.line()}"


def _flag(help_text: str) -> dict:
    return {"action": "store_true", "help": help_text}


@dataclass(frozen=True)
class Step:
    func: Callable[[Args, Pins], object]  # a str it returns is printed last
    arguments: dict[str, dict] | None = None  # name or flag -> argparse keywords


ROUTE = {
    "choices": ("cpu", "cuda"),
    "help": "vLLM binaries to install on (default: cuda where an NVIDIA GPU is "
    "present, else cpu)",
}
ROUTED = {"--route": ROUTE}  # a step that installs on one route's binaries
STEPS = {
    "fetch": Step(_fetch, ROUTED),
    "tree": Step(
        lambda a, p: print(tree.build(p, _sdist(p), force=a.force)),
        arguments={"--force": _flag("rebuild even if the inputs are unchanged")},
    ),
    "lock": Step(_lock),
    "install": Step(
        lambda a, p: print(install.install(p, a.route, without_gpu=a.without_gpu)[0]),
        {
            **ROUTED,
            "--without-gpu": _flag(
                "install the cuda route on a machine without a driver, for checking it "
                "there (make test does, in build/cuda-route); vLLM then finds no "
                "platform"
            ),
        },
    ),
    "regression": Step(
        lambda a, p: regression.check(p, *install.install(p, a.route)[:2]), ROUTED
    ),
    "wheel": Step(lambda a, p: print(wheel.build(p))),
    "model": Step(_model, ROUTED),
    "test": Step(lambda a, p: testrun.run(p, a.route), ROUTED),
    "matrix": Step(
        lambda a, p: matrix.run(p, a.versions),
        arguments={
            "versions": {
                "nargs": "*",
                "help": "only these releases (default: all, plus the fork)",
            }
        },
    ),
    "generate": Step(lambda a, p: generate.write(p)),
    "patch-status": Step(lambda a, p: patch_status.check(p)),
    "upstream": Step(lambda a, p: print(upstream.build(p))),
    "rebase": Step(
        lambda a, p: (rebase.accept if a.accept else rebase.trial)(p, a.version),
        arguments={
            "version": {"help": "the upstream vLLM version, e.g. 0.26.0"},
            "--accept": _flag("move fork.toml and patches/ to that version"),
        },
    ),
    "gpu-bundle": Step(
        _gpu_bundle,
        arguments={
            "--host": {
                "help": "the host's file from `bash run.sh --inventory` (default: "
                "fork.toml [gpu_bundle] host, the reference H200)"
            },
            "--part-mib": {
                "type": float,
                "help": "the largest part, in MiB (default: PART_MIB or fork.toml's)",
            },
        },
    ),
    "nightly": Step(lambda a, p: nightly.run(p)),
    "serve": Step(lambda a, p: serve.serve(p, a), ROUTED),
}
HELP = {  # each step's, as `python3 -m forkbuild STEP --help` shows it
    "fetch": "download the pinned sdist and wheel, verified by sha256",
    "tree": "build build/vllm-<version>: sdist + patches + tests, as git",
    "lock": "locks/ROUTE-pyXY.txt: every route's venv, per Python, pinned with sha256 "
    "(uv pip compile; needs the package index)",
    "install": "build/venv: the route's lock installed by uv, hash-checked, and an "
    "editable install of the tree",
    "regression": "the regression tests must fail unpatched and pass patched",
    "wheel": "a distributable patched CUDA wheel in dist/",
    "model": "generate the embedded tiny random-weight models",
    "test": "everything CI runs: forkbuild's tool tests, the CUDA route without a GPU "
    "(its install in build/cuda-route, every compiled extension loaded through a "
    "driver stub, the GPU tests' clean skip; docs/tests.md), the regression proof (the "
    "CPU suite fails on stock vLLM and passes on the fork) and the patch-status check",
    "matrix": "the fork's CPU suite on the [matrix] releases: docs/version-matrix.md",
    "generate": "rewrite the docs' and the nightly pipeline's blocks that restate "
    "fork.toml and patches/",
    "patch-status": "confirm each patch's DEP-3 Applied-Upstream on the matrix",
    "upstream": "dist/upstream/<pr>/: the test PRs of upstream-prs/ for the newest "
    "release, each proven alone and together, measured by differential mutation",
    "rebase": "try the series on another release (changes nothing without --accept)",
    "gpu-bundle": "dist/gpu-bundle/: the GPU cases for an air-gapped GPU host, in "
    "parts of at most PART_MIB MiB (run.sh in part 1)",
    "nightly": "the nightly GPU job: CUDA build, GPU tests, benchmark (needs a GPU)",
    "serve": "vllm serve through the fork",
}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="forkbuild", description=__doc__)
    sub = top.add_subparsers(dest="step", required=True)
    for name, step in STEPS.items():
        cmd = sub.add_parser(name, help=HELP[name], description=HELP[name])
        cmd.set_defaults(func=step.func, route=None)
        for flag, keywords in (step.arguments or {}).items():
            cmd.add_argument(flag, **keywords)
        if name == "serve":
            serve.add_arguments(cmd)
    return top


def _fail(message: str, status: int = 1) -> int:
    print(message, file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    # uv installs no bytecode, so the venv's processes must be free to write it on first
    # import (docs/setup-and-locks.md, "Bytecode").
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    args = parser().parse_args(argv)
    where = f"forkbuild {args.step}"
    try:
        closing = args.func(args, pins.load())
    except ForkError as exc:
        return _fail(f"{where}: error: {exc}")
    except KeyboardInterrupt:
        return _fail(f"{where}: interrupted; run it again to resume", 130)
    except OSError as exc:
        if exc.errno != 28:  # ENOSPC
            raise
        full = f"no space left on device ({exc.filename})"
        return _fail(f"{where}: error: {full} -- free disk space and run again")
    log.step(f"{args.step}: done")
    if isinstance(closing, str) and closing:  # the test summary, where CI looks
        print(closing, flush=True)
    return 0
