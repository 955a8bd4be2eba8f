"""The GPU bundle's runner, on the GPU host's own `python3`: the standard library and
the fork modules beside it (run.sh checks them and sets PYTHONPATH), no network:

    python3 -m forkbuild.gpu.bundle.runner inventory            this host, as host file
    python3 -m forkbuild.gpu.bundle.runner install BUNDLE DEST  unpack, verify the parts
    python3 -m forkbuild.gpu.bundle.runner run BUNDLE OUT       check, install, run

What `run` refuses, runs and writes to OUT: docs/gpu-nightly.md, "run.sh OUT".
"""

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from forkbuild.core import fixcheck, log, pytest_runner
from forkbuild.core.errors import ForkError
from forkbuild.core.hashing import sha256_file
from forkbuild.core.pins import GpuKind, gpu_table
from forkbuild.gpu import required as gpu_required
from forkbuild.gpu.bundle import proofs
from forkbuild.gpu.bundle import standin as bundle_standin

MANIFEST = "manifest.json"
MODULE = "forkbuild.gpu.bundle.runner"
FILE_LIST = "FILES.sha256"  # every archive's first member (build.py's write_tar)
RUNNER = str(Path(__file__).resolve().parents[3])  # where these modules are
# A kernel case takes seconds, an engine case two tiny engines (docs/gpu-nightly.md).
CASE_LIMIT_S = 240
RUN_LIMIT_S = 12 * 60
# The proofs after the cases, each bounded (the run's estimate: docs/gpu-nightly.md,
# "What the first run proves"): stock's two kernel cases, FA3 under memcheck, the two
# engines of the offload benchmark.
STOCK_LIMIT_S = 90
SANITIZER_LIMIT_S = 120
FIGURES_LIMIT_S = 90
# The whole run's (the 8 minutes): each step runs at most its limit or the time
# left, a proof with none left is "not run: out of time".
DEADLINE_ENV, DEADLINE_S = "FORK_BUNDLE_DEADLINE_S", 480
# No hub, no telemetry; pytest loads only the runner's plugins (not the host's
# pytest-cov, xdist, ...), and vLLM's conftest does not reach for its GPU-memory helper
# (tests/utils.py, not carried).
OFFLINE = dict.fromkeys(("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DO_NOT_TRACK"), "1")
OFFLINE |= dict.fromkeys(("VLLM_NO_USAGE_STATS", "PIP_NO_INDEX"), "1")
OFFLINE |= {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "VLLM_TEST_CLEAN_GPU_MEMORY": "0"}
PLUGINS = ["-p", "pytest_forked", "-p", "pytest_timeout"]
SMI = ["nvidia-smi", f"--query-gpu={gpu_required.NVIDIA_SMI_QUERY}", "--format=csv"]
REMAKE = (
    "make a bundle for this host: `bash run.sh --inventory > host.txt`, then "
    "`make gpu-bundle GPU_HOST=host.txt` on the build machine"
)


def home(bundle: Path) -> Path:
    """FORK_BUNDLE_HOME, else /tmp; a folder named by the manifest (reused warm)."""
    base = os.environ.get("FORK_BUNDLE_HOME") or "/tmp/vllm-fork-gpu-bundle"
    return Path(base).resolve() / sha256_file(bundle / MANIFEST)[:16]


def read_manifest(bundle: Path) -> dict:
    try:
        return json.loads((bundle / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ForkError(
            f"{bundle / MANIFEST} cannot be read ({exc})",
            "transfer part 1 (run.sh, manifest.json, runner/, part-1/) again",
        ) from None


def query_gpus() -> str:
    """nvidia-smi's GPU table, or ForkError when this host has no usable NVIDIA GPU."""
    try:
        done = subprocess.run(SMI, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ForkError(
            f"no NVIDIA GPU on this host (nvidia-smi: {exc})",
            "run the bundle on a GPU host; `bash run.sh --inventory` describes one",
        ) from None
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or len(lines) < 2:
        said = (done.stderr or done.stdout).strip().splitlines() or ["no GPU listed"]
        raise ForkError(
            f"no NVIDIA GPU on this host (nvidia-smi: {said[-1]})",
            "run the bundle on a GPU host with its driver loaded",
        )
    return done.stdout


def check_host(manifest: dict) -> None:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here != manifest["python"]:
        raise ForkError(
            f"this python3 is {platform.python_version()}; the bundle was made for "
            f"Python {manifest['python']}",
            f"run it with that Python (PYTHON=... bash run.sh), or {REMAKE}",
        )
    libc, version = platform.libc_ver()
    if libc != "glibc" or _numbers(version) < _numbers(manifest["glibc"]):
        raise ForkError(
            f"this host's C library is {libc or 'unknown'} {version}; the bundle's "
            f"packages need glibc {manifest['glibc']} or newer",
            REMAKE,
        )
    for name in ("torch", "triton"):
        try:  # this interpreter's own environment: the bundle is not on its path
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        want = manifest[name]
        public, _, local = (have or "").partition("+")
        other_build = name == "torch" and local not in ("", manifest["cuda_label"])
        if public != want or other_build:
            raise ForkError(
                f"this host's {name} is {have or 'not installed'}; the bundle needs "
                f"{want} (the fork's CUDA lock)",
                f"install {name}=={want} in this python3, or use a host that has it",
            )


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def _output(*command: str) -> str:
    return subprocess.run(command, capture_output=True, text=True).stdout.strip()


def inventory() -> str:
    """A host file for `make gpu-bundle GPU_HOST=FILE`: Python, torch, GPUs, driver,
    toolkit as comments, then this python3's distributions as `pip freeze` does."""
    lines = [
        f"# python: {platform.python_version()}",
        f"# executable: {sys.executable}",
        f"# glibc: {'.'.join(platform.libc_ver()[1].split('.')[:2])}",
    ]
    try:
        import torch

        lines.append(
            f"# torch: {torch.__version__} (CUDA {torch.version.cuda}), "
            f"sees {torch.cuda.device_count()} GPU(s)"
        )
    except Exception as exc:  # an inventory reports, it does not fail
        lines.append(f"# torch: does not import ({type(exc).__name__}: {exc})")
    try:
        gpus = query_gpus().strip().splitlines()
        lines += [f"# gpu: {row}" for row in gpus]
        query = ("--query-gpu=driver_version", "--format=csv,noheader")
        driver = _output("nvidia-smi", *query)
        lines.append(f"# driver: {driver.split()[0] if driver else 'unknown'}")
    except ForkError as exc:
        lines.append(f"# gpu: none ({exc.cause})")
    nvcc = shutil.which("nvcc")
    release = (_output(nvcc, "--version").splitlines() or ["unknown"]) if nvcc else []
    lines.append(f"# nvcc: {nvcc}: {release[-1]}" if nvcc else "# nvcc: not on PATH")
    dists = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}
    lines += [f"{n}=={dists[n]}" for n in sorted(filter(None, dists), key=str.lower)]
    return "\n".join(lines) + "\n"


def present(manifest: dict, bundle: Path) -> list[str]:
    """The components whose part has arrived, every archive checked by sha256. Part 1
    must be whole; a later part's folder that is there must hold good archives."""
    components = []
    for part in manifest["parts"]:
        folder = bundle / part["name"]
        if not folder.is_dir():
            if part["name"] == "part-1":
                raise ForkError(f"{folder} is missing", "transfer part 1 again")
            continue
        for name in part["components"]:
            entry = manifest["components"][name]
            archive = bundle / entry["archive"]
            if not archive.is_file():
                raise ForkError(
                    f"{archive} is missing from {part['name']}",
                    f"transfer {part['name']} again (all of {folder.name}/)",
                )
            if sha256_file(archive) != entry["sha256"]:
                raise ForkError(
                    f"{archive} is damaged (its sha256 is not the manifest's)",
                    f"transfer {part['name']} again",
                )
            components.append(name)
    return components


def _extract(archive: Path, root: Path, listing: Path) -> None:
    """ARCHIVE into ROOT (plain files, inside ROOT only); its file list to LISTING."""
    with tarfile.open(archive, "r:*") as tar:  # xz (in streams) or plain: the codec
        for number, member in enumerate(tar):
            if number == 0:
                if member.name != FILE_LIST or not member.isfile():
                    raise ForkError(
                        f"{archive.name} does not start with its file list",
                        "rebuild the bundle: make gpu-bundle",
                    )
                listing.write_bytes(tar.extractfile(member).read())
                continue
            target = (root / member.name).resolve()
            if not member.isfile() or not target.is_relative_to(root.resolve()):
                raise ForkError(
                    f"{archive.name} holds {member.name!r}, which is not a plain file "
                    "inside the bundle",
                    "rebuild the bundle: make gpu-bundle",
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            target.chmod(member.mode & 0o755 | 0o644)


def install(manifest: dict, bundle: Path, dest: Path, components: list[str]) -> None:
    """COMPONENTS unpacked into DEST (once: stamped), each file checked by its list."""
    stamps = dest / ".unpacked"
    stamps.mkdir(parents=True, exist_ok=True)
    for name in components:
        entry = manifest["components"][name]
        stamp, listing = stamps / entry["sha256"], stamps / f"{entry['sha256']}.sha256"
        root = dest / entry["root"]
        if not (stamp.exists() and listing.exists()):
            mib = entry["bytes"] / 2**20
            log.step(f"bundle: unpacking {entry['archive']} ({mib:.1f} MiB)")
            _extract(bundle / entry["archive"], root, listing)
        lines = (line.partition("  ") for line in listing.read_text().splitlines())
        files = {path: digest for digest, _, path in lines}  # `sha256sum` lines
        bad = [
            path
            for path, digest in files.items()
            if not (root / path).is_file() or sha256_file(root / path) != digest
        ]
        if bad or len(files) != entry["files"]:
            stamp.unlink(missing_ok=True)
            raise ForkError(
                f"{len(bad) or 'some'} file(s) of {name} in {dest} are not as its "
                f"archive lists them, e.g. {(bad or ['the list'])[0]}",
                f"remove {dest} and run again",
            )
        stamp.write_text(name + "\n")
    log.step(f"bundle: {len(components)} component(s) in {dest}, every file verified")


def stand_ins(manifest: dict, components: list[str]) -> list[str]:
    """The modules of [gpu_bundle] stand_in whose component has not arrived."""
    table = manifest.get("stand_in", {})
    return sorted(table[c] for c in table if c not in components)


def case_args(
    nodes: list[str], standing_in: list[str] = (), stock: bool = False, forked=True
) -> list[str]:
    """pytest's arguments for NODES: forked, each under CASE_LIMIT_S (pytest-timeout in
    the forked child, as the nightly runs it), with the stand-ins' plugin if any, and
    where STOCK the overlay's (stock_overlay.py: case_env's STOCK says which module)."""
    limit = [
        f"--timeout={CASE_LIMIT_S}" if a.startswith("--timeout=") else a
        for a in gpu_required.PER_CASE_TIMEOUT
    ]
    standin = ["-p", bundle_standin.__name__] if standing_in else []
    overlay = ["-p", proofs.OVERLAY] if stock else []
    fork = ["--forked"] if forked else []
    return [*PLUGINS, *standin, *overlay, *fork, "-v", "-rs", *limit, *nodes]


def case_env(
    dest: Path, standing_in: list[str] = (), stock: Path | None = None, report=None
) -> dict[str, str]:
    """The cases' environment; STOCK: stock's module file for the overlay, REPORT:
    where the overlay records what loaded and ran."""
    # Always set: a value inherited from the caller never stands in for what arrived.
    return {
        **OFFLINE,
        "VLLM_OFFLOAD_E2E_MODELS": str(dest / "models"),
        bundle_standin.ENV: ",".join(standing_in),
        proofs.ENV: str(stock or ""),
        proofs.REPORT_ENV: str(report or ""),
    }


def stock_file(manifest: dict, dest: Path) -> Path:
    """Where stock's fixcheck module unpacks (the manifest's stock component)."""
    root = manifest["components"][manifest["stock"]["component"]]["root"]
    return dest / root / fixcheck.MODULE_PATH


def pythonpath(dest: Path, runner: bool = False) -> str:
    """The tree, the bundle's site, and where RUNNER the runner's (the stand-ins')."""
    paths = [str(dest / "tree"), str(dest / "site"), *([RUNNER] if runner else [])]
    return os.pathsep.join(paths)


def probe(platform_too: bool, version: str, dest: Path) -> dict:
    """`probe`: what is wrong with `import vllm` from DEST, the bundle first and the
    stand-ins in (the modules stood in for: the runner's, it checks)."""
    standing_in = bundle_standin.install(bundle_standin.from_env())
    import vllm

    name = fixcheck.MODULE_PATH[:-3].replace("/", ".")
    verdict = fixcheck.classify(Path(importlib.util.find_spec(name).origin).read_text())
    problems = []
    if not Path(vllm.__file__).resolve().is_relative_to((dest / "site").resolve()):
        problems.append(f"`import vllm` gives {vllm.__file__}, not the bundle's")
    if (have := importlib.metadata.version("vllm")) != version:
        problems.append(f"vLLM's version is {have}")
    if verdict != "fixed":
        problems.append(f"{fixcheck.FUNCTION} is {verdict}")
    if platform_too:  # resolving the CUDA platform loads the cache ops' extension
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            picked = type(current_platform).__name__
            problems.append(f"vLLM picks {picked}, not its CUDA platform")
    return {"problems": problems, "stand_ins": standing_in}


def check_vllm(
    manifest: dict, dest: Path, components: list[str], standing_in: list[str] = ()
) -> None:
    platform_too = set(manifest["every_case"]) <= set(components)
    report = dest / "probe.json"  # a file: vLLM logs to stdout
    report.unlink(missing_ok=True)
    argv = [sys.executable, "-m", MODULE, "probe", str(int(platform_too))]
    argv += [manifest["fork_version"], str(dest)]
    env = {**os.environ, **case_env(dest, standing_in)}
    env["PYTHONPATH"] = pythonpath(dest, runner=True)
    done = subprocess.run(
        argv, env=env, cwd=dest / "tree", capture_output=True, text=True
    )
    if done.returncode != 0 or not report.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ForkError(
            f"the bundle's vLLM does not import: {last}",
            f"a package is missing from the bundle or the host's differs: {REMAKE}",
        )
    found = json.loads(report.read_text())
    problems = found["problems"]
    if sorted(found["stand_ins"]) != sorted(standing_in):
        problems.append(
            f"the probe stood in for {found['stand_ins'] or 'nothing'}, the runner for "
            f"{list(standing_in) or 'nothing'}"
        )
    if problems:
        raise ForkError(
            "; ".join(problems),
            "remove other vLLM installs from PYTHONPATH, or rebuild the bundle",
        )


def plan(
    manifest: dict, required: tuple[str, ...], components: list[str]
) -> tuple[list[str], dict[str, str]]:
    """The required cases the parts present allow, and why each other one does not."""
    have = set(components)
    where = {c: part["name"] for part in manifest["parts"] for c in part["components"]}
    runnable, apart = [], {}
    for node in required:
        if node in manifest["not_carried"]:
            apart[node] = f"not in the bundle: {manifest['not_carried'][node]}"
        elif node not in manifest["needs"]:
            apart[node] = "not in the bundle: the manifest does not list what it needs"
        else:
            need = manifest["every_case"] + manifest["needs"][node]
            if missing := [c for c in need if c not in have]:
                parts = sorted({where[c] for c in missing})
                apart[node] = f"needs {', '.join(parts)} (not transferred yet)"
            else:
                runnable.append(node)
    return runnable, apart


def run(bundle: Path, out: Path) -> int:
    manifest, began = read_manifest(bundle), time.monotonic()
    deadline = began + float(os.environ.get(DEADLINE_ENV) or DEADLINE_S)
    gpus = query_gpus()  # before anything else: without a GPU there is nothing to do
    check_host(manifest)
    components = present(manifest, bundle)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpus.csv").write_text(gpus)
    listed = gpu_required.parse_nvidia_smi(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    kind, required = gpu_required.select(listed, gpu_table(manifest["gpu"]))
    dest = home(bundle)
    install(manifest, bundle, dest, components)
    standing_in = stand_ins(manifest, components)
    check_vllm(manifest, dest, components, standing_in)
    log.step(
        f"bundle: vLLM {manifest['fork_version']} from {dest / 'site'} carries the "
        f"fix; {kind.name}: {len(required)} required case(s)"
        + (f"; stand-in for {', '.join(standing_in)}" if standing_in else "")
    )
    runnable, apart = plan(manifest, required, components)
    seconds = {"setup": time.monotonic() - began}  # what the budget's estimate is of
    for node, why in apart.items():
        print(f"{node}: {why}")
    outcome = pytest_runner.Outcome({})
    if runnable:
        outcome = pytest_runner.run_pytest(
            Path(sys.executable),
            dest / "tree",
            case_args(runnable, standing_in),
            out / "gpu-tests.xml",
            pythonpath=pythonpath(dest, runner=bool(standing_in)),
            extra_env=case_env(dest, standing_in),
            timeout_s=max(1, min(RUN_LIMIT_S, deadline - time.monotonic())),
        )
    seconds["cases"] = time.monotonic() - began - seconds["setup"]
    have = set(components)
    parts = [p["name"] for p in manifest["parts"] if set(p["components"]) <= have]

    def save(proved: dict, final: bool = False) -> int:
        """summary.json as far as the run got: after the cases, after each proof."""
        seconds["proofs"] = time.monotonic() - began - seconds["setup"]
        seconds["proofs"] -= seconds["cases"]
        proved["seconds"] = {step: round(s, 1) for step, s in seconds.items()}
        run = (kind, parts, runnable, apart, outcome, out, standing_in)
        return conclude(*run, proved, final)

    left = lambda limit: min(limit, deadline - time.monotonic())  # noqa: E731
    proved = prove(
        manifest, dest, components, runnable, outcome, out, standing_in, save, left
    )
    return save(proved, final=True)


def prove(
    manifest: dict,
    dest: Path,
    components: list[str],
    runnable: list[str],
    fork: pytest_runner.Outcome,
    out: Path,
    standing_in: list[str],
    save,
    left,
) -> dict:
    """The proofs beside the cases the parts present allow (proofs.py): stock's runs,
    memcheck, the figures; each {} where not run, and why in "not_run". SAVE gets what
    was found before the first and after each; LEFT(limit): the seconds one may take."""
    found, not_run = {"stock": {}, "sanitizer": {}, "figures": {}}, {}
    save({**found, "not_run": not_run})
    # A proof that cannot run is reported as such: the run's summary is still written.
    if (nodes := [n for n in manifest["stock"]["cases"] if n in runnable]) and (
        limit := left(STOCK_LIMIT_S)
    ) <= 0:
        found["stock"] = dict.fromkeys(nodes, proofs.OUT_OF_TIME)
    elif nodes:
        try:
            found["stock"] = run_stock(
                manifest, dest, nodes, fork, out, standing_in, limit
            )
        except ForkError as exc:
            found["stock"] = {n: proofs.did_not_run(exc.cause) for n in nodes}
    save({**found, "not_run": not_run})
    for node in manifest["stock"]["cases"]:
        if node not in runnable:
            not_run[f"stock: {node}"] = "its fork case does not run here"
    node, tool = manifest["sanitizer_case"], proofs.sanitizer()
    if node in runnable and tool and (limit := left(SANITIZER_LIMIT_S)) <= 0:
        found["sanitizer"] = proofs.OUT_OF_TIME
    elif node in runnable and tool:
        try:
            found["sanitizer"] = run_sanitizer(
                tool, node, dest, out, standing_in, limit
            )
        except ForkError as exc:
            found["sanitizer"] = proofs.did_not_run(exc.cause)
    elif node:
        why = "no compute-sanitizer on this host" if tool is None else ""
        not_run["sanitizer"] = why or "its case does not run here"
    save({**found, "not_run": not_run})
    figures = manifest["figures"]
    need = [*manifest["every_case"], *figures.get("needs", ())]
    if figures and set(need) <= set(components):
        limit = left(FIGURES_LIMIT_S)
        found["figures"] = (
            run_figures(figures, dest, out, limit) if limit > 0 else proofs.OUT_OF_TIME
        )
    elif figures:
        missing = sorted({c for c in need if c not in components})
        not_run["figures"] = f"needs {', '.join(missing)} (not transferred yet)"
    return {**found, "not_run": not_run}


def run_stock(
    manifest: dict,
    dest: Path,
    nodes: list[str],
    fork: pytest_runner.Outcome,
    out: Path,
    standing_in: list[str],
    limit: float,
) -> dict:
    """NODES again, each forked, with stock's module (stock_overlay.py): node -> the
    verdict (proofs.stock_verdict)."""
    stock, report = stock_file(manifest, dest), out / "stock-overlay.jsonl"
    report.unlink(missing_ok=True)
    log.step(f"bundle: {len(nodes)} case(s) again with stock's {stock.name}")
    ran = pytest_runner.run_pytest(
        Path(sys.executable),
        dest / "tree",
        case_args(nodes, standing_in, stock=True),
        out / "stock-tests.xml",
        pythonpath=pythonpath(dest, runner=True),
        output=out / "stock-tests.log",
        extra_env=case_env(dest, standing_in, stock, report),
        timeout_s=limit,
    )
    events = proofs.read_events(report)
    return {n: proofs.stock_verdict(n, fork, ran, events, stock) for n in nodes}


def run_sanitizer(
    tool: str,
    node: str,
    dest: Path,
    out: Path,
    standing_in: list[str],
    limit: float,
) -> dict:
    """NODE under TOOL's memcheck, in one process (not forked): its verdict."""
    log.step(f"bundle: {node} under {tool} memcheck")
    began, log_file = time.monotonic(), out / "sanitizer.log"
    checked = pytest_runner.run_pytest(
        Path(sys.executable),
        dest / "tree",
        case_args([node], standing_in, forked=False),
        out / "sanitizer-tests.xml",
        pythonpath=pythonpath(dest, runner=bool(standing_in)),
        output=log_file,
        # no caching allocator: memcheck sees each tensor's own allocation, not torch's
        # big blocks, inside which an out-of-bounds access would go unseen
        extra_env={
            **case_env(dest, standing_in),
            "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
        },
        timeout_s=limit,
        prefix=(tool, *proofs.SANITIZER_ARGS),
    )
    seconds = time.monotonic() - began
    return proofs.sanitizer_verdict(node, checked, log_file, seconds)


def run_figures(figures: dict, dest: Path, out: Path, limit: float) -> dict:
    """The offload benchmark in the tree on the bundle's tiny GPT-OSS (eager: no
    compile or graph capture in the budget); its JSON report in OUT."""
    report, output = out / "offload-figures.json", out / "offload-figures.log"
    report.unlink(missing_ok=True)
    model = dest / "models" / figures["model"]
    command = [sys.executable, figures["script"], "--out", str(report)]
    command += ["--model", str(model), "--enforce-eager"]
    log.step(f"bundle: the offload figures ({figures['script']}; report: {output})")
    env = {**os.environ, **case_env(dest), "PYTHONPATH": pythonpath(dest)}
    began = time.monotonic()
    with open(output, "w") as sink:
        code, stopped = pytest_runner.run_limited(
            command,
            cwd=dest / "tree",
            env=env,
            timeout_s=limit,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    seconds = time.monotonic() - began
    return proofs.figures_verdict(report, -1 if stopped else code, seconds)


def conclude(
    kind: GpuKind,
    parts: list[str],  # present
    runnable: list[str],
    apart: dict[str, str],
    outcome: pytest_runner.Outcome,
    out: Path,
    standing_in: list[str] = (),
    proved: dict | None = None,
    final: bool = True,
) -> int:
    """summary.json and summary.txt; where FINAL, what the run found printed too."""
    proved = proved or {"stock": {}, "sanitizer": {}, "figures": {}, "not_run": {}}
    say = print if final else lambda *_, **__: None
    not_run = gpu_required.not_run(runnable, [outcome])
    failed = outcome.failed + outcome.errors
    line = (
        f"{outcome.passed} passed, {failed} failed, {outcome.skipped} skipped, "
        f"{len(apart)} required not run here"
    )
    for problem in (*([outcome.killed] if outcome.killed else []), *not_run):
        say(problem)
    for what, why in proved["not_run"].items():
        say(f"{what}: not run ({why})")
    if not runnable:
        line += f" (parts present: {', '.join(parts)}: none of them runs a case yet)"
    if apart:
        line += " (listed above; the nightly's verdict needs them too)"
    if standing_in:
        line += f" (stand-in for {', '.join(standing_in)} until its part arrives)"
    # Then what the proofs showed, each in a few words (summary.json has the rest).
    shown = [f"{n.split('::', 1)[-1]}: {v['line']}" for n, v in proved["stock"].items()]
    shown += [proved[k]["line"] for k in ("sanitizer", "figures") if proved[k]]
    line += "".join(f"; {s}" for s in shown)
    unproved = [k for k, v in proved["stock"].items() if not v["proved"]]
    unproved += [
        k for k in ("sanitizer", "figures") if proved[k].get("proved") is False
    ]
    summary = {
        "gpu_kind": kind.name,
        "parts_present": parts,
        "cases": outcome.cases,
        "skip_reasons": outcome.reasons,
        "required_not_run": not_run,
        "killed": outcome.killed,
        "not_run_here": {**apart, **proved["not_run"]},
        "stand_ins": list(standing_in),
        "stock": proved["stock"],  # node -> stock and fork verdicts (proofs.py)
        "sanitizer": proved["sanitizer"],
        "figures": proved["figures"],
        "seconds": proved.get("seconds", {}),  # setup, cases, proofs: the budget's
        "junit": "gpu-tests.xml",
        "summary": line,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.txt").write_text(line + "\n")
    say(line, flush=True)
    return 1 if failed or not_run or outcome.killed or unproved else 0


def main(argv: list[str]) -> int:
    try:
        match argv:
            case ["inventory"]:
                print(inventory(), end="")
            case ["probe", platform_too, version, dest]:
                found = probe(platform_too == "1", version, Path(dest))
                (Path(dest) / "probe.json").write_text(json.dumps(found))
            case ["install", bundle, dest]:
                bundle, dest = Path(bundle).resolve(), Path(dest).resolve()
                manifest = read_manifest(bundle)
                install(manifest, bundle, dest, present(manifest, bundle))
                print(pythonpath(dest))
            case ["run", bundle, out]:
                # Resolved here: pytest runs in the unpacked tree, not where run.sh ran.
                return run(Path(bundle).resolve(), Path(out).resolve())
            case _:
                print(__doc__, file=sys.stderr)
                return 2
        return 0
    except ForkError as exc:
        print(f"run.sh: {exc}", file=sys.stderr)
        return 2
    except (OSError, tarfile.TarError, EOFError) as exc:  # lzma's errors are OSErrors
        print(
            f"run.sh: {type(exc).__name__}: {exc} -- check the disk under "
            "FORK_BUNDLE_HOME (default /tmp) and transfer the parts again",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
