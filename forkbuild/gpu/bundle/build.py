"""`make gpu-bundle`: the GPU cases for an air-gapped GPU host, in parts it can take
(what each part holds, and why: docs/gpu-nightly.md, "On an air-gapped GPU host")."""

import contextlib
import hashlib
import io
import json
import lzma
import multiprocessing
import os
import shutil
import sys
import tarfile
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from forkbuild.core import fixcheck, log
from forkbuild.core.errors import ForkError, run_or_fail
from forkbuild.core.hashing import sha256_file
from forkbuild.core.pins import (
    REPO_ROOT,
    GpuBundle,
    Pins,
    build_dir,
    cache_dir,
    load_gpu_bundle,
)
from forkbuild.gpu import cuda_route
from forkbuild.gpu.bundle.runner import FILE_LIST
from forkbuild.setup import fetch, lock, uv
from forkbuild.setup.load_extensions import record_digest, wheel_record
from forkbuild.setup.tree import GENERATED, git, read_series, swap_into_place
from forkbuild.setup.wheel import dist_dir, patched_paths

FORMAT = "fork-gpu-bundle-3"
RUNNER_MODULES = (  # the runner's modules, standard library only, paths in forkbuild/
    "__init__",
    *(f"core/{m}" for m in ("__init__", "errors", "log", "hashing", "pins")),
    *(f"core/{m}" for m in ("pytest_runner", "pytest_progress", "fixcheck")),
    *(f"gpu/{m}" for m in ("__init__", "required", "bundle/__init__")),
    *(f"gpu/bundle/{m}" for m in ("standin", "stock_overlay", "proofs", "runner")),
)
TRACE = ["-p", "forkbuild.gpu.bundle.import_trace"]  # import_trace.py, a pytest plugin
# The roots a component unpacks into on the host: site/ goes first on PYTHONPATH, tree/
# is where pytest runs (the node ids are the tree's), models/ holds the tiny models,
# stock/ stock vLLM's fixcheck module (stock_overlay.py serves it to the stock runs).
SITE, TREE, MODELS, STOCK = "site", "tree", "models", "stock"
HINT_HOST = "make the file with `bash run.sh --inventory` on the host"
HINT_ROUTE = "rerun the CUDA route's install: rm -r build/cuda-route; make test"


@dataclass(frozen=True)
class Host:
    """A GPU host as `run.sh --inventory` describes it: Python X.Y, and its packages."""

    python: str
    glibc: str  # "2.39": which manylinux wheels it runs
    packages: dict[str, str | None]  # normalized name -> version (None: not given)
    source: Path

    @property
    def platform(self) -> str:  # uv's --python-platform: x86_64-manylinux_2_39
        return f"x86_64-manylinux_{self.glibc.replace('.', '_')}"


def read_host(path: Path) -> Host:
    """`# python:`, `# glibc:`, then `pip freeze` lines (a bare name: no version)."""
    if not path.is_file():
        raise ForkError(
            f"no host file {path}", f"{HINT_HOST}: make gpu-bundle GPU_HOST=FILE"
        )
    said, packages = {}, {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        key, colon, value = text.lstrip("#").partition(":")
        if text.startswith("#") and colon and key.strip() in ("python", "glibc"):
            with contextlib.suppress(InvalidVersion):
                version = Version(value.strip())
                said[key.strip()] = f"{version.major}.{version.minor}"
        elif text and not text.startswith(("#", "-e ")):
            try:  # name==version or a bare name: one == specifier at most
                pin = Requirement(text)
                pinned = [s.version for s in pin.specifier if s.operator == "=="]
                if pin.extras or pin.marker or len(pin.specifier) != len(pinned[:1]):
                    raise InvalidRequirement(text)
            except InvalidRequirement:
                cause = f"{path}:{number}: not a `pip freeze` line: {text!r}"
                raise ForkError(cause, HINT_HOST) from None
            packages[canonicalize_name(pin.name)] = pinned[0] if pinned else None
    if len(said) < 2:
        raise ForkError(
            f"{path} does not say the host's Python and C library "
            "(`# python: X.Y.Z` and `# glibc: X.Y` lines)",
            HINT_HOST,
        )
    return Host(said["python"], said["glibc"], packages, path)


def cuda_label(lock_pins: dict[str, str]) -> str:
    """The local version label of the lock's torch: CUDA 13.0 -> cu130."""
    version = Version(lock_pins["nvidia-cuda-runtime"])
    return f"cu{version.major}{version.minor}"


def check_host_torch(host: Host, lock_pins: dict[str, str]) -> None:
    """The host's torch and triton must be the lock's (and torch's CUDA build)."""
    label = cuda_label(lock_pins)
    for name in ("torch", "triton"):
        have, want = host.packages.get(name, "none"), lock_pins[name]
        public, _, local = (have or "").partition("+")
        if public != want or (local and local != label):
            raise ForkError(
                f"the host's {name} is {have or 'unknown'}; the bundle needs {want}"
                + (f" (+{label} or no label)" if name == "torch" else "")
                + ", the CUDA lock's, which the fork's CUDA wheel was built against",
                f"install {name}=={want} on the host, or run the nightly there instead",
            )


@dataclass(frozen=True)
class Trace:
    distributions: dict[str, dict]  # name -> {"version", "requires"}
    tree_files: tuple[str, ...]


def trace_imports(
    pins: Pins, settings: GpuBundle, route: tuple[Path, Path, Path], report: Path
) -> Trace:
    """The GPU cases collected in ROUTE (python, tree, stub) with import_trace.py."""
    python, tree, stub = route
    out = report.with_suffix(".json")
    env = {
        **os.environ,
        **cuda_route.stub_env(stub),
        "PYTHONPATH": os.pathsep.join([str(tree), str(REPO_ROOT)]),
        "FORKBUILD_TRACE_OUT": str(out),
        "FORKBUILD_TRACE_BLOCK": ",".join(settings.left_out.values()),
        "FORKBUILD_TRACE_IMPORT": ",".join(settings.engine_modules),
    }
    log.step(f"gpu bundle: tracing what the GPU cases import (report: {report})")
    run_or_fail(
        [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only"]
        + [*TRACE, *pins.gpu_tests, *pins.cuda_route_tests],
        "collecting the GPU tests to trace their imports failed",
        report=report,
        cwd=tree,
        env=env,
    )
    if not out.is_file():
        raise ForkError("the import trace wrote no report", f"see {report}")
    found = json.loads(out.read_text())
    if found["import_errors"]:
        raise ForkError(
            "modules the GPU cases import do not import in the CUDA venv: "
            + "; ".join(found["import_errors"]),
            "fix fork.toml [gpu_bundle] engine_modules or the install",
        )
    return Trace(found["distributions"], tuple(found["tree_files"]))


def _closure(roots: set[str], requires: dict[str, list[str]]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += requires.get(name, [])
    return seen


@dataclass(frozen=True)
class Selection:
    carried: dict[str, str]  # normalized name -> the lock's version
    from_host: dict[str, str | None]  # used as the host has them
    provided_by_host: tuple[str, ...]  # torch, triton, torch's NVIDIA packages
    left_out: tuple[str, ...]  # imported here, not needed (fork.toml)


def select(
    trace: Trace, host: Host, lock_pins: dict[str, str], settings: GpuBundle
) -> Selection:
    names = {canonicalize_name(n): n for n in trace.distributions}
    requires = {
        canonicalize_name(n): [canonicalize_name(r) for r in d["requires"]]
        for n, d in trace.distributions.items()
    }
    provided = {"torch", "triton"} | {
        n for n in _closure({"torch"}, requires) if n.startswith(("nvidia-", "cuda-"))
    }
    # The runner's own packages are carried whether or not the collection loaded them.
    roots = {canonicalize_name(n) for n in settings.harness}
    if missing := sorted(roots - lock_pins.keys()):
        raise ForkError(
            f"the CUDA lock does not pin the runner's {', '.join(missing)}",
            "add them to fork.toml [toolchain] test and run `make lock`",
        )
    harness = _closure(roots, requires)
    names.update({n: n for n in roots - names.keys()})
    carried, from_host = {}, {}
    for name in sorted(names.keys() - provided - {"vllm"}):
        if name not in lock_pins:
            raise ForkError(
                f"the GPU cases import {names[name]}, which the CUDA lock does not pin",
                "add it to the lock's inputs (fork.toml) or to [gpu_bundle] left_out",
            )
        have = host.packages.get(name, "absent")
        if name in harness or have not in (None, lock_pins[name]):
            carried[name] = lock_pins[name]
        else:
            from_host[name] = have
    by_host = tuple(sorted(provided & names.keys()))
    return Selection(carried, from_host, by_host, tuple(sorted(settings.left_out)))


@dataclass
class Component:
    """Files bound for one root on the host, in one archive."""

    name: str
    root: str  # SITE, TREE or MODELS
    files: dict[str, Path] = field(default_factory=dict)  # path in the root -> source
    digests: dict[str, str] = field(default_factory=dict)  # path -> sha256 (hex)

    def add(self, path: str, source: Path, digest: str | None = None) -> None:
        self.files[path] = source
        self.digests[path] = digest or sha256_file(source)

    def members(self) -> list[tuple[str, str, int, str]]:
        """(path, source, mode, sha256) of each file, in the archive's order."""
        return [
            (p, str(s), 0o755 if os.access(s, os.X_OK) else 0o644, self.digests[p])
            for p, s in sorted(self.files.items())
        ]

    def key(self, codec: "Codec") -> str:
        """What the archive's bytes depend on: names, contents, modes, the codec."""
        listing = [(path, digest, mode) for path, _, mode, digest in self.members()]
        text = json.dumps([FORMAT, codec.name, codec.filters, codec.chunk, listing])
        return hashlib.sha256(text.encode()).hexdigest()

    def raw_size(self) -> int:
        return sum(f.stat().st_size for f in self.files.values())


def _wheel_files(
    tree: Path, wheel: Path, loaded: set[str], patched: set[str]
) -> tuple[Component, list[Component], list[str]]:
    """The official wheel's files under vllm/ (the tree's where patched), each held to
    its RECORD: vLLM's Python, the extensions the cases load, the rest left out."""
    record = wheel_record(wheel)
    python, extensions, left = Component("vllm", SITE), [], []
    for path, digest in sorted(record.items()):
        if not path.startswith("vllm/") or path.endswith("/") or path in GENERATED:
            # vllm/_version.py: the build's own (the fork's version), added after
            continue
        source = tree / path
        if path in patched:
            python.add(path, source)
            continue
        data = source.read_bytes() if source.is_file() else None
        if data is None or record_digest(data) != digest:
            raise ForkError(
                f"{source} is not the official wheel's {path} (its RECORD differs)",
                HINT_ROUTE,
            )
        read = hashlib.sha256(data).hexdigest()  # not read from disk a second time
        if not (path.endswith(".so") or data.startswith(b"\x7fELF")):
            python.add(path, source, read)
        elif path in loaded:
            extensions.append(Component(path, SITE))
            extensions[-1].add(path, source, read)
        else:
            left.append(path)
    for path in sorted(p for p in patched - record.keys() if p.startswith("vllm/")):
        if (tree / path).is_file():  # a file the series adds
            python.add(path, tree / path)
    return python, extensions, left


def vllm_components(
    pins: Pins, tree: Path, wheel: Path, loaded: set[str], work: Path
) -> tuple[Component, list[Component], list[str]]:
    """vLLM's Python (patched, a .dist-info), its loaded extensions, the rest left."""
    patched = patched_paths(read_series())
    python, extensions, left = _wheel_files(tree, wheel, loaded, patched)
    version_file = tree / "vllm" / "_version.py"
    if pins.fork_version not in version_file.read_text():
        raise ForkError(f"{version_file} does not give {pins.fork_version}", HINT_ROUTE)
    python.add("vllm/_version.py", version_file)
    if missing := sorted(loaded - {e.name for e in extensions}):
        raise ForkError(
            f"the cases load {', '.join(missing)}, which the official wheel lacks"
        )
    # The version is what vLLM's platform detection reads (a "cpu" in it means CPU).
    info = work / "dist-info" / f"vllm-{pins.fork_version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {pins.fork_version}\n"
        f"Summary: vLLM {pins.upstream_version} with the fork's patches (forkbuild "
        "gpu-bundle)\n"
    )
    (info / "INSTALLER").write_text("forkbuild-gpu-bundle\n")
    for entry in sorted(info.iterdir()):
        python.add(f"{info.name}/{entry.name}", entry)
    module = tree / fixcheck.MODULE_PATH
    if (fixed := fixcheck.classify(module.read_text())) != "fixed":
        raise ForkError(f"{module} is {fixed}, not fixed", "make tree")
    return python, extensions, left


def tree_component(tree: Path, trace: Trace, pins: Pins, figures: dict) -> Component:
    """The tree's test files the collection loaded, and pyproject.toml (pytest's); the
    fork's offload benchmark (FIGURES: fork.toml's), run in the tree as the nightly
    runs it."""
    component = Component("tree", TREE)
    wanted = {f for f in trace.tree_files if f.startswith("tests/")}
    wanted |= {*pins.gpu_tests, *pins.cuda_route_tests}
    for path in sorted(wanted | {"pyproject.toml"}):
        if path.endswith(".py") or path == "pyproject.toml":
            component.add(path, tree / path)
    for path in [figures["script"], *figures["helpers"]] if figures else ():
        component.add(
            path, tree / path if (tree / path).is_file() else REPO_ROOT / path
        )
    return component


def stock_component(pins: Pins, tree: Path, work: Path) -> Component:
    """Stock vLLM's fixcheck module: the release's, as TREE's first commit (the pinned
    sdist, tag v<version>) holds it; it must read as buggy."""
    ref = f"v{pins.upstream_version}:{fixcheck.MODULE_PATH}"
    shown = git(["show", ref], tree)
    if shown.returncode != 0 or fixcheck.classify(shown.stdout) != "buggy":
        said = shown.stderr.strip() or f"reads as {fixcheck.classify(shown.stdout)}"
        raise ForkError(
            f"{tree}: {ref} is not stock's buggy module ({said})", HINT_ROUTE
        )
    target = work / STOCK / fixcheck.MODULE_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(shown.stdout)
    component = Component(STOCK, STOCK)
    component.add(fixcheck.MODULE_PATH, target)
    return component


def packages_component(
    pins: Pins, selection: Selection, host: Host, lock_file: Path, work: Path, omit
) -> tuple[Component, list[str]]:
    """The carried distributions, from the lock for the host, less what OMIT names."""
    target, requirements = work / "packages", work / "packages.txt"
    requirements.write_text(lock.entries(lock_file, set(selection.carried)))
    uv.install(
        pins,
        ["install", "--target", str(target), "--no-deps", "--require-hashes"]
        + ["--python-version", host.python, "--python-platform", host.platform]
        + ["--only-binary", ":all:", "--quiet", "-r", str(requirements)],
        what=f"the {len(selection.carried)} packages the bundle carries",
    )
    component, omitted = Component("packages", SITE), []
    for source in sorted(p for p in target.rglob("*") if p.is_file() or p.is_symlink()):
        path = source.relative_to(target).as_posix()
        if "__pycache__" in path.split("/"):
            continue
        if source.is_symlink():
            raise ForkError(
                f"{path} of the carried packages is a symbolic link",
                "the bundle carries regular files only",
            )
        if path in omit:
            omitted.append(path)
        else:
            component.add(path, source)
    if unused := set(omit) - set(omitted):
        raise ForkError(
            "fork.toml [gpu_bundle] omit names files no carried package has: "
            f"{', '.join(sorted(unused))}",
            "remove them from the list",
        )
    return component, omitted


def models_component(python: Path, tree: Path, stub: Path, work: Path) -> Component:
    """Every engine case's tiny GPT-OSS, generated by the tests' own helper."""
    folder = work / "models"
    run_or_fail(
        [str(python), "-m", "tests.v1.worker.offload_e2e_configs", str(folder)],
        "generating the tiny models failed",
        cwd=tree,
        env={**os.environ, **cuda_route.stub_env(stub), "PYTHONPATH": str(tree)},
    )
    component = Component(MODELS, MODELS)
    for source in sorted(p for p in folder.rglob("*") if p.is_file()):
        component.add(source.relative_to(folder).as_posix(), source)
    return component


@dataclass(frozen=True)
class Codec:
    """NAME: the manifest's codec ("xz", or "tar": plain); the tar in streams of CHUNK
    bytes, each compressed with FILTERS on WORKERS processes and concatenated (lzma,
    tarfile "r:*", reads them as one). PRESETS: components whose last filter (LZMA2)
    takes another preset (fork.toml [gpu_bundle] xz_preset)."""

    name: str
    filters: tuple[dict, ...] = ()
    chunk: int = 32 << 20
    workers: int = os.cpu_count() or 1
    presets: tuple[tuple[str, int], ...] = ()

    @property
    def suffix(self) -> str:
        return ".tar.xz" if self.filters else ".tar"

    def of(self, component: str) -> "Codec":
        """The codec COMPONENT's archive is written with."""
        preset = dict(self.presets).get(component)
        filters = self.filters
        if preset is not None:
            filters = (*filters[:-1], {**filters[-1], "preset": preset})
        return replace(self, filters=filters, presets=())


# The x86 filter before LZMA2 preset 6: the extensions, most of the bytes, come out
# smaller with it at no cost in time. Part 1 is nearly full and keeps preset 6; the
# other parts' components take fork.toml's faster presets (docs/setup-and-locks.md,
# "Cold CI"; benchmarks/bundle_compression.py).
XZ = Codec("xz", ({"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 6}))
PLAIN = Codec("tar")  # what no transfer carries: the simulated host's bundle


def transfer_codec(settings: GpuBundle) -> Codec:
    """XZ with fork.toml [gpu_bundle] xz_preset: what `make gpu-bundle` writes."""
    return replace(XZ, presets=tuple(sorted(settings.xz_preset.items())))


def write_tar(files: list[tuple[str, str, int, str]], out: Path) -> None:
    """A deterministic tar of FILES (path, source, mode, sha256), first FILE_LIST, as
    `sha256sum` writes: the manifest vouches for the archive, the list for each file."""
    listing = "".join(f"{digest}  {path}\n" for path, _, _, digest in files).encode()
    with tarfile.open(out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo(FILE_LIST)
        info.size, info.mode, info.mtime = len(listing), 0o644, 0
        tar.addfile(info, io.BytesIO(listing))
        for path, source, mode, _ in files:
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = os.path.getsize(source), mode, 0
            with open(source, "rb") as handle:
                tar.addfile(info, handle)


def _xz_stream(tar: str, offset: int, size: int, filters: tuple[dict, ...]) -> bytes:
    with open(tar, "rb") as handle:
        handle.seek(offset)
        data = handle.read(size)
    return lzma.compress(data, lzma.FORMAT_XZ, filters=filters)


def _progress(total: int):
    """Bytes done, on stderr (every 30 s where it is a log, not a terminal)."""
    # Imported here: `make lock` runs on the previous tool lock, maybe without it.
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    shown = dict(desc="gpu bundle: xz", mininterval=0.5 if tty else 30, ascii=not tty)
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, **shown)


def _xz_all(tars: dict[str, Path], codec: Codec, outs: dict[str, Path]) -> None:
    """Each of TARS into OUTS (name -> path), in CODEC.chunk streams on every worker,
    each with its component's filters (Codec.of)."""
    jobs = [
        (name, offset, min(codec.chunk, tar.stat().st_size - offset))
        for name, tar in tars.items()
        for offset in range(0, max(tar.stat().st_size, 1), codec.chunk)
    ]
    streams: dict[str, dict[int, bytes]] = {name: {} for name in tars}
    # Spawned: forked from a process with threads (check.py's), a worker could inherit
    # a lock held in another thread (stdout's, flushed at exit) and hang.
    spawn = multiprocessing.get_context("spawn")
    with (
        _progress(sum(size for _, _, size in jobs)) as bar,
        ProcessPoolExecutor(max_workers=codec.workers, mp_context=spawn) as pool,
    ):
        futures = {
            pool.submit(_xz_stream, str(tars[n]), o, s, codec.of(n).filters): (n, o, s)
            for n, o, s in jobs
        }
        for future in as_completed(futures):
            name, offset, size = futures[future]
            streams[name][offset] = future.result()
            bar.update(size)
            if len(streams[name]) == sum(1 for n, _, _ in jobs if n == name):
                with open(outs[name], "wb") as out:
                    out.writelines(b for _, b in sorted(streams.pop(name).items()))
                mib = outs[name].stat().st_size / 2**20
                log.step(f"gpu bundle: {name}: {mib:.1f} MiB compressed")


def compress(
    components: list[Component], codec: Codec = XZ, store: Path | None = None
) -> dict[str, Path]:
    """Each component's archive in STORE (default: the cache, reused by content)."""
    store = store or cache_dir() / "gpu-bundle"
    store.mkdir(parents=True, exist_ok=True)
    keys = {c.name: c.key(codec.of(c.name)) for c in components}
    archives = {n: store / f"{key}{codec.suffix}" for n, key in keys.items()}
    # A cached archive is reused only as it was written (its .sha256 file says so).
    sums = {n: Path(f"{a}.sha256") for n, a in archives.items()}
    kept = {n for n, a in archives.items() if a.is_file() and sums[n].is_file()}
    kept = {n for n in kept if sums[n].read_text().strip() == sha256_file(archives[n])}
    todo = [c for c in components if c.name not in kept]
    if not todo:
        return archives
    log.step(
        f"gpu bundle: {len(todo)} component(s), "
        f"{sum(c.raw_size() for c in todo) / 2**20:.0f} MiB, as {codec.name} "
        f"({', '.join(c.name for c in todo)}) in {store}"
    )
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=store) as tmp:
        tars = {c.name: Path(tmp) / f"{keys[c.name]}.tar" for c in todo}
        for c in todo:
            write_tar(c.members(), tars[c.name])
        outs = {n: Path(f"{t}.xz") for n, t in tars.items()} if codec.filters else tars
        if codec.filters:
            _xz_all(tars, codec, outs)
        for c in todo:
            sums[c.name].write_text(sha256_file(outs[c.name]) + "\n")
            os.replace(outs[c.name], archives[c.name])
    return archives


@dataclass(frozen=True)
class Part:
    name: str
    components: tuple[str, ...]
    size: int  # bytes, the runner's files included in part 1


def pack(
    sizes: dict[str, int], order: list[str], limit: int, first_extra: int
) -> list[Part]:
    """Components, in ORDER, into the first part of at most LIMIT bytes with room (part
    1 also holds FIRST_EXTRA bytes: the runner and manifest)."""
    filled: list[list[str]] = []
    used: list[int] = []  # bytes, per part
    for name in order:
        size = sizes[name]
        room = [i for i, u in enumerate(used) if u + size <= limit]
        if room:
            filled[room[0]].append(name)
            used[room[0]] += size
            continue
        start = 0 if filled else first_extra
        if start + size > limit:
            raise ForkError(
                f"{name} is {size / 2**20:.1f} MiB compressed, more than a part of "
                f"{limit / 2**20:.0f} MiB can hold",
                "raise PART_MIB, give it a higher fork.toml [gpu_bundle] xz_preset, "
                "or omit files of it ([gpu_bundle] omit)",
            )
        filled.append([name])
        used.append(start + size)
    return [
        Part(f"part-{i + 1}", tuple(names), size)
        for i, (names, size) in enumerate(zip(filled, used))
    ]


def cases_by_part(
    parts: list[Part], base: list[str], needs: dict[str, list[str]]
) -> dict[str, list[str]]:
    """Part name -> the node ids whose needs the parts up to it first meet."""
    have, met, added = set(), set(), {}
    for part in parts:
        have |= set(part.components)
        now = {n for n, need in needs.items() if set(base) | set(need) <= have}
        added[part.name] = sorted(now - met)
        met = now
    return added


@dataclass(frozen=True)
class Bundle:
    folder: Path
    parts: list[Part]
    cases: dict[str, list[str]]
    manifest: dict

    def line(self) -> str:
        cases = {k: [n.split("::", 1)[-1] for n in v] for k, v in self.cases.items()}
        return "; ".join(
            f"{p.name} {p.size / 2**20:.1f} MiB "
            f"({', '.join(c.rsplit('/', 1)[-1] for c in p.components)})"
            f": {', '.join(cases[p.name]) or 'no case yet'}"
            for p in self.parts
        )


@dataclass(frozen=True)
class Source:
    """What every bundle is made from: the CUDA route, the trace there, the settings."""

    python: Path
    tree: Path
    stub: Path  # the folder of the driver stub
    trace: Trace
    settings: GpuBundle


def prepare(pins: Pins, results: Path, route: tuple[Path, ...] | None = None) -> Source:
    """The CUDA route (ROUTE, else made in build/cuda-route) and the trace there."""
    if route is None:
        python, tree = cuda_route.install_cuda_route(pins, results)
        route = (python, tree, cuda_route.build_driver_stub(python, tree))
    settings = load_gpu_bundle()
    trace = trace_imports(pins, settings, route, results / "gpu-bundle-trace.log")
    return Source(*route, trace, settings)


@dataclass
class Made:
    """A bundle for a host: its components and what was left out."""

    pins: Pins
    settings: GpuBundle
    host: Host
    lock_pins: dict[str, str]
    selection: Selection
    components: list[Component]
    left: list[str] = field(default_factory=list)  # the wheel's compiled files
    omitted: list[str] = field(default_factory=list)  # fork.toml [gpu_bundle] omit


def components(pins: Pins, source: Source, host_file: Path, work: Path) -> Made:
    """The components for HOST_FILE (its torch and triton checked), gathered in WORK."""
    host = read_host(host_file)
    lock_file = lock.path("cuda", host.python)
    if not lock_file.is_file():
        raise ForkError(
            f"the host's Python is {host.python}, which the fork does not lock",
            f"the fork supports Python {', '.join(pins.pythons)}",
        )
    lock_pins = lock.pinned(lock_file)
    check_host_torch(host, lock_pins)
    selection = select(source.trace, host, lock_pins, source.settings)
    wheel = fetch.artifacts_dir() / pins.routes["cuda"].wheel.filename
    files = source.trace.tree_files
    loaded = {f for f in files if f.startswith("vllm/") and f.endswith(".so")}
    log.step(
        f"gpu bundle: for {host.source.name} (Python {host.python}): "
        f"{len(selection.carried)} packages carried, {len(selection.from_host)} the "
        f"host's, {', '.join(selection.provided_by_host)} the host's by rule; "
        f"extensions the cases load: {', '.join(sorted(loaded))}"
    )
    python, extensions, left = vllm_components(pins, source.tree, wheel, loaded, work)
    packages, omitted = packages_component(
        pins, selection, host, lock_file, work, source.settings.omit
    )
    tiny = models_component(source.python, source.tree, source.stub, work)
    tree = tree_component(source.tree, source.trace, pins, source.settings.figures)
    stock = stock_component(pins, source.tree, work)
    parts = [tree, stock, python, packages, *extensions, tiny]
    return Made(pins, source.settings, host, lock_pins, selection, parts, left, omitted)


def build(
    pins: Pins,
    host_file: Path | None = None,
    out: Path | None = None,
    part_mib: float | None = None,
    source: Source | None = None,
    codec: Codec | None = None,
) -> Bundle:
    """The bundle for HOST_FILE (default: fork.toml's) in OUT (dist/gpu-bundle), with
    CODEC (default: transfer_codec's)."""
    results = build_dir() / "test-results"
    results.mkdir(parents=True, exist_ok=True)
    source = source or prepare(pins, results)
    settings = source.settings
    codec = codec or transfer_codec(settings)
    mib = part_mib or float(os.environ.get("PART_MIB") or settings.part_mib)
    out = out or dist_dir() / "gpu-bundle"
    with tempfile.TemporaryDirectory(prefix=".gpu-bundle-", dir=build_dir()) as tmp:
        work = Path(tmp)
        made = components(pins, source, host_file or REPO_ROOT / settings.host, work)
        # A plain tar is quick to write again: only the xz archives are cached.
        archives = compress(made.components, codec, None if codec.filters else work)
        return assemble(made, archives, codec, int(mib * 2**20), out)


def runner_files() -> dict[str, Path]:
    """Part 1's loose files: run.sh and the runner's modules (path in the bundle)."""
    code = REPO_ROOT / "forkbuild"
    runner = {f"runner/forkbuild/{m}.py": code / f"{m}.py" for m in RUNNER_MODULES}
    return {"run.sh": code / "gpu" / "bundle" / "run.sh", **runner}


def _order(settings: GpuBundle, names: set[str]) -> list[str]:
    """The components in fork.toml's order; every name the settings use, one of them."""
    order = [name for name in settings.order if name in names]
    if unordered := sorted(names - set(order)):
        raise ForkError(
            f"fork.toml [gpu_bundle] order does not place {', '.join(unordered)}",
            "add them to the order list",
        )
    used = [settings.every_case, settings.stand_in, settings.xz_preset]
    used += [*settings.needs.values(), settings.figures.get("needs", ())]
    if unknown := sorted({c for need in used for c in need} - names):
        raise ForkError(
            "fork.toml [gpu_bundle] needs names what the bundle does not hold: "
            f"{', '.join(unknown)}",
            "name components: " + ", ".join(order),
        )
    return order


def manifest(made: Made, entries: dict[str, dict], parts: list[Part]) -> dict:
    """manifest.json: what the runner checks and runs (ENTRIES: the components')."""
    host, lock_pins, settings = made.host, made.lock_pins, made.settings
    cases = cases_by_part(parts, list(settings.every_case), settings.needs)
    return {
        "format": FORMAT,
        "fork_version": made.pins.fork_version,
        "made_for": host.source.name,
        "python": host.python,
        "glibc": host.glibc,
        "torch": lock_pins["torch"],
        "triton": lock_pins["triton"],
        "cuda_label": cuda_label(lock_pins),
        "fix": {"module": fixcheck.MODULE_PATH, "function": fixcheck.FUNCTION},
        "parts": [
            {"name": p.name, "components": list(p.components), "adds": cases[p.name]}
            for p in parts
        ],
        "components": entries,
        "every_case": list(settings.every_case),
        "stand_in": dict(settings.stand_in),
        "needs": {node: list(need) for node, need in settings.needs.items()},
        "not_carried": dict(settings.not_carried),
        "stock": {"cases": list(settings.stock_cases), "component": STOCK},
        "sanitizer_case": settings.sanitizer_case,
        "figures": dict(settings.figures),
        "gpu": settings.gpu,  # the nightly's table (forkbuild/gpu/required.py)
        **asdict(made.selection),
        "compiled_left_out": made.left,
        "omitted": made.omitted,
    }


def assemble(
    made: Made, archives: dict[str, Path], codec: Codec, limit: int, out: Path
) -> Bundle:
    """The bundle in OUT (written beside it, then renamed), parts of at most LIMIT."""
    order = _order(made.settings, {c.name for c in made.components})
    runner = runner_files()
    sizes = {name: archives[name].stat().st_size for name in order}
    extra = sum(p.stat().st_size for p in runner.values()) + (64 << 10)  # the manifest
    parts = pack(sizes, order, limit, extra)
    where = {name: part.name for part in parts for name in part.components}
    entries = {
        c.name: {
            "archive": f"{where[c.name]}/{c.name.rsplit('/', 1)[-1]}{codec.suffix}",
            "root": c.root,
            "sha256": sha256_file(archives[c.name]),
            "codec": codec.name,
            "bytes": sizes[c.name],
            "files": len(c.files),
        }
        for c in made.components
    }
    content = manifest(made, entries, parts)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        measured = _write_bundle(partial, archives, content, parts, limit)
        out.parent.mkdir(parents=True, exist_ok=True)
        swap_into_place(partial, out)  # OUT is the old bundle or the new one
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    cases = {p["name"]: p["adds"] for p in content["parts"]}
    bundle = Bundle(out, measured, cases, content)
    log.step(f"gpu bundle: {out}: {bundle.line()}")
    return bundle


def _write_bundle(
    partial: Path, archives: dict[str, Path], manifest: dict, parts: list[Part], limit
) -> list[Part]:
    """The bundle's files in PARTIAL; the PARTS as they measure (at most LIMIT)."""
    runner = runner_files()
    for path, source in runner.items():
        (partial / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, partial / path)
    for name, entry in manifest["components"].items():
        target = partial / entry["archive"]
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(archives[name], target)
        except OSError:
            shutil.copyfile(archives[name], target)
    (partial / "manifest.json").write_text(
        json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    )
    # What run.sh checks with sha256sum before it starts the runner (the manifest then
    # vouches for every archive and file).
    loose = [*runner, "manifest.json"]
    (partial / "SHA256SUMS").write_text(
        "".join(f"{sha256_file(partial / p)}  {p}\n" for p in loose)
    )
    loose.append("SHA256SUMS")
    measured = []
    for part in parts:
        files = [*(partial / part.name).iterdir()]
        if part.name == "part-1":
            files += [partial / path for path in loose]
        total = sum(f.stat().st_size for f in files)
        measured.append(Part(part.name, part.components, total))
        if total > limit:
            raise ForkError(
                f"{part.name} is {total / 2**20:.1f} MiB, over {limit / 2**20:.0f} MiB",
                "raise PART_MIB, or omit files (fork.toml [gpu_bundle] omit)",
            )
    return measured
