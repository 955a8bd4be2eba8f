"""Regenerate docs/backport-audit-files.txt: the vllm/ files the CPU engine test runs.

    build/venv/bin/python docs/make_backport_audit_files.py            # trace, then
    write build/venv/bin/python docs/make_backport_audit_files.py --raw DIR  # keep the
    raw trace

It runs tests/v1/worker/test_packed_kv_cache_offload_cpu_engine.py with pytest inside
the patched tree (build/vllm-0.25.1), with a sitecustomize.py first on PYTHONPATH. That
hook installs sys.settrace (and threading.settrace) in every Python process of the run:
the pytest process and the fresh case process that runs the engine. The hook records
each function that starts running (one set lookup a call; it returns None, so no line
events) and, at exit, the files of sys.modules. A file counts as executed when a
function of it ran: a code object with CO_OPTIMIZED (so not a module or class body),
other than a comprehension or lambda that a module body runs at import. The executed
files, with ADDED, are compared between the 0.25.1 and 0.26.0 sdists
(forkbuild.upstream.rebase.differing_files); the audited set is cut from those that
differ by the rule of KV_PATH below. About 4 minutes on 2 cores (the test with the
trace on); --no-trace --raw DIR rewrites from a kept trace.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from forkbuild.core import pins  # noqa: E402
from forkbuild.setup import fetch, install, tree  # noqa: E402
from forkbuild.upstream import rebase  # noqa: E402

OUTPUT = REPO / "docs" / "backport-audit-files.txt"
TEST = "tests/v1/worker/test_packed_kv_cache_offload_cpu_engine.py"
NEXT = rebase.AUDIT_RELEASE

# The audited set (the rule docs/backport-audit.md states): the executed files that
# differ and lie on the KV-cache path of the #47054 configuration, that is the code that
# plans, allocates, views, writes, reads or moves the packed KV cache, or runs the
# offloading connector. The generic block accounting (v1/core/sched/,
# kv_cache_manager.py, ...) and everything else that ran and differs is listed as
# excluded, with a reason in the audit.
KV_PATH = (
    "vllm/distributed/kv_transfer/",
    "vllm/v1/kv_offload/",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm/v1/worker/gpu/attn_utils.py",
    "vllm/v1/worker/utils.py",
    "vllm/v1/attention/backend.py",
    "vllm/v1/attention/backends/",
    "vllm/v1/attention/ops/",
    "vllm/model_executor/layers/attention/attention.py",
)
# Added although the CPU engine does not run them: what a GPU runs in their place
# (FlashAttention where the CPU engine runs Triton; the CUDA transfer worker where the
# test's host-copy worker stands in), the SimpleCPUOffloadConnector and MultiConnector
# roads of docs/affected.md, and the tiering spec.
ADDED = {
    "vllm/v1/attention/backends/flash_attn.py": "GPU: the backend of #47054",
    "vllm/vllm_flash_attn/flash_attn_interface.py": "GPU: FlashAttention's kernels",
    "vllm/v1/kv_offload/cpu/gpu_worker.py": "GPU: CPUOffloadingSpec's transfer worker",
    "vllm/v1/kv_offload/cpu/shared_offload_region.py": "GPU: its host memory",
    "vllm/v1/simple_kv_offload/manager.py": "road: SimpleCPUOffloadConnector",
    "vllm/v1/kv_offload/tiering/spec.py": (
        "the tiering spec: its DP region (issue 28, #47987)"
    ),
    "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py": (
        "road: MultiConnector(NIXL + Offloading) (issue 36, #46865)"
    ),
}

SITECUSTOMIZE = textwrap.dedent("""
    import atexit, json, os, sys, threading
    _dir = os.environ.get("AUDIT_TRACE_DIR")
    if _dir:
        _seen = set()
        _ran = set()
        def _trace(frame, event, arg):
            code = frame.f_code
            if code not in _seen:
                _seen.add(code)
                # A function ran: CO_OPTIMIZED (class bodies lack it), and not a
                # comprehension or lambda run by a module body at import.
                caller = frame.f_back
                if code.co_flags & 0x1 and not (
                    code.co_name.startswith("<")
                    and caller is not None
                    and caller.f_code.co_name == "<module>"
                ):
                    _ran.add(code)
            return None
        sys.settrace(_trace)
        threading.settrace(_trace)
        def _dump():
            sys.settrace(None)
            ran = {}
            for code in list(_ran):
                ran.setdefault(code.co_filename, []).append(code.co_name)
            imported = sorted({getattr(m, "__file__", None) or ""
                               for m in list(sys.modules.values())} - {""})
            out = {"argv": sys.argv, "ran": {k: sorted(set(v)) for k, v in ran.items()},
                   "imported": imported}
            with open(os.path.join(_dir, f"{os.getpid()}.json"), "w") as f:
                json.dump(out, f)
        atexit.register(_dump)
""")


def trace(raw: Path) -> None:
    """Run the test with the hook; RAW gets one JSON file per Python process."""
    raw.mkdir(parents=True, exist_ok=True)
    hook = raw / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(hook), "AUDIT_TRACE_DIR": str(raw)}
    done = subprocess.run(
        [
            str(install.venv_python()),
            "-m",
            "pytest",
            TEST,
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=tree.tree_dir(pins.load()),
        env=env,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"the test failed (exit {done.returncode}); no file written")


def _inner(path: str) -> str | None:
    """vllm/... for a file of the vllm package, else None."""
    parts = Path(path).parts
    if "vllm" not in parts or not path.endswith(".py"):
        return None
    i = len(parts) - 1 - parts[::-1].index("vllm")
    return "/".join(parts[i:])


def collect(raw: Path) -> tuple[set[str], set[str]]:
    executed, imported = set(), set()
    for dump in raw.glob("*.json"):
        data = json.loads(dump.read_text())
        executed.update(filter(None, map(_inner, data["ran"])))
        imported.update(filter(None, map(_inner, data["imported"])))
    return executed, imported - executed


def write(raw: Path) -> None:
    fork_pins = pins.load()
    python = install.venv_python()
    old = fetch.fetch(fork_pins.sdist, lambda: python, quiet=True)
    new = fetch.fetch(fork_pins.release(NEXT).sdist, lambda: python, quiet=True)
    executed, imported_only = collect(raw)
    differing = rebase.differing_files(old, new, sorted(executed | set(ADDED)))
    audited = sorted(
        f for f in differing if f in ADDED or (f in executed and f.startswith(KV_PATH))
    )
    excluded = sorted(set(differing) - set(audited))
    lines = [
        "# The files the #47054 configuration runs, for docs/backport-audit.md.",
        "# Produced by docs/make_backport_audit_files.py: a settrace hook in every "
        "process of",
        f"# `pytest {TEST}` in build/vllm-0.25.1",
        "# (a file is executed when a function of it ran; module and class bodies do "
        "not count).",
        "# differs: the file is not byte-identical in "
        f"vllm-{fork_pins.upstream_version}.tar.gz and vllm-{NEXT}.tar.gz.",
        "# [audited] is read by forkbuild/tests/test_backport_audit.py: every file "
        "there that",
        "# differs must have a row in the audit's file table.",
        "",
        "[audited]  # executed and differing on the KV-cache path, and the added files "
        "below",
        *audited,
        "",
        "[added]  # of [audited]: not run by the CPU engine",
        *(f"{f}  # {why}" for f, why in sorted(ADDED.items()) if f in audited),
        "",
        "[excluded]  # executed and differing, off that path; one-line reasons in the "
        "audit",
        *excluded,
        "",
        f"[executed]  # {len(executed)} files",
        *sorted(executed),
        "",
        f"[imported-only]  # {len(imported_only)} files imported, no function of them "
        "ran",
        *sorted(imported_only),
    ]
    OUTPUT.write_text("\n".join(lines) + "\n")
    print(
        f"{OUTPUT}: {len(executed)} executed; {len(differing)} differ (with the "
        f"{len(ADDED)} added files); {len(audited)} audited, {len(excluded)} excluded"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--raw", type=Path, help="keep the raw trace here (default: a temporary folder)"
    )
    parser.add_argument(
        "--no-trace", action="store_true", help="reuse the trace in --raw"
    )
    args = parser.parse_args()
    if args.no_trace:
        write(args.raw)
        return
    with tempfile.TemporaryDirectory(prefix="audit-trace-") as tmp:
        raw = args.raw or Path(tmp)
        trace(raw)
        write(raw)


if __name__ == "__main__":
    main()
