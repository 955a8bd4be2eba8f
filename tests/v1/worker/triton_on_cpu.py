# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run vLLM's real Triton kernels on CPU tensors, under Triton's interpreter.

For a fresh process that sets ``TRITON_INTERPRET=1`` and calls
``enable_triton_on_cpu()`` before anything imports vLLM: Triton's interpreter
switch and vLLM's Triton gate are read once, at import.
"""


def enable_triton_on_cpu() -> None:
    """Environment shims, not mocks: they make the real kernels runnable here.

    vLLM disables Triton when no GPU driver is active; on a "+cpu" build it keeps
    Triton only if Triton knows a "cpu" backend, which Triton 3.x does not ship.
    An inactive placeholder entry passes that gate without changing which driver
    Triton picks. The cache-write kernel sizes its tiles from the CUDA device
    capability, which has no answer without a GPU: report Hopper's.
    """
    import torch
    import triton.backends

    class _InactiveDriver:
        @classmethod
        def is_active(cls):
            return False

    triton.backends.backends.setdefault(
        "cpu", triton.backends.Backend(compiler=None, driver=_InactiveDriver)
    )
    torch.cuda.get_device_capability = lambda device=None: (9, 0)


def run_case_in_fresh_process(
    script: str, *args: str, env: dict[str, str | None], timeout: float = 600
) -> str:
    """Run SCRIPT (a test module that is also its case's worker) with ARGS in a
    fresh interpreter, the checkout's root first on PYTHONPATH so that it imports
    the ``tests`` package as pytest does, with ENV over this process's
    environment (None: unset). It must exit cleanly and print "all checks
    passed". A kernel that writes out of bounds may kill its process: that fails
    the case instead of the test session. Returns the worker's stdout."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(script).resolve().parents[3])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    merged = {**os.environ, "PYTHONPATH": path, **env}
    result = subprocess.run(
        [sys.executable, script, *args],
        env={key: value for key, value in merged.items() if value is not None},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    report = (result.stdout + result.stderr)[-6000:]
    assert result.returncode >= 0, (
        f"case process killed by signal {-result.returncode}:\n{report}"
    )
    assert result.returncode == 0, report
    assert "all checks passed" in result.stdout, report
    return result.stdout
