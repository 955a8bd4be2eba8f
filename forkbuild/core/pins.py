"""Read fork.toml, the fork's single pinned source of truth."""

import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from forkbuild.core.errors import ForkError

REPO_ROOT = Path(__file__).resolve().parents[2]
PINS_FILE = REPO_ROOT / "fork.toml"
T = TypeVar("T")


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
    exclude: tuple[str, ...] = ()  # not locked (--excludes): declared, never imported


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
    torch_sha256: dict[str, str]  # matrix releases' torch wheels (the fork's: locks)
    build: tuple[str, ...]
    forkbuild: tuple[str, ...]  # forkbuild's own libraries (its tool environment)
    tools: tuple[str, ...]
    test: tuple[str, ...]
    routes: dict[str, Route]
    regression_by_patch: dict[str, tuple[str, ...]]  # patch file name -> its modules
    suite: tuple[str, ...]
    gpu_tests: tuple[str, ...]
    cuda_route_tests: tuple[str, ...] = ()  # run only on the CUDA build without a GPU
    releases: tuple[Release, ...] = ()
    gpu: "GpuTable | None" = None  # fork.toml [gpu], defined below

    @property
    def regression_tests(self) -> tuple[str, ...]:  # every patch's, fork.toml's order
        return tuple({m: 0 for ms in self.regression_by_patch.values() for m in ms})

    def release(self, version: str) -> Release:
        if found := [r for r in self.releases if r.version == version]:
            return found[0]
        known = ", ".join(r.version for r in self.releases)
        raise ForkError(
            f"vLLM {version} is not in the version matrix ({known})",
            "add it to [matrix] in fork.toml",
        )

    @property
    def toolchain(self) -> tuple[str, ...]:  # every venv's, beside vLLM's requirements
        libraries = (*self.build, *self.forkbuild, *self.tools, *self.test)
        return (f"torch=={self.torch}", *libraries)

    sdist = property(lambda self: self.artifacts["sdist"])
    fork_version = property(lambda self: f"{self.upstream_version}+{self.label}")


def _read(path: Path, make: Callable[[dict], T]) -> T:
    """MAKE of the parsed file at PATH; a missing file, bad TOML or key said as such."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        hint = "run forkbuild from a clone of the fork"
        raise ForkError(f"{path} is missing", hint) from None
    except tomllib.TOMLDecodeError as exc:
        raise ForkError(f"{path} is not valid TOML: {exc}", "fix the file") from None
    try:
        return make(raw)
    except KeyError as exc:
        hint = "compare it with the fork's main branch"
        raise ForkError(f"{path} lacks the key {exc}", hint) from None


def load(path: Path = PINS_FILE) -> Pins:
    return _read(path, _pins)


def _pins(raw: dict) -> Pins:
    artifacts = {key: _artifact(key, a) for key, a in raw["artifacts"].items()}
    routes = {name: _route(name, r, artifacts) for name, r in raw["routes"].items()}
    tc, matrix = raw["toolchain"], raw.get("matrix", {})
    torch_sha256 = matrix.get("torch-sha256", {})
    versions = matrix.get("releases", [])
    releases = tuple(_release(raw, artifacts, tc["torch"], v) for v in versions)
    up, tests = raw["upstream"], raw["tests"]
    return Pins(
        *(raw["fork"]["label"], up["version"], tuple(up["pythons"])),
        *(tuple(up["machines"]), up["lock_platform"], artifacts),
        uv=_artifact("uv", tc["uv"]),
        torch=tc["torch"],
        torch_sha256={k: v.lower() for k, v in torch_sha256.items()},
        **{k: tuple(tc[k]) for k in ("build", "forkbuild", "tools", "test")},
        routes=routes,
        regression_by_patch={k: tuple(v) for k, v in tests["regression"].items()},
        suite=tuple(tests["suite"]),
        gpu_tests=tuple(tests["gpu"]),
        cuda_route_tests=tuple(tests.get("cuda_route", ())),
        releases=releases,
        gpu=gpu_table(raw["gpu"]),
    )


def _route(name: str, r: dict, artifacts: dict[str, Artifact]) -> Route:
    extra, exclude = tuple(r["extra"]), tuple(r.get("exclude", ()))
    wheel = artifacts[r["wheel"]]
    return Route(name, wheel, r["requirements"], extra, r["target_device"], exclude)


def _artifact(key: str, a: dict) -> Artifact:
    return Artifact(key, a["requirement"], a["filename"], a["sha256"].lower())


def _release(raw: dict, artifacts: dict[str, Artifact], torch: str, v: str) -> Release:
    if v == raw["upstream"]["version"]:  # the fork's base: its files are [artifacts]
        return Release(v, torch, artifacts["sdist"], artifacts["wheel-cpu"])
    entry = raw["matrix"]["release"][v]
    sdist = _artifact(f"sdist-{v}", entry["sdist"])
    binaries = _artifact(f"binaries-{v}", entry["binaries"])
    return Release(v, entry["torch"], sdist, binaries, entry.get("note", ""))


# -- fork.toml [gpu]: the nightly's GPU kinds, queues, cases (a bundle manifest's too)
Capability = tuple[int, int]  # CUDA compute capability (major, minor): 9.0 -> (9, 0)


def capability(text: str) -> Capability:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


@dataclass(frozen=True)
class GpuCase:
    """A case due from KIND on, with GPUS GPUs; the bundle's extras, or why none."""

    node: str
    kind: str
    gpus: int = 1
    bundle: tuple[str, ...] | None = None  # None: not in the bundle
    not_in_bundle: str = ""


@dataclass(frozen=True)
class GpuKind:
    """A GPU generation: from which compute capability, and what it must run."""

    name: str
    min_capability: Capability
    cases: tuple[str, ...]  # required with any number of GPUs
    multi_gpu_cases: tuple[str, ...] = ()  # required only with two GPUs or more
    queues: tuple[tuple[str, int], ...] = ()  # the nightly's agent queues, GPUs each

    def required(self, gpu_count: int) -> tuple[str, ...]:
        return self.cases + (self.multi_gpu_cases if gpu_count >= 2 else ())


@dataclass(frozen=True)
class GpuTable:
    """The GPU kinds, oldest first, and every case some kind requires, by node id."""

    kinds: tuple[GpuKind, ...]
    cases: dict[str, GpuCase]

    def all_required(self) -> set[str]:  # of every kind, with any GPU count
        return set(self.cases)

    def kind_of(self, capability: Capability) -> GpuKind | None:
        """The newest kind whose minimum it reaches (10.0 is Hopper: runs FA3 too)."""
        fitting = [k for k in self.kinds if capability >= k.min_capability]
        return fitting[-1] if fitting else None

    def kind(self, name: str) -> GpuKind:
        return next(kind for kind in self.kinds if kind.name == name)

    @property
    def queues(self) -> dict[str, tuple[GpuKind, int]]:  # queue -> kind, GPUs
        return {q: (k, n) for k in self.kinds for q, n in k.queues}


def gpu_table(data: dict) -> GpuTable:
    """A [gpu] mapping's table: a case is due from its `kind` on, on `gpus` GPUs."""
    named = sorted(
        data["kinds"].items(), key=lambda kv: capability(kv[1]["capability"])
    )
    order = [name for name, _ in named]
    cases = {node: _gpu_case(node, c, order) for node, c in data["cases"].items()}
    kinds = []
    for rank, (name, entry) in enumerate(named):
        due = [c for c in cases.values() if order.index(c.kind) <= rank]
        one = tuple(c.node for c in due if c.gpus == 1)
        more = tuple(c.node for c in due if c.gpus >= 2)
        queues = tuple(entry["queues"].items())
        kinds.append(GpuKind(name, capability(entry["capability"]), one, more, queues))
    return GpuTable(tuple(kinds), cases)


def _gpu_case(node: str, c: dict, kinds: list[str]) -> GpuCase:
    if c.get("kind") not in kinds:
        raise ForkError(
            f"fork.toml [gpu] cases name unknown kinds: {c.get('kind')} ({node})",
            f"use one of {', '.join(kinds)}",
        )
    carry, why = _bundle_entry(node, c), c.get("not_in_bundle", "")
    return GpuCase(node, c["kind"], c.get("gpus", 1), carry, why)


def _bundle_entry(node: str, case: dict) -> tuple[str, ...] | None:
    """What the GPU bundle holds for the case (None: `not_in_bundle` says why not)."""
    if ("bundle" in case) == ("not_in_bundle" in case):
        gives = "both `bundle` and" if "bundle" in case else "neither `bundle` nor"
        raise ForkError(
            f"fork.toml [gpu.cases] {node!r} gives {gives} `not_in_bundle`",
            "give one: `bundle = [...]`, what the bundle holds for it beyond "
            '[gpu_bundle] every_case, or `not_in_bundle = "why"`',
        )
    return tuple(case["bundle"]) if "bundle" in case else None


def cache_dir() -> Path:  # outside the clone: a fresh clone reuses the downloads
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("VLLM_FORK_CACHE") or Path(cache) / "vllm-fork")


def locks_dir() -> Path:
    return REPO_ROOT / "locks"


def build_dir() -> Path:
    return Path(os.environ.get("VLLM_FORK_BUILD") or REPO_ROOT / "build")


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
    xz_preset: dict[str, int] = field(default_factory=dict)  # component -> LZMA2 preset
    stock_cases: tuple[str, ...] = ()  # run again on stock's module: must fail
    sanitizer_case: str = ""  # run under compute-sanitizer memcheck: 0 errors
    figures: dict = field(default_factory=dict)  # the offload benchmark: script, needs


def gpu_bundle_of(raw: dict) -> GpuBundle:
    """The settings from fork.toml's parsed text RAW ([gpu_bundle] and [gpu])."""
    table, gpu = raw["gpu_bundle"], raw["gpu"]
    cases = gpu["cases"]
    carried = {node: _bundle_entry(node, case) for node, case in cases.items()}
    needs = {node: held for node, held in carried.items() if held is not None}
    not_carried = {n: c["not_in_bundle"] for n, c in cases.items() if n not in needs}
    lists = ("order", "every_case", "harness", "engine_modules", "omit", "stock_cases")
    settings = {k: tuple(table.get(k, ())) for k in lists}
    tables = ("left_out", "stand_in", "xz_preset", "figures")
    settings |= {k: dict(table.get(k, {})) for k in tables}
    settings |= {"needs": needs, "not_carried": not_carried, "gpu": gpu}
    presets = settings["xz_preset"].items()
    bad = {k: v for k, v in presets if type(v) is not int or not 0 <= v <= 9}
    if bad:
        raise ForkError(
            f"fork.toml [gpu_bundle] xz_preset gives {bad}",
            "give each component an LZMA2 preset, 0 (fastest) to 9",
        )
    if unknown := [n for n in settings["stock_cases"] if n not in needs]:
        raise ForkError(
            f"fork.toml [gpu_bundle] stock_cases names {unknown[0]}, no bundle case",
            "name cases of [gpu.cases] that the bundle carries",
        )
    sanitizer = table.get("sanitizer_case", "")
    if sanitizer and sanitizer not in needs:
        raise ForkError(
            f"fork.toml [gpu_bundle] sanitizer_case {sanitizer} is no bundle case",
            "name a case of [gpu.cases] that the bundle carries",
        )
    figures = settings["figures"]
    shapes = {"script": str, "helpers": list, "model": str, "needs": list}
    if figures and {k: type(v) for k, v in figures.items()} != shapes:
        raise ForkError(
            f"fork.toml [gpu_bundle] figures gives {sorted(figures)}",
            "give script and model (paths) and helpers and needs (lists), or no table",
        )
    host, mib = table["host"], float(table["part_mib"])
    return GpuBundle(host, mib, **settings, sanitizer_case=sanitizer)


def load_gpu_bundle(path: Path = PINS_FILE) -> GpuBundle:
    return _read(path, gpu_bundle_of)
