"""What the GPU bundle's runner proves beside the fork's cases, read from what ran
(docs/gpu-nightly.md, "What the first run proves"): stock's module fails the cases the
fork passes, compute-sanitizer's memcheck finds no error in the fork's FA3 case, and
the offload benchmark's figures. Standard library only: the GPU host's python3."""

import json
import re
import shutil
from pathlib import Path

from forkbuild.core.pytest_runner import Outcome

# stock_overlay.py, the stock runs' pytest plugin (-p: imported only where it is to
# work), its settings: stock's module file, and where it records what loaded and ran.
OVERLAY = "forkbuild.gpu.bundle.stock_overlay"
ENV, REPORT_ENV = "FORK_BUNDLE_STOCK", "FORK_BUNDLE_STOCK_REPORT"

# compute-sanitizer: where the host's PATH lacks it, the CUDA toolkit's usual place.
SANITIZER = ("compute-sanitizer", "/usr/local/cuda/bin/compute-sanitizer")
# memcheck of the application's process (the run is not forked); CUDA API errors are
# not reported: torch's and FA3's probing calls fail on purpose, and would count in
# the ERROR SUMMARY (--report-api-errors, compute-sanitizer's documentation).
SANITIZER_ARGS = ("--tool", "memcheck", "--report-api-errors", "no")
_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
# What a failure on stock may be, found in JUnit's text of the case: a CUDA fault (as
# torch or Triton words it), pytest-forked's report of a child killed by a signal, an
# AssertionError (the cases' torch.testing.assert_close: its message is the layer's).
_CUDA_FAULT = re.compile(
    r"^(?:E\s+)?\w*Error: (?:CUDA error|Triton Error \[CUDA\]): (.+)$", re.MULTILINE
)
FAILURES = (
    ("crash", re.compile("CRASHED with signal")),
    ("mismatch", re.compile(r"^(E\s+)?AssertionError", re.MULTILINE)),
)


def failure_kind(status: str, said: str) -> str:
    """What a stock case failed with (the CUDA fault's words, or FAILURES), "" where it
    did not fail so: a skip, a pass, or an error without the call's failure (in setup)
    prove nothing; pytest-forked reports a child that died as an error, a crash."""
    fault = _CUDA_FAULT.search(said)
    marked = [kind for kind, mark in FAILURES if mark.search(said)]
    kind = fault.group(1).strip()[:80] if fault else (marked or [""])[0]
    return kind if status == "failed" or (status, kind) == ("error", "crash") else ""


def read_events(report: Path) -> list[dict]:
    """stock_overlay.py's JSON lines (none if it wrote none)."""
    if not report.is_file():
        return []
    return [json.loads(line) for line in report.read_text().splitlines() if line]


def did_not_run(cause: str) -> dict:
    """A proof whose run did not end as pytest's (the sanitizer or pytest failed to
    start, ...): not proved, and why."""
    return {"proved": False, "line": f"did not run: {cause}"}


OUT_OF_TIME = {"proved": False, "line": "not run: out of time"}  # the run's deadline


def not_stock(events: list[dict], stock_file: Path) -> str:
    """What is wrong with the module the run loaded, "" if it was STOCK_FILE and its
    function reads as buggy: what the stock runs' proof rests on."""
    loaded = [(e["origin"], e["verdict"]) for e in events if e["event"] == "loaded"]
    if loaded and all(found == (str(stock_file), "buggy") for found in loaded):
        return ""
    shown = ", ".join(f"{o} ({v})" for o, v in loaded) or "nothing recorded"
    return f"the module loaded was {shown}, not stock's {stock_file}"


def stock_verdict(node: str, fork: Outcome, stock: Outcome, events, stock_file) -> dict:
    """NODE's proof: stock's module was the one loaded and its function ran in the case
    (EVENTS), the case failed there as FAILURES tells, and passed on the fork."""
    origin = str(stock_file)
    ran = [e for e in events if e["event"] == "ran" and e["case"] == node]
    status = stock.cases.get(node, "not run")
    kind = failure_kind(status, stock.said.get(node, ""))
    problems = [wrong] if (wrong := not_stock(events, stock_file)) else []
    ran = any((e["origin"], e["verdict"]) == (origin, "buggy") for e in ran)
    if not ran:
        problems.append("stock's function did not run in the case")
    if not kind:
        first = _first_error(stock.said.get(node, ""))
        problems.append(f"on stock it {status}{f' ({first})' if first else ''}")
    fork_status = fork.cases.get(node, "not run")
    if fork_status != "passed":
        problems.append(f"on the fork it {fork_status}")
    line = f"stock fails ({kind}), fork passes" if not problems else "; ".join(problems)
    return {
        "stock": status,
        "failure": kind,
        "stock_function_ran": ran,
        "fork": fork_status,
        "proved": not problems,
        "line": line,
    }


def _first_error(said: str) -> str:
    """The first `E ` line of pytest's report (the exception), else its first line."""
    lines = [line.strip() for line in said.strip().splitlines()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return ([*errors, *lines] or [""])[0][:200]


def sanitizer() -> str | None:
    """The host's compute-sanitizer, if it has one."""
    found = [shutil.which(name) for name in SANITIZER]
    return next(filter(None, found), None)


def sanitizer_verdict(node: str, outcome: Outcome, log: Path, seconds: float) -> dict:
    """memcheck's ERROR SUMMARY of the run in LOG: 0 errors, and the case passed."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    counts = [int(n) for n in _ERROR_SUMMARY.findall(text)]
    errors = sum(counts) if counts else None
    status = outcome.cases.get(node, "not run")
    proved = errors == 0 and status == "passed" and not outcome.killed
    said = "no ERROR SUMMARY" if errors is None else f"{errors} errors"
    line = f"memcheck: {said}, case {status} in {seconds:.0f} s" + (
        f" ({outcome.killed})" if outcome.killed else ""
    )
    return {
        "case": node,
        "errors": errors,
        "case_status": status,
        "seconds": round(seconds, 1),
        "proved": proved,
        "line": line,
    }


def figures_verdict(report: Path, returncode: int, seconds: float) -> dict:
    """The benchmark's JSON REPORT (it exits non-zero where a figure is missing)."""
    try:
        found = json.loads(report.read_text())
    except (OSError, ValueError):  # none, or cut short
        found = {}
    found = found if isinstance(found, dict) else {}
    runs = found.get("runs") or []
    pinned = found.get("pinned_copy") or {}
    shown = [
        f"{run.get('layout')}: store {_gbps(run.get('store_GBps'))}, load "
        f"{_gbps(run.get('load_GBps'))}, TTFT cold {_s(run.get('ttft_cold_batch_s'))} "
        f"vs CPU hit {_s(run.get('ttft_cpu_hit_batch_s'))}"
        for run in runs
    ]
    limit = f"pinned copy D2H {_gbps(pinned.get('d2h_GBps'))}, H2D "
    limit += _gbps(pinned.get("h2d_GBps"))
    proved = returncode == 0 and bool(found)
    line = "figures: " + ("; ".join([*shown, limit]) if found else "no report")
    return {
        "exit": returncode,
        "seconds": round(seconds, 1),
        "proved": proved,
        "report": found,
        "line": line + ("" if proved else f" (exit {returncode})"),
    }


def _gbps(value) -> str:
    return f"{value:.1f} GB/s" if isinstance(value, (int, float)) else "none"


def _s(value) -> str:
    return f"{value:.3f} s" if isinstance(value, (int, float)) else "none"
