# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU->GPU offloading loads from pageable host memory use the DMA copy.

The CPU offloading worker (``vllm/v1/kv_offload/cpu/gpu_worker.py``) picks each
direction's copy function when it builds its handlers. For loads of small,
8-byte-aligned KV pages vLLM 0.25.1 picks Triton's ``swap_blocks_batch``
(``_select_swap_blocks_fn``, :35-58), whose kernel loads the CPU pages through
their host addresses on the GPU: valid for pinned memory only. The worker's
host memory is pageable when pinning is off (``PIN_MEMORY``, off by default
under WSL2: ``vllm/platforms/cuda.py`` :282-300) and when the tiering spec's
shared region was not registered with CUDA (pinning off, or cudaHostRegister
refused it: ``pin_mmap_region``, :123-150). 0.25.1 picks the kernel anyway;
on a GPU its first load faults or reads wrong bytes.

Each case builds the real ``CPUOffloadingWorker`` (0.24's
``CpuGpuOffloadingHandlers``) with pageable host memory, as the offloading
specs build it, and checks the copy function of its load handler. Every case
fails on 0.25.1 (the load handler holds Triton's copy) and passes with the
fork's patch 0007, as on vLLM 0.31.0, the first release that tells the
selection whether the host memory is pinned.

Stand-ins for what this CPU-only machine lacks (the worker, its handlers and
the selection run unchanged):
- ``DeviceMemory``: CPU tensors that report themselves as CUDA tensors, for the
  handler's device check; nothing here reads them.
- Triton on: vLLM turns Triton off where no GPU driver is active, which on its
  own would send every load to the DMA copy and hide the defect.
- A refused ``pin_mmap_region``: cudaHostRegister needs a CUDA driver. The
  stand-in leaves the region pageable, as the real one does when the driver
  refuses the registration.
"""

import uuid
from typing import Any

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

pytestmark = pytest.mark.cpu_test

# 0.24 builds the same two handlers as CpuGpuOffloadingHandlers.
Worker = getattr(gpu_worker, "CPUOffloadingWorker", None) or getattr(
    gpu_worker, "CpuGpuOffloadingHandlers", None
)
if Worker is None:
    pytest.skip(
        "this vLLM has neither CPUOffloadingWorker nor CpuGpuOffloadingHandlers",
        allow_module_level=True,
    )

NUM_GPU_BLOCKS = 8
NUM_CPU_BLOCKS = 4
HOST_MEMORY = ["pinning-off", "pinning-off-shared-region", "registration-refused"]


class DeviceMemory(torch.Tensor):
    """Stands in for a CUDA KV cache tensor: CPU memory that says it is CUDA's."""

    @property
    def is_cuda(self) -> bool:
        return True


def _refused_host_registration(region: SharedOffloadRegion, *args, **kwargs) -> None:
    """Stands in for cudaHostRegister failing: the region stays pageable."""


@pytest.fixture
def triton_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # The selection consults Triton as it would on a CUDA host, where it is on.
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(gpu_worker, "HAS_TRITON", True)
    monkeypatch.setattr(gpu_worker, "triton", triton)


def _kv_caches(page_sizes: list[int]) -> CanonicalKVCaches:
    tensors = [
        CanonicalKVCacheTensor(
            tensor=torch.zeros(NUM_GPU_BLOCKS, size, dtype=torch.int8).as_subclass(
                DeviceMemory
            ),
            page_size_bytes=size,
        )
        for size in page_sizes
    ]
    refs = [
        CanonicalKVCacheRef(tensor_idx=idx, page_size_bytes=size)
        for idx, size in enumerate(page_sizes)
    ]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[refs])


def _shared_region(page_sizes: list[int]) -> SharedOffloadRegion:
    # One worker (rank 0) whose row holds every tensor's page, padded to the
    # host page size the region requires, as the tiering spec sizes it.
    worker_page = sum(page_sizes)
    align = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    row = -(-worker_page // align) * align
    return SharedOffloadRegion(
        f"fork-test-{uuid.uuid4().hex}", NUM_CPU_BLOCKS, 0, row, worker_page
    )


def _handlers(worker: Any) -> tuple[Any, Any]:
    """The worker's load (CPU->GPU) and store (GPU->CPU) handlers."""
    if hasattr(worker, "_load_handler"):
        return worker._load_handler, worker._store_handler
    return worker.cpu_to_gpu_handler, worker.gpu_to_cpu_handler


@pytest.mark.parametrize(
    "page_sizes", [[512], [2048, 16384]], ids=["512B", "2KiB+16KiB"]
)
@pytest.mark.parametrize("host_memory", HOST_MEMORY)
def test_pageable_host_memory_loads_with_dma(
    host_memory: str,
    page_sizes: list[int],
    triton_on: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv_caches = _kv_caches(page_sizes)
    # In pinned memory these pages take Triton's copy: the stand-ins leave the
    # kernel selectable, so only the host memory can turn it down below.
    pinned_choice = gpu_worker._select_swap_blocks_fn(kv_caches.group_data_refs, False)
    assert pinned_choice is not ops.swap_blocks_batch

    monkeypatch.setattr(gpu_worker, "PIN_MEMORY", host_memory == "registration-refused")
    monkeypatch.setattr(gpu_worker, "pin_mmap_region", _refused_host_registration)
    region = None if host_memory == "pinning-off" else _shared_region(page_sizes)
    try:
        worker = Worker(kv_caches, 1, NUM_CPU_BLOCKS, region)
    except BaseException:
        if region is not None:
            region.cleanup()  # its file in /dev/shm outlives the process
        raise
    load_handler, store_handler = _handlers(worker)
    try:
        assert region is None or not region.is_pinned
        load_copy = load_handler._swap_blocks_batch
        assert load_copy is ops.swap_blocks_batch, (
            f"a CPU->GPU load from pageable host memory ({host_memory}) would run "
            f"{load_copy!r}, which reads the host pages from the GPU"
        )
        assert store_handler._swap_blocks_batch is ops.swap_blocks_batch
    finally:
        if hasattr(worker, "shutdown"):
            worker.shutdown()
        else:
            store_handler.shutdown()  # it owns the shared region
            load_handler.shutdown()
