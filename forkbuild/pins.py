"""Read fork.toml, the fork's single pinned source of truth."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from forkbuild.errors import ForkError

REPO_ROOT = Path(__file__).resolve().parent.parent
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


@dataclass(frozen=True)
class Pins:
    label: str
    upstream_version: str
    python: str
    machines: tuple[str, ...]
    artifacts: dict[str, Artifact]
    torch: str
    torch_sha256: dict[str, str]
    build: tuple[str, ...]
    test: tuple[str, ...]
    routes: dict[str, Route]
    regression_tests: tuple[str, ...]
    suite: tuple[str, ...]
    gpu_tests: tuple[str, ...]

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
        raise ForkError(f"{path} is missing", "run forkbuild from a clone of the fork") from None
    except tomllib.TOMLDecodeError as exc:
        raise ForkError(f"{path} is not valid TOML: {exc}", "fix the file") from None
    try:
        artifacts = {
            key: Artifact(key, a["requirement"], a["filename"], a["sha256"].lower())
            for key, a in raw["artifacts"].items()
        }
        routes = {
            name: Route(
                name,
                artifacts[r["wheel"]],
                r["requirements"],
                tuple(r["extra"]),
                r["target_device"],
            )
            for name, r in raw["routes"].items()
        }
        tc = raw["toolchain"]
        return Pins(
            label=raw["fork"]["label"],
            upstream_version=raw["upstream"]["version"],
            python=raw["upstream"]["python"],
            machines=tuple(raw["upstream"]["machines"]),
            artifacts=artifacts,
            torch=tc["torch"],
            torch_sha256={k: v.lower() for k, v in tc["torch-sha256"].items()},
            build=tuple(tc["build"]),
            test=tuple(tc["test"]),
            routes=routes,
            regression_tests=tuple(raw["tests"]["regression"]),
            suite=tuple(raw["tests"]["suite"]),
            gpu_tests=tuple(raw["tests"]["gpu"]),
        )
    except KeyError as exc:
        raise ForkError(f"{path} lacks the key {exc}", "compare it with the fork's main branch") from None


def cache_dir() -> Path:
    """Downloads live outside the clone so that a fresh clone on the same machine reuses them."""
    base = os.environ.get("VLLM_FORK_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    ) / "vllm-fork"
    return Path(base)


def build_dir() -> Path:
    return Path(os.environ.get("VLLM_FORK_BUILD") or REPO_ROOT / "build")
