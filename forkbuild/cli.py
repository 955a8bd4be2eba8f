"""Command line: python3 -m forkbuild STEP. Each step runs the steps it depends on."""

from __future__ import annotations

import argparse
import os
import sys
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


def _sdist(p: Pins) -> Path:
    # pip runs in the venv (the sdist's metadata needs torch), made only if a file is
    # missing. Any route's venv has pip.
    return fetch.fetch(p.sdist, lambda: install.ensure_toolchain(p))


def _fetch(args: argparse.Namespace, p: Pins) -> None:
    route = install.pick_route(p, args.route)
    _sdist(p)
    fetch.fetch(route.wheel, lambda: install.ensure_toolchain(p))


def _tree(args: argparse.Namespace, p: Pins) -> None:
    print(tree.build(p, _sdist(p), force=args.force))


def _lock(args: argparse.Namespace, p: Pins) -> None:
    lock.generate(p, tree.build(p, _sdist(p)))
    upstream.lock_hooks(p, upstream.release_hook_config(p))


def _install(args: argparse.Namespace, p: Pins) -> None:
    print(install.install(p, args.route, without_gpu=args.without_gpu)[0])


def _regression(args: argparse.Namespace, p: Pins) -> None:
    python, tree_path, _ = install.install(p, args.route)
    regression.check(p, python, tree_path)


def _wheel(args: argparse.Namespace, p: Pins) -> None:
    print(wheel.build(p))


def _model(args: argparse.Namespace, p: Pins) -> None:
    python, _, _ = install.install(p, args.route)
    for name in serve.EMBEDDED:
        print(serve.ensure_tiny_model(python, name))


def _serve(args: argparse.Namespace, p: Pins) -> None:
    serve.serve(p, args)


def _test(args: argparse.Namespace, p: Pins) -> str:
    return testrun.run(p, args.route)


def _matrix(args: argparse.Namespace, p: Pins) -> None:
    matrix.run(p, args.versions)


def _patch_status(args: argparse.Namespace, p: Pins) -> None:
    patch_status.check(p)


def _generate(args: argparse.Namespace, p: Pins) -> str:
    return generate.write(p)


def _upstream(args: argparse.Namespace, p: Pins) -> None:
    print(upstream.build(p))


def _rebase(args: argparse.Namespace, p: Pins) -> None:
    (rebase.accept if args.accept else rebase.trial)(p, args.version)


def _gpu_bundle(args: argparse.Namespace, p: Pins) -> str:
    host = Path(args.host) if args.host else None
    bundle = gpu_bundle.build(p, host, part_mib=args.part_mib)
    return f"gpu bundle {bundle.folder}: {bundle.line()}"


def _nightly(args: argparse.Namespace, p: Pins) -> str:
    return nightly.run(p)


ROUTE = {
    "choices": ("cpu", "cuda"),
    "default": None,
    "help": "vLLM binaries to install on (default: cuda where an NVIDIA GPU is "
    "present, else cpu)",
}
# Each step: its function, its help, whether it installs on one route's binaries, and
# its own arguments (name or flag, argparse keywords).
STEPS = {
    "fetch": (
        _fetch,
        "download the pinned sdist and wheel, verified by sha256",
        True,
        [],
    ),
    "tree": (
        _tree,
        "build build/vllm-<version>: sdist + patches + tests, as git",
        False,
        [
            (
                "--force",
                {
                    "action": "store_true",
                    "help": "rebuild even if the inputs are unchanged",
                },
            )
        ],
    ),
    "lock": (
        _lock,
        "locks/ROUTE-pyXY.txt: every route's venv, per Python, pinned with sha256 (uv "
        "pip compile; needs the package index)",
        False,
        [],
    ),
    "install": (
        _install,
        "build/venv: the route's lock installed by uv, hash-checked, and an editable "
        "install of the tree",
        True,
        [
            (
                "--without-gpu",
                {
                    "action": "store_true",
                    "help": "install the cuda route on a machine without a driver, for "
                    "checking it there (make test does, in build/cuda-route); vLLM "
                    "then finds no platform",
                },
            )
        ],
    ),
    "regression": (
        _regression,
        "the regression tests must fail unpatched and pass patched",
        True,
        [],
    ),
    "wheel": (_wheel, "a distributable patched CUDA wheel in dist/", False, []),
    "model": (_model, "generate the embedded tiny random-weight models", True, []),
    "test": (
        _test,
        "everything CI runs: forkbuild's tool tests (serve, wheel, locks, bad input), "
        "the CUDA route without a GPU (its install in build/cuda-route, every compiled "
        "extension loaded through a driver stub, FlashInfer's JIT toolchain, the GPU "
        "tests' clean skip under that build, the kernel test's calls up to the ops' "
        "dispatch), the regression proof (the CPU suite fails on stock vLLM and passes "
        "on the fork) and the patch-status check",
        True,
        [],
    ),
    "matrix": (
        _matrix,
        "the fork's CPU suite on the [matrix] releases: docs/version-matrix.md",
        False,
        [
            (
                "versions",
                {
                    "nargs": "*",
                    "help": "only these releases (default: all, plus the fork)",
                },
            )
        ],
    ),
    "generate": (
        _generate,
        "rewrite the docs' and the nightly pipeline's blocks that restate fork.toml "
        "and patches/",
        False,
        [],
    ),
    "patch-status": (
        _patch_status,
        "confirm each patch's DEP-3 Applied-Upstream on the matrix",
        False,
        [],
    ),
    "upstream": (
        _upstream,
        "dist/upstream/<pr>/: the test PRs of upstream-prs/ for the newest release, "
        "each proven alone and together, measured by differential mutation",
        False,
        [],
    ),
    "rebase": (
        _rebase,
        "try the series on another release (changes nothing without --accept)",
        False,
        [
            ("version", {"help": "the upstream vLLM version, e.g. 0.26.0"}),
            (
                "--accept",
                {
                    "action": "store_true",
                    "help": "move fork.toml and patches/ to that version",
                },
            ),
        ],
    ),
    "gpu-bundle": (
        _gpu_bundle,
        "dist/gpu-bundle/: the GPU cases for an air-gapped GPU host, in parts of at "
        "most PART_MIB MiB (run.sh in part 1)",
        False,
        [
            (
                "--host",
                {
                    "help": "the host's file from `bash run.sh --inventory` (default: "
                    "fork.toml [gpu_bundle] host, the reference H200)"
                },
            ),
            (
                "--part-mib",
                {
                    "type": float,
                    "default": None,
                    "help": "the largest part, in MiB (default: PART_MIB or "
                    "fork.toml's)",
                },
            ),
        ],
    ),
    "nightly": (
        _nightly,
        "the nightly GPU job: CUDA build, GPU tests, benchmark (needs a GPU)",
        False,
        [],
    ),
    "serve": (_serve, "vllm serve through the fork", True, []),
}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="forkbuild", description=__doc__)
    sub = top.add_subparsers(dest="step", required=True)
    for name, (func, help_text, route, arguments) in STEPS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(func=func, route=None)
        if route:  # only the steps that install on one route's binaries
            cmd.add_argument("--route", **ROUTE)
        for flag, keywords in arguments:
            cmd.add_argument(flag, **keywords)
        if name == "serve":
            serve.add_arguments(cmd)
    return top


def main(argv: list[str] | None = None) -> int:
    # uv installs no bytecode, so the venv's processes must be free to write it on first
    # import (docs/setup-and-locks.md, "Bytecode").
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    args = parser().parse_args(argv)
    try:
        closing = args.func(args, pins.load())
    except ForkError as exc:
        print(f"forkbuild {args.step}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"forkbuild {args.step}: interrupted; run it again to resume",
            file=sys.stderr,
        )
        return 130
    except OSError as exc:
        if exc.errno != 28:  # ENOSPC
            raise
        print(
            f"forkbuild {args.step}: error: no space left on device "
            f"({exc.filename}) -- free disk space and run again",
            file=sys.stderr,
        )
        return 1
    log.step(f"{args.step}: done")
    if closing:  # the test summary: last, where CI looks for it
        print(closing, flush=True)
    return 0
