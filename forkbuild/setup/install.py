"""Step 3: build/venv holding exactly the route's lock, and an editable install of the
patched tree on vLLM's precompiled binaries (VLLM_PRECOMPILED_WHEEL_LOCATION names the
verified local wheel: unset, vLLM 0.25.1's setup.py fetches a nightly one instead)."""

import json
import os
import re
import shutil
import sys
import threading
import urllib.parse
import uuid
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from forkbuild.core import fixcheck, log, preflight
from forkbuild.core.errors import ForkError, run_or_fail
from forkbuild.core.hashing import digest_of
from forkbuild.core.pins import REPO_ROOT, Pins, Route, build_dir
from forkbuild.setup import bootstrap, bytecode, fetch, lock, tree, uv

LOCK_RECORD = ".forkbuild-lock"  # in the venv: the lock it holds (locks/cpu-py311.txt)
INSTALL_STAMP = ".forkbuild-installed"  # inside the tree: a rebuilt tree drops it
VENV_ID = ".forkbuild-venv-id"  # in the venv, fresh in each: part of the install stamp
EDITABLE_CONFIG = ".forkbuild-uv-editable.toml"  # in the tree, git-ignored


def venv_dir() -> Path:
    return build_dir() / "venv"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def pick_route(pins: Pins, requested: str | None) -> Route:
    name = requested or ("cuda" if preflight.has_nvidia_gpu() else "cpu")
    if name not in pins.routes:
        raise ForkError(
            f"unknown route {name!r}", f"use one of {', '.join(pins.routes)}"
        )
    return pins.routes[name]


def _usable_route(pins: Pins, requested: str | None, without_gpu: bool) -> Route:
    """CUDA without a GPU would replace the CPU venv, then fail (`make test`: ok)."""
    route = pick_route(pins, requested)
    if route.target_device != "cuda" or without_gpu or preflight.has_nvidia_gpu():
        return route
    raise ForkError(
        f"the {route.name} route needs an NVIDIA GPU and its driver, and this machine "
        "has none",
        "here, install the CPU route (`make install`, the default without a GPU); "
        "`make test` checks the CUDA route's build without a GPU",
    )


def ensure_toolchain(
    pins: Pins, route_name: str | None = None, without_gpu: bool = False
) -> Path:
    """build/venv with exactly the route's lock for this Python."""
    preflight.check_all(pins)
    record = venv_dir() / LOCK_RECORD
    if route_name is None and record.is_file():
        # A step that installs no route's binaries (tree, wheel, rebase...) keeps the
        # venv it finds rather than rebuilding it for the default route.
        recorded = Path(record.read_text().strip()).name.split("-py")[0]
        route_name = recorded if recorded in pins.routes else None
    route = _usable_route(pins, route_name, without_gpu)
    lock_file = lock.path(route.name, lock.running_python())
    if not lock_file.is_file():
        raise ForkError(
            f"{lock_file} is missing", "run `make lock` (needs the package index)"
        )

    def fill(python: Path) -> None:
        preflight.check_disk(build_dir(), 12, "the virtualenv")
        bootstrap.sync(pins, python, lock_file)
        venv = python.parent.parent
        kept = bytecode.store("venv", lock_file.read_bytes())
        if linked := bytecode.restore(site_packages(venv), kept):
            log.step(f"install: {linked} bytecode files of earlier venvs linked in")
        record = lock_file.relative_to(lock_file.parent.parent)  # locks/cpu-py311.txt
        (venv / LOCK_RECORD).write_text(f"{record}\n")
        (venv / VENV_ID).write_text(uuid.uuid4().hex + "\n")

    key = digest_of([sys.version, pins.uv.sha256, lock_file.read_bytes()])
    what = f"the packages of {lock_file.name}"
    python, made = uv.venv_in_place(pins, venv_dir(), key, what, fill)
    count = f" ({len(lock.pinned(lock_file))} packages)" if made else ""
    log.step(f"install: {venv_dir()} holds exactly {lock_file.name}{count}")
    return python


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{lock.running_python()}" / "site-packages"


def tree_bytecode(pins: Pins) -> Path:
    patches = (p.path.read_bytes() for p in tree.read_series())
    return bytecode.store("tree", pins.sdist.sha256, *patches)


def keep_bytecode(pins: Pins, route: Route, tree_path: Path) -> None:
    """Keep what Python compiled in this venv and tree for the next fresh ones."""
    lock_file = lock.path(route.name, lock.running_python())
    venv_store = bytecode.store("venv", lock_file.read_bytes())
    bytecode.keep(site_packages(venv_dir()), venv_store)
    bytecode.keep(tree_path / "vllm", tree_bytecode(pins))


def _version_label(pins: Pins, route: Route) -> str:
    # vLLM picks the CPU platform only when its version contains "cpu".
    return pins.fork_version + (".cpu" if route.target_device == "cpu" else "")


def precompiled_env(pins: Pins, route: Route, wheel: Path) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": route.target_device,
        "VLLM_USE_PRECOMPILED": "1",
        "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel),
        "VLLM_VERSION_OVERRIDE": _version_label(pins, route),
    }


def install(
    pins: Pins, route_name: str | None = None, *, without_gpu: bool = False
) -> tuple[Path, Path, Route]:
    """Make sure fetch, tree and the venv are complete; return (python, tree, route)."""
    preflight.check_all(pins)
    route = _usable_route(pins, route_name, without_gpu)
    python, tree_path = _venv_beside_tree(pins, route, without_gpu)
    wheel = fetch.fetch(route.wheel, lambda: python)
    lock.check(pins, tree_path)
    if is_installed(route, tree_path):
        # Verified by the probe when stamped; what may change since is the source.
        fixed = tree_path / fixcheck.MODULE_PATH
        _require_fix(fixed.read_text(), str(fixed))
        keep_bytecode(pins, route, tree_path)
        log.step("install: the venv and the editable tree are up to date and verified")
        return python, tree_path, route
    stamp = tree_path / INSTALL_STAMP
    stamp.unlink(missing_ok=True)
    bytecode.restore(tree_path / "vllm", tree_bytecode(pins))
    log.step(f"install: editable install of {tree_path} on {route.wheel.filename}")
    config = editable_config(pins, route, tree_path)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="extensions") as pool:
        # The per-ISA kernels setup.py leaves out are unpacked meanwhile (~200 MB on
        # the CPU route); what it unpacks is its own to write.
        leave = left_to_setup_py(tree_path / "setup.py")
        adding = pool.submit(add_missing_extensions, wheel, tree_path, leave=leave)
        editable = ["pip", "install", "--quiet", "--config-file", str(config)]
        editable += ["--python", str(python), "--no-deps", "--no-build-isolation"]
        editable += ["--offline", "--reinstall-package", "vllm", "-e", str(tree_path)]
        env = precompiled_env(pins, route, wheel)
        uv.run(pins, editable, what="install the tree in editable mode", extra_env=env)
        adding.result()
    add_missing_extensions(wheel, tree_path)  # any setup.py named and did not write
    check_install(python, tree_path, route, without_gpu)
    keep_bytecode(pins, route, tree_path)
    stamp.write_text(install_stamp(route, tree_path) + "\n")
    return python, tree_path, route


def is_installed(route: Route, tree_path: Path) -> bool:
    """The tree was installed into this very venv (its id), which still holds it."""
    stamp = tree_path / INSTALL_STAMP
    held = stamp.exists() and holds_editable(tree_path)
    return held and stamp.read_text().strip() == install_stamp(route, tree_path)


def install_stamp(route: Route, tree_path: Path) -> str:
    """The route's wheel, the tree's inputs, the venv's lock and the venv's own id."""
    venv_id = venv_dir() / VENV_ID
    inputs = (tree_path / ".git" / tree.INPUTS_FILE).read_text()
    made_from = (venv_dir() / uv.STAMP).read_text()
    own_id = venv_id.read_text() if venv_id.exists() else ""
    return digest_of([route.name, route.wheel.sha256, inputs, made_from, own_id])


def holds_editable(tree_path: Path) -> bool:
    """Whether the venv's vLLM is TREE_PATH's editable install (its metadata: cheap)."""
    found = site_packages(venv_dir()).glob("vllm-*.dist-info/direct_url.json")
    try:
        info = json.loads(next(found).read_text())
    except (StopIteration, OSError, ValueError):
        return False
    url = urllib.parse.urlparse(info.get("url", ""))
    if url.scheme != "file" or not info.get("dir_info", {}).get("editable"):
        return False
    # Resolved on both sides: uv may write it as given (VLLM_FORK_BUILD a link).
    return Path(urllib.parse.unquote(url.path)).resolve() == tree_path.resolve()


def _venv_beside_tree(
    pins: Pins, route: Route, without_gpu: bool = False
) -> tuple[Path, Path]:
    """The venv and the patched tree, made at the same time on two cores."""
    venv, stop = Future[Path](), threading.Event()

    def make_tree() -> Path:  # only an sdist download needs the venv's pip
        return tree.build(pins, fetch.fetch(pins.sdist, venv.result), stop=stop)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tree") as pool:
        making_tree = pool.submit(make_tree)
        try:
            try:
                venv.set_result(ensure_toolchain(pins, route.name, without_gpu))
            except BaseException:
                failed = "the venv could not be made, so the sdist cannot be downloaded"
                venv.set_exception(ForkError(failed))
                raise
            return venv.result(), making_tree.result()
        except KeyboardInterrupt:  # the tree step stops at its next file or git command
            stop.set()
            raise


EDITABLE_METADATA = """\
# Written by forkbuild's install step (forkbuild/setup/install.py: editable_config).
[[dependency-metadata]]
name = "vllm"
version = "{version}"
requires-dist = []  # installed with --no-deps: the lock holds the dependencies
"""


def editable_config(pins: Pins, route: Route, tree_path: Path) -> Path:
    """A uv configuration giving the editable vLLM's version: uv runs setup.py once."""
    config = tree_path / EDITABLE_CONFIG
    config.write_text(EDITABLE_METADATA.format(version=_version_label(pins, route)))
    return config


# The CPU build's per-ISA kernels, which vLLM 0.25.1's setup.py does not unpack: the
# only extensions unpacked while it runs. `_C` needs AVX-512 BF16, so without
# `_C_AVX2` and `_C_AVX512` an AVX2-only host had no CPU kernels.
PER_ISA_KERNEL = re.compile(r"vllm/_C_[A-Z0-9]+\.abi3\.so")


def left_to_setup_py(setup_py: Path) -> Callable[[str], bool]:
    """The wheel members setup.py writes: all but the per-ISA kernels it does not name
    (in quotes: the members it unpacks)."""
    text = setup_py.read_text()
    return lambda member: not PER_ISA_KERNEL.fullmatch(member) or f'"{member}"' in text


def add_missing_extensions(
    wheel: Path, tree_path: Path, *, leave: Callable[[str], bool] = lambda member: False
) -> list[str]:
    """Copy the wheel's extensions the install left out; LEAVE: what setup.py writes."""
    added = []
    with zipfile.ZipFile(wheel) as whl:
        for name in whl.namelist():
            target = tree_path / name
            compiled = name.startswith("vllm/") and name.endswith(".so")
            if not compiled or target.exists() or leave(name):
                continue
            partial = target.with_name(target.name + ".partial")
            with whl.open(name) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.rename(target)
            added.append(name)
    if added:
        names = ", ".join(Path(n).name for n in added)
        what = f"{len(added)} compiled extension(s) vLLM's setup.py skips"
        log.step(f"install: added {what}: {names}")
    return added


def probe_path(tree_path: Path) -> str:
    """install_probe's PYTHONPATH: the tree first (as the tests run), then forkbuild."""
    return os.pathsep.join([str(tree_path), str(REPO_ROOT)])


def _require_fix(source: str, what: str) -> None:
    if (verdict := fixcheck.classify(source)) != "fixed":
        raise ForkError(
            f"{what} is {verdict}, not fixed",
            "check patches/series and rebuild the tree (make tree)",
        )


def check_install(
    python: Path, tree_path: Path, route: Route, without_gpu: bool = False
) -> None:
    """Ask the venv itself what `import vllm` gives: the tree, the fix, the platform."""
    log.step("install: asking the venv what `import vllm` gives")
    result = run_or_fail(
        [str(python), "-m", "forkbuild.setup.install_probe"],
        f"`import vllm` fails in {venv_dir()}",
        "run `make install` again",
        cwd=tree_path,
        env={**os.environ, "PYTHONPATH": probe_path(tree_path)},
    )
    info = json.loads(result.stdout.strip().splitlines()[-1])
    if not Path(info["vllm"]).resolve().is_relative_to(tree_path.resolve()):
        raise ForkError(
            f"`import vllm` resolves to {info['vllm']}, not into {tree_path}",
            f"remove other vLLM installs from the venv (rm -r {venv_dir()}) and run "
            "again",
        )
    _require_fix(info["source"], f"the installed {fixcheck.FUNCTION}")
    # Without a driver vLLM finds no platform at all (UnspecifiedPlatform, no device).
    no_driver = without_gpu and route.target_device == "cuda"
    if info["device"] != ("" if no_driver else route.target_device):
        raise ForkError(
            f"vLLM detected {info['platform']} (device {info['device']!r}) on the "
            f"{route.name} route (version {info['version']})",
            f"rm -r {venv_dir()} and run again",
        )
    if info["cpu_kernels"] is False:
        raise ForkError(
            "vLLM's CPU kernels do not load on this host (torch.ops._C lacks "
            "init_cpu_memory_env): the CPU engine cannot start",
            f"check that {route.wheel.filename}'s vllm/_C*.so files are in "
            f"{tree_path / 'vllm'}; rm -r {venv_dir()} and run again",
        )
    log.step(
        f"install: verified: vllm {info['version']} from {tree_path}, "
        f"{info['platform']}, {fixcheck.FUNCTION} carries the fix"
    )
