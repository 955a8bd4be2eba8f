"""Which figures of an offload_throughput_gpu.py report are missing.

A benchmark that prints 0 GB/s or no TTFT has measured nothing (a counter that did not
move, a store that never happened); it must fail the nightly job instead of publishing
the zero. Standard library only, so that forkbuild's CPU tests can check it without
torch or vLLM.
"""

from __future__ import annotations

import math
from typing import Any

# Per layout run: the connector's byte counters, the GB/s derived from them, and the
# batch TTFTs cold and on a CPU hit.
RUN_FIGURES = (
    "store_bytes",
    "load_bytes",
    "store_GBps",
    "load_GBps",
    "ttft_cold_batch_s",
    "ttft_cpu_hit_batch_s",
)
PINNED_COPY_FIGURES = ("h2d_GBps", "d2h_GBps")
LAYOUTS = 2  # cross-layer (packed) and per-layer


def _is_positive_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def missing_figures(report: dict[str, Any]) -> list[str]:
    """One line per figure of REPORT that is absent, not a number, zero or negative."""
    problems = []
    runs = report.get("runs")
    if not isinstance(runs, list) or len(runs) != LAYOUTS:
        problems.append(f"runs: expected {LAYOUTS} layout runs, got {runs!r}")
        runs = runs if isinstance(runs, list) else []
    for index, run in enumerate(runs):
        run = run if isinstance(run, dict) else {}
        where = f"runs[{index}] ({run.get('layout', 'no layout')})"
        problems += [
            f"{where}.{name}: {run.get(name)!r}"
            for name in RUN_FIGURES
            if not _is_positive_number(run.get(name))
        ]
    pinned = report.get("pinned_copy")
    pinned = pinned if isinstance(pinned, dict) else {}
    problems += [
        f"pinned_copy.{name}: {pinned.get(name)!r}"
        for name in PINNED_COPY_FIGURES
        if not _is_positive_number(pinned.get(name))
    ]
    return problems
