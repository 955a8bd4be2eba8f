"""The offload benchmark fails when a figure it reports is zero or missing (checked on
synthetic reports: the benchmark itself needs a GPU)."""

import copy
import runpy
from types import SimpleNamespace

import pytest

from forkbuild.core.pins import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
# By path: benchmarks/ is no package, and the benchmark script imports torch and vLLM.
figures = SimpleNamespace(**runpy.run_path(str(BENCHMARKS / "offload_figures.py")))


LAYOUTS = ("cross-layer (packed)", "per-layer")
COMPLETE = {
    "gpu": "NVIDIA H100 80GB HBM3",
    "model": "tiny-gpt-oss",
    "runs": [{"layout": n, **dict.fromkeys(figures.RUN_FIGURES, 1.5)} for n in LAYOUTS],
    "pinned_copy": dict.fromkeys(figures.PINNED_COPY_FIGURES, 24.0),
}


@pytest.mark.parametrize(
    "bad", [0, 0.0, None, -1.0, float("nan"), float("inf"), "12", True]
)
@pytest.mark.parametrize("name", figures.RUN_FIGURES)
def test_a_zero_or_invalid_run_figure_is_reported(name, bad):
    report = copy.deepcopy(COMPLETE)
    report["runs"][1][name] = bad
    assert figures.missing_figures(report) == [f"runs[1] (per-layer).{name}: {bad!r}"]


def test_absent_figures_runs_and_pinned_copy_are_reported():
    assert figures.missing_figures(COMPLETE) == []  # a complete report: none
    report = copy.deepcopy(COMPLETE)
    del report["runs"][0]["load_GBps"]
    del report["pinned_copy"]["d2h_GBps"]
    assert figures.missing_figures(report) == [
        "runs[0] (cross-layer (packed)).load_GBps: None",
        "pinned_copy.d2h_GBps: None",
    ]
    missing = figures.missing_figures({"gpu": "x"})
    assert missing[0] == "runs: expected 2 layout runs, got None"
    assert missing[1:] == ["pinned_copy.h2d_GBps: None", "pinned_copy.d2h_GBps: None"]
    one_run = {**COMPLETE, "runs": COMPLETE["runs"][:1]}
    assert figures.missing_figures(one_run)[0].startswith("runs: expected 2 layout")


def test_the_benchmark_exits_non_zero_on_missing_figures():
    # The script needs a GPU to run; its source must at least apply the check.
    source = (BENCHMARKS / "offload_throughput_gpu.py").read_text()
    assert "from offload_figures import missing_figures" in source
    assert "missing = missing_figures(report)" in source
    assert "raise SystemExit(" in source
