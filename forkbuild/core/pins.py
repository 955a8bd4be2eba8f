"""Read fork.toml, the fork's single pinned source of truth."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from forkbuild.core.errors import ForkError

REPO_ROOT = Path(__file__).resolve().parents[2]
PINS_FILE = REPO_ROOT / "fork.toml"


@dataclass(frozen=True)
class Artifact:
    key: str
    requirement: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class Route:
    """How to install the tree on one kind of machine (cpu or cuda)."""

    name: str
    wheel: Artifact
    requirements: str
    extra: tuple[str, ...]
    target_device: str
    # Dependencies left out of the route's lock (uv pip compile --excludes): what a
    # package declares but the route never imports (FlashInfer's CUDA compilers on CPU).
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True)
class Release:
    """A stock upstream release of the version matrix."""

    version: str
    torch: str
    sdist: Artifact
    binaries: Artifact  # the wheel whose compiled extensions the release's Python loads
    note: str = ""  # what a reader of the matrix table must know about this release


@dataclass(frozen=True)
class Pins:
    label: str
    upstream_version: str
    pythons: tuple[str, ...]  # "3.11", ...: supported, and locked
    machines: tuple[str, ...]
    lock_platform: str
    artifacts: dict[str, Artifact]
    uv: Artifact
    torch: str
    # the matrix releases' torch wheels (the fork's are locked)
    torch_sha256: dict[str, str]
    build: tuple[str, ...]
    tools: tuple[str, ...]
    test: tuple[str, ...]
    routes: dict[str, Route]
    regression_by_patch: dict[str, tuple[str, ...]]  # patch file name -> its modules
    suite: tuple[str, ...]
    gpu_tests: tuple[str, ...]
    # Modules run only on the CUDA build without a GPU (forkbuild/gpu/cuda_route.py).
    cuda_route_tests: tuple[str, ...] = ()
    releases: tuple[Release, ...] = ()

    @property
    def regression_tests(self) -> tuple[str, ...]:
        """Every regression module, of every patch, in fork.toml's order."""
        return tuple(
            dict.fromkeys(m for ms in self.regression_by_patch.values() for m in ms)
        )

    def torch_pins(self, version: str) -> dict[str, str]:
        """sha256 pins of VERSION's torch wheels (the toolchain's or a release's)."""
        prefix = f"torch-{version}-"
        return {k: v for k, v in self.torch_sha256.items() if k.startswith(prefix)}

    def release(self, version: str) -> Release:
        for release in self.releases:
            if release.version == version:
                return release
        known = ", ".join(r.version for r in self.releases)
        raise ForkError(
            f"vLLM {version} is not in the version matrix ({known})",
            "add it to [matrix] in fork.toml",
        )

    @property
    def toolchain(self) -> tuple[str, ...]:
        """What every venv of the fork has beside vLLM's own requirements."""
        return (f"torch=={self.torch}", *self.build, *self.tools, *self.test)

    @property
    def sdist(self) -> Artifact:
        return self.artifacts["sdist"]

    @property
    def fork_version(self) -> str:
        return f"{self.upstream_version}+{self.label}"


def load(path: Path = PINS_FILE) -> Pins:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ForkError(
            f"{path} is missing", "run forkbuild from a clone of the fork"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ForkError(f"{path} is not valid TOML: {exc}", "fix the file") from None
    try:
        artifacts = {key: _artifact(key, a) for key, a in raw["artifacts"].items()}
        routes = {
            name: Route(
                name,
                artifacts[r["wheel"]],
                r["requirements"],
                tuple(r["extra"]),
                r["target_device"],
                tuple(r.get("exclude", ())),
            )
            for name, r in raw["routes"].items()
        }
        tc = raw["toolchain"]
        matrix = raw.get("matrix", {})
        torch_sha256 = matrix.get("torch-sha256", {})
        releases = tuple(
            _release(raw, artifacts, tc["torch"], version)
            for version in matrix.get("releases", [])
        )
        return Pins(
            label=raw["fork"]["label"],
            upstream_version=raw["upstream"]["version"],
            pythons=tuple(raw["upstream"]["pythons"]),
            machines=tuple(raw["upstream"]["machines"]),
            lock_platform=raw["upstream"]["lock_platform"],
            artifacts=artifacts,
            uv=_artifact("uv", tc["uv"]),
            torch=tc["torch"],
            torch_sha256={k: v.lower() for k, v in torch_sha256.items()},
            build=tuple(tc["build"]),
            tools=tuple(tc["tools"]),
            test=tuple(tc["test"]),
            routes=routes,
            regression_by_patch={
                k: tuple(v) for k, v in raw["tests"]["regression"].items()
            },
            suite=tuple(raw["tests"]["suite"]),
            gpu_tests=tuple(raw["tests"]["gpu"]),
            cuda_route_tests=tuple(raw["tests"].get("cuda_route", ())),
            releases=releases,
        )
    except KeyError as exc:
        raise ForkError(
            f"{path} lacks the key {exc}", "compare it with the fork's main branch"
        ) from None


def _artifact(key: str, a: dict) -> Artifact:
    return Artifact(key, a["requirement"], a["filename"], a["sha256"].lower())


def _release(
    raw: dict, artifacts: dict[str, Artifact], torch: str, version: str
) -> Release:
    # the fork's base: its files are [artifacts]
    if version == raw["upstream"]["version"]:
        return Release(version, torch, artifacts["sdist"], artifacts["wheel-cpu"])
    entry = raw["matrix"]["release"][version]
    return Release(
        version,
        entry["torch"],
        _artifact(f"sdist-{version}", entry["sdist"]),
        _artifact(f"binaries-{version}", entry["binaries"]),
        entry.get("note", ""),
    )


def cache_dir() -> Path:
    """Downloads live outside the clone so that a fresh clone on the same machine reuses
    them."""
    if os.environ.get("VLLM_FORK_CACHE"):
        return Path(os.environ["VLLM_FORK_CACHE"])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "vllm-fork"


def locks_dir() -> Path:
    return REPO_ROOT / "locks"


def build_dir() -> Path:
    return Path(os.environ.get("VLLM_FORK_BUILD") or REPO_ROOT / "build")


# --- fork.toml [gpu_bundle]: the GPU bundle's settings (forkbuild/gpu/bundle/) --------


@dataclass(frozen=True)
class GpuBundle:
    """fork.toml [gpu_bundle], and what each [gpu.cases] row says of the bundle."""

    host: str  # the default host file, in the repository
    part_mib: float
    order: tuple[str, ...]  # the order in which components fill the parts
    every_case: tuple[str, ...]
    needs: dict[str, tuple[str, ...]]  # node id -> components beyond every_case
    not_carried: dict[str, str]  # node id -> why the bundle does not carry it
    gpu: dict  # [gpu] as it is: the runner's table (forkbuild/gpu/required.py)
    left_out: dict[str, str]  # distribution -> module
    stand_in: dict[str, str]  # component -> module
    harness: tuple[str, ...] = ()
    engine_modules: tuple[str, ...] = ()
    omit: tuple[str, ...] = ()


def gpu_bundle_of(raw: dict) -> GpuBundle:
    """The settings from fork.toml's parsed text RAW ([gpu_bundle] and [gpu])."""
    table, gpu = raw["gpu_bundle"], raw["gpu"]
    needs, not_carried = {}, {}
    for node, case in gpu["cases"].items():
        if ("bundle" in case) == ("not_in_bundle" in case):
            raise ForkError(
                f"fork.toml [gpu.cases] {node!r} gives "
                + ("both `bundle` and" if "bundle" in case else "neither `bundle` nor")
                + " `not_in_bundle`",
                "give one: `bundle = [...]`, what the bundle holds for it beyond "
                '[gpu_bundle] every_case, or `not_in_bundle = "why"`',
            )
        if "bundle" in case:
            needs[node] = tuple(case["bundle"])
        else:
            not_carried[node] = case["not_in_bundle"]
    lists = ("order", "every_case", "harness", "engine_modules", "omit")
    return GpuBundle(
        host=table["host"],
        part_mib=float(table["part_mib"]),
        needs=needs,
        not_carried=not_carried,
        gpu=gpu,
        left_out=dict(table.get("left_out", {})),
        stand_in=dict(table.get("stand_in", {})),
        **{k: tuple(table.get(k, ())) for k in lists},
    )


def load_gpu_bundle(path: Path = PINS_FILE) -> GpuBundle:
    try:
        return gpu_bundle_of(tomllib.loads(path.read_text()))
    except KeyError as exc:
        raise ForkError(
            f"{path} lacks the key {exc}", "compare it with the fork's main branch"
        ) from None
