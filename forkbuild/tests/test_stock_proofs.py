"""The GPU bundle's proofs beside its cases, without a GPU: how a stock failure is read
from pytest-forked's real reports, memcheck's summary, and the stock overlay run for
real on a CPU case of the fork's tree that executes _reshape_attention_kv_cache (with
stock's module it fails and the record shows stock's function ran; without the overlay
it passes, and the runner's check refuses the record)."""

import os
import sys
from pathlib import Path

import pytest

from forkbuild.core import fixcheck, pins, pytest_runner
from forkbuild.core.pytest_runner import Outcome
from forkbuild.gpu.bundle import build as gpu_bundle
from forkbuild.gpu.bundle import proofs
from forkbuild.setup import install, tree

# How a stock case can end, as the forked child ends it (the real plugin, its reports).
ENDINGS = """import os
import signal
import types

import pytest

torch = types.SimpleNamespace(testing=types.SimpleNamespace())

def _close(actual, expected, msg):
    raise AssertionError(msg)

torch.testing.assert_close = _close

IMA = "CUDA error: an illegal memory access was encountered"

@pytest.fixture
def broken():
    raise RuntimeError("a view that does not fit")

@pytest.fixture
def cleanup():  # vLLM's conftest's cleanup_fixture: empty_cache raises again
    yield
    raise RuntimeError(IMA)

def test_memory():
    raise RuntimeError(IMA)

def test_memory_then_teardown(cleanup):
    raise RuntimeError(IMA)

def test_teardown_only(cleanup):
    pass

def test_misaligned():
    raise RuntimeError("Triton Error [CUDA]: misaligned address")

def test_exits():  # a worker's exception or SystemExit: no crash
    os._exit(3)

def test_not_close_call():  # assert_close( in the traceback, no AssertionError
    torch.testing.assert_close(1.0)

def test_crash():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_mismatch():
    torch.testing.assert_close(1.0, 2.0, msg="model.layers.0.self_attn.attn")

def test_other():
    raise ValueError("something else")

def test_setup(broken):
    pass

def test_passes():
    pass
"""
IMA = "an illegal memory access was encountered"
WANT = {
    "test_memory": IMA,
    "test_memory_then_teardown": IMA,  # the call's failure, not the teardown's error
    "test_teardown_only": "",
    "test_misaligned": "misaligned address",
    "test_exits": "",
    "test_not_close_call": "",
    "test_crash": "crash",
    "test_mismatch": "mismatch",
    "test_other": "",  # failed, but not as stock's view fails: no proof
    "test_setup": "",  # an error in setup proves nothing
    "test_passes": "",
}


def test_a_stock_failure_is_read_as_what_it_was(tmp_path):
    (tmp_path / "test_endings.py").write_text(ENDINGS)
    args = ["-p", "pytest_forked", "--forked", "test_endings.py"]  # the runner's
    env = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    junit = tmp_path / "endings.xml"
    outcome = pytest_runner.run_pytest(
        Path(sys.executable), tmp_path, args, junit, extra_env=env
    )
    found = {
        node.split("::")[-1]: proofs.failure_kind(status, outcome.said.get(node, ""))
        for node, status in outcome.cases.items()
    }
    assert found == WANT, outcome.said


def _events(origin: Path, verdict: str, case: str) -> list[dict]:
    loaded = {"event": "loaded", "origin": str(origin), "verdict": verdict}
    return [loaded, {**loaded, "event": "ran", "case": case}]


def test_stock_fails_and_fork_passes_only_with_stock_run_and_failing(tmp_path):
    node, stock = "t.py::case", tmp_path / "stock.py"
    fork = Outcome({node: "passed"})
    said = {node: "E   RuntimeError: CUDA error: an illegal memory access"}
    failed = Outcome({node: "failed"}, said=said)
    verdict = proofs.stock_verdict(
        node, fork, failed, _events(stock, "buggy", node), stock
    )
    assert verdict["proved"] and verdict["line"] == (
        "stock fails (an illegal memory access), fork passes"
    )
    other = tmp_path / "attn_utils.py"  # the fork's module: the overlay was not used
    verdict = proofs.stock_verdict(
        node, fork, failed, _events(other, "fixed", node), stock
    )
    assert not verdict["proved"] and "not stock's" in verdict["line"]
    ran_elsewhere = _events(stock, "buggy", "t.py::other")
    verdict = proofs.stock_verdict(node, fork, failed, ran_elsewhere, stock)
    assert verdict["line"] == "stock's function did not run in the case"
    passed = Outcome({node: "passed"})
    verdict = proofs.stock_verdict(
        node, fork, passed, _events(stock, "buggy", node), stock
    )
    assert verdict["line"] == "on stock it passed"
    broken_fork = Outcome({node: "failed"})
    verdict = proofs.stock_verdict(
        node, broken_fork, failed, _events(stock, "buggy", node), stock
    )
    assert verdict["line"] == "on the fork it failed"


def test_memcheck_needs_its_summary_at_zero_and_the_case_passed(tmp_path):
    node, log = "t.py::fa3", tmp_path / "sanitizer.log"
    passed = Outcome({node: "passed"})
    log.write_text(
        "========= COMPUTE-SANITIZER\n...\n========= ERROR SUMMARY: 0 errors\n"
    )
    verdict = proofs.sanitizer_verdict(node, passed, log, 95.4)
    assert verdict["proved"] and verdict["errors"] == 0 and verdict["seconds"] == 95.4
    assert verdict["line"] == "memcheck: 0 errors, case passed in 95 s"
    log.write_text("========= Invalid __global__ read of size 2 bytes\n")
    log.write_text(log.read_text() + "========= ERROR SUMMARY: 1 error\n")
    assert proofs.sanitizer_verdict(node, passed, log, 1)["errors"] == 1
    log.write_text("no summary: the sanitizer was killed\n")
    verdict = proofs.sanitizer_verdict(node, passed, log, 1)
    assert not verdict["proved"] and verdict["errors"] is None


def test_figures_are_read_from_the_benchmarks_report(tmp_path):
    report = tmp_path / "offload-figures.json"
    assert proofs.figures_verdict(report, 1, 3)["line"] == "figures: no report (exit 1)"
    report.write_text('{"runs": [')  # cut short: no report, not a crash of the runner
    assert (
        proofs.figures_verdict(report, -1, 3)["line"] == "figures: no report (exit -1)"
    )
    run = {"layout": "per-layer", "store_GBps": 20.04, "load_GBps": 18.0}
    run |= {"ttft_cold_batch_s": 0.5, "ttft_cpu_hit_batch_s": 0.25}
    pinned = {"h2d_GBps": 50.0, "d2h_GBps": 51.0}
    report.write_text(__import__("json").dumps({"runs": [run], "pinned_copy": pinned}))
    verdict = proofs.figures_verdict(report, 0, 3)
    assert verdict["proved"] and verdict["report"]["pinned_copy"] == pinned
    assert verdict["line"] == (
        "figures: per-layer: store 20.0 GB/s, load 18.0 GB/s, TTFT cold 0.500 s vs CPU "
        "hit 0.250 s; pinned copy D2H 51.0 GB/s, H2D 50.0 GB/s"
    )


# A CPU case of the fork's tree whose reshape runs _reshape_attention_kv_cache on a
# packed page: it fails on stock 0.25.1 (the regression proof lists it).
CPU_CASE = (
    "tests/v1/worker/test_packed_kv_cache_pipeline.py::test_offload_packed_kv_cache_"
    "views[SimpleCPUOffloadConnector-FLASH_ATTN-v2]"
)


@pytest.fixture(scope="module")
def fork_tree() -> Path:
    fork_pins = pins.load()
    path, python = tree.tree_dir(fork_pins), install.venv_python()
    if not (path.is_dir() and python.exists()):
        pytest.skip(
            "needs the fork's tree and venv: make install (make test makes them)"
        )
    return path


def _overlaid(fork_tree: Path, tmp_path: Path, stock: Path | None):
    report = tmp_path / f"{'stock' if stock else 'fork'}.jsonl"
    outcome = pytest_runner.run_pytest(
        install.venv_python(),
        fork_tree,
        [*(["-p", proofs.OVERLAY] if stock else []), CPU_CASE],
        tmp_path / f"{report.stem}.xml",
        pythonpath=os.pathsep.join([str(fork_tree), str(pins.REPO_ROOT)]),
        output=tmp_path / f"{report.stem}.log",
        extra_env={
            proofs.ENV: str(stock or ""),
            proofs.REPORT_ENV: str(report),
        },
    )
    return outcome.cases.get(CPU_CASE), proofs.read_events(report)


def test_the_overlay_runs_stocks_function_and_the_check_fails_without_it(
    fork_tree, tmp_path
):
    # stock's module as the bundle carries it: the release commit's, read as buggy
    component = gpu_bundle.stock_component(pins.load(), fork_tree, tmp_path)
    stock = next(iter(component.files.values()))
    status, events = _overlaid(fork_tree, tmp_path, stock)
    ran = [e for e in events if e["event"] == "ran"]
    assert status == "failed", tmp_path
    assert ran and {(e["origin"], e["verdict"], e["case"]) for e in ran} == {
        (str(stock), "buggy", CPU_CASE)
    }
    assert proofs.not_stock(events, stock) == ""
    # On purpose without the overlay: the fork's function runs, the case passes, and
    # the check the runner's stock verdict rests on fails (nothing was recorded).
    status, events = _overlaid(fork_tree, tmp_path, None)
    assert status == "passed" and events == [], tmp_path
    assert "nothing recorded" in proofs.not_stock(events, stock)
    fork_module = fork_tree / fixcheck.MODULE_PATH  # a record of the fork's is refused
    assert "not stock's" in proofs.not_stock(_events(fork_module, "fixed", ""), stock)
