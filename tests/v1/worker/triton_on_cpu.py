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
