"""The GPU bundle's pieces without a GPU: the host file, what is carried, the packing
into parts, the required-case table it shares with the nightly, and a small bundle in
the real format, made by the builder and unpacked by the bundle's own run.sh."""

import contextlib
import dataclasses
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from forkbuild.core import pins, preflight
from forkbuild.core.errors import ForkError
from forkbuild.core.pytest_runner import Outcome
from forkbuild.gpu.bundle import build as gpu_bundle
from forkbuild.gpu.bundle import check as bundle_check
from forkbuild.gpu.bundle import proofs
from forkbuild.gpu.bundle import runner as bundle_run
from forkbuild.gpu.bundle import standin as bundle_standin
from forkbuild.gpu.bundle.build import Component, Host, Made, Selection, Trace
from forkbuild.setup import lock

SETTINGS = pins.load_gpu_bundle()
NO_GPU = pytest.mark.skipif(preflight.has_nvidia_gpu(), reason="this machine has a GPU")
LOCK = lock.pinned(lock.path("cuda", "3.12"))  # the reference host's: torch 2.11.0
HEAD = "# python: 3.12.3\n# glibc: 2.39\n"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"  # this one's


def _host(tmp_path: Path, text: str) -> Host:
    path = tmp_path / "host.txt"
    path.write_text(text)
    return gpu_bundle.read_host(path)


def test_a_host_file_gives_python_glibc_and_versions(tmp_path):
    text = f"{HEAD}# gpu: H200\nNumPy==2.5.2\npyyaml\nmy_pkg @ file:///x.whl\n-e /src\n"
    host = _host(tmp_path, text + "torch==2.11.0+cu130\n")
    assert (host.python, host.glibc) == ("3.12", "2.39")
    assert host.platform == "x86_64-manylinux_2_39"
    want = {"numpy": "2.5.2", "pyyaml": None, "my-pkg": None, "torch": "2.11.0+cu130"}
    assert host.packages == want
    # fork.toml's reference host: the notes' host
    host = gpu_bundle.read_host(pins.REPO_ROOT / SETTINGS.host)
    assert host.python == "3.12" and host.packages["triton"] == "3.6.0"
    assert host.packages["torch"] == "2.11.0+cu130" and "pydantic" not in host.packages
    assert host.packages["numpy"] == "2.5.2" and host.packages["pyyaml"] is None


BAD_HOSTS = ["numpy==1\n", "# python: 3.12.3\nnumpy==1\n", f"{HEAD}not a line!\n"]


@pytest.mark.parametrize("text", [*BAD_HOSTS, f"{HEAD}a>=1\n", f"{HEAD}a==1,==2\n"])
def test_a_bad_host_file_is_refused_with_what_to_do(tmp_path, text):
    with pytest.raises(ForkError, match="inventory"):
        _host(tmp_path, text)


@pytest.mark.parametrize(
    "torch, ok",
    [(t, True) for t in ("2.11.0+cu130", "2.11.0")]
    + [(t, False) for t in ("2.11.0+cu128", "2.10.0+cu130", None)],
)
def test_only_the_locks_torch_build_is_taken(tmp_path, torch, ok):
    torch_line = f"torch=={torch}\n" if torch else ""
    host = _host(tmp_path, f"{HEAD}triton==3.6.0\n{torch_line}")
    refused = pytest.raises(ForkError, match="the host's torch")
    with contextlib.nullcontext() if ok else refused:
        gpu_bundle.check_host_torch(host, LOCK)


def _trace(**extra) -> Trace:
    """What the collection loaded (select reads the names and requires, no version)."""
    names = ("nvidia-cuda-runtime", "triton", "numpy", "vllm", "pydantic", "PyYAML")
    dists = {n: {"version": "1", "requires": []} for n in (*names, "pluggy")}
    dists["torch"] = {"version": "1", "requires": ["nvidia-cuda-runtime", "sympy"]}
    dists["pytest"] = {"version": "1", "requires": ["pluggy"]}
    return Trace(dists | extra, ())


def test_carried_is_what_the_host_lacks_or_has_at_another_version(tmp_path):
    text = "numpy==2.5.2\npyyaml\npytest==8.0\npluggy\ntorch==2.11.0\ntriton==3.6.0\n"
    host = _host(tmp_path, HEAD + text)
    chosen = gpu_bundle.select(_trace(), host, LOCK, SETTINGS)
    # pydantic: absent; numpy: another version; the runner's own packages (pytest, its
    # pluggy, pytest-forked, pytest-timeout, tblib), loaded by the collection or not.
    carried = ["numpy", "pydantic", "pytest", "pluggy", "pytest-forked"]
    assert chosen.carried == {n: LOCK[n] for n in (*carried, "pytest-timeout", "tblib")}
    # a bare name: the host's, version unknown
    assert chosen.from_host == {"pyyaml": None}
    assert chosen.provided_by_host == ("nvidia-cuda-runtime", "torch", "triton")
    # an import the lock does not pin is refused
    with pytest.raises(ForkError, match="does not pin"):
        trace = _trace(stray={"version": "1", "requires": []})
        gpu_bundle.select(trace, host, LOCK, SETTINGS)


def test_every_required_case_says_what_the_bundle_holds_for_it():
    """Each case of fork.toml [gpu] is carried (with what it needs, each a component the
    bundle orders) or said not to be, never both; a row saying neither or both is
    refused."""
    assert set(SETTINGS.needs) | set(SETTINGS.not_carried) == set(SETTINGS.gpu["cases"])
    named = {c for need in SETTINGS.needs.values() for c in need}
    assert named | set(SETTINGS.every_case) <= set(SETTINGS.order)
    assert set(SETTINGS.stand_in) <= set(SETTINGS.order) - set(SETTINGS.every_case)
    for row in ({}, {"bundle": [], "not_in_bundle": "why"}):
        case = {"t.py::one": {"kind": "Hopper", **row}}
        with pytest.raises(ForkError, match="'t.py::one' gives (neither|both)") as exc:
            pins.gpu_bundle_of({"gpu_bundle": {}, "gpu": {"cases": case}})
        assert "not_in_bundle" in exc.value.hint


def test_components_fill_the_first_part_with_room_and_parts_name_their_cases():
    """First fit; with the sizes the reference bundle measured (docs/gpu-nightly.md),
    fork.toml's order gives part 1 a kernel case (Triton, with the cache ops stood in
    for), parts 1-2 FA3's, parts 1-3 every kernel case, parts 1-4 the engine cases."""
    mib = 2**20
    sizes = {"a": 40 * mib, "b": 30 * mib, "c": 10 * mib, "d": 5 * mib}
    parts = gpu_bundle.pack(sizes, ["a", "b", "c", "d"], 56 * mib, first_extra=2 * mib)
    assert [p.components for p in parts] == [("a", "c"), ("b", "d")]
    with pytest.raises(ForkError, match="more than a part"):
        gpu_bundle.pack({"a": 57 * mib}, ["a"], 56 * mib, first_extra=0)
    names = ["py", "c", "fa"]
    parts = [gpu_bundle.Part(f"part-{i}", (c,), 0) for i, c in enumerate(names, 1)]
    cases = gpu_bundle.cases_by_part(parts, ["py", "c"], {"k": [], "f": ["fa"]})
    assert cases == {"part-1": [], "part-2": ["k"], "part-3": ["f"]}
    ext, fa = "vllm/_", "vllm/vllm_flash_attn/_vllm_"
    sizes = {"tree": 0.1, "vllm": 6.6, "packages": 37.7, f"{fa}fa3_C.abi3.so": 9.9}
    sizes["stock"] = 0.01  # stock's fixcheck module, for the stock runs
    sizes |= {f"{ext}qutlass_C.abi3.so": 0.3, f"{ext}C_stable_libtorch.abi3.so": 50.8}
    sizes |= {f"{fa}fa2_C.abi3.so": 51.7, f"{ext}moe_C_stable_libtorch.abi3.so": 37.6}
    sizes = {n: int(v * mib) for n, v in (sizes | {"models": 12.1}).items()}
    parts = gpu_bundle.pack(sizes, SETTINGS.order, SETTINGS.part_mib * mib, mib // 4)
    added = gpu_bundle.cases_by_part(parts, SETTINGS.every_case, SETTINGS.needs)
    kernels = "tests/v1/worker/test_packed_kv_cache_gpu_kernels.py::"
    assert added["part-1"] == [f"{kernels}test_triton_attention_over_packed_views"]
    # FlashAttention's vllm_flash_attn, which the case's fixture imports, needs FA3 (or
    # FA2) on CUDA: part 1 carries it.
    assert f"{fa}fa3_C.abi3.so" in parts[0].components
    assert "stock" in parts[0].components  # the stock runs go with the first cases
    assert added["part-2"] == [f"{kernels}test_flash_attention_over_packed_views[3]"]
    assert added["part-3"] == [f"{kernels}test_flash_attention_over_packed_views[2]"]
    assert len(parts) == 4 and len(added["part-4"]) == 5


# --- a small bundle in the real format ------------------------------------------------


def _settings(order: str, every_case: str, kinds: dict, cases: dict, **more):
    """fork.toml's [gpu_bundle] and [gpu] (ORDER and EVERY_CASE: names by spaces)."""
    table = {"host": "h.txt", "part_mib": 1, "order": order.split()}
    table |= {"every_case": every_case.split(), **more}
    gpu = {"kinds": kinds, "cases": cases}
    return pins.gpu_bundle_of({"gpu_bundle": table, "gpu": gpu})


HOPPER, AMPERE = {"kind": "Hopper"}, {"kind": "Ampere"}
SMALL = _settings(
    "tree site-a site-b",
    "tree site-a",
    {"Hopper": {"capability": "9.0", "queues": {"q": 1}}},
    {
        "t.py::one": {**HOPPER, "bundle": []},
        "t.py::two": {**HOPPER, "bundle": ["site-b"]},
        "t.py::three": {**HOPPER, "not_in_bundle": "not here"},
    },
)


def _assemble(fork_pins, tmp_path, files, limit, settings, codec=gpu_bundle.XZ):
    """A bundle of FILES ((component, path) -> data; a root: the name before a dash)."""
    by_name: dict[str, Component] = {}
    for (name, path), data in files.items():
        source = tmp_path / "src" / name / path
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_bytes(data)
        by_name.setdefault(name, Component(name, name.split("-")[0])).add(path, source)
    components = list(by_name.values())
    host = Host(PYTHON, "2.17", {}, tmp_path)
    pinned = lock.pinned(lock.path("cuda", host.python))
    selection = Selection({}, {}, (), ())
    made = Made(fork_pins, settings, host, pinned, selection, components)
    store = tmp_path / "store" if codec is gpu_bundle.PLAIN else None
    archives = gpu_bundle.compress(components, codec, store)
    return gpu_bundle.assemble(made, archives, codec, limit, tmp_path / "bundle")


# 1 MiB streams: the 3 MiB file is in several, which the runner reads as one.
SMALL_XZ = gpu_bundle.Codec("xz", gpu_bundle.XZ.filters, chunk=1 << 20)


@pytest.fixture(params=[SMALL_XZ, gpu_bundle.PLAIN], ids=["xz", "tar"])
def small_bundle(request, scratch, fork_pins, tmp_path) -> Path:
    files = {("tree", "tests/t.py"): b"x = 1\n"}
    files[("site-a", "pkg/__init__.py")] = b"A = 1\n"
    files[("site-b", "pkg/b.so")] = os.urandom(3 << 20)
    limit = int(3.05 * 2**20)
    bundle = _assemble(fork_pins, tmp_path, files, limit, SMALL, request.param)
    assert [p.components for p in bundle.parts] == [("tree", "site-a"), ("site-b",)]
    assert bundle.cases == {"part-1": ["t.py::one"], "part-2": ["t.py::two"]}
    codec = {e["codec"] for e in bundle.manifest["components"].values()}
    assert codec == {request.param.name}
    return bundle.folder


def _run_sh(bundle: Path, *args: str, tools: dict[str, str] | None = None, **env: str):
    """run.sh from the bundle's parent, away from this checkout: its own runner. TOOLS:
    executables (name -> script) first on PATH, the GPU host's nvidia-smi, nvcc."""
    where = bundle.parent / "bin"
    where.mkdir(exist_ok=True)
    for name, text in (tools or {}).items():
        (where / name).write_text(text)
        (where / name).chmod(0o755)
    path = f"{where}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PYTHON": sys.executable, "PATH": path, **env}
    command = ["bash", str(bundle / "run.sh"), *args]
    kwargs = dict(cwd=bundle.parent, env=env, timeout=120)
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def test_run_sh_unpacks_the_parts_present_and_checks_every_file(small_bundle, tmp_path):
    dest = tmp_path / "dest"
    done = _run_sh(small_bundle, "--install", str(dest))
    assert done.returncode == 0, done.stderr
    assert (dest / "tree" / "tests" / "t.py").read_text() == "x = 1\n"
    assert (dest / "site" / "pkg" / "b.so").stat().st_size == 3 << 20
    assert done.stdout.strip() == f"{dest / 'tree'}{os.pathsep}{dest / 'site'}"
    # A file changed after unpacking is found on the next run.
    (dest / "site" / "pkg" / "__init__.py").write_text("A = 2\n")
    again = _run_sh(small_bundle, "--install", str(dest))
    assert again.returncode == 2 and "not as its archive lists them" in again.stderr
    # A part not transferred yet only means fewer components.
    shutil.rmtree(small_bundle / "part-2")
    done = _run_sh(small_bundle, "--install", str(tmp_path / "fewer"))
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "fewer" / "site" / "pkg" / "b.so").exists()


@pytest.mark.parametrize(
    "damaged, said",
    [
        ("part-2/*", ["transfer part-2 again", "part-2/{} is damaged"]),
        ("runner/forkbuild/gpu/bundle/runner.py", ["part 1 is damaged"]),
        pytest.param("", ["no NVIDIA GPU"], marks=NO_GPU),
    ],
    ids=["damaged-part", "damaged-runner", "no-gpu"],
)
def test_a_bundle_that_cannot_run_stops_at_once_in_one_line(
    small_bundle, tmp_path, damaged, said
):
    for path in small_bundle.glob(damaged) if damaged else ():
        path.write_bytes(path.read_bytes()[:-10])
        said = [s.format(path.name) for s in said]
    dest = tmp_path / "dest"  # damaged: `--install DEST`, else `run.sh OUT`
    done = _run_sh(small_bundle, *(["--install"] if damaged else []), str(dest))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1
    assert all(s in lines[0] for s in said), lines
    assert not dest.exists()  # nothing unpacked, no OUT made


# What nvidia-smi (both of the runner's queries) and nvcc print on a 2 x H200 host.
SMI_CSV = """index, uuid, name, compute_cap, memory.total [MiB]
0, GPU-8c3e1f2a, NVIDIA H200, 9.0, 143771 MiB
1, GPU-5b07d9e4, NVIDIA H200, 9.0, 143771 MiB
"""
FAKE_SMI = f"""#!/bin/sh
case "$*" in
  *noheader*) printf '570.124.06\\n570.124.06\\n' ;;
  *) cat <<'EOF'
{SMI_CSV}EOF
esac
"""
FAKE_NVCC = """#!/bin/sh
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Cuda compilation tools, release 13.0, V13.0.88"
echo "Build cuda_13.0.r13.0/compiler.36424714_0"
"""


def test_the_inventory_names_gpus_driver_nvcc_packages(small_bundle, tmp_path):
    tools = {"nvidia-smi": FAKE_SMI, "nvcc": FAKE_NVCC}
    done = _run_sh(small_bundle, "--inventory", tools=tools)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "# gpu: 0, GPU-8c3e1f2a, NVIDIA H200, 9.0, 143771 MiB" in lines
    assert "# gpu: 1, GPU-5b07d9e4, NVIDIA H200, 9.0, 143771 MiB" in lines
    assert "# driver: 570.124.06" in lines and "570.124.06" not in lines  # once
    nvcc = tmp_path / "bin" / "nvcc"
    assert f"# nvcc: {nvcc}: Build cuda_13.0.r13.0/compiler.36424714_0" in lines
    host = _host(tmp_path, done.stdout)
    assert host.python == PYTHON and host.packages["pytest"] is not None


ESCAPES = [[("FILES.sha256", b""), (n, b"x")] for n in ("../escape", "/etc/escape")]


@pytest.mark.parametrize("members", [*ESCAPES, [("tests/t.py", b"no list first")]])
def test_an_archive_that_writes_outside_or_lacks_its_list_is_refused(tmp_path, members):
    archive = tmp_path / "a.tar.xz"
    with tarfile.open(archive, mode="w:xz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "root").mkdir()
    with pytest.raises(ForkError):
        bundle_run._extract(archive, tmp_path / "root", tmp_path / "list")
    assert not (tmp_path / "escape").exists()


def test_the_runner_runs_what_the_parts_allow_and_says_why_not_the_rest():
    parts = [{"name": "part-1", "components": ["tree", "site-a"]}]
    parts.append({"name": "part-2", "components": ["site-b"]})
    manifest = {"parts": parts, "every_case": list(SMALL.every_case)}
    manifest["needs"] = {"t.py::one": [], "t.py::two": ["site-b"]}
    manifest["not_carried"] = {"t.py::three": "not here"}
    nodes = tuple(f"t.py::{n}" for n in ("one", "two", "three", "four"))
    runnable, apart = bundle_run.plan(manifest, nodes, ["tree", "site-a"])
    assert runnable == ["t.py::one"]
    assert apart == {
        "t.py::two": "needs part-2 (not transferred yet)",
        "t.py::three": "not in the bundle: not here",
        "t.py::four": "not in the bundle: the manifest does not list what it needs",
    }


def test_the_runner_stands_in_only_for_what_has_not_arrived(tmp_path, monkeypatch):
    manifest = {"stand_in": {"ext.so": "pkg._ext", "other.so": "pkg._other"}}
    assert bundle_run.stand_ins(manifest, ["tree", "other.so"]) == ["pkg._ext"]
    assert bundle_run.stand_ins(manifest, ["ext.so", "other.so"]) == []
    assert bundle_run.stand_ins({}, []) == []
    args = bundle_run.case_args(["t.py::one"], ["pkg._ext"])
    assert args[args.index("forkbuild.gpu.bundle.standin") - 1] == "-p"
    assert "forkbuild.gpu.bundle.standin" not in bundle_run.case_args(["t.py::one"])
    env = bundle_run.case_env(tmp_path, ["pkg._ext", "pkg._other"])
    assert env[bundle_standin.ENV] == "pkg._ext,pkg._other"
    # set empty, not left out: a value from the caller's environment never applies
    assert bundle_run.case_env(tmp_path)[bundle_standin.ENV] == ""
    # a stand-in is an empty module, only where nothing was imported
    monkeypatch.delitem(sys.modules, "fork_test_absent._ext", raising=False)
    monkeypatch.setitem(sys.modules, "fork_test_present", sys)
    bundle_standin.install(["fork_test_absent._ext", "fork_test_present"])
    stood_in = sys.modules.pop("fork_test_absent._ext")
    assert getattr(stood_in, bundle_standin.MARK) and not hasattr(stood_in, "__file__")
    assert sys.modules["fork_test_present"] is sys  # a real module is never replaced


@pytest.mark.parametrize(
    "status, code", [("passed", 0), ("skipped", 1), ("failed", 1), (None, 1)]
)
def test_a_runnable_case_that_did_not_pass_fails_the_run(tmp_path, status, code):
    outcome = Outcome({"t.py::one": status} if status else {})
    hopper = pins.gpu_table(SMALL.gpu).kind("Hopper")
    ran = (["part-1"], ["t.py::one"], {}, outcome, tmp_path)  # parts, runnable, ...
    assert bundle_run.conclude(hopper, *ran) == code
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["parts_present"] == ["part-1"]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith(f"{outcome.passed} passed, ")


def test_lock_entries_are_the_locks_own_lines():
    text = lock.entries(lock.path("cuda", "3.12"), {"tblib"})
    assert text.startswith("tblib==3.1.0 \\\n    --hash=sha256:")
    assert text.count("==") == 1


# --- run.sh OUT end to end, with a stand-in GPU and a stand-in vLLM ------------------

# What fixcheck reads as the fixed packed branch (the patched function's shape).
FIXED = """
def _reshape_attention_kv_cache(packing, raw, permuted_kv_cache_shape):
    if packing is not None:
        return raw.view(permuted_kv_cache_shape)
"""
# Stock's: the same branch viewed with the logical shape (fixcheck: buggy).
STOCK = """
def _reshape_attention_kv_cache(packing, raw, permuted_kv_cache_shape):
    kv_cache_shape = "logical"
    if packing is not None:
        return raw.view(kv_cache_shape)
"""
KERNELS = "tests/v1/worker/test_packed_kv_cache_gpu_kernels.py"
TRITON = f"{KERNELS}::test_triton_attention_over_packed_views"
FA3 = f"{KERNELS}::test_flash_attention_over_packed_views[3]"
ENGINE = "tests/e.py::engine"
# The stand-in cases: two required node ids, one passes, one fails.
CASES = """import os
import signal
import types

import pytest

def test_triton_attention_over_packed_views(request):
    # the module's function as vLLM's callers reach it; a wrong view crashes
    from vllm.v1.worker.gpu import attn_utils
    raw = types.SimpleNamespace(view=lambda shape: shape)
    if attn_utils._reshape_attention_kv_cache(1, raw, "physical") != "physical":
        os.kill(os.getpid(), signal.SIGSEGV)
    # run as the runner runs cases: forked, with its time limit, offline
    assert request.config.option.forked
    assert request.config.getini('timeout_func_only') is True
    assert os.environ['HF_HUB_OFFLINE'] == '1'
    assert os.environ['PYTEST_DISABLE_PLUGIN_AUTOLOAD'] == '1'
    assert os.environ['VLLM_OFFLOAD_E2E_MODELS'].endswith('models')
    # the models' part is absent: its module is the runner's stand-in
    from vllm import _C_models
    assert _C_models.__fork_bundle_stand_in__

@pytest.mark.parametrize('fa_version', [3])
def test_flash_attention_over_packed_views(fa_version):
    assert False
"""
# A stand-in vLLM, carrying the fix, whose platform is CUDA.
PLATFORM = """import vllm._C_models  # noqa: F401 (the probe has the stand-in too)
current_platform = type("CudaPlatform", (), {"is_cuda": lambda self: True})()
"""
VLLM = dict.fromkeys(
    f"vllm/{p}__init__.py" for p in ("", "v1/", "v1/worker/", "v1/worker/gpu/")
)
VLLM["vllm/v1/worker/gpu/attn_utils.py"] = FIXED
VLLM["vllm/platforms/__init__.py"] = PLATFORM
KINDS = {
    "Ampere": {"capability": "8.0", "queues": {"a": 1}},
    "Hopper": {"capability": "9.0", "queues": {"h": 1}},
}
STAND_IN = _settings(
    "tree stock site models",
    "tree site",
    KINDS,
    {
        TRITON: {**AMPERE, "bundle": []},
        FA3: {**HOPPER, "bundle": []},
        ENGINE: {**HOPPER, "bundle": ["models"]},
        "tests/e.py::tp2": {**HOPPER, "gpus": 2, "bundle": []},
        "tests/f.py::flashinfer": {**AMPERE, "not_in_bundle": "too big"},
    },
    stand_in={"models": "vllm._C_models"},
    stock_cases=[TRITON, FA3],
)


def test_run_sh_gives_the_nightlys_verdict(scratch, fork_pins, tmp_path):
    """run.sh runs the cases the parts allow. The runner's GPU path on CPU: the host
    checks, the unpacking, the vLLM probe, the plan, the forked pytest run with the
    per-case limit, the reports and the exit status."""
    version = fork_pins.fork_version
    info = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    files = {("tree", KERNELS): CASES.encode()}
    files |= {("site", path): (text or "").encode() for path, text in VLLM.items()}
    files[("site", f"vllm-{version}.dist-info/METADATA")] = info.encode()
    files[("models", "m.bin")] = os.urandom(250 << 10)
    files[("stock", "vllm/v1/worker/gpu/attn_utils.py")] = STOCK.encode()
    bundle = _assemble(fork_pins, tmp_path, files, 300 << 10, STAND_IN)
    shutil.rmtree(bundle.folder / "part-2")  # the models' part has not arrived
    out = tmp_path / "out"  # given relative, from where run.sh is called
    # all that run.sh asks of the GPU before the cases, which here need none
    env = dict(FORK_BUNDLE_HOME="home", CUDA_VISIBLE_DEVICES="0")  # one GPU of two
    done = _run_sh(bundle.folder, "out", tools={"nvidia-smi": FAKE_SMI}, **env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == (
        "1 passed, 1 failed, 0 skipped, 2 required not run here "
        "(listed above; the nightly's verdict needs them too) "
        "(stand-in for vllm._C_models until its part arrives); "
        "test_triton_attention_over_packed_views: stock fails (crash), fork passes; "
        "test_flash_attention_over_packed_views[3]: stock's function did not run in "
        "the case; on stock it failed (assert False); on the fork it failed"
    )
    assert (tmp_path / "home").is_dir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gpu_kind"] == "Hopper" and summary["parts_present"] == ["part-1"]
    assert summary["stand_ins"] == ["vllm._C_models"]
    assert summary["cases"] == {TRITON: "passed", FA3: "failed"}
    # the stock runs: stock's function ran in the Triton case (the overlay's record)
    stock = summary["stock"][TRITON]
    assert stock["proved"] and stock["stock_function_ran"] and stock["stock"] == "error"
    assert not summary["stock"][FA3]["proved"]
    assert summary["sanitizer"] == summary["figures"] == {}
    assert set(summary["seconds"]) == {"setup", "cases", "proofs"}  # the budget's
    assert summary["not_run_here"] == {
        ENGINE: "needs part-2 (not transferred yet)",
        # no TP=2: 1 GPU visible
        "tests/f.py::flashinfer": "not in the bundle: too big",
    }
    assert (out / "gpu-tests.xml").is_file()
    assert (out / "gpus.csv").read_text() == SMI_CSV


@pytest.mark.parametrize(
    "failing", [(), ("background",), ("foreground",), ("background", "foreground")]
)
def test_the_reference_bundle_made_meanwhile_loses_no_error(failing, capsys):
    """check's two builds at once: either's error raised (the foreground's first, the
    other's said), never before both have ended."""
    ended = []

    def job(name: str, delay: float) -> str:
        time.sleep(delay)
        ended.append(name)
        if name in failing:
            raise ForkError(f"{name} failed")
        return name

    background = lambda: job("background", 0.3)
    foreground = lambda: job("foreground", 0)
    if failing:
        with pytest.raises(ForkError, match=f"{failing[-1]} failed"):
            bundle_check.meanwhile(background, foreground)
    else:
        assert bundle_check.meanwhile(background, foreground) == tuple(ended[::-1])
    assert sorted(ended) == ["background", "foreground"]  # the slow one ended too
    said = "meanwhile, this failed too: background failed" in capsys.readouterr().err
    assert said == (len(failing) == 2)


def test_xz_preset_gives_a_component_its_own_preset(scratch, tmp_path):
    """fork.toml [gpu_bundle] xz_preset: that component's streams take the preset (its
    archive keyed by it), the others XZ's; each archive reads back as its tar."""
    codec = dataclasses.replace(SMALL_XZ, presets=(("fast", 0),))
    data = b"".join(i.to_bytes(4, "little") for i in range(600_000))  # 2.3 MiB
    comps = {name: Component(name, gpu_bundle.SITE) for name in ("kept", "fast")}
    for name, comp in comps.items():
        (tmp_path / name).write_bytes(data)
        comp.add("f.bin", tmp_path / name)
    archives = gpu_bundle.compress(list(comps.values()), codec, tmp_path / "store")
    assert archives["kept"].name != archives["fast"].name
    for name, preset in (("kept", 6), ("fast", 0)):
        gpu_bundle.write_tar(comps[name].members(), tmp_path / f"{name}.tar")
        raw = (tmp_path / f"{name}.tar").read_bytes()
        lzma2 = {"id": lzma.FILTER_LZMA2, "preset": preset}
        filters = (*gpu_bundle.XZ.filters[:-1], lzma2)
        streams = [raw[o : o + codec.chunk] for o in range(0, len(raw), codec.chunk)]
        want = [lzma.compress(s, lzma.FORMAT_XZ, filters=filters) for s in streams]
        assert archives[name].read_bytes() == b"".join(want)
        assert lzma.decompress(archives[name].read_bytes()) == raw


def test_a_bad_xz_preset_is_refused(fork_pins, tmp_path):
    kinds = {"Hopper": {"capability": "9.0", "queues": {"q": 1}}}
    cases = {"t.py::one": {**HOPPER, "bundle": []}}
    with pytest.raises(ForkError, match="xz_preset gives"):
        _settings("tree site-a", "tree", kinds, cases, xz_preset={"site-a": 10})
    settings = _settings("tree site-a", "tree", kinds, cases, xz_preset={"gone": 3})
    files = {("tree", "t.py"): b"", ("site-a", "a.py"): b""}
    with pytest.raises(ForkError, match="does not hold: gone"):
        _assemble(fork_pins, tmp_path, files, 1 << 20, settings)


def test_the_proofs_name_cases_the_bundle_carries():
    kinds = {"Hopper": {"capability": "9.0", "queues": {"q": 1}}}
    cases = {"t.py::one": {**HOPPER, "bundle": []}}
    cases["t.py::no"] = {**HOPPER, "not_in_bundle": "too big"}
    made = _settings("tree", "tree", kinds, cases, stock_cases=["t.py::one"])
    assert made.stock_cases == ("t.py::one",) and made.sanitizer_case == ""
    # fork.toml's: the headline FA3 case and the Triton case, FA3 under memcheck
    assert SETTINGS.sanitizer_case in SETTINGS.stock_cases
    assert len(SETTINGS.stock_cases) == 2 and set(SETTINGS.stock_cases) <= set(
        SETTINGS.needs
    )
    for wrong in ({"stock_cases": ["t.py::no"]}, {"sanitizer_case": "t.py::no"}):
        with pytest.raises(ForkError, match="no bundle case"):
            _settings("tree", "tree", kinds, cases, **wrong)
    figures = {"script": "b.py", "helpers": [], "model": "m", "needs": []}
    assert _settings("tree", "tree", kinds, cases, figures=figures).figures == figures
    for wrong in ({"script": "b.py"}, {**figures, "needs": "models"}):
        with pytest.raises(ForkError, match="figures gives"):
            _settings("tree", "tree", kinds, cases, figures=wrong)


def test_a_proof_that_did_not_run_fails_the_run_and_says_why(tmp_path):
    hopper = pins.gpu_table(SMALL.gpu).kind("Hopper")
    ran = (["part-1"], ["t.py::one"], {}, Outcome({"t.py::one": "passed"}), tmp_path)
    proved = {"stock": {}, "figures": {}, "not_run": {"figures": "needs part-4"}}
    proved["sanitizer"] = proofs.did_not_run("pytest could not run the tests (exit 3)")
    assert bundle_run.conclude(hopper, *ran, [], proved) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["summary"].endswith(
        "; did not run: pytest could not run the tests (exit 3)"
    )
    assert summary["not_run_here"] == {"figures": "needs part-4"}
    assert summary["figures"] == {} and summary["stock"] == {}


def test_a_proof_past_the_runs_deadline_is_not_run_and_the_summary_is_saved(tmp_path):
    manifest = {"stock": {"cases": ["t.py::one"]}, "sanitizer_case": ""}
    manifest |= {"figures": {}, "every_case": []}
    saved, ran = [], ["t.py::one"]
    args = (manifest, tmp_path, [], ran, Outcome({}), tmp_path, [], saved.append)
    found = bundle_run.prove(*args, lambda limit: 0)  # no time left
    assert found["stock"] == {"t.py::one": proofs.OUT_OF_TIME}
    # before the first proof (the cases' summary), then after each
    assert saved[0] == {"stock": {}, "sanitizer": {}, "figures": {}, "not_run": {}}
    assert saved[-1]["stock"] == found["stock"]
