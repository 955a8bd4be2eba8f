"""The nightly GPU job's verdict: the cases each GPU kind and count must run, and a skip
or absence of one fails the job with its reason (synthetic pytest outcomes)."""

import importlib
import json

import pytest

from forkbuild.core.errors import ForkError
from forkbuild.core.pins import gpu_table, load
from forkbuild.core.pytest_runner import Outcome
from forkbuild.gpu import nightly
from forkbuild.gpu import required as gpu_required

KERNELS = "tests/v1/worker/test_packed_kv_cache_gpu_kernels.py"
E2E = "tests/v1/worker/test_packed_kv_cache_offload_e2e.py"
ENGINE = f"{E2E}::test_offload_reload_matches_baseline"
FA3 = f"{KERNELS}::test_flash_attention_over_packed_views[3]"
TRITON = f"{KERNELS}::test_triton_attention_over_packed_views"
SERVE = "forkbuild/tests/test_serve_gpu.py::test_offload_preset_serves_and_reloads"
# The table of fork.toml [gpu]: what each kind must run comes from there, never retyped.
TABLE = load().gpu
AMPERE = set(TABLE.kind("Ampere").required(1))
HOPPER = set(TABLE.kind("Hopper").required(1))
TWO_H100 = set(TABLE.kind("Hopper").required(2))
(TP2,) = TWO_H100 - HOPPER
EVERY_CASE = TABLE.all_required()

# Made-up `nvidia-smi --query-gpu=index,uuid,name,compute_cap,memory.total --format=csv`
HEADER = "index, uuid, name, compute_cap, memory.total [MiB]\n"
H100 = ("NVIDIA H100 80GB HBM3", "9.0", "81559 MiB")
H200 = ("NVIDIA H200", "9.0", "143771 MiB")
A100 = ("NVIDIA A100-SXM4-80GB", "8.0", "81920 MiB")
A10 = ("NVIDIA A10", "8.6", "23028 MiB")
T4 = ("Tesla T4", "7.5", "15360 MiB")


def _select(csv: str, visible: str | None = None):
    return gpu_required.select(gpu_required.parse_nvidia_smi(csv, visible), TABLE)


def uuid(index: int) -> str:
    return f"GPU-{index}a5e{index}c1f-0b0e-4c7a-9d2e-6f1b2c3d4e{index:02d}"


def _csv(*gpus: tuple[str, str, str]) -> str:
    """nvidia-smi's CSV for GPUS, indexed in order."""
    rows = (f"{i}, {uuid(i)}, {', '.join(gpu)}\n" for i, gpu in enumerate(gpus))
    return HEADER + "".join(rows)


# CUDA_VISIBLE_DEVICES on two H100s, and how many GPUs it shows (one: TP=2 is not
# required).
VISIBLE = [
    (None, 2),  # unset: every GPU
    ("0", 1),  # an agent pinned to one GPU of two
    ("1", 1),
    ("1,0", 2),
    (" 0 , 1 ", 2),
    ("0,7,1", 1),  # CUDA stops at the first entry that names no GPU
    ("0,x,1", 1),
    ("1gpu", 1),  # read like strtoul: the leading number
    (uuid(1), 1),
    (uuid(1)[:12], 1),  # an unambiguous UUID prefix
    (f"{uuid(0)},{uuid(1)[:12]}", 2),
    (f"{uuid(0)},1", 1),  # a UUID list ends at an entry that is no UUID
]


@pytest.mark.parametrize(
    ("gpus", "visible", "kind", "required"),
    [
        ((A100,), None, "Ampere", AMPERE),
        ((A10,), None, "Ampere", AMPERE),
        # TP=2 is a FLASH_ATTN case: FA3, Hopper only
        ((A100, A100), None, "Ampere", AMPERE),
        ((H100,), None, "Hopper", HOPPER),
        ((H200,), None, "Hopper", HOPPER),
        ((H100, A100), None, "Ampere", AMPERE),  # mixed: the weakest GPU decides
        # A100 at index 0, H100 at 1: the agent that sees only the H100 is a Hopper one.
        ((A100, H100), "1", "Hopper", HOPPER),
        ((A100, H100), uuid(0), "Ampere", AMPERE),
        *(
            ((H100, H100), v, "Hopper", TWO_H100 if n == 2 else HOPPER)
            for v, n in VISIBLE
        ),
    ],
)
def test_required_cases_per_kind_gpu_count_and_visible_devices(
    gpus, visible, kind, required
):
    selected, cases = _select(_csv(*gpus), visible)
    assert selected.name == kind
    assert set(cases) == required and len(cases) == len(required)


UNREADABLE = "did not report the GPUs' index, uuid and compute cap"
OLD_QUERY = "name, compute_cap, memory.total [MiB]\nNVIDIA A10, 8.6, 1 MiB\n"
# CUDA_VISIBLE_DEVICES empty, an unknown index, a negative one, repeated; an ambiguous,
# unknown or repeated UUID (prefix).
HIDING = ["", "7", "-1", "0,0", "GPU-", "GPU-ffff"]
HIDING += ["GPU-1a5e1c1f-0b0e,GPU-1a5e1c1f-0b0e"]


@pytest.mark.parametrize(
    ("csv", "visible", "match"),
    [
        (_csv(T4), None, r"capability 7\.5 is older than Ampere"),
        ("Failed to initialize NVML: Driver/library mismatch\n", None, UNREADABLE),
        (OLD_QUERY, None, UNREADABLE),
        (HEADER, None, "listed no GPU"),
        (_csv(H100), "MIG-4b0c2c7e", "MIG instances: the nightly GPU job needs wh"),
        *((_csv(H100, H100), v, r"leaves none of the 2 GPU\(s\)") for v in HIDING),
    ],
)
def test_old_gpus_a_bad_nvidia_smi_and_hidden_gpus_are_refused(csv, visible, match):
    with pytest.raises(ForkError, match=match):
        _select(csv, visible)


def _conclude(gpus, statuses, reasons=None, *, out) -> str:
    """nightly.conclude with STATUSES split into the job's two pytest runs: the GPU
    tests in the tree, the serve test."""
    kind, required = _select(_csv(*gpus))
    in_tree = dict(statuses)
    serve = {SERVE: in_tree.pop(SERVE)} if SERVE in in_tree else {}
    runs = (
        Outcome(run, {n: r for n, r in (reasons or {}).items() if n in run})
        for run in (in_tree, serve)
    )
    return nightly.conclude(kind, required, *runs, 0, out)


def test_the_verdict_on_the_required_cases(tmp_path, capsys):
    # One H100: the TP=2 case skips, and that is allowed with one GPU.
    statuses = {case: "passed" for case in HOPPER} | {TP2: "skipped"}
    line = _conclude((H100,), statuses, {TP2: "needs 2 GPUs"}, out=tmp_path)
    assert line == f"summary: {len(HOPPER)} passed, 0 failed, 1 skipped, 0 xfailed"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpu_kind"] == "Hopper" and summary["required_not_run"] == []
    # Ampere may skip what only Hopper runs.
    statuses = {case: "passed" for case in AMPERE}
    statuses |= {case: "skipped" for case in EVERY_CASE - AMPERE}
    line = _conclude((A100,), statuses, out=tmp_path)
    assert line.endswith(f"0 failed, {len(EVERY_CASE - AMPERE)} skipped, 0 xfailed")
    # FA3 does not import on a Hopper runner: every FA3 and FLASH_ATTN case skips and
    # nothing fails. That is the green job this check exists to turn red.
    fa3_reason = "FlashAttention 3 is not supported on this GPU"
    sinks_reason = "GPT-OSS attention sinks need FlashAttention 3 (Hopper) or newer"
    flash = {case for case in EVERY_CASE if "FLASH_ATTN" in case}
    statuses = {case: "passed" for case in EVERY_CASE} | {FA3: "skipped"}
    statuses |= {case: "skipped" for case in flash}
    reasons = {FA3: fa3_reason} | dict.fromkeys(flash, sinks_reason)
    match = f"on Hopper: 0 failed .*, {len(flash | {FA3})} required case"
    with pytest.raises(ForkError, match=match):
        _conclude((H100, H100), statuses, reasons, out=tmp_path)
    printed = capsys.readouterr().out
    assert f"{FA3}: required but skipped: {fa3_reason}" in printed
    assert f"{TP2}: required but skipped: {sinks_reason}" in printed
    not_run = json.loads((tmp_path / "summary.json").read_text())["required_not_run"]
    assert len(not_run) == len(flash | {FA3})
    assert all("required but skipped" in line for line in not_run)
    # The serve test did not report at all (renamed, or its run produced no case).
    statuses = {case: "passed" for case in HOPPER - {SERVE}}
    with pytest.raises(ForkError, match="1 required case"):
        _conclude((H100,), statuses, out=tmp_path)
    assert f"{SERVE}: required but not run (not collected" in capsys.readouterr().out
    # A failure too (a failed benchmark: test_nightly.py's graceful stop test).
    statuses = {case: "passed" for case in AMPERE} | {TRITON: "failed"}
    with pytest.raises(ForkError, match="1 failed .*, 0 required case"):
        _conclude((A100,), statuses, out=tmp_path)


def test_the_gpu_table_and_its_required_node_ids():
    # What testrun checks after collecting the GPU cases (and the tool tests) on CPU.
    gpu_required.check_collected(EVERY_CASE | {f"{ENGINE}[some-new-case]"}, EVERY_CASE)
    renamed = (EVERY_CASE - {TP2}) | {f"{ENGINE}[FLASH_ATTN-v1-tp2-renamed]"}
    match = r"1 node id.* not collected: .*FLASH_ATTN-v1-tp2\]"
    with pytest.raises(ForkError, match=match):
        gpu_required.check_collected(renamed, EVERY_CASE)
    # The tree's cases are checked by `make test` after collecting them with vLLM; the
    # serve test is forkbuild's own, so a rename of it fails right here too.
    path, _, name = SERVE.partition("::")
    assert SERVE in EVERY_CASE
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    assert callable(getattr(module, name, None)), f"{path} has no {name}"
    # A case is required from its kind on, with its GPU count (fork.toml [gpu]).
    kinds = {"Hopper": {"capability": "9.0", "queues": {"h1": 1, "h2": 2}}}
    kinds["Ampere"] = {"capability": "8.0", "queues": {"a1": 1}}
    cases = {"a": {"kind": "Ampere", "bundle": []}}
    cases["h"] = {"kind": "Hopper", "not_in_bundle": "why"}
    cases["tp2"] = {"kind": "Hopper", "gpus": 2, "bundle": ["x"]}
    table = gpu_table({"kinds": kinds, "cases": cases})
    assert [k.name for k in table.kinds] == ["Ampere", "Hopper"]  # by capability
    assert table.kind("Ampere").required(2) == ("a",)
    assert table.kind("Hopper").required(1) == ("a", "h")
    assert table.kind("Hopper").required(2) == ("a", "h", "tp2")
    assert table.kind_of((10, 0)).name == "Hopper" and table.kind_of((7, 5)) is None
    assert table.kind("Hopper").queues == (("h1", 1), ("h2", 2))
    assert table.cases["tp2"].bundle == ("x",) and table.cases["a"].bundle == ()
    assert table.cases["h"].bundle is None and table.cases["h"].not_in_bundle == "why"
    with pytest.raises(ForkError, match="unknown kinds: Blackwell"):
        gpu_table({"kinds": {}, "cases": {"b": {"kind": "Blackwell"}}})
