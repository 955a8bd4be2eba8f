# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU offloading for an engine that runs on the CPU itself.

vLLM 0.25.1's ``CPUOffloadingSpec.get_worker`` refuses non-CUDA platforms: its
transfer worker needs CUDA (pinned host memory, streams, events, a CUDA copy
kernel). This spec is the real ``CPUOffloadingSpec`` (block sizes, CPU cache
size, the scheduler-side manager and eviction policy) except for that worker,
replaced through vLLM's own extension point: ``kv_connector_extra_config``
``{"spec_name": "HostCopyOffloadingSpec", "spec_module_path": __name__}``.

The replacement copies the bytes the CUDA worker copies, for the same transfer
specs: for each KV cache group, the group's GPU blocks, and for each of the
group's data references, the first ``page_size_bytes`` of the block in the
referenced canonical tensor. Copies are synchronous; a job is reported finished
at the next ``get_finished``, as an asynchronous worker may.
"""

import time

import torch

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class HostCopyOffloadingWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, num_host_blocks: int):
        self.device_rows = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
            for t in kv_caches.tensors
        ]
        self.host_rows = [
            torch.zeros((num_host_blocks, rows.shape[1]), dtype=torch.int8)
            for rows in self.device_rows
        ]
        self.group_data_refs = kv_caches.group_data_refs
        self._finished: list[TransferResult] = []

    def _copy(
        self, job_id: int, gpu_spec: GPULoadStoreSpec, host_spec, to_host: bool
    ) -> bool:
        start = time.perf_counter()
        gpu_blocks = [int(b) for b in gpu_spec.block_ids]
        host_blocks = [int(b) for b in host_spec.block_ids]
        # Offloaded blocks are GPU blocks here (block_size_factor 1): the two
        # lists pair up one to one, group after group.
        assert len(gpu_blocks) == len(host_blocks) == sum(gpu_spec.group_sizes)
        num_bytes, first = 0, 0
        for size, refs in zip(gpu_spec.group_sizes, self.group_data_refs):
            pairs = list(
                zip(gpu_blocks[first : first + size], host_blocks[first : first + size])
            )
            first += size
            for ref in refs:
                device = self.device_rows[ref.tensor_idx]
                host = self.host_rows[ref.tensor_idx]
                for gpu_block, host_block in pairs:
                    page = slice(0, ref.page_size_bytes)
                    if to_host:
                        host[host_block, page] = device[gpu_block, page]
                    else:
                        device[gpu_block, page] = host[host_block, page]
                    num_bytes += ref.page_size_bytes
        self._finished.append(
            TransferResult(job_id, True, num_bytes, time.perf_counter() - start)
        )
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec
    ) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy completed when it was submitted


class HostCopyOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` with the host-copy worker above."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # 0.26 renamed the offloaded-to-GPU block ratio to blocks_per_chunk.
        factor = getattr(self, "block_size_factor", None)
        if factor is None:
            factor = self.blocks_per_chunk
        assert factor == 1, "the host-copy worker moves whole blocks"
        if self._worker is None:
            self._worker = HostCopyOffloadingWorker(kv_caches, self.num_blocks)
        return self._worker


class PageRecordingOffloadingWorker(HostCopyOffloadingWorker):
    """The host-copy worker that also keeps, per (canonical tensor, host block), the
    whole device page a store read (``stored``) and the whole device page a load
    left (``restored``): the pages the attention kernels read, not only the bytes
    the data references let a transfer move."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_host_blocks: int):
        super().__init__(kv_caches, num_host_blocks)
        self.stored: dict[tuple[int, int], torch.Tensor] = {}
        self.restored: dict[tuple[int, int], torch.Tensor] = {}

    def _pages(self, gpu_spec: GPULoadStoreSpec, host_spec) -> dict:
        gpu_blocks = [int(b) for b in gpu_spec.block_ids]
        host_blocks = [int(b) for b in host_spec.block_ids]
        pages, first = {}, 0
        for size, refs in zip(gpu_spec.group_sizes, self.group_data_refs):
            for gpu_block, host_block in zip(
                gpu_blocks[first : first + size], host_blocks[first : first + size]
            ):
                for ref in refs:
                    rows = self.device_rows[ref.tensor_idx]
                    pages[(ref.tensor_idx, host_block)] = rows[gpu_block].clone()
            first += size
        return pages

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self.stored.update(self._pages(src_spec, dst_spec))
        return super().submit_store(job_id, src_spec, dst_spec)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec
    ) -> bool:
        done = super().submit_load(job_id, src_spec, dst_spec)
        self.restored.update(self._pages(dst_spec, src_spec))
        return done


class PageRecordingOffloadingSpec(HostCopyOffloadingSpec):
    """``HostCopyOffloadingSpec`` with the page-recording worker above."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = PageRecordingOffloadingWorker(kv_caches, self.num_blocks)
        return super().get_worker(kv_caches)
