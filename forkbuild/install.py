"""Step 3: a virtualenv at build/venv with the pinned toolchain and an editable,
python-only install of the patched tree on vLLM's precompiled binaries.

VLLM_PRECOMPILED_WHEEL_LOCATION always points at the verified local wheel: when it is
unset, vLLM 0.25.1's setup.py fetches a nightly wheel from the network instead.
Each stage writes a stamp when it has finished, so an interrupted install is redone
from the start of that stage on the next run, and a finished one is skipped.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import venv
import zipfile
from pathlib import Path

from forkbuild import fetch, fixcheck, log, preflight, tree, wheelhouse
from forkbuild.errors import ForkError
from forkbuild.hashing import digest_of
from forkbuild.pins import Pins, Route, build_dir
from forkbuild.pip_runner import run_pip

TOOLCHAIN_STAMP = ".forkbuild-toolchain"
INSTALL_STAMP = ".forkbuild-installed"  # inside the tree: a rebuilt tree drops it


def venv_dir() -> Path:
    return build_dir() / "venv"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def pick_route(pins: Pins, requested: str | None) -> Route:
    name = requested or ("cuda" if preflight.has_nvidia_gpu() else "cpu")
    if name not in pins.routes:
        raise ForkError(f"unknown route {name!r}", f"use one of {', '.join(pins.routes)}")
    return pins.routes[name]


def ensure_toolchain(pins: Pins) -> Path:
    """The venv with torch, vLLM's build requirements and the test runner."""
    preflight.check_all(pins)
    requirements = [f"torch=={pins.torch}", *pins.build, *pins.test]
    stamp_value = digest_of([platform.python_version(), *requirements])
    stamp = venv_dir() / TOOLCHAIN_STAMP
    if stamp.exists() and stamp.read_text().strip() == stamp_value and venv_python().exists():
        log.step(f"install: toolchain venv {venv_dir()} is up to date")
        return venv_python()
    preflight.check_disk(build_dir(), 12, "the virtualenv")
    if venv_dir().exists():
        log.step(f"install: removing unfinished or outdated venv {venv_dir()}")
        shutil.rmtree(venv_dir())
    log.step(f"install: creating venv {venv_dir()} (Python {platform.python_version()})")
    venv.EnvBuilder(with_pip=True).create(venv_dir())
    wheelhouse.install(pins, venv_python(), requirements, what=f"torch {pins.torch} and build/test tools")
    stamp.write_text(stamp_value + "\n")
    return venv_python()


def _version_label(pins: Pins, route: Route) -> str:
    # vLLM picks the CPU platform only when its version contains "cpu".
    suffix = ".cpu" if route.target_device == "cpu" else ""
    return f"{pins.fork_version}{suffix}"


def precompiled_env(pins: Pins, route: Route, wheel: Path) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": route.target_device,
        "VLLM_USE_PRECOMPILED": "1",
        "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel),
        "VLLM_VERSION_OVERRIDE": _version_label(pins, route),
    }


def install(pins: Pins, route_name: str | None = None) -> tuple[Path, Path, Route]:
    """Make sure fetch, tree and the venv are complete; return (python, tree, route)."""
    route = pick_route(pins, route_name)
    python = ensure_toolchain(pins)
    sdist = fetch.fetch(pins.sdist, python)
    wheel = fetch.fetch(route.wheel, python)
    tree_path = tree.build(pins, sdist)

    stamp = tree_path / INSTALL_STAMP
    stamp_value = digest_of(
        [route.name, route.wheel.sha256, (tree_path / ".git" / tree.INPUTS_FILE).read_text(),
         (venv_dir() / TOOLCHAIN_STAMP).read_text(), *route.extra,
         (tree_path / route.requirements).read_bytes()]
    )
    if stamp.exists() and stamp.read_text().strip() == stamp_value:
        log.step("install: vLLM requirements and the editable tree are up to date")
    else:
        stamp.unlink(missing_ok=True)
        wheelhouse.install(
            pins,
            python,
            [f"torch=={pins.torch}", *route.extra],
            what=f"vLLM's {route.requirements}",
            requirement_files=[tree_path / route.requirements],
        )
        log.step(f"install: editable install of {tree_path} on {route.wheel.filename}")
        run_pip(
            python,
            ["install", "--no-build-isolation", "--no-deps", "-q", "-e", str(tree_path)],
            what="install the tree in editable mode",
            env=precompiled_env(pins, route, wheel),
            quiet=True,
        )
        add_missing_extensions(wheel, tree_path)
    check_install(python, tree_path, route)
    stamp.write_text(stamp_value + "\n")
    return python, tree_path, route


def add_missing_extensions(wheel: Path, tree_path: Path) -> list[str]:
    """Copy the wheel's compiled extensions that vLLM's precompiled install left out.

    vLLM 0.25.1's setup.py extracts a fixed list of extensions (`_C`, the attention
    kernels, ...), which lacks the CPU build's per-ISA variants `_C_AVX2` and
    `_C_AVX512`. The CPU platform loads `_C` only where AVX-512 BF16 exists and one of
    the variants elsewhere, so without them the CPU engine has no kernels on an
    AVX2-only host (`torch.ops._C` has no `init_cpu_memory_env`). The wheel is the
    verified one; each file is written beside its final name, then renamed.
    """
    added = []
    with zipfile.ZipFile(wheel) as whl:
        for name in whl.namelist():
            target = tree_path / name
            if not (name.startswith("vllm/") and name.endswith(".so")) or target.exists():
                continue
            partial = target.with_name(target.name + ".partial")
            with whl.open(name) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.rename(target)
            added.append(name)
    if added:
        log.step(f"install: added {len(added)} compiled extension(s) vLLM's setup.py skips: "
                 + ", ".join(Path(n).name for n in added))
    return added


_PROBE = """
import importlib.metadata, inspect, json, vllm
from vllm.platforms import current_platform
from vllm.v1.worker.gpu import attn_utils
cpu_kernels = None
if current_platform.device_type == "cpu":  # the ones this host's ISA loads
    import torch
    current_platform.import_kernels()
    cpu_kernels = hasattr(torch.ops._C, "init_cpu_memory_env")
print(json.dumps({
    "vllm": vllm.__file__,
    "module": attn_utils.__file__,
    "version": importlib.metadata.version("vllm"),
    "platform": type(current_platform).__name__,
    "device": current_platform.device_type,
    "source": inspect.getsource(attn_utils._reshape_attention_kv_cache),
    "cpu_kernels": cpu_kernels,
}))
"""


def check_install(python: Path, tree_path: Path, route: Route) -> dict[str, str]:
    """Ask the venv itself what `import vllm` gives: the tree, the fix, the platform."""
    # From inside the tree, with it first on sys.path, as the tests run: nothing there may
    # shadow the installed metadata (vLLM picks its platform from the version string).
    result = subprocess.run(
        [str(python), "-c", _PROBE], capture_output=True, text=True, cwd=tree_path,
        env={**os.environ, "PYTHONPATH": str(tree_path)}, check=False,
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ForkError(f"`import vllm` fails in {venv_dir()}: {last}", "run `make install` again")
    info = json.loads(result.stdout.strip().splitlines()[-1])
    if not Path(info["vllm"]).resolve().is_relative_to(tree_path.resolve()):
        raise ForkError(
            f"`import vllm` resolves to {info['vllm']}, not into {tree_path}",
            "remove other vLLM installs from the venv (rm -r build/venv) and run again",
        )
    verdict = fixcheck.classify(info["source"])
    if verdict != "fixed":
        raise ForkError(
            f"the installed {fixcheck.FUNCTION} is {verdict}, not fixed",
            "check patches/series and rebuild the tree (make tree)",
        )
    if info["device"] != route.target_device:
        raise ForkError(
            f"vLLM detected {info['platform']} (device {info['device']!r}) on the "
            f"{route.name} route (version {info['version']})",
            "rm -r build/venv and run again",
        )
    if info["cpu_kernels"] is False:
        raise ForkError(
            "vLLM's CPU kernels do not load on this host (torch.ops._C lacks "
            "init_cpu_memory_env): the CPU engine cannot start",
            f"check that {route.wheel.filename}'s vllm/_C*.so files are in {tree_path / 'vllm'}; "
            "rm -r build/venv and run again",
        )
    log.step(
        f"install: verified: vllm {info['version']} from {tree_path}, {info['platform']}, "
        f"{fixcheck.FUNCTION} carries the fix"
    )
    return info
